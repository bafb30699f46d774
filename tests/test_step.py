"""Issue 27: the step as 8 GPUs run it, proved on CPU processes over gloo: gradients stay in DDP's
buckets, the host reads nothing before the update (and the probe sees the read that follows it, and
each kind of read planted before it; a skipped step still changes nothing), one compiled training
graph, a stuck rank ends the run after collective_timeout while rank 0's slow work alone does not,
and replicas that drift apart stop the run before a checkpoint. The probes and faults live in
wrapping scripts (SEAMS) that patch what train_gpt2.py calls and then run it as `python
train_gpt2.py` does."""
import os
import re
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log

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

COUNT = """
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


def storages():  # (distinct storages of the gradients, gradients, parameters that train)
    grads = [p.grad for p in run['model'].parameters() if p.grad is not None]
    trained = sum(p.requires_grad for p in run['model'].parameters())
    return len({g.untyped_storage().data_ptr() for g in grads}), len(grads), trained


def step_begins(step):
    if counting:  # the control: its count ends where the next step begins
        say(f"rank {rank} step {step - 1} host reads in the whole step: {stop_counting()}")
    if step == NAN_STEP and (rank == 1 or os.environ.get('WORLD_SIZE') is None):
        # a NaN in one rank's gradient (its first parameter's): DDP's all-reduce takes it everywhere
        hooks.append(next(run['model'].parameters()).register_hook(lambda g: g * float('nan')))
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
        n, of, trained = storages()
        say(f"rank {rank} step {step} gradient storages after the synced micro-step: {n} of {of} gradients")
        say(f"rank {rank} step {step} parameters that train: {trained}")


next_batch = shards.DataLoaderLite.next_batch
def probed_next_batch(self):
    if self.micro == 1:  # micro-step 1 begins: micro-step 0's backward ran without sync
        with unseen():
            n, _, _ = storages()
            say(f"rank {rank} step {begun[0] - 1} gradient storages after a micro-step without sync: {n}")
    return next_batch(self)
shards.DataLoaderLite.next_batch = probed_next_batch
"""
PROBE = wrapper(COUNT)


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
    and must see the step's one read after it (issue 56: a tolist() of the loss, the norm and the
    flags; before, finite.tolist() and loss.item()). Step 3's gradient is NaN on one rank: the step is
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
    assert all(v.count("'tolist'") == 1 and "'item'" not in v for v in whole.values()), whole
    assert all((unchanged[k, s] == "True") == (s == 3) for k in ranks for s in range(steps)), unchanged
    if nproc:
        storages = probed(r, "gradient storages after a micro-step without sync")
        assert storages == {(k, s): "1" for k in ranks for s in range(steps)}, storages
        trained = probed(r, "parameters that train")  # each with its gradient, all in one bucket
        synced = probed(r, "gradient storages after the synced micro-step")
        assert synced == {(k, s): f"1 of {trained[k, s]} gradients" for k, s in trained}, synced
    log = read_log(tmp_path / "log")  # float16: a NaN gradient is an overflow, the loss scale halved
    logged = {"overflow": {3: 32768.0}} if "--dtype=float16" in extra else {"skip": {3: 1.0}}
    assert {k: log.get(k) for k in ("overflow", "skip")} == {"overflow": None, "skip": None, **logged}, log
    assert sorted(log["train"]) == list(range(steps)), log


# Host reads a trainer might write, each planted in one step of a run (from step 1 on) on its loss, in
# the forward: the code, and the name the probe must report.
PLANTS = {"torch.equal": ("torch.equal(loss, loss)", "equal"), "Tensor.equal": ("loss.equal(loss)", "equal"),
          "torch.allclose": ("torch.allclose(loss, loss)", "allclose"),
          "Tensor.allclose": ("loss.allclose(loss + 1)", "allclose"),
          "to the CPU": ("loss.to('cpu')", "to"),
          "to a CPU device": ("loss.to(device=torch.device('cpu'))", "to"),
          "copy_ into a CPU tensor": ("torch.empty(()).copy_(loss)", "copy_"),
          "Tensor.nonzero": ("(loss > 0).nonzero()", "nonzero"),
          "torch.nonzero as_tuple": ("torch.nonzero(loss > 0, as_tuple=True)", "nonzero"),
          "bool mask": ("loss[loss > 0]", "__getitem__"),
          "bool mask set": ("loss.detach().clone()[loss > 0] = 0", "__setitem__"),
          "masked_select": ("torch.masked_select(loss, loss > 0)", "masked_select")}
