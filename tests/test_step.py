"""Issue 27: the step as 8 GPUs run it, proved on CPU processes over gloo: gradients stay in DDP's
buckets, the host reads nothing before the update (and the probe sees the read that follows it; a
skipped step still changes nothing), one compiled training graph, a stuck rank ends the run after
collective_timeout while rank 0's slow work alone does not, and replicas that drift apart stop
the run before a checkpoint. The probes and faults live in wrapping scripts (SEAMS) that patch
what train_gpt2.py calls and then run it as `python train_gpt2.py` does."""
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log, run_script

COMMON = [*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=128", "--val_tokens=256",
          "--sample_interval=0", "--hellaswag=False", "--keep_checkpoints=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"), 7, 600, [128 * 9 + 30, 128 * 9 + 5])


# The seams of a training step, for a wrapping script. The trainer begins each step with
# model.train() (GPT.train(True), through DDP or torch.compile's wrapper: the evals leave the model in
# eval mode), and updates in optimizer.step(); configure_optimizers (which it calls once, on its raw
# model) is wrapped to keep the model and the optimizer and to hook that optimizer's step(). These
# call the script's step_begins, before_update and after_update with the number of the step (counted
# from this process's first step: the step's own number in a run that starts from scratch); a step()
# outside a training step (FSDP's state dict may call one) is not an update. The script then
# redefines those it needs and calls train(): runpy runs train_gpt2.py as `python train_gpt2.py ARGS`
# does (the modules are patched first: the trainer binds its names when it runs).
SEAMS = """
import os, runpy, sys, time
import torch
import model
from gptkit import checkpoint, distributed, shards
from gptkit.run import Run
rank = int(os.environ.get('RANK', 0))
run, begun, stepping = {}, [0], []  # the raw model and the optimizer; the training steps begun; in one
lifecycles = []  # the trainer's Run: its stop_signal says when torchrun asks this rank to stop
run_init = Run.__init__
def keep_run(self):
    run_init(self)
    lifecycles.append(self)
Run.__init__ = keep_run


def say(line):  # one write: the ranks' lines stay whole
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


def step_begins(step):  # the step's model.train(), before it runs: zero_grad and its micro-steps follow
    pass


def before_update(step):  # the step's optimizer.step(), before it runs
    pass


def after_update(step):  # ... and after it: the update is done (or skipped)
    pass


model_train = model.GPT.train
def train_mode(self, mode=True):
    if mode and 'optimizer' in run:
        stepping[:] = [begun[0]]
        begun[0] += 1
        step_begins(stepping[0])
    return model_train(self, mode)
model.GPT.train = train_mode


def update_hook(seam):
    def hook(*_):
        if stepping:
            seam(stepping[0])
    return hook


configure = model.GPT.configure_optimizers
def configure_optimizers(self, *a, **k):
    optimizer = configure(self, *a, **k)
    run.update(model=self, optimizer=optimizer)
    optimizer.register_step_pre_hook(update_hook(before_update))
    optimizer.register_step_post_hook(update_hook(after_update))
    optimizer.register_step_post_hook(lambda *_: stepping.clear())
    return optimizer
model.GPT.configure_optimizers = configure_optimizers


def train():
    sys.argv[0] = TRAINER
    runpy.run_path(TRAINER, run_name='__main__')
"""


def wrapper(body):
    """A script: SEAMS, then body (its probes or faults), then the trainer's run."""
    return f"TRAINER = {os.path.join(ROOT, 'train_gpt2.py')!r}\n{SEAMS}\n{body}\ntrain()\n"


def start(script, tmp_path, args, nproc, env=()):
    """script (its text: a wrapper, with faults or probes) started as a user runs train_gpt2.py:
    torchrun with nproc processes, or plain python (nproc None)."""
    (tmp_path / "script.py").write_text(script)
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = one_thread(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, **dict(env))
    cmd = [*launcher, str(tmp_path / "script.py"), *args]
    return commands.Popen(cmd, cwd=ROOT, env=env, stdout=commands.PIPE, stderr=commands.PIPE, text=True)


