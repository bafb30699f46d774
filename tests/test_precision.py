"""Precision chosen by the hardware (dtype="auto"), and float16 training with loss scaling: an
overflow skips the update without counting as a bad step, and a float16 run resumes bit for bit.
The faults are injected by wrapping scripts (test_step.SEAMS) that run train_gpt2.py as python does."""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from gptkit import hardware
from gptkit.configurator import trainer_defaults
import commands
import test_resume
from conftest import ROOT, one_thread, read_log, run_script
from test_resume import args, assert_same, state, wait_for_step
from test_step import wrapper

# the tests that share this module's runs (its fixtures) go to one xdist worker: each run happens once
shares_runs = pytest.mark.xdist_group("test_precision")


data, one = test_resume.data, test_resume.one  # its fixtures: pytest finds them among this module's names too

FP16 = ["--dtype=float16"]

# A gradient poisoned in the given steps of a run from scratch, on every rank: the model's first
# parameter's times FACTOR. SCALE: GradScaler's first loss scale (None: its own, 65536).
POISON = """
BAD, FACTOR, SCALE, hooks = {bad}, {factor}, {scale}, []


def step_begins(step):
    if step in BAD:
        hooks.append(next(run['model'].parameters()).register_hook(lambda g: g * FACTOR))


def after_update(step):
    while hooks:
        hooks.pop().remove()


if SCALE is not None:
    init = torch.amp.GradScaler.__init__
    torch.amp.GradScaler.__init__ = lambda self, *a, **k: init(self, *a, **dict(k, init_scale=SCALE))
"""


def poison_script(folder, bad, factor="float('nan')", scale=None):
    """folder/poison.py: train_gpt2.py with the gradients of the steps in bad poisoned (POISON)."""
    path = folder / "poison.py"
    path.write_text(wrapper(POISON.format(bad=set(bad), factor=factor, scale=scale)))
    return str(path)


def inject_nan(script, cmd_args):
    return run_script(cmd_args, script=script, PYTHONPATH=ROOT)


# the reference below, with oneDNN free to use every instruction the kernel lists
needs_cpuinfo = pytest.mark.skipif(not os.path.exists("/proc/cpuinfo") or "ONEDNN_MAX_CPU_ISA" in os.environ,
                                   reason="needs Linux's /proc/cpuinfo, and no ONEDNN_MAX_CPU_ISA")


def cpuinfo_has(kind="bf16"):
    """The independent reference: the kernel's CPU flags (kind: bf16 or fp16)."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return f"avx512_{kind}" in flags or f"amx_{kind}" in flags


@pytest.mark.quick
@needs_cpuinfo
def test_cpu_bf16_units_are_detected():
    assert hardware.cpu_has_bf16() == cpuinfo_has("bf16")
    assert hardware.cpu_has_fp16() == cpuinfo_has("fp16")


# oneDNN kept to AVX2, as on most laptops and Zen 3: every bf16 and float16 matmul emulated
AVX2 = dict(ONEDNN_MAX_CPU_ISA="AVX2")


@needs_cpuinfo
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("dtype, kind", [("float16", "fp16"), ("bfloat16", "bf16")])
def test_a_precision_emulated_on_this_cpu_is_said_at_start(data, tmp_path, isa, dtype, kind):
    """Issue 57.5: bf16 or float16 asked for on a CPU without units for it gets one warning at start, with
    the slowdown and what auto would pick; the kernel's flags say which CPU has them."""
    env = AVX2 if isa == "avx2" else {}
    r = run_script(args(data, tmp_path, f"--dtype={dtype}", "--max_steps=1", "--eval_interval=0"), **env)
    assert r.returncode == 0, r.stderr
    warning = f"warning: this CPU has no {dtype} units: {dtype} is emulated, ~"
    assert r.stdout.count(warning) == (isa == "avx2" or not cpuinfo_has(kind)), r.stdout
    auto = "bfloat16" if isa == "native" and cpuinfo_has("bf16") else "float32"
    said = r.stdout.count(f"x slower than float32 (dtype='auto' picks {auto} here)")
    assert said == r.stdout.count(warning)


@pytest.mark.quick
def test_auto_picks_by_hardware(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    no_bf16 = "auto: this CPU has no bf16 units; bf16 would be emulated, ~130x slower"
    assert hardware.resolve_dtype("auto", "cpu") == ("float32", no_bf16)
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    assert hardware.resolve_dtype("auto", "cpu")[0] == "bfloat16"
    assert hardware.resolve_dtype("float16", "cpu") == ("float16", "as configured")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    v100 = "auto: Tesla V100 (compute capability 7.0) has no bf16; float16 with loss scaling"
    assert hardware.resolve_dtype("auto", "cuda:0") == ("float16", v100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert hardware.resolve_dtype("auto", "cuda:0")[0] == "bfloat16"
    assert hardware.resolve_dtype("auto", "mps")[0] == "float32"


def _agree(rank, store_path, out_path):
    """One rank: its hardware 'has' bf16 on rank 0 only; choose_precision must agree."""
    hardware.resolve_dtype = lambda dtype, device: ("bfloat16", "x") if rank == 0 else ("float32", "y")
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, 2), rank=rank,
                                         world_size=2)
    c = hardware.choose_precision(trainer_defaults(), "cpu")
    with open(f"{out_path}.{rank}", "w") as f:
        f.write(f"{c['dtype']} {c['compile']}")
    torch.distributed.destroy_process_group()