PLANTED = wrapper(COUNT + "\n\ndef plant(step, loss):\n" + "".join(
    f"    if step == {i}:\n        {code}\n" for i, (code, _) in enumerate(PLANTS.values(), 1)) + """

planted, probe_step_begins = set(), step_begins
def plant_once(model, inputs, out):  # the step's first forward: (logits, loss)
    if stepping and stepping[0] not in planted:
        planted.add(stepping[0])
        plant(stepping[0], out[1])


def step_begins(step):
    if step == 0:
        run['model'].register_forward_hook(plant_once)
    probe_step_begins(step)
""")


@pytest.fixture(scope="module")
def planted(data, tmp_path_factory):
    """{step: host reads the probe saw before its update} of one run with PLANTS, one a step."""
    tmp_path = tmp_path_factory.mktemp("planted")
    args = [f"--max_steps={len(PLANTS) + 1}", "--eval_interval=0", "--checkpoint_interval=0"]
    r = launch(PLANTED, tmp_path, argv(data, tmp_path / "log", *args), None)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return {step: reads for (_, step), reads in probed(r, "host reads before the update").items()}


@pytest.mark.xdist_group("planted")  # one worker: one run for them all
@pytest.mark.parametrize("step, kind", enumerate(["none", *PLANTS]), ids=["none", *PLANTS])
def test_the_probe_sees_each_kind_of_host_read_before_the_update(planted, step, kind):
    """The probe of the test above sees each way of reading the host that tests/host_reads.py lists
    beyond the plain ones (item(), tolist(), ...) when the trainer's step makes it before its update,
    once, by name; step 0, with none planted, reads nothing."""
    assert planted[step] == (f"[{PLANTS[kind][1]!r}]" if step else "[]"), planted


# --- one compiled training graph ----------------------------------------------------------------

GRAPHS = wrapper("""
graphs = []  # each graph Dynamo compiles: (with gradients, a size in it symbolic)
inductor, torch_compile = torch._dynamo.lookup_backend('inductor'), torch.compile


def recorded(gm, example_inputs):  # torch.compile's default backend, inductor, each graph recorded
    values = [node.meta.get('example_value') for node in gm.graph.find_nodes(op='placeholder')]
    sizes = [size for v in values for size in (v.shape if torch.is_tensor(v) else [v])]
    graphs.append((torch.is_grad_enabled(), any(isinstance(size, torch.SymInt) for size in sizes)))
    return inductor(gm, example_inputs)
torch.compile = lambda model, **options: torch_compile(model, backend=recorded, **options)


def step_begins(step):
    if step == 0:
        say(f"rank {rank} graphs before the first step: {graphs}")


run_trainer = train
def train():
    run_trainer()
    say(f"rank {rank} graphs: {graphs}")
""")


def test_the_training_graph_is_compiled_once_with_static_shapes(data, tmp_path):
    """compile=True, 3 processes: 16 val sequences give the ranks 6, 5 and 5, so with B=2 two
    ranks' last val batch holds one sequence. Unpadded, Dynamo recompiled GPT.forward for it with
    a dynamic batch size, and then the training graph with a dynamic size too. Here each rank
    compiles one graph without gradients for the val loss, then one with them for training (grad
    mode is all that differs), no size in either is symbolic, and nothing compiles after that (the
    evals of steps 3 and 6, the steps after the first). Each graph is seen as inductor gets it."""
    r = launch(GRAPHS, tmp_path, argv(data, tmp_path / "log", "--compile=True", "--total_batch_size=96",
                                      "--max_steps=6", "--eval_interval=3", "--checkpoint_interval=0"), 3)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    first = dict(re.findall(r"rank (\d+) graphs before the first step: (.*)", r.stdout))
    graphs = dict(re.findall(r"rank (\d+) graphs: (.*)", r.stdout))
    assert first == {str(k): "[(False, False)]" for k in range(3)}, first
    assert graphs == {str(k): "[(False, False), (True, False)]" for k in range(3)}, graphs
    # issue 56.5: what rank 0 says of DDP's pieces (here the whole model is one bucket)
    assert "compiled under DDP: the training graph in 1 piece, about one per bucket_cap_mb=" in r.stdout
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
    if step == env('STALL_STEP'):
        say(f"rank {rank} begins step {step} at {time.time():.3f}")
    if rank == env('STALL_RANK') and step == env('STALL_STEP'):  # stuck (until torchrun stops it)
        say(f"rank {rank} stalls at step {step}")
        while not lifecycles[0].stop_signal:
            time.sleep(0.05)
        os._exit(1)