def ended(p, timeout=300):
    """The started run p to its end (commands.finish), with `ended`, the time it did."""
    r = commands.finish(p, timeout)
    r.ended = time.time()
    return r


def launch(script, tmp_path, args, nproc, env=(), timeout=300):
    """script run to its end (start, above)."""
    return ended(start(script, tmp_path, args, nproc, env), timeout)


def argv(data, log_dir, *extra):
    return [*COMMON, f"--data_root={data}", f"--log_dir={log_dir}", *extra]


# --- gradients in DDP's buckets, no host read before the update, a skipped step changes nothing ----

PROBE = wrapper("""
import contextlib
from tests.host_reads import HostReads
NAN_STEP = 3
CONTROL_STEP = 1  # the probe's positive control: it counts on past the update, until the next step begins


counting, before, hooks = [], [], []  # the count going on; the state as the step began; the poison


@contextlib.contextmanager
def unseen():  # the probe's own work is not the trainer's
    for mode in counting:
        mode.paused = True
    try:
        yield
    finally:
        for mode in counting:
            mode.paused = False


def stop_counting():
    mode = counting.pop()
    mode.__exit__(None, None, None)
    return mode.seen


def tensors():  # the weights and the optimizer's state
    optimizer_state = [v for s in run['optimizer'].state.values() for v in s.values() if torch.is_tensor(v)]
    return list(run['model'].state_dict().values()) + optimizer_state


def bitwise_equal(xs, ys):  # NaN equals NaN, bit for bit
    bits = lambda t: t.view(-1).view(torch.uint8) if t.is_floating_point() else t
    return len(xs) == len(ys) and all(torch.equal(bits(x), bits(y)) for x, y in zip(xs, ys))


def storages():  # (distinct storages of the gradients, gradients)
    grads = [p.grad for p in run['model'].parameters() if p.grad is not None]
    return len({g.untyped_storage().data_ptr() for g in grads}), len(grads)


def step_begins(step):
    if counting:  # the control: its count ends where the next step begins
        say(f"rank {rank} step {step - 1} host reads in the whole step: {stop_counting()}")
    if step == NAN_STEP and (rank == 1 or os.environ.get('WORLD_SIZE') is None):
        # a NaN in one rank's gradient: DDP's all-reduce takes it everywhere
        poison = lambda m, i, out: out.register_hook(lambda g: g * float('nan')) and None
        hooks.append(run['model'].transformer.wpe.register_forward_hook(poison))
    before[:] = [t.clone() for t in tensors()]
    mode = HostReads()
    mode.__enter__()
    counting.append(mode)


def before_update(step):
    say(f"rank {rank} step {step} host reads before the update: {list(counting[-1].seen)}")
    if step != CONTROL_STEP:  # the control step counts on
        stop_counting()


def after_update(step):
    with unseen():
        while hooks:
            hooks.pop().remove()
        same = bitwise_equal(before, tensors())
        say(f"rank {rank} step {step} weights and optimizer state unchanged: {same}")
        n, of = storages()
        say(f"rank {rank} step {step} gradient storages after the synced micro-step: {n} of {of} gradients")


next_batch = shards.DataLoaderLite.next_batch
def probed_next_batch(self):
    if self.micro == 1:  # micro-step 1 begins: micro-step 0's backward ran without sync
        with unseen():
            n, _ = storages()
            say(f"rank {rank} step {begun[0] - 1} gradient storages after a micro-step without sync: {n}")
    return next_batch(self)
shards.DataLoaderLite.next_batch = probed_next_batch
""")


def probed(r, what):
    """{(rank, step): value} of the probe's lines 'rank R step S <what>: value'."""
    found = re.findall(rf"rank (\d+) step (\d+) {re.escape(what)}: (.*)", r.stdout)
    return {(int(rank), int(step)): value for rank, step, value in found}


