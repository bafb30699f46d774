"""parallel="fsdp" against "ddp", and several nodes: real torchrun processes over gloo on CPU."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log, run_script
from commands import children, kill_job
from test_resume import assert_same

# the tests that share this module's runs (its fixtures) go to one xdist worker: each run happens once
shares_runs = pytest.mark.xdist_group("test_parallel")


STEPS = 16
COMMON = [*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=128", f"--max_steps={STEPS}",
          "--eval_interval=8", "--val_tokens=256", "--sample_interval=0", "--checkpoint_interval=8",
          "--hellaswag=False", "--keep_checkpoints=0", "--max_lr=1e-3", "--min_lr=1e-4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"), 1, 600, [128 * 9 + 30, 128 * 9 + 5])


def args(data, log_dir, *extra):
    return [*COMMON, f"--data_root={data}", f"--log_dir={log_dir}", *extra]


def ckpt(log_dir, step=STEPS):
    return torch.load(os.path.join(log_dir, f"model_{step:05d}.pt"), map_location="cpu", weights_only=True)


def state_mib(out):
    """The 'parameters, gradients and optimizer state per rank' figure rank 0 printed (under FSDP)."""
    return float(re.search(r"parameters, gradients and optimizer state per rank: ([\d.]+) MiB", out).group(1))


def whole_state_mib(ckpt):
    """What a DDP rank holds, from its checkpoint: every parameter (the tied weight once), a gradient
    of each one's size, and the optimizer's state."""
    params = {t.untyped_storage().data_ptr(): t.nbytes for t in ckpt["model"].values()}
    optimizer = sum(t.nbytes for s in ckpt["optimizer"]["state"].values() for t in s.values())
    return (2 * sum(params.values()) + optimizer) / 2 ** 20


# The trainer, with each FSDP unit that torch's fully_shard makes said on stdout (the module, and the
# processes that share it): the run itself is the trainer's, as torchrun would run it.
SHARD_PROBE = """
import os, runpy, sys, torch.distributed as dist, torch.distributed.fsdp as fsdp
fully_shard = fsdp.fully_shard
def probe(module, *a, **k):
    print(f"probe: fully_shard {{type(module).__name__}} over {{dist.get_world_size()}}", flush=True)
    return fully_shard(module, *a, **k)