def after_update(step):
    if rank == env('NUDGE_RANK') and step == env('NUDGE_STEP'):  # this replica's weights drift off
        with torch.no_grad():
            next(run['model'].parameters()).view(-1)[0] += 1e-3


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


wait_for_all = distributed.wait_for_all
def said_wait_for_all():  # rank 0's work alone awaited (a checkpoint's write), from this moment
    say(f"rank {rank} enters wait_for_all at {time.time():.3f}")
    wait_for_all()
distributed.wait_for_all = said_wait_for_all
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
    """Seconds from the last moment a wrapper said event (its line ends with the time) to the run's end
    (as the test saw it: later, never sooner)."""
    return r.ended - float(re.findall(rf"{event} at ([\d.]+)", r.stdout)[-1])


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
    # Rank 0 starts the wait that times out (step 9's all-reduce) after it says it began step 9, so the
    # lower bound needs no slack however loaded the machine. The 60 s are for torchrun to end the stuck
    # rank on a loaded machine; a wait that never ended would meet the test's own timeout (300 s).
    assert TIMEOUT <= since("rank 0 begins step 9", r) < TIMEOUT + 60, r.stdout[-2000:]
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
    # from the moment rank 1 itself began to wait, as above: no slack below, 60 s above
    assert TIMEOUT <= since("rank 1 enters wait_for_all", r) < TIMEOUT + 60, r.stdout[-2000:]
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


# --- issue 56: no wait between steps, checkpoints written while training goes on -----------------

GAPS = wrapper("""
import statistics
from gptkit import run as lifecycle
begins = []  # (the time, the collectives this rank has issued) as each step begins
group = lambda: torch.distributed.distributed_c10d._get_default_group()
# from step 10, in blocks of 5 steps, rank 0's log writes take 20 ms more (a slow file system) or not:
# the machine's load, which drifts, weighs on both alike
slow_step = lambda step: step >= 10 and step // 5 % 2 == 1


append = lifecycle.append
def slow_append(path, text):  # the line of the step begun last
    if slow_step(len(begins) - 1):
        time.sleep(0.02)
    append(path, text)
lifecycle.append = slow_append


def step_begins(step):
    begins.append((time.time(), group()._get_sequence_number_for_group()))


run_trainer = train
def train():
    run_trainer()
    # DDP's buckets: the gradients are views into them
    buckets = len({p.grad.untyped_storage().data_ptr() for p in run['model'].parameters()})
    walls = [b[0] - a[0] for a, b in zip(begins, begins[1:])]
    calls = [b[1] - a[1] for a, b in zip(begins, begins[1:])]
    # a step's wall time: from its start to the next one's (when a slow line would hold the others)
    fast, slow = (statistics.median(w for i, w in enumerate(walls) if i >= 10 and slow_step(i) == s)
                  for s in (False, True))
    say(f"rank {rank} ms a step: {fast * 1000:.2f} then {slow * 1000:.2f}")
    # after the first two steps: the first one's end shortens the timeout (a barrier), and DDP
    # rebuilds its buckets in the second (a broadcast)
    beyond = sorted(set(c - buckets for c in calls[2:]))
    say(f"rank {rank} collectives a step beyond DDP's {buckets}: {beyond}")
""")