RUNS = {"ddp-adamw": (2, ["--optimizer=adamw"]), "ddp-muon": (2, ["--optimizer=muon", "--muon_lr=3e-3"]),
        "one-float16": (None, ["--dtype=float16"])}


QUICK = {"one-float16": pytest.mark.quick}  # the edit loop's tier: the one process's run


@pytest.mark.parametrize("nproc, extra", [pytest.param(*run, id=name, marks=QUICK.get(name, ()))
                                          for name, run in RUNS.items()])
def test_the_step_waits_for_nothing_before_its_update(data, tmp_path, nproc, extra):
    """Under DDP with 2 micro-steps, the gradients stay views into DDP's bucket through every
    micro-step (1 storage, not one per parameter: a second copy of them, 4 bytes per parameter)
    and after the synced one (gradient_as_bucket_view: every gradient a view, none missing);
    between a step's start (its model.train()) and its optimizer.step() the host reads no
    tensor (any way tests/host_reads.py lists), on one process as on two, AdamW as Muon,
    float16 too; the probe's control: in step 1 it counts on past the update until step 2 begins,
    and must see finite.tolist() and loss.item(). Step 3's gradient is NaN on one rank: the step is
    skipped on the device (found_inf), its weights and optimizer state stay bit for bit, and it is
    logged as a bad step (float16: as an overflow); every other step moves them."""
    steps = 6
    args = [f"--max_steps={steps}", "--eval_interval=0", "--checkpoint_interval=0", *extra]
    r = launch(PROBE, tmp_path, argv(data, tmp_path / "log", *args), nproc)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ranks = range(nproc or 1)
    reads = probed(r, "host reads before the update")
    unchanged = probed(r, "weights and optimizer state unchanged")
    assert set(reads) == set(unchanged) == {(k, s) for k in ranks for s in range(steps)}, r.stdout[-2000:]
    assert set(reads.values()) == {"[]"}, reads
    whole = probed(r, "host reads in the whole step")  # the control (CONTROL_STEP): reads where they are
    assert set(whole) == {(k, 1) for k in ranks}, whole
    assert all("'tolist'" in v and "'item'" in v for v in whole.values()), whole
    assert all((unchanged[k, s] == "True") == (s == 3) for k in ranks for s in range(steps)), unchanged
    if nproc:
        storages = probed(r, "gradient storages after a micro-step without sync")
        assert storages == {(k, s): "1" for k in ranks for s in range(steps)}, storages
        n = 12 * 2 + 4  # the tiny model's parameters (12 a block, wte = lm_head, wpe, ln_f's 2): one bucket
        synced = probed(r, "gradient storages after the synced micro-step")
        assert synced == {(k, s): f"1 of {n} gradients" for k in ranks for s in range(steps)}, synced
    log = read_log(tmp_path / "log")  # float16: a NaN gradient is an overflow, the loss scale halved
    logged = {"overflow": {3: 32768.0}} if "--dtype=float16" in extra else {"skip": {3: 1.0}}
    assert {k: log.get(k) for k in ("overflow", "skip")} == {"overflow": None, "skip": None, **logged}, log
    assert sorted(log["train"]) == list(range(steps)), log


# --- one compiled training graph ----------------------------------------------------------------