def test_every_rank_takes_the_least_capable_choice(tmp_path):
    mp.spawn(_agree, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2)
    chosen = [(tmp_path / f"out.{r}").read_text() for r in (0, 1)]
    assert chosen == ["float32 False"] * 2  # compile: CUDA only


def test_trainer_says_what_auto_chose(data, tmp_path):
    r = run_script(args(data, tmp_path, "--dtype=auto", "--max_steps=2", "--eval_interval=0"))
    assert r.returncode == 0, r.stderr
    expected = "bfloat16" if hardware.cpu_has_bf16() else "float32"
    assert r.stdout.count(f"precision: {expected} (auto: this CPU has ") == 1
    assert torch.load(tmp_path / "model_00002.pt", weights_only=True)["train_config"]["dtype"] == expected


def tiny_step(data, folder, init_scale, poison):
    """A float16 run of 2 steps from a given loss scale, step 1's gradient poisoned (True: inf; a
    number: that many times its size): (step 1 finite, step 1 a float16 overflow, step 1 moved the
    weights, the loss scale after it), as its output line, log.txt and checkpoints say."""
    factor = "float('inf')" if poison is True else repr(poison)
    folder.mkdir()
    script = poison_script(folder, {1} if poison else set(), factor, init_scale)
    log_dir = folder / "log"
    r = inject_nan(script, args(data, log_dir, *FP16, "--max_steps=2", "--checkpoint_interval=1",
                                "--eval_interval=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    line = re.findall(r"^step     1 \| loss .*$", r.stdout, re.M)
    assert len(line) == 1, r.stdout[-3000:]
    overflow = "| float16 overflow: update skipped, loss scale now" in line[0]
    bad = "| non-finite: update skipped (1 in a row, max_bad_steps=5)" in line[0]
    log = read_log(log_dir)
    assert sorted(log["train"]) == [0, 1], log
    assert {k: log.get(k) for k in ("overflow", "skip")} == {  # the line and log.txt say the same
        "overflow": {1: init_scale / 2} if overflow else None, "skip": {1: 1.0} if bad else None}, log
    before, after = state(log_dir, 1), state(log_dir, 2)
    moved = any(not torch.equal(before["model"][k], after["model"][k]) for k in before["model"])
    if not moved:  # a skipped step: the AdamW state too, as it was
        assert_same(before, after)
    assert before["scaler"]["scale"] == init_scale, before["scaler"]  # step 0 was clean
    return not (overflow or bad), overflow, moved, after["scaler"]["scale"]


@pytest.mark.quick
def test_overflow_is_loss_scaling_not_a_bad_step(data, tmp_path):
    assert tiny_step(data, tmp_path / "clean", 2.0 ** 16, poison=False) == (True, False, True, 2.0 ** 16)
    # skipped, scale halved
    assert tiny_step(data, tmp_path / "inf", 2.0 ** 16, poison=True) == (False, True, False, 2.0 ** 15)
    # at a scale of 1 an overflow is no loss-scaling matter: a bad step
    assert tiny_step(data, tmp_path / "scale1", 1.0, poison=True) == (False, False, False, 0.5)


@pytest.mark.quick
def test_a_non_finite_norm_the_scaler_did_not_see_is_a_bad_step(data, tmp_path):
    """Issue 21.5: finite gradients whose norm overflows (1e30 times their size) skip the update,
    but the scaler found nothing and keeps its scale: a bad step, not a float16 overflow (which
    would never count towards max_bad_steps)."""
    assert tiny_step(data, tmp_path / "1e30", 2.0 ** 16, poison=1e30) == (False, False, False, 2.0 ** 16)


@pytest.fixture(scope="module")
def fp16(data, tmp_path_factory):
    """An uninterrupted float16 run whose step 10 overflows (a gradient poisoned with NaN)."""
    log_dir = tmp_path_factory.mktemp("fp16")
    script = poison_script(tmp_path_factory.mktemp("fp16_script"), [10])
    r = inject_nan(script, args(data, log_dir, *FP16, "--max_bad_steps=1"))
    assert r.returncode == 0, r.stderr
    return log_dir, r.stdout


@shares_runs
def test_float16_overflow_is_logged_and_skipped(fp16, data, one):
    log_dir, stdout = fp16
    assert "step    10 | loss " in stdout
    assert "| float16 overflow: update skipped, loss scale now 32768" in stdout
    log = read_log(log_dir)
    assert log["overflow"] == {10: 32768.0} and "skip" not in log  # max_bad_steps=1 did not stop it
    assert sorted(log["train"]) == list(range(120))
    assert state(log_dir, 20)["scaler"]["scale"] == state(log_dir)["scaler"]["scale"] == 32768.0
    # float16 trains like float32: a nearby loss at the end
    assert abs(read_log(one)["train"][119] - log["train"][119]) < 0.05


@shares_runs
def test_float16_resumes_bit_identically_after_kill9(fp16, data, tmp_path):
    """kill -9 after the checkpoint at step 20, then the same command: the same log, weights,
    AdamW state and loss scale (32768, restored: a fresh scaler would start at 65536)."""
    ref, _ = fp16
    log_dir = tmp_path / "log"
    run_args = args(data, log_dir, *FP16, "--max_bad_steps=1")
    p = commands.Popen([sys.executable, poison_script(tmp_path, [10]), *run_args],
                     cwd=ROOT, env=one_thread(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT),
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_step(log_dir, 22, p)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    r = run_script(args(data, log_dir, *FP16, "--max_bad_steps=1"))  # no poison now: step 10 is behind it
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout
    assert (log_dir / "log.txt").read_text() == (ref / "log.txt").read_text()
    assert_same(state(ref), state(log_dir))
    assert state(log_dir)["scaler"] == state(ref)["scaler"] and state(ref)["scaler"]["scale"] == 32768.0


def torchrun(script, run_args):
    """script (train_gpt2.py wrapped, with a fault) run by torchrun with 2 processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    return commands.run([*cmd, *run_args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                      env=one_thread(PYTHONPATH=ROOT))


@shares_runs
def test_two_processes_skip_the_same_overflow(fp16, data, tmp_path):
    """torchrun, 2 processes, the same poisoned step: the all-reduced gradients overflow on every
    rank, every rank skips it (no hang, no divergence), and the run matches the 1-process run."""
    script = poison_script(tmp_path, [10])
    r = torchrun(script, args(data, tmp_path / "log", *FP16, "--max_bad_steps=1"))
    assert r.returncode == 0, r.stderr
    one_log, two_log = read_log(fp16[0]), read_log(tmp_path / "log")
    assert two_log["overflow"] == {10: 32768.0} and "skip" not in two_log
    for step in range(120):
        assert abs(one_log["train"][step] - two_log["train"][step]) <= 1e-4, step
    assert state(tmp_path / "log")["scaler"] == state(fp16[0])["scaler"]


ONE_RANK = wrapper("""
hooks = []


def row_0_nan(g):
    return torch.cat((g[:1] * float('nan'), g[1:]))


def step_begins(step):  # rank 1 only, step 10: NaN in row 0 of the model's first parameter's gradient
    if rank == 1 and step == 10:
        # hooked as each forward begins: FSDP has gathered the whole parameter by then, the one it uses
        poison = lambda model, inputs: hooks.append(next(model.parameters()).register_hook(row_0_nan))
        hooks.append(run['model'].register_forward_pre_hook(poison))


def after_update(step):
    while hooks:
        hooks.pop().remove()


update = torch.amp.GradScaler.update
def update_and_say(self, *a, **k):  # the step's last word on the loss scale
    update(self, *a, **k)
    say(f"rank {rank} step {begun[0] - 1} scale {self.get_scale():g}")
torch.amp.GradScaler.update = update_and_say
""")


def test_an_overflow_one_rank_sees_is_skipped_by_all(data, tmp_path):
    """Issue 21.7: rank 1 alone makes row 0 of the model's first parameter's gradient NaN. DDP's
    all-reduce spreads it to every rank; FSDP's reduce-scatter leaves it in rank 0's shard only
    (rank 0 holds a parameter's first rows), and each rank's scaler checks its own shard (DTensor
    all-reduces what they found). Every rank must skip the step and lower its loss scale together
    (a rank that kept 65536 would mix differently scaled gradients from then on), and FSDP with
    float16 must train as DDP does."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    logs = {}
    for parallel in ("ddp", "fsdp"):
        run_args = args(data, tmp_path / parallel, *FP16, "--max_steps=16", f"--parallel={parallel}")
        r = torchrun(script, run_args)
        assert r.returncode == 0, r.stdout + r.stderr
        # each rank's line is one write, but rank 0's buffered output may be flushed mid-line around
        # it: find, not split
        found = re.findall(r"rank (\d+) step (\d+) scale (\S+)\n", r.stdout)
        scales = {(int(k), int(s)): float(v) for k, s, v in found}
        for s in range(16):
            want = 65536.0 if s < 10 else 32768.0
            assert scales[0, s] == scales[1, s] == want, (parallel, s, scales[0, s], scales[1, s])
        logs[parallel] = log = read_log(tmp_path / parallel)
        assert log["overflow"] == {10: 32768.0} and "skip" not in log, parallel
        assert sorted(log["train"]) == list(range(16)), parallel
    assert all(abs(logs["ddp"]["train"][s] - logs["fsdp"]["train"][s]) <= 1e-5 for s in range(16)), logs