def test_rank_0s_log_writes_hold_no_rank_and_a_step_has_one_collective(data, tmp_path):
    """Issue 56.1, on 2 processes: in every other block of 5 steps rank 0's writes to log.txt take 20 ms
    more (a slow file system); rank 1's median wall time a step rises by less than 5 ms (the lines are
    written on rank 0's writer thread; before, rank 1 waited for them in the next step's all-reduce of
    the stop flag). A plain step issues one collective beyond DDP's bucket all-reduces: the loss, the
    stop flag and a failed write in one all-reduce (the process group's sequence number counts them)."""
    # 120 steps: a median over 55 steps each way, which a loaded machine moves by 2-3 ms
    args = ["--max_steps=120", "--eval_interval=0", "--checkpoint_interval=0"]
    # torchrun gives a stopping worker no time: rank 0 warns that a stop checkpoint would not fit
    no_grace = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"}
    r = launch(GAPS, tmp_path, argv(data, tmp_path / "log", *args), 2, no_grace)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    fast, slow = map(float, re.search(r"rank 1 ms a step: ([\d.]+) then ([\d.]+)", r.stdout).groups())
    assert slow - fast < 5, r.stdout[-3000:]
    assert re.findall(r"collectives a step beyond DDP's \d+: (.*)", r.stdout) == ["[1]", "[1]"], r.stdout
    assert sorted(read_log(tmp_path / "log")["train"]) == list(range(120))
    assert r.stdout.count("more than the 0 s that torchrun waits before it kills a stopping worker; give "
                          "it more with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=") == 1, r.stdout[-3000:]


ASYNC = wrapper("""
SLOW_STEP, SLOW_S = int(os.environ.get('SLOW_STEP', 4)), 6  # the checkpoint of step 4 takes 6 s more to land
FULL_STEP = int(os.environ.get('FULL_STEP', -1))  # or the disk is full for it
write = checkpoint.atomic_write
def slow_write(path, write_to):  # its bytes written, then slow to reach the disk (before the rename)
    def slow(f):
        write_to(f)
        if path.endswith(f"model_{FULL_STEP:05d}.pt"):
            raise OSError(28, "No space left on device")
        if path.endswith(f"model_{SLOW_STEP:05d}.pt"):
            say(f"rank 0 writes slowly from {time.time():.3f}")
            time.sleep(SLOW_S)
            say(f"rank 0 has written at {time.time():.3f}")
    return write(path, slow)
checkpoint.atomic_write = slow_write


def step_begins(step):
    say(f"rank {rank} begins step {step} at {time.time():.3f}")
""")
ASYNC_ARGS = ["--max_steps=16", "--eval_interval=4", "--checkpoint_interval=4"]
shares_slow_run = pytest.mark.xdist_group("slow_written")  # one worker: one run for both