def test_the_training_graph_is_compiled_once_with_static_shapes(data, tmp_path):
    """compile=True, 3 processes: 16 val sequences give the ranks 6, 5 and 5, so with B=2 two
    ranks' last val batch holds one sequence. Unpadded, Dynamo recompiled GPT.forward for it with
    a dynamic batch size, and then the training graph with a dynamic size too. Here each rank
    compiles GPT.forward twice: for the val loss, then once more for training (the only guard that
    fails is grad mode), no input size is ever symbolic, and nothing recompiles after that."""
    r = run_script(argv(data, tmp_path / "log", "--compile=True", "--total_batch_size=96", "--max_steps=6",
                        "--eval_interval=3", "--checkpoint_interval=0"), nproc=3,
                   TORCH_LOGS="recompiles,dynamic")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    for rank in range(3):
        recompiles = re.findall(rf"\[rank{rank}\].*Recompiling function (\w+)", out)
        reasons = re.findall(rf"\[rank{rank}\].*\[__recompiles\]\s+- (.*)", out)
        reasons = [x.split(":", 1)[1].strip() for x in reasons]
        assert recompiles == ["forward"], (rank, recompiles, reasons)
        assert reasons == ["GLOBAL_STATE changed: grad_mode"], (rank, recompiles, reasons)
    inputs = re.findall(r"create_symbol .* for L\['(idx|targets)'\]", out)
    assert not inputs and "create_symbol" in out, inputs  # the log was on: symbols, but none for an input
    assert sorted(read_log(tmp_path / "log")["val"]) == [0, 3, 6]


# --- waits: a stuck rank ends the run, a slow first step or rank 0's slow work alone does not ------

FAULTS = wrapper("""
env = lambda k: int(os.environ.get(k, -1))
if env('WAIT_FOR_ALL_S') > 0:  # wait_for_all's bound in seconds, not hours
    distributed.WAIT_FOR_ALL_TIMEOUT = env('WAIT_FOR_ALL_S')


def cold_start():  # this rank's first eval and first step as a cold compile cache makes them
    if rank == env('SLOW_RANK'):
        say(f"rank {rank} compiles slowly")
        time.sleep(float(os.environ['SLOW_FIRST_S']))


forward, evals = model.GPT.forward, []
def forward_first_eval_slow(self, *a, **k):  # the first forward without gradients: the first eval's
    if not torch.is_grad_enabled() and not evals:
        evals.append(1)
        cold_start()
    return forward(self, *a, **k)
model.GPT.forward = forward_first_eval_slow


def step_begins(step):
    if step == 0:
        cold_start()
    if rank == env('STALL_RANK') and step == env('STALL_STEP'):  # stuck (until torchrun stops it)
        say(f"rank {rank} stalls at step {step} at {time.time():.3f}")
        while not lifecycles[0].stop_signal:
            time.sleep(0.05)
        os._exit(1)


def after_update(step):
    if rank == env('NUDGE_RANK') and step == env('NUDGE_STEP'):  # this replica's weights drift off
        with torch.no_grad():
            run['model'].transformer.wpe.weight[0, 0] += 1e-3


write = checkpoint.atomic_write
def slow_write(path, write_to):  # rank 0 alone: the checkpoint of step SLOW_STEP, its bytes then slow to land
    def slow(f):
        write_to(f)
        t0 = time.time()
        if path.endswith(f"model_{env('SLOW_STEP'):05d}.pt"):
            say(f"rank 0 writes slowly at {t0:.3f}")
        while path.endswith(f"model_{env('SLOW_STEP'):05d}.pt") and time.time() - t0 < env('SLOW_WRITE_S'):
            if lifecycles[0].stop_signal:  # a hung file system: until torchrun stops this rank
                os._exit(1)
            time.sleep(0.05)
    return write(path, slow)
checkpoint.atomic_write = slow_write
""")
# a margin that a loaded machine keeps: with 3 s, a rank starved of its core (2 cores, beside another
# test's processes) could be taken for a stuck one
TIMEOUT = 20
WAITS = ["--max_steps=12", "--eval_interval=4", "--checkpoint_interval=8", f"--collective_timeout={TIMEOUT}"]


def errors(r):
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


def gave_up(rank, limit):
    """The one line of a rank that waited for the others past limit."""
    return (f"error: rank {rank} waited more than {limit} s for the other ranks: one of them is stuck or "
            "gone; the last checkpoint stands: run the same command again to resume")


def since(event, r):
    """Seconds from the moment a wrapper said event (its line ends with the time) to the run's end."""
    return r.ended - float(re.search(rf"{event} at ([\d.]+)", r.stdout)[1])