fsdp.fully_shard = probe  # before gptkit/fsdp.py imports it
sys.argv[0] = os.path.join({root!r}, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def shard_probe(tmp_path):
    (tmp_path / "shard_probe.py").write_text(SHARD_PROBE.format(root=ROOT))
    return str(tmp_path / "shard_probe.py")


def units(out, world):
    """Whether out says FSDP sharded 3 units (2 blocks and the rest of the GPT) over world processes,
    on each of them."""
    found = sorted(re.findall(r"probe: fully_shard (\w+) over (\d+)", out))
    return found == sorted([("Block", str(world))] * 2 * world + [("GPT", str(world))] * world)


def run_two(data, tmp_path_factory, parallel):
    log_dir = tmp_path_factory.mktemp(parallel)
    probe = shard_probe(tmp_path_factory.mktemp(f"{parallel}_probe"))
    r = run_script(args(data, log_dir, f"--parallel={parallel}"), nproc=2, script=probe, PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return log_dir, r.stdout + r.stderr  # errors and tracebacks go to stderr: the checks below read both


@pytest.fixture(scope="module")
def ddp2(data, tmp_path_factory):
    return run_two(data, tmp_path_factory, "ddp")


@pytest.fixture(scope="module")
def fsdp2(data, tmp_path_factory):
    return run_two(data, tmp_path_factory, "fsdp")


@shares_runs
def test_fsdp_matches_ddp(ddp2, fsdp2):
    """Same losses and weights within float rounding (a reduce-scatter sums in its own order), and
    FSDP holds about half the state per rank at 2 ranks."""
    (ddp_dir, ddp_out), (fsdp_dir, fsdp_out) = ddp2, fsdp2
    a, b = read_log(ddp_dir), read_log(fsdp_dir)
    assert a.keys() == b.keys() and {"train", "val", "bpb"} <= a.keys()
    assert a["train"].keys() == b["train"].keys() == set(range(STEPS))
    for kind in a:
        for step in a[kind]:
            assert abs(a[kind][step] - b[kind][step]) <= 1e-5, (kind, step, a[kind][step], b[kind][step])
    assert_same(ckpt(ddp_dir), ckpt(fsdp_dir), tol=1e-5)
    assert ckpt(ddp_dir)["model"].keys() == ckpt(fsdp_dir)["model"].keys()  # one checkpoint format
    whole = whole_state_mib(ckpt(ddp_dir))
    assert state_mib(fsdp_out) <= 0.6 * whole, (state_mib(fsdp_out), whole)
    assert "state per rank" not in ddp_out  # every DDP rank holds the whole state: nothing to say
    assert re.search(r"error|Traceback", fsdp_out) is None
    assert "deprecated" not in ddp_out + fsdp_out, ddp_out  # torch's words for a setting of ours it renamed
    assert units(fsdp_out, world=2) and "fully_shard" not in ddp_out, (fsdp_out, ddp_out)


def test_fsdp_on_one_process_is_the_plain_run(data, tmp_path):
    """parallel="fsdp" under torchrun with one process: one shard each (gpu_check.py's way to run
    FSDP on one GPU), and the same run as plain python's."""
    probe = shard_probe(tmp_path)
    r = run_script(args(data, tmp_path / "fsdp1", "--parallel=fsdp", f"--max_steps={STEPS // 2}"), nproc=1,
                   script=probe, PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stderr
    assert units(r.stdout, world=1), r.stdout
    plain = run_script(args(data, tmp_path / "plain", f"--max_steps={STEPS // 2}"), script=probe,
                       PYTHONPATH=ROOT)
    assert plain.returncode == 0 and "fully_shard" not in plain.stdout, plain.stdout + plain.stderr
    a, b = read_log(tmp_path / "plain"), read_log(tmp_path / "fsdp1")
    assert a.keys() == b.keys() and all(abs(a[k][s] - b[k][s]) <= 1e-6 for k in a for s in a[k]), (a, b)


@shares_runs
def test_fsdp_checkpoint_resumes_on_one_process(fsdp2, data, tmp_path):
    """An FSDP run's mid-run checkpoint, resumed by one plain process, ends where a one-process
    run ends."""
    one = tmp_path / "one"
    r = run_script(args(data, one))
    assert r.returncode == 0, r.stderr
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(os.path.join(fsdp2[0], "model_00008.pt"), resumed)
    r = run_script(args(data, resumed))
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout
    assert_same(ckpt(one), ckpt(resumed), tol=1e-5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(cmd_args, max_restarts=0):
    """Two torchrun agents on this machine (--nnodes=2, one process each), meeting through c10d
    rendezvous on 127.0.0.1, as two nodes would."""
    env = one_thread(PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [*two_nodes(rdzv_id="test"), f"--max-restarts={max_restarts}", "train_gpt2.py", *cmd_args]
    return [start_node(cmd, ROOT, env) for _ in range(2)]


def two_nodes(rdzv_id):
    """torchrun's command for one of two nodes of one process each, meeting on 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_id={rdzv_id}"]


def start_node(cmd, cwd, env):
    """One node's torchrun, in the background, in a session of its own (finish waits for it)."""
    return commands.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)


def finish(nodes, timeout=240):
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                kill_job(q)
            for q in nodes:
                q.stdout.seek(0)  # all each node said, the part communicate read too
            raise AssertionError("the two-node job hung\n" + "\n".join(q.stdout.read() for q in nodes))
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    return "\n".join(outs)


@shares_runs
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_nodes_match_one_node(parallel, ddp2, fsdp2, data, tmp_path):
    """2 agents x 1 process = 1 agent x 2 processes, bit for bit."""
    one_node = (ddp2 if parallel == "ddp" else fsdp2)[0]
    finish(start_nodes(args(data, tmp_path, f"--parallel={parallel}")))
    assert read_log(tmp_path) == read_log(one_node)
    assert_same(ckpt(one_node), ckpt(tmp_path))


@shares_runs
def test_two_nodes_recover_from_a_dead_worker(fsdp2, data, tmp_path):
    """A worker of one node killed mid-run, --max-restarts=1: both nodes restart their workers in a
    new rendezvous, which resume from the last checkpoint; the run ends as an uninterrupted one."""
    nodes = start_nodes(args(data, tmp_path, "--parallel=fsdp"), max_restarts=1)
    t0, log = time.time(), tmp_path / "log.txt"
    while not (log.exists() and "\n8 train " in "\n" + log.read_text()):  # model_00008.pt is on disk
        assert time.time() - t0 < 180 and all(p.poll() is None for p in nodes), "no step 8"
        time.sleep(0.005)
    worker = children(nodes[1].pid)
    assert len(worker) == 1, worker
    os.kill(worker[0], signal.SIGKILL)
    out = finish(nodes)
    assert out.count("resuming from") == 1, out
    assert read_log(tmp_path) == read_log(fsdp2[0])
    assert_same(ckpt(fsdp2[0]), ckpt(tmp_path))


def test_fsdp_evals_hellaswag_and_samples_as_ddp(tmp_path):
    """Under FSDP the evals run on a gathered copy of the whole model: the val loss, HellaSwag and
    the samples come out as under DDP (samples token for token)."""
    from test_hellaswag import make_examples, write_file
    data = random_shards(tmp_path / "data", 2, 300, [1000], vocab=50257)
    write_file(tmp_path / "hella.jsonl", make_examples(31, seed=3))
    common = [*TINY, f"--data_root={data}", "--B=2", "--T=16", "--total_batch_size=64", "--max_steps=4",
              "--eval_interval=2", "--val_tokens=256", "--sample_interval=2", "--sample_length=6",
              f"--hellaswag_file={tmp_path / 'hella.jsonl'}"]
    for parallel in ("ddp", "fsdp"):
        r = run_script([*common, f"--log_dir={tmp_path / parallel}", f"--parallel={parallel}"], nproc=2)
        assert r.returncode == 0, r.stdout + r.stderr
    a, b = read_log(tmp_path / "ddp"), read_log(tmp_path / "fsdp")
    assert sorted(b["hella"]) == [0, 2, 4] and a["hella"] == b["hella"]
    assert all(abs(a["val"][s] - b["val"][s]) <= 1e-5 for s in a["val"])
    samples = (tmp_path / "fsdp" / "samples.txt").read_text()
    assert samples.count("sample 0:") == 2 and samples == (tmp_path / "ddp" / "samples.txt").read_text()


@shares_runs
def test_the_tied_weight_is_gathered_and_saved_once(ddp2, fsdp2):
    """Issue 21.14: wte and lm_head are one parameter; an FSDP checkpoint, like a DDP one, holds it
    once (both keys on one storage), not two gathered copies of it."""
    for log_dir, _ in (ddp2, fsdp2):
        model = ckpt(log_dir)["model"]
        wte, head = model["transformer.wte.weight"], model["lm_head.weight"]
        assert torch.equal(wte, head), log_dir
        assert wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr(), log_dir


# The trainer as rank 0 of 2 (torchrun's environment, without torchrun): the process group it asks
# for is said on stdout, then the group's first collective gives up, as one would when the other rank
# never comes.
INIT_PROBE = """
import os, runpy, sys, torch.distributed as dist
def init_process_group(**kw):
    print(f"probe: init_process_group {{kw['backend']}} {{kw['timeout'].total_seconds():g}}", flush=True)
    dist.is_initialized, dist.get_rank, dist.get_world_size = lambda: True, lambda *a: 0, lambda *a: 2
    dist.destroy_process_group = lambda *a: None
    raise RuntimeError("Timed out waiting 42000ms for recv operation to complete")
dist.init_process_group = init_process_group
sys.argv[0] = os.path.join({root!r}, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""
STUCK = ("error: rank 0 waited more than {} s for the other ranks: one of them is stuck or gone; the last "
         "checkpoint stands: run the same command again to resume")


ENV_PROBE = """
import os, runpy, sys, torch.distributed as dist
KEYS = ('TORCH_FR_DUMP_TEMP_FILE', 'TORCH_NCCL_DEBUG_INFO_TEMP_FILE', 'TORCH_FR_BUFFER_SIZE',
        'TORCH_NCCL_DUMP_ON_TIMEOUT', 'TORCHINDUCTOR_COMPILE_THREADS')
def init_process_group(**kw):  # the environment the group is made in; then the run ends
    print('probe: inductor read its config before:', 'torch._inductor.config' in sys.modules)
    import torch._inductor.config as inductor
    print('probe: compile_threads', inductor.compile_threads)
    for key in KEYS:
        print(f'probe: {{key}}={{os.environ.get(key)}}')
    sys.exit(3)
dist.init_process_group = init_process_group
sys.argv[0] = os.path.join({root!r}, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_the_group_is_made_with_the_flight_recorders_dump_in_log_dir_and_a_share_of_the_cpus(tmp_path):
    """Issue 45.2, 45.5 and 56.6: under torchrun (its variables given here), before the process group is
    made: NCCL's flight recorder dumps on a timeout into log_dir/nccl_trace_rank_N, its buffer and the
    dump itself left to torch's defaults (2,000 entries, on), and inductor's compile workers are this
    process's CPUs divided by the ranks of its node, read by inductor (not read before); whatever the
    user set stays as set (the dump's path under its older name too: torch reads that one as well)."""
    torchrun = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", PYTHONPATH=ROOT)
    (tmp_path / "env.py").write_text(ENV_PROBE.format(root=ROOT))
    cpus = len(os.sched_getaffinity(0))

    def probe(**env):
        r = run_script(["--device=cpu", f"--log_dir={tmp_path / 'log'}"], script=str(tmp_path / "env.py"),
                       **torchrun, **env)
        assert r.returncode == 3, r.stdout + r.stderr
        return dict(line[len("probe: "):].split("=", 1) for line in r.stdout.splitlines()
                    if line.startswith("probe: TORCH")), r.stdout

    env, out = probe()
    assert env == {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "log" / "nccl_trace_rank_"),
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "None", "TORCH_FR_BUFFER_SIZE": "None",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "None",
                   "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, cpus // 2))}
    assert "probe: inductor read its config before: False" in out
    assert f"probe: compile_threads {max(1, cpus // 2)}\n" in out
    env, out = probe(TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "mine_"),
                     TORCH_NCCL_DUMP_ON_TIMEOUT="0", TORCHINDUCTOR_COMPILE_THREADS="5")
    assert env == {"TORCH_FR_DUMP_TEMP_FILE": "None",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "mine_"),
                   "TORCH_FR_BUFFER_SIZE": "None", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                   "TORCHINDUCTOR_COMPILE_THREADS": "5"}
    assert "probe: compile_threads 5\n" in out


@pytest.mark.quick
def test_the_process_group_waits_for_the_first_step_longer_than_collective_timeout(tmp_path):
    """Issue 36.4 (was 27.5, 21.12): the process group's collectives wait up to
    distributed.FIRST_STEP_TIMEOUT (at least collective_timeout) until the first training step is done,
    as ranks compile at their own pace; then, once the ranks have met, collective_timeout. Each limit
    is named in the one line of a rank that gave up, and so is wait_for_all's (issue 36.3), which
    waits in the process group's store: no second process group. test_step.py's waits run the second
    phase and wait_for_all on real processes, each with its one line."""
    from gptkit import distributed
    assert distributed.FIRST_STEP_TIMEOUT >= 3600 and distributed.WAIT_FOR_ALL_TIMEOUT >= 3600  # hours
    (tmp_path / "init.py").write_text(INIT_PROBE.format(root=ROOT))
    for timeout, waits in ((42, distributed.FIRST_STEP_TIMEOUT), (10 ** 5, 10 ** 5)):
        r = run_script(["--device=cpu", f"--collective_timeout={timeout}", f"--log_dir={tmp_path / 'log'}"],
                       script=str(tmp_path / "init.py"), PYTHONPATH=ROOT, RANK="0", LOCAL_RANK="0",
                       WORLD_SIZE="2")
        assert f"probe: init_process_group gloo {waits}\n" in r.stdout, r.stdout + r.stderr
        assert r.returncode == 1 and r.stderr.splitlines() == [STUCK.format(f"FIRST_STEP_TIMEOUT={waits}")], \
            r.stderr


FAKE_HUB = """
import os, runpy, sys, time, torch, transformers
from gptkit import distributed
arrivals, calls = os.path.join(os.environ['HF_CACHE'], 'arrivals_1'), [0]
def arriving(meet):  # each decision taken with the others: rank 1 marks the moment it arrives
    def wrapped(*a, **k):
        calls[0] += 1
        if os.environ['RANK'] == '1':
            with open(arrivals, 'a') as f:
                f.write('arrived\\n')
        return meet(*a, **k)
    return wrapped
for name in ('barrier', 'max_over_ranks', 'min_over_ranks'):
    setattr(distributed, name, arriving(getattr(distributed, name)))
def from_pretrained(name, *a, **k):  # the HF hub, offline: a download into the cache (one line), or a read
    cached = os.path.join(os.environ['HF_CACHE'], name)
    if not os.path.exists(cached):
        with open(os.environ['DOWNLOADS'], 'a') as f:
            f.write(f"rank {os.environ['RANK']}\\n")
        if os.environ['RANK'] == '0':  # the download lasts until rank 1 arrives at the next decision
            t0 = time.time()  # (60 s at most): the ranks took calls[0] of them together before this
            while time.time() - t0 < 60 and (not os.path.exists(arrivals)
                                             or len(open(arrivals).readlines()) <= calls[0]):
                time.sleep(0.01)
        open(cached, 'w').close()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=512)
        return transformers.GPT2LMHeadModel(config)
transformers.GPT2LMHeadModel.from_pretrained = from_pretrained
sys.argv[0] = os.path.join(os.environ['PYTHONPATH'], 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_init_from_gpt2_is_downloaded_by_one_rank_the_others_read_it(data, tmp_path):
    """Issue 36.5: init_from=gpt2 on 2 ranks of a node: LOCAL_RANK 0 downloads it into the node's
    HF cache, the other waits (in a collective) and then reads it there, instead of every rank
    downloading it at once before the first collective that needs them all. The download ends only
    once rank 1 has arrived at that collective: a rank 1 that did not wait would download too. The
    run then trains."""
    (tmp_path / "hub.py").write_text(FAKE_HUB)
    (tmp_path / "cache").mkdir()
    run_args = args(data, tmp_path / "log", "--init_from=gpt2", "--max_steps=2", "--eval_interval=0",
                    "--checkpoint_interval=0")
    r = run_script(run_args, nproc=2, script=str(tmp_path / "hub.py"), PYTHONPATH=ROOT,
                   HF_CACHE=str(tmp_path / "cache"), DOWNLOADS=str(tmp_path / "downloads"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "downloads").read_text().splitlines() == ["rank 0"]
    assert sorted(read_log(tmp_path / "log")["train"]) == [0, 1]


PROBE = """
import os, runpy, sys, weakref
from gptkit.shards import DataLoaderLite
from model import GPT
made, init = weakref.WeakSet(), GPT.__init__  # every GPT the run makes, while it is alive
def register(self, *a, **k):
    init(self, *a, **k)
    made.add(self)
GPT.__init__ = register
next_batch = DataLoaderLite.next_batch
def probe(*a, **k):  # before every micro-batch of training: how many GPT modules are alive in this process
    print(f"live GPTs: {{len(made)}}", flush=True)
    return next_batch(*a, **k)
DataLoaderLite.next_batch = probe
sys.argv[0] = os.path.join({root!r}, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_fsdp_eval_copy_is_gone_during_training(data, tmp_path):
    """Issue 21.1: under FSDP the evals run on a gathered copy of the whole model (4 bytes per
    parameter on every rank); between evals no copy may stay alive. Counted with the garbage
    collector before every micro-batch (2 a step) of both ranks, evals at steps 0, 4, 8, ...: one GPT
    (the sharded one) each time."""
    (tmp_path / "probe.py").write_text(PROBE.format(root=ROOT))
    run_args = args(data, tmp_path / "log", "--parallel=fsdp", "--max_steps=10", "--eval_interval=4",
                    "--checkpoint_interval=0")
    r = run_script(run_args, nproc=2, script=str(tmp_path / "probe.py"), PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = re.findall(r"live GPTs: (\d+)", r.stdout)
    assert len(counts) == 2 * 10 * 2 and set(counts) == {"1"}, counts


FAKE_DOWNLOAD = """
import io, os, urllib.request
def urlopen(url, *a, **k):  # the HellaSwag download, served from a local file: one line per download
    with open(os.environ['DOWNLOADS'], 'a') as f:
        f.write(os.getcwd() + '\\n')
    r = io.BytesIO(open(os.environ['HELLASWAG_SOURCE'], 'rb').read())
    r.headers = {'Content-Length': str(len(r.getvalue()))}
    return r
urllib.request.urlopen = urlopen
"""


def test_two_nodes_with_their_own_code_folders_both_download_hellaswag(tmp_path):
    """Issue 21.13: two nodes, each with its own copy of the code (and so of ./hellaswag/), and no
    hellaswag_file: each node downloads the val split once (its local rank 0), and the run evaluates
    HellaSwag on both, instead of switching it off with a warning."""
    from test_hellaswag import make_examples, write_file
    data = random_shards(tmp_path / "data", 2, 300, [1000], vocab=50257)
    write_file(tmp_path / "source.jsonl", make_examples(23, seed=5))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAKE_DOWNLOAD)
    env = one_thread(PYTHONUNBUFFERED="1", PYTHONPATH=str(tmp_path / "site"),
                     DOWNLOADS=str(tmp_path / "downloads"), HELLASWAG_SOURCE=str(tmp_path / "source.jsonl"))
    cmd = [*two_nodes(rdzv_id="hella"), "train_gpt2.py", *TINY, f"--data_root={data}",
           f"--log_dir={tmp_path / 'log'}", "--B=2", "--T=16", "--total_batch_size=64", "--max_steps=2",
           "--eval_interval=2", "--val_tokens=256", "--sample_interval=0"]
    nodes, not_code = [], shutil.ignore_patterns(".*", "tests", "hellaswag", "docs", "__pycache__", "log*")
    for name in ("node_a", "node_b"):
        code = tmp_path / name
        shutil.copytree(ROOT, code, ignore=not_code)
        nodes.append(start_node(cmd, code, env))
    out = finish(nodes)
    assert "no HellaSwag eval" not in out, out
    assert sorted(read_log(tmp_path / "log")["hella"]) == [0, 2]
    downloads = (tmp_path / "downloads").read_text().split()
    assert sorted(downloads) == [str(tmp_path / "node_a"), str(tmp_path / "node_b")]
    for name in ("node_a", "node_b"):
        downloaded = tmp_path / name / "hellaswag" / "hellaswag_val.jsonl"
        assert downloaded.read_bytes() == (tmp_path / "source.jsonl").read_bytes()