@pytest.fixture(scope="module")
def slow_written(data, tmp_path_factory):
    """(log_dir, output) of a run on 2 processes whose checkpoint of step 4 takes 6 s to write."""
    tmp_path = tmp_path_factory.mktemp("slow_written")
    r = launch(ASYNC, tmp_path, argv(data, tmp_path / "log", *ASYNC_ARGS), 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return tmp_path / "log", r


def said_at(event, r):
    return float(re.search(rf"{event} ([\d.]+)", r.stdout).group(1))


def same_state(a, b):
    """Two checkpoints hold the same weights and optimizer state, bit for bit."""
    x, y = (torch.load(p, map_location="cpu", weights_only=True) for p in (a, b))
    tensors = lambda c: torch.utils._pytree.tree_leaves([c["model"], c["optimizer"]["state"]])
    return all(torch.equal(s, t) for s, t in zip(tensors(x), tensors(y)))


@shares_slow_run
def test_steps_train_while_a_checkpoint_is_written(slow_written, data, tmp_path):
    """Issue 56.3: the checkpoint of step 4 is copied to host memory, then written on rank 0's writer
    thread for 6 s while both ranks train on (steps 6 and 7, and 5 too unless it outran the thread,
    begin during the write; the save of step 8 waits for it, and step 8 begins after). Every
    checkpoint loads, and the run resumed from the slow one ends as the uninterrupted run did: the
    same log and the same final state, bit for bit."""
    from gptkit import checkpoint
    log, r = slow_written
    # what rank 0 said after the first step: the copy's size, the tensors of a checkpoint; no warning
    # within torchrun's 30 s
    ckpt = torch.load(log / "model_00004.pt", weights_only=True)
    tensors = {t.untyped_storage().data_ptr(): t.nbytes
               for t in torch.utils._pytree.tree_leaves([ckpt["model"], ckpt["optimizer"]])
               if torch.is_tensor(t)}
    said = float(re.search(r"checkpoints: each save takes ([\d.]+) MiB of host memory", r.stdout)[1])
    assert said == round(sum(tensors.values()) / 2 ** 20, 1) and "warning" not in r.stdout
    began, written = said_at("rank 0 writes slowly from", r), said_at("rank 0 has written at", r)
    during = {int(s) for rank, s, t in re.findall(r"rank (\d) begins step (\d+) at ([\d.]+)", r.stdout)
              if began < float(t) < written}
    # (step 5 may begin before the writer thread reaches the slow part, which a fast step outruns)
    assert {6, 7} <= during <= {5, 6, 7}, r.stdout[-3000:]
    assert [s for s, _ in checkpoint.list_checkpoints(log)] == [16, 12, 8, 4]
    for _, path in checkpoint.list_checkpoints(log):
        checkpoint.read_checkpoint(path)  # its keys, checksum and shapes
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(log / "model_00004.pt", resumed)
    r = launch(ASYNC, tmp_path, argv(data, resumed, *ASYNC_ARGS), 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # the lines after those the checkpoint vouches for (written before it, on the same thread)
    size = checkpoint.read_checkpoint(log / "model_00004.pt")["logs"]["log.txt"]
    assert (resumed / "log.txt").read_bytes() == (log / "log.txt").read_bytes()[size:]
    assert same_state(log / "model_00016.pt", resumed / "model_00016.pt")


@shares_slow_run
def test_sigterm_during_a_write_in_flight_completes_it_then_stops(slow_written, data, tmp_path):
    """Issue 56.3: SIGTERM reaches both workers while rank 0 writes the checkpoint of step 4 in the
    background: they finish their step, the write in flight completes, the stop checkpoint is
    written, they exit 75 (as torchrun reports them), and the same command resumes to the state of
    the run that was not stopped."""
    from gptkit import checkpoint
    log = tmp_path / "log"
    p = start(ASYNC, tmp_path, argv(data, log, *ASYNC_ARGS), 2)
    deadline = time.time() + 120
    while not any(log.glob("model_00004.pt.tmp*")):  # the write of step 4 in flight
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    for pid in commands.children(p.pid):  # the workers, as a scheduler signals a job's processes
        os.kill(pid, signal.SIGTERM)
    r = ended(p)
    out = r.stdout + r.stderr
    assert "exitcode  : 75" in out and r.returncode == 1, out[-3000:]
    stopped = int(re.search(r"SIGTERM: stopped at step (\d+); wrote ", r.stdout).group(1))
    assert said_at("rank 0 has written at", r) > said_at("rank 0 writes slowly from", r)
    # the signal came before step 9's all-reduce: step 8's save waited for the write of step 4
    steps = [s for s, _ in checkpoint.list_checkpoints(log)]
    assert 4 < stopped <= 9 and steps[0] == stopped and steps[-1] == 4, (steps, r.stdout[-3000:])
    for _, path in checkpoint.list_checkpoints(log):
        checkpoint.read_checkpoint(path)
    r = launch(ASYNC, tmp_path, argv(data, log, *ASYNC_ARGS), 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (log / "log.txt").read_text() == (slow_written[0] / "log.txt").read_text()
    assert same_state(slow_written[0] / "model_00016.pt", log / "model_00016.pt")


def test_a_background_write_that_fails_stops_every_rank_with_one_line(data, tmp_path):
    """Issue 56.3: the background write of step 8's checkpoint fails (a full disk): the next step's
    all-reduce tells every rank, and the run ends there with one line from rank 0 naming the file,
    exit 1; no part of that file is left, and the checkpoint of step 4 stands."""
    from gptkit import checkpoint
    log = tmp_path / "log"
    r = launch(ASYNC, tmp_path, argv(data, log, *ASYNC_ARGS), 2, {"FULL_STEP": "8", "SLOW_STEP": "-1"})
    assert r.returncode == 1, r.stdout[-2000:]
    assert errors(r) == [f"error: could not write the checkpoint {log / 'model_00008.pt'} ([Errno 28] No "
                         f"space left on device); the earlier checkpoints are untouched: fix that (free "
                         f"some space, say) and run the same command again to resume"], r.stderr[-3000:]
    assert max(read_log(log)["train"]) <= 9  # it stopped at once
    assert [s for s, _ in checkpoint.list_checkpoints(log)] == [4] and not list(log.glob("*.tmp*"))