# The waits' runs mostly sleep (for a timeout, a slow write): they run at once, started one after
# another from this thread, then awaited in threads.
# One xdist worker runs them all (loadgroup): the other is free for the rest of the suite.
SLOW_FIRST_TIMEOUT = 10  # the slow first eval and step: 2.5x this in all
WAIT_RUNS = {
    "stuck": (WAITS, {"STALL_RANK": "1", "STALL_STEP": "9"}),
    "slow_write": (WAITS, {"SLOW_STEP": "8", "SLOW_WRITE_S": str(2 * TIMEOUT)}),
    "hung_write": (WAITS, {"SLOW_STEP": "12", "SLOW_WRITE_S": "100000", "WAIT_FOR_ALL_S": str(TIMEOUT)}),
    "plain": (FIRST := ["--max_steps=6", "--eval_interval=3", "--checkpoint_interval=3",
                        f"--collective_timeout={SLOW_FIRST_TIMEOUT}"], {}),
    "slow_first": (FIRST, {"SLOW_RANK": "1", "SLOW_FIRST_S": str(SLOW_FIRST_TIMEOUT * 1.25)}),
}


_waits = {}  # kept here, not by the fixture's scope: xdist may run another module between these tests


@pytest.fixture
def waits(data, tmp_path_factory):
    """{name: (its log_dir, the run ended)} of WAIT_RUNS, run once in this process."""
    if not _waits:
        _waits.update(run_waits(data, tmp_path_factory))
    return _waits


def run_waits(data, tmp_path_factory):
    """WAIT_RUNS, and then "resumed_slow": plain's run resumed from its evaluated checkpoint of step 3
    with slow_first's delays, its first eval (step 6) after its first step."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in [*WAIT_RUNS, "resumed_slow"]}
    started = {name: start(FAULTS, dirs[name], argv(data, dirs[name] / "log", *args), 2, env)
               for name, (args, env) in WAIT_RUNS.items()}
    with ThreadPoolExecutor(len(started)) as pool:
        futures = {name: pool.submit(ended, p) for name, p in started.items()}
        plain = futures["plain"].result()
        assert plain.returncode == 0, plain.stderr[-3000:]
        resumed = dirs["resumed_slow"] / "log"
        resumed.mkdir()
        shutil.copy(dirs["plain"] / "log" / "model_00003.pt", resumed)
        slow = start(FAULTS, dirs["resumed_slow"], argv(data, resumed, *FIRST), 2, WAIT_RUNS["slow_first"][1])
        runs = {name: future.result() for name, future in futures.items()} | {"resumed_slow": ended(slow)}
    return {name: (dirs[name] / "log", runs[name]) for name in dirs}


waiting = pytest.mark.xdist_group("waits")  # one worker starts WAIT_RUNS, once


@waiting
def test_a_stuck_rank_ends_the_run_after_collective_timeout(waits):
    """Rank 1 stops answering in step 9 (after the checkpoint of step 8): rank 0 gives up after
    collective_timeout=20 s from that moment (the first step's longer timeout is over), not sooner,
    with one line naming that bound, and exits 1, well before the test's own timeout; the checkpoint
    stands."""
    log, r = waits["stuck"]
    assert r.returncode == 1, r.stdout[-2000:]
    assert TIMEOUT - 1 < since("rank 1 stalls at step 9", r) < TIMEOUT + 60
    assert errors(r) == [gave_up(0, f"collective_timeout={TIMEOUT}")], r.stderr[-3000:]
    assert os.path.exists(log / "model_00008.pt")
    assert max(read_log(log)["train"]) <= 9


@waiting
def test_rank_0_writing_checkpoints_slower_than_the_timeout_is_not_stuck(waits):
    """The checkpoint of step 8 takes rank 0 40 s to write, twice collective_timeout=20 s: the
    others wait for it (distributed.wait_for_all) and the run ends normally, its log whole. (Waiting in
    a collective instead, they would give up 20 s before the write ends.)"""
    log, r = waits["slow_write"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert since("rank 0 writes slowly", r) > 2 * TIMEOUT  # the write did take that long
    assert sorted(read_log(log)["train"]) == list(range(12))
    assert os.path.exists(log / "model_00012.pt")


@waiting
def test_rank_0_hung_in_a_checkpoint_write_ends_the_run_after_wait_for_all_timeout(waits):
    """Issue 36.3: rank 0's write of the last checkpoint (step 12) hangs, as on a hung NFS server:
    rank 1 waits for it through the process group's store up to distributed.WAIT_FOR_ALL_TIMEOUT
    (hours; 20 s here), then ends the run with one line naming that bound, exit 1; the checkpoint
    of step 8 stands, whole, for the next start. (Before: a gloo barrier that waited 7 days.)"""
    from gptkit import checkpoint
    log, r = waits["hung_write"]
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert TIMEOUT - 1 < since("rank 0 writes slowly", r) < TIMEOUT + 60
    assert errors(r) == [gave_up(1, f"WAIT_FOR_ALL_TIMEOUT={TIMEOUT}")], r.stderr[-3000:]
    assert [s for s, _ in checkpoint.list_checkpoints(log)] == [8]
    assert checkpoint.pick_checkpoint(log)[0] == 8  # it loads, its checksum whole


@waiting
def test_a_rank_slow_in_its_first_eval_and_step_does_not_end_the_run(waits):
    """Issue 36.4: rank 1 takes 12.5 s longer than rank 0 in its first eval and again in its first
    step, as a cold compile cache on one node makes them: 2.5 x collective_timeout=10 s in all, each
    delay past it. Until the first step is done the ranks wait up to distributed.FIRST_STEP_TIMEOUT,
    then collective_timeout; the run ends as one without the delay does, with the same losses."""
    (plain_log, plain), (slow_log, r) = waits["plain"], waits["slow_first"]
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("rank 1 compiles slowly") == 2
    a, b = read_log(plain_log), read_log(slow_log)
    assert sorted(b["train"]) == list(range(6)) and sorted(b["val"]) == [0, 3, 6]
    assert a == b


@waiting
def test_a_resumed_run_whose_first_evals_come_after_its_first_step_waits_for_them_too(waits):
    """Issue 45.1: resumed from an evaluated checkpoint (step 3), a run's first evals come after its
    first step (at step 6), and rank 1 takes 12.5 s longer in each (a cold compile cache after a
    requeue), past collective_timeout=10 s: the ranks wait the long timeout until those graphs are
    built too, and the run ends with the losses of the uninterrupted one."""
    (plain_log, _), (log, r) = waits["plain"], waits["resumed_slow"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and r.stdout.count("rank 1 compiles slowly") == 2
    a, b = read_log(plain_log), read_log(log)
    assert sorted(b["train"]) == [3, 4, 5] and sorted(b["val"]) == [6]
    assert all(a[kind][step] == b[kind][step] for kind in ("train", "val") for step in b[kind]), (a, b)


# --- replicas checked at every checkpoint ------------------------------------------------------------

def test_replicas_that_differ_stop_the_run_before_a_checkpoint(data, tmp_path):
    """Rank 1's weights nudged after step 5: the checkpoint of step 8 finds them unlike rank 0's,
    one line names rank 1 and the step, and no checkpoint of the diverged state is written."""
    nudge = {"NUDGE_RANK": "1", "NUDGE_STEP": "5"}
    r = launch(FAULTS, tmp_path, argv(data, tmp_path / "log", *WAITS), 2, nudge)
    assert r.returncode == 1, r.stdout[-2000:]
    assert len(errors(r)) == 1, r.stderr[-3000:]
    assert errors(r)[0].startswith("error: step 8: the weights of rank 1 differ from rank 0's: DDP keeps "
                                   "replicas equal only while"), r.stderr[-3000:]
    assert not os.path.exists(tmp_path / "log" / "model_00008.pt")
