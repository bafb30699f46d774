"""Exact resume, preemption and node failure, with real processes: a run stopped any way and
started again with the same command ends with the same log and the same weights as a run that
was never stopped."""
import inspect
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import torch

import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log, run_script, write_shards
from commands import children, kill_job
from gptkit.checkpoint import RESUME_KEYS

# the tests that share this module's runs (its fixtures) go to one xdist worker: each run happens once
shares_runs = pytest.mark.xdist_group("test_resume")


MAX_STEPS = 120
COMMON = [*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=256", f"--max_steps={MAX_STEPS}",
          "--eval_interval=20", "--val_tokens=256", "--sample_interval=0", "--checkpoint_interval=20",
          "--hellaswag=False", "--keep_checkpoints=0",
          "--max_lr=1e-3", "--min_lr=1e-4"]  # small lr: 1 vs 2 processes agree to 1e-5 (see test_train)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Shards that a 256-token step leaves mid-way: the runs change shard and wrap around."""
    return random_shards(tmp_path_factory.mktemp("data"), 0, 600, [256 * 7 + 50, 256 * 5 + 8])


def args(data, log_dir, *extra):
    return [*COMMON, f"--data_root={data}", f"--log_dir={log_dir}", *extra]


@pytest.fixture(scope="module")
def one(data, tmp_path_factory):
    """An uninterrupted 1-process run (keeps all its checkpoints)."""
    log_dir = tmp_path_factory.mktemp("one")
    r = run_script(args(data, log_dir))
    assert r.returncode == 0, r.stderr
    return log_dir


@pytest.fixture(scope="module")
def two(data, tmp_path_factory):
    """An uninterrupted 2-process torchrun run."""
    log_dir = tmp_path_factory.mktemp("two")
    r = run_script(args(data, log_dir), nproc=2)
    assert r.returncode == 0, r.stderr
    return log_dir


def start(cmd_args, nproc=None, torchrun_args=(), **kw):
    """The command of run_script, in the background, in its own process group."""
    env = one_thread(PYTHONUNBUFFERED="1")
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *torchrun_args]
    return commands.Popen([*cmd, "train_gpt2.py", *cmd_args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw)


def wait_for_step(log_dir, step, proc, timeout=120):
    """Until log.txt has a train line for step (the checkpoint before it is on disk by then)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if f"\n{step} train " in "\n" + (log_dir / "log.txt").read_text():
                return
        except FileNotFoundError:
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.005)
    raise AssertionError(f"no step {step} in {timeout} s")


def state(log_dir, step=MAX_STEPS):
    return torch.load(log_dir / f"model_{step:05d}.pt", map_location="cpu", weights_only=True)


def assert_same(a, b, tol=0.0):
    """Same weights and AdamW moments: bit for bit when tol is 0."""
    assert a["model"].keys() == b["model"].keys()
    pairs = [(k, a["model"][k], b["model"][k]) for k in a["model"]]
    for i, s in a["optimizer"]["state"].items():
        t = b["optimizer"]["state"][i]
        pairs += [(f"optimizer {i} {m}", s[m], t[m]) for m in ("exp_avg", "exp_avg_sq", "step")]
    for name, x, y in pairs:
        if tol == 0:
            assert torch.equal(x, y), name
        else:
            assert (x - y).abs().max().item() <= tol, (name, (x - y).abs().max().item())


def assert_resumed_exactly(a, b):
    """Every entry of checkpoint b is checkpoint a's, tensors bit for bit: the model, the optimizer,
    the loader, the RNG, ... and any entry a trainer adds (the config aside: its log_dir differs)."""
    assert a.keys() == b.keys()
    for key in [k for k in a if k != "train_config"]:
        x, y = torch.utils._pytree.tree_flatten(a[key]), torch.utils._pytree.tree_flatten(b[key])
        assert x[1] == y[1], key  # the same structure
        assert all(torch.equal(u, v) if torch.is_tensor(u) else u == v for u, v in zip(x[0], y[0])), key


def assert_log_complete(log_dir):
    """Every step once, in order: no line the crashed run wrote after its checkpoint survives."""
    lines = (log_dir / "log.txt").read_text().splitlines()
    train = [int(line.split()[0]) for line in lines if line.split()[1] == "train"]
    val = [int(line.split()[0]) for line in lines if line.split()[1] == "val"]
    assert train == list(range(MAX_STEPS)) and val == list(range(0, MAX_STEPS + 1, 20)), lines


def copy_checkpoint(src, dst, step, log_lines=None):
    """dst as a run that crashed after writing checkpoint step: that checkpoint, and log.txt with
    the lines written after it too, the last one cut short."""
    dst.mkdir()
    shutil.copy(src / f"model_{step:05d}.pt", dst)
    text = (src / "log.txt").read_text()
    (dst / "log.txt").write_text(text[:len(text) * 3 // 4] if log_lines is None else log_lines)


@shares_runs
def test_checkpoint_holds_everything_and_loads_weights_only(one):
    ckpts = sorted(p.name for p in one.glob("model_*.pt"))
    assert ckpts == [f"model_{s:05d}.pt" for s in range(20, MAX_STEPS + 1, 20)]
    for name in ckpts:
        ckpt = torch.load(one / name, weights_only=True)  # plain tensors and containers only
        assert set(RESUME_KEYS) <= ckpt.keys() and {"val_loss"} <= ckpt.keys()
        logged = read_log(one)["val"][ckpt["step"]]
        assert ckpt["evaluated"] and ckpt["val_loss"] == pytest.approx(logged, abs=5e-5)
        assert set(ckpt["rng"]) == {"torch"}  # and "cuda" on a GPU
        assert ckpt["loader"]["file"].startswith("edufineweb_train_") and ckpt["bad_steps"] == 0
        assert len(ckpt["optimizer"]["state"]) == len(ckpt["model"]) - 1  # lm_head is tied to wte
    # the loader position is global: the same after step 20 for 1 and for 2 processes. An epoch is
    # 12 steps (7 in shard file 0, 5 in file 1), so step 20 is 8 steps into epoch 1, whose shard
    # order the seed draws (shuffle, the default: docs/data.md)
    order, steps = np.random.default_rng([1337, 1]).permutation(2), (7, 5)
    shard = int(8 >= steps[order[0]])
    assert torch.load(one / "model_00020.pt", weights_only=True)["loader"] == {
        "epoch": 1, "shard": shard, "pos": 256 * (8 - shard * steps[order[0]]), "shuffle": True, "seed": 1337,
        "file": f"edufineweb_train_{order[shard]:06d}.npy"}


@shares_runs
@pytest.mark.parametrize("step", [20, 60])
def test_resume_from_a_checkpoint_is_bit_identical(one, data, tmp_path, step):
    """A run stopped at a checkpoint and run again: the same log.txt, byte for byte, and the same
    weights and optimizer state, bit for bit."""
    copy_checkpoint(one, tmp_path / "resumed", step)
    r = run_script(args(data, tmp_path / "resumed"))
    assert r.returncode == 0, r.stderr
    assert f"resuming from {tmp_path / 'resumed' / f'model_{step:05d}.pt'}: step {step}" in r.stdout
    assert f"step {step:5d} | val loss" not in r.stdout  # the checkpoint's own evals are not run again
    assert (tmp_path / "resumed" / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(tmp_path / "resumed"))
    assert_resumed_exactly(state(one), state(tmp_path / "resumed"))


# a resume that forgets to load one entry of the checkpoint (here the loader's position)
FORGET_ONE = """
from gptkit import checkpoint
load = checkpoint.load_state
def forgetful(state, ckpt, path):
    load({k: v for k, v in state.items() if k != 'loader'}, ckpt, path)
checkpoint.load_state = forgetful
"""


@shares_runs
def test_a_resume_that_misses_an_entry_fails_the_exact_resume_check(one, data, tmp_path):
    """Issue 54.4: what a checkpoint holds is listed once, and the check above compares every entry:
    an entry whose load side is missing makes it fail (a user's new state, an EMA, is one entry)."""
    copy_checkpoint(one, tmp_path / "resumed", 100)
    r = run_script(args(data, tmp_path / "resumed"), PYTHONPATH=ROOT,
                   script=wrapper(tmp_path, "forget.py", FORGET_ONE))
    assert r.returncode == 0, r.stderr
    with pytest.raises(AssertionError):
        assert_resumed_exactly(state(one), state(tmp_path / "resumed"))


@shares_runs
def test_kill9_of_torchrun_then_the_same_command(two, data, tmp_path):
    """kill -9 of torchrun and both workers after the first checkpoint; the same command again
    resumes and ends as the uninterrupted run did."""
    log_dir = tmp_path / "log"
    p = start(args(data, log_dir), nproc=2)
    wait_for_step(log_dir, 22, p)  # checkpoint 20 is written, and 2 more steps are logged
    kill_job(p)
    assert not (log_dir / f"model_{MAX_STEPS:05d}.pt").exists()
    r = run_script(args(data, log_dir), nproc=2)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout
    assert_log_complete(log_dir)
    assert read_log(log_dir) == read_log(two)
    assert_same(state(two), state(log_dir))


@shares_runs
def test_torchrun_max_restarts_recovers_from_a_dead_worker(two, data, tmp_path):
    """torchrun --max-restarts=1, rank 1 killed mid-run: the group restarts (each attempt in its
    own rendezvous keys), resumes from the checkpoint and finishes as if nothing happened."""
    log_dir = tmp_path / "log"
    p = start(args(data, log_dir), nproc=2, torchrun_args=["--max-restarts=1"])
    wait_for_step(log_dir, 22, p)
    workers = sorted(children(p.pid))  # torchrun starts them in the order of their ranks
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    try:
        out, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_job(p)
        raise AssertionError("the restarted group hung")
    assert p.returncode == 0, out
    assert out.count("resuming from") == 1, out
    assert_log_complete(log_dir)
    assert read_log(log_dir) == read_log(two)
    assert_same(state(two), state(log_dir))


@shares_runs
def test_sigterm_checkpoints_the_current_step_and_exits_75(one, two, data, tmp_path):
    """SIGTERM (a scheduler's preemption): the step in flight finishes, a checkpoint of it is
    written, the process exits with 75; the same command resumes exactly. Once for one process,
    once for torchrun with the signal sent to its whole process group, as SLURM does."""
    log_dir = tmp_path / "one"
    p = start(args(data, log_dir))
    wait_for_step(log_dir, 22, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 75, out
    stopped = int(re.search(r"SIGTERM: stopped at step (\d+); wrote ", out).group(1))
    written = log_dir / f"model_{stopped:05d}.pt"
    assert f"wrote {written}; run the same command again to resume (exit code 75)" in out
    assert 22 < stopped < MAX_STEPS and f"{stopped - 1} train" in (log_dir / "log.txt").read_text()
    ckpt = state(log_dir, stopped)
    assert ckpt["step"] == stopped and not ckpt["evaluated"] and ckpt["val_loss"] is None  # no time for evals
    r = run_script(args(data, log_dir))
    assert r.returncode == 0, r.stderr
    assert f"resuming from {log_dir / f'model_{stopped:05d}.pt'}: step {stopped}" in r.stdout
    assert (log_dir / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(log_dir))

    log_dir = tmp_path / "two"
    p = start(args(data, log_dir), nproc=2)
    wait_for_step(log_dir, 22, p)
    os.killpg(p.pid, signal.SIGTERM)  # torchrun passes it on to the workers and waits for them
    out, _ = p.communicate(timeout=60)
    # issue 57.3: the line says what torchrun prints after it
    assert ("run the same command again to resume (exit code 75); torchrun's traceback and exit code 1 "
            "may follow: the checkpoint is whole") in out, out
    assert p.returncode == 1  # torchrun's own code when it was signalled (the workers exit 75)
    r = run_script(args(data, log_dir), nproc=2)
    assert r.returncode == 0, r.stderr
    assert_log_complete(log_dir)
    assert_same(state(two), state(log_dir))


@shares_runs
@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_elastic_resume_on_another_number_of_processes(one, two, data, tmp_path, first, then):
    """The first half on 2 processes (accumulation 4), the second on 1 (accumulation 8), and the
    other way round: the same global batches in the same order, so the losses and weights of an
    uninterrupted run."""
    src = {1: one, 2: two}[first]
    lines = (src / "log.txt").read_text().splitlines(keepends=True)
    until_60 = "".join(line for line in lines if int(line.split()[0]) <= 60)
    copy_checkpoint(src, tmp_path / "log", 60, log_lines=until_60)
    r = run_script(args(data, tmp_path / "log"), nproc=None if then == 1 else then)
    assert r.returncode == 0, r.stderr
    assert f"grad_accum_steps={8 // then}" in r.stdout and "resuming from" in r.stdout
    a, b = read_log({1: one, 2: two}[then]), read_log(tmp_path / "log")
    assert sorted(b["train"]) == list(range(MAX_STEPS))
    for step in range(MAX_STEPS):
        assert abs(a["train"][step] - b["train"][step]) <= 1e-5, step
    # float rounding only (the data is the same): 120 steps at lr 1e-3 drift 6.6e-6 apart in file
    # order, 1.05e-5 in the default shuffled order, measured 2026-12-01
    assert_same(state({1: one, 2: two}[then]), state(tmp_path / "log"), tol=2e-5)


@shares_runs
def test_unloadable_newest_checkpoint_falls_back(one, data, tmp_path):
    """The newest checkpoints: two truncated (torch.load raises an OSError for some cuts), one
    with a flipped bit in a weight (torch.load alone would take it), one a pickle that would run
    code. Each is reported with its path and
    renamed aside, the run resumes from the one before, and nothing the pickle asked for ran."""
    log_dir = tmp_path / "log"
    copy_checkpoint(one, log_dir, 40)
    shutil.copy(one / "model_00060.pt", log_dir)
    with open(log_dir / "model_00060.pt", "r+b") as f:
        f.truncate(os.path.getsize(log_dir / "model_00060.pt") // 2)
    # cut shorter still: torch.load raises an OSError (EINVAL)
    (log_dir / "model_00050.pt").write_bytes((one / "model_00060.pt").read_bytes()[:20000])
    shutil.copy(one / "model_00080.pt", log_dir)
    weight = state(one, 80)["model"]["transformer.h.1.mlp.c_fc.weight"]
    raw = bytearray((log_dir / "model_00080.pt").read_bytes())
    at = raw.find(weight.numpy().tobytes()[:64]) + 1000
    assert at > 1000
    raw[at] ^= 0x10
    (log_dir / "model_00080.pt").write_bytes(bytes(raw))
    flipped = torch.load(log_dir / "model_00080.pt", weights_only=True)["model"]
    flipped = flipped["transformer.h.1.mlp.c_fc.weight"]
    assert not torch.equal(flipped, weight)  # loads, wrong
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    torch.save({"model": Evil()}, log_dir / "model_00100.pt")  # the zip format of a real checkpoint
    with pytest.raises(pickle.UnpicklingError):
        torch.load(log_dir / "model_00100.pt", weights_only=True)

    r = run_script(args(data, log_dir))
    assert r.returncode == 0, r.stderr
    for step in (50, 60, 80, 100):
        path = log_dir / f"model_{step:05d}.pt"
        said = [s for s in r.stdout.splitlines() if s.startswith(f"warning: cannot resume from {path}: ")]
        assert len(said) == 1 and said[0].endswith(f"; renamed it {path.name}.bad"), r.stdout
    assert r.stdout.count(": not a whole zip archive, as torch.save writes: cut short, or another kind") == 2
    assert "the tensors do not match the checksum written with them: the file is corrupt" in r.stdout
    assert ("it holds pickled objects that a weights-only load refuses (Trying to load unsupported GLOBAL "
            "posix.system") in r.stdout
    assert f"resuming from {log_dir / 'model_00040.pt'}: step 40" in r.stdout
    assert not marker.exists()
    assert (log_dir / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(log_dir))
    assert (log_dir / "model_00060.pt").exists()  # written again by the resumed run
    assert all((log_dir / f"model_{s:05d}.pt.bad").exists() for s in (50, 60, 80, 100))


@shares_runs
def test_read_error_is_not_corruption(one, data, tmp_path):
    """A checkpoint that cannot be read (here a folder in its place: an OSError, as an I/O error
    would be) is no proof that it is bad: the run stops and nothing is renamed or falls back."""
    log_dir = tmp_path / "log"
    copy_checkpoint(one, log_dir, 20)
    (log_dir / "model_00040.pt").mkdir()
    before = sorted(os.listdir(log_dir))
    r = run_script(args(data, log_dir))
    assert r.returncode == 1
    assert f"error: cannot read {log_dir / 'model_00040.pt'} (IsADirectoryError: " in r.stderr
    assert "nothing falls back: fix the cause and run again" in r.stderr
    assert sorted(os.listdir(log_dir)) == before  # nothing else: the lock the run took is gone


def test_no_loadable_checkpoint_is_an_error(data, tmp_path):
    """A lone truncated checkpoint: one line, and nothing renamed, as docs/resume.md says (issue 57.4:
    the docs said it would be renamed)."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "model_00010.pt").write_bytes(b"\0" * 1000)
    r = run_script(args(data, log_dir))
    assert r.returncode == 1
    assert "warning" not in r.stdout and len(r.stderr.splitlines()) == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"error: {str(log_dir)!r} holds checkpoints but none can be resumed from "
                               f"({log_dir / 'model_00010.pt'}: not a whole zip archive, as torch.save "
                               f"writes: cut short, or another kind of file): move them away"), r.stderr
    # nothing renamed, nothing written but the lock
    assert sorted(os.listdir(log_dir)) == ["model_00010.pt"]


@shares_runs
def test_config_against_the_checkpoint(one, data, tmp_path):
    """A model-shape change is refused naming the keys; other changes are allowed and printed; a
    finished run has nothing to do; resume='never' refuses a folder with checkpoints."""
    log_dir = tmp_path / "log"
    copy_checkpoint(one, log_dir, 40)
    # the folder as a run leaves it when it refuses: the lock a run takes added
    before = sorted(os.listdir(log_dir)), (log_dir / "log.txt").read_text()
    r = run_script(args(data, log_dir, "--n_layer=3", "--n_embd=64"))
    assert r.returncode == 1
    assert (f"error: {log_dir / 'model_00040.pt'} holds a model with n_layer=2, n_embd=32, but the config "
            f"asks for n_layer=3, n_embd=64") in r.stderr
    r = run_script(args(data, log_dir, "--resume=never"))
    assert r.returncode == 1 and "resume='never'" in r.stderr
    assert (sorted(os.listdir(log_dir)), (log_dir / "log.txt").read_text()) == before  # untouched

    r = run_script(args(data, log_dir, "--max_steps=42", "--max_lr=2e-3"))
    assert r.returncode == 0, r.stderr
    assert "resuming with changed settings: " in r.stdout
    assert "max_lr 0.001 -> 0.002, max_steps 120 -> 42" in r.stdout
    assert sorted(read_log(log_dir)["train"]) == list(range(42))
    r = run_script(args(data, log_dir, "--max_steps=42"))
    assert r.returncode == 0 and "| loss" not in r.stdout
    assert f"nothing to do: {log_dir / 'model_00042.pt'} is step 42 and max_steps=42" in r.stdout


def wrapper(tmp_path, name, patch, after=""):
    """tmp_path/name: a script that runs patch (Python: a probe or a fault on a seam the trainer
    calls), then train_gpt2.py as python runs it, then after. Run it with run_script(script=...)."""
    path = tmp_path / name
    path.write_text(f"import os, runpy, sys\n{patch}\nsys.argv[0] = {TRAINER!r}\n"
                    f"runpy.run_path({TRAINER!r}, run_name='__main__')\n{after}\n")
    return str(path)


TRAINER = os.path.join(ROOT, "train_gpt2.py")
INJECT = """
import torch
bad, calls = {bad}, [0]
clip = torch.nn.utils.clip_grad_norm_
def poisoned(parameters, *a, **k):  # a NaN gradient on the chosen steps (the clip's calls, one a step)
    parameters = list(parameters)
    if calls[0] in bad:
        parameters[0].grad.mul_(float('nan'))
    calls[0] += 1
    return clip(parameters, *a, **k)
torch.nn.utils.clip_grad_norm_ = poisoned
"""


def inject_nan(bad_steps, cmd_args, tmp_path):
    """The trainer with a NaN gradient at the optimizer steps of bad_steps (counted from the run's start)."""
    script = wrapper(tmp_path, f"nan{len(list(tmp_path.glob('nan*')))}.py", INJECT.format(bad=set(bad_steps)))
    return run_script(cmd_args, script=script, PYTHONPATH=ROOT)


@shares_runs
def test_non_finite_step_is_skipped(one, data, tmp_path):
    """A NaN gradient at step 30: no update (weights and AdamW state as before it), logged, and
    the run goes on. Steps 30.. all NaN: after max_bad_steps a checkpoint of the last good state
    and a clear error."""
    log_dir = tmp_path / "log"
    every_step = ["--max_steps=40", "--checkpoint_interval=1", "--eval_interval=0"]  # a checkpoint a step
    r = inject_nan([30], args(data, log_dir, *every_step), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step    30 | loss " in r.stdout
    assert "non-finite: update skipped (1 in a row, max_bad_steps=5)" in r.stdout
    log = read_log(log_dir)
    assert log["skip"] == {30: 1}
    assert all(np.isfinite(v) for v in log["train"].values()) and sorted(log["train"]) == list(range(40))
    assert_same(state(log_dir, 30), state(log_dir, 31))  # step 30 changed nothing
    lm_head = [state(log_dir, step)["model"]["lm_head.weight"] for step in (31, 32)]
    assert not torch.equal(*lm_head)  # and the steps after it did

    log_dir = tmp_path / "stop"
    r = inject_nan(range(30, 100), args(data, log_dir, "--max_bad_steps=3"), tmp_path)
    assert r.returncode == 1
    assert (f"error: stopped after 3 steps in a row with a non-finite loss or gradient norm "
            f"(max_bad_steps=3); {log_dir / 'model_00033.pt'} holds the last good weights") in r.stderr
    assert read_log(log_dir)["skip"] == {30: 1, 31: 2, 32: 3}
    ckpt = state(log_dir, 33)
    assert ckpt["bad_steps"] == 3 and not ckpt["evaluated"]
    # the weights of step 30, the last good update: resume the clean run from its checkpoint 20 to step 30
    copy_checkpoint(one, tmp_path / "clean", 20)
    r = run_script(args(data, tmp_path / "clean", "--checkpoint_interval=10"))
    assert r.returncode == 0, r.stderr
    assert_same(state(tmp_path / "clean", 30), ckpt)

    # an automatic restart (the same command) does not push on; a raised max_bad_steps does
    r = run_script(args(data, log_dir, "--max_bad_steps=3"))
    assert r.returncode == 1
    assert (f"{log_dir / 'model_00033.pt'} was written after 3 steps in a row with a non-finite loss or "
            f"gradient norm, and max_bad_steps=3: to go on (after lowering max_lr, say), raise max_bad_steps "
            f"above 3") in r.stderr
    r = run_script(args(data, log_dir, "--max_bad_steps=4"))
    assert r.returncode == 0, r.stderr
    log = read_log(log_dir)
    assert sorted(log["train"]) == list(range(MAX_STEPS)) and log["skip"] == {30: 1, 31: 2, 32: 3}


@shares_runs
def test_failed_checkpoint_write_keeps_the_earlier_ones(one, data, tmp_path):
    """A checkpoint write that fails (here: a file size limit, as a full disk) stops the run with
    the OS's reason; the earlier checkpoint is untouched, no temporary file is left, and the same
    command then resumes exactly."""
    import resource

    log_dir = tmp_path / "log"
    copy_checkpoint(one, log_dir, 20)
    size = os.path.getsize(log_dir / "model_00020.pt")

    def limit():  # files stop growing at half a checkpoint; SIGXFSZ ignored: the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
    env = one_thread()
    r = subprocess.run([sys.executable, "train_gpt2.py", *args(data, log_dir)], cwd=ROOT, env=env,
                       preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert (f"error: could not write the checkpoint {log_dir / 'model_00040.pt'} ([Errno 27] File too "
            f"large); the earlier checkpoints are untouched") in r.stderr
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00020.pt", "run.json"]
    assert_same(state(one, 20), state(log_dir, 20))
    r = run_script(args(data, log_dir))
    assert r.returncode == 0, r.stderr
    assert (log_dir / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(log_dir))


def test_keep_checkpoints(data, tmp_path):
    """Only the newest keep_checkpoints remain, and the older are deleted after the newer is whole."""
    r = run_script(args(data, tmp_path, "--keep_checkpoints=2", "--max_steps=60", "--checkpoint_interval=10"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("model_*")) == ["model_00050.pt", "model_00060.pt"]


def test_samples_are_trimmed_too(tmp_path):
    """With GPT-2's vocabulary the run writes samples: a resume drops those written after the
    checkpoint, and samples.txt ends as the uninterrupted run's."""
    rng = np.random.default_rng(5)
    data = tmp_path / "data"
    write_shards(data, "val", [rng.integers(0, 50257, 300)])
    write_shards(data, "train", [rng.integers(0, 50257, 1000)])
    common = [*TINY, f"--data_root={data}", "--B=2", "--T=16", "--total_batch_size=64", "--max_steps=8",
              "--eval_interval=4", "--val_tokens=256", "--sample_interval=2", "--sample_length=4",
              "--checkpoint_interval=4", "--hellaswag=False"]
    r = run_script([*common, f"--log_dir={tmp_path / 'a'}"])
    assert r.returncode == 0, r.stderr
    samples = (tmp_path / "a" / "samples.txt").read_text()
    assert [line.split()[1] for line in samples.splitlines()] == ["2"] * 4 + ["4"] * 4 + ["6"] * 4 + ["8"] * 4
    copy_checkpoint(tmp_path / "a", tmp_path / "b", 4)
    (tmp_path / "b" / "samples.txt").write_text(samples[:-10])  # all of them, the last cut short
    r = run_script([*common, f"--log_dir={tmp_path / 'b'}"])
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "samples.txt").read_text() == samples
    assert (tmp_path / "b" / "log.txt").read_text() == (tmp_path / "a" / "log.txt").read_text()


def checksum_before_issue_36(obj):
    """The checksum as written until issue 36, one .item() per tensor: what older checkpoints hold."""
    if torch.is_tensor(obj):
        t = obj.detach().contiguous().view(-1)
        return t.view(torch.int32 if t.element_size() == 4 else torch.uint8).sum(dtype=torch.int64).item()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if not isinstance(obj, (list, tuple)):
        return 0
    return sum(map(checksum_before_issue_36, obj)) % 2 ** 62


# a checkpoint a step, no evals: the trainer's checkpoints of steps 1 and 2, the moments made
TWO_CHECKPOINTS = ["--max_steps=2", "--checkpoint_interval=1", "--eval_interval=0"]

COUNT_READS = """
import json
from tests.host_reads import HostReads
saves, modes = [], {}  # the host reads of each save_checkpoint, by name; the counts going on


def profile(frame, event, arg):  # each call of the trainer's save_checkpoint, from its start to its end
    if frame.f_code.co_name == 'save_checkpoint' and frame.f_code.co_filename == %r:
        if event == 'call':
            modes[frame] = HostReads()
            modes[frame].__enter__()
        elif event == 'return':
            modes[frame].__exit__(None, None, None)
            saves.append(modes.pop(frame).seen)
sys.setprofile(profile)
"""


def test_a_checkpoint_write_reads_values_back_a_fixed_number_of_times(data, tmp_path):
    """Issue 36.5: writing a checkpoint once read tensor values back to the host once a tensor, and on a
    GPU each read waits for the device (~450 at 124M); then twice (the replicas' checksum, the
    checkpoint's). Since issue 56 one process reads none: its tensors are copied to the host without a
    wait, and the checksum is summed there, on the writer thread (under DDP the replicas' checksum is
    the one read). Every read that tests/host_reads.py lists, for two model sizes, in every call of
    the trainer's save_checkpoint during a real run (a profile hook brackets each call)."""
    script = wrapper(tmp_path, "count_reads.py", COUNT_READS % TRAINER,
                     after="sys.setprofile(None)\nprint('saves:', json.dumps(saves))")
    seen = {}
    for n_layer in (1, 4):
        r = run_script(args(data, tmp_path / f"log{n_layer}", *TWO_CHECKPOINTS, f"--n_layer={n_layer}"),
                       script=script, PYTHONPATH=ROOT)
        assert r.returncode == 0, r.stderr
        seen[n_layer] = json.loads(r.stdout.split("saves:")[1])
        assert sorted(p.name for p in (tmp_path / f"log{n_layer}").glob("model_*.pt")) == [
            "model_00001.pt", "model_00002.pt"]
    assert seen == {1: [[], []], 4: [[], []]}


WRITE_THE_OLD_WAY = """
import torch
from gptkit import checkpoint
from gptkit.common import atomic_write
%s
write = checkpoint.write


def write_both(ckpt, *args):  # each checkpoint also written as before issue 36, to OLD
    write(ckpt, *args)  # which adds the logs' sizes and the checksum to ckpt
    old = {key: value for key, value in ckpt.items() if key != 'checksum'}
    old['checksum'] = checksum_before_issue_36(old)
    os.makedirs(OLD, exist_ok=True)  # under the same file name, which torch.save writes into the file
    atomic_write(os.path.join(OLD, f"model_{ckpt['step']:05d}.pt"), lambda f: torch.save(old, f))
checkpoint.write = write_both
OLD = %r
"""


def test_a_checkpoint_is_the_file_written_before_issue_36(data, tmp_path):
    """Issue 36.5: the checkpoint's tensors go to the host in one pass and its checksum is read once,
    but the file is byte for byte the one written before (torch.save of the state, the checksum
    summed one tensor at a time): old checkpoints verify, the tied wte/lm_head weight is saved once
    (one storage, two keys), the state dict keeps its metadata. A real run writes each checkpoint,
    and a wrapper writes the state it was given the old way beside it. Issue 56: the checksum is the
    one check, so torch.save computes no CRC32 (0 in each record's header)."""
    from gptkit import checkpoint
    patch = WRITE_THE_OLD_WAY % (inspect.getsource(checksum_before_issue_36), str(tmp_path / "old"))
    r = run_script(args(data, tmp_path / "log", *TWO_CHECKPOINTS), PYTHONPATH=ROOT,
                   script=wrapper(tmp_path, "old_way.py", patch))
    assert r.returncode == 0, r.stderr
    for name in ("model_00001.pt", "model_00002.pt"):
        assert (tmp_path / "log" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
        assert {info.CRC for info in zipfile.ZipFile(tmp_path / "log" / name).infolist()} == {0}
        ckpt = checkpoint.read_checkpoint(tmp_path / "old" / name)  # verifies
        model = ckpt["model"]
        assert model["lm_head.weight"].untyped_storage().data_ptr() == \
            model["transformer.wte.weight"].untyped_storage().data_ptr()
        assert len(ckpt["optimizer"]["state"]) == len(model) - 1  # AdamW's moments, in the file
        assert hasattr(model, "_metadata")  # the state dict's, as torch writes it
    nested = {"a": [torch.randn(5), (torch.randint(-2 ** 31, 2 ** 31 - 1, (7,), dtype=torch.int32), 3)],
              "b": {"c": torch.ones(3, dtype=torch.float16), "d": torch.arange(-9, 9)}, "e": "text"}
    assert checkpoint.checksum(nested) == checksum_before_issue_36(nested)


PROBE_OPTIMIZER = """
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
seen = []


def first_step(optimizer, args, kwargs):  # the resumed optimizer as its first step finds it
    if not seen:
        seen.append(1)
        torch.save({"groups": [(g["fused"], g["foreach"]) for g in optimizer.param_groups],
                    "state": optimizer.state_dict()["state"]}, %r)
register_optimizer_step_pre_hook(first_step)
"""


@pytest.mark.quick
def test_resumed_optimizer_keeps_this_devices_settings(data, tmp_path):
    """Issue 21.6: a checkpoint's param groups carry the saving run's AdamW settings (foreach, as
    written before issue 27 made AdamW fused everywhere); a resume keeps the fresh optimizer's and
    the checkpoint's state: probed at the resumed run's first optimizer step."""
    log_dir = tmp_path / "log"
    r = run_script(args(data, log_dir, "--max_steps=1", "--eval_interval=0"))
    assert r.returncode == 0, r.stderr
    path = log_dir / "model_00001.pt"
    ckpt = torch.load(path, weights_only=True)
    assert [(g["fused"], g["foreach"]) for g in ckpt["optimizer"]["param_groups"]] == [(True, None)] * 2
    for group in ckpt["optimizer"]["param_groups"]:
        group.update(fused=False, foreach=True)  # as an older CPU run wrote them (the checksum: tensors only)
    torch.save(ckpt, path)
    probe = tmp_path / "probe.pt"
    r = run_script(args(data, log_dir, "--max_steps=2", "--eval_interval=0"), PYTHONPATH=ROOT,
                   script=wrapper(tmp_path, "probe_optimizer.py", PROBE_OPTIMIZER % str(probe)))
    assert r.returncode == 0, r.stderr
    assert f"resuming from {path}: step 1" in r.stdout
    seen = torch.load(probe, weights_only=True)
    assert seen["groups"] == [(True, None)] * 2
    assert seen["state"].keys() == ckpt["optimizer"]["state"].keys()
    assert all(torch.equal(seen["state"][i][k], ckpt["optimizer"]["state"][i][k])
               for i in seen["state"] for k in ("exp_avg", "exp_avg_sq", "step"))


@shares_runs
def test_ctrl_c_stops_like_sigterm_and_a_second_one_aborts(one, data, tmp_path):
    """Issue 21.9: the first Ctrl-C (SIGINT) finishes the step, writes its checkpoint and exits 75
    with one line; the same command resumes to the uninterrupted run's log and weights. In a
    process with the handlers on, a second Ctrl-C raises KeyboardInterrupt at once."""
    log_dir = tmp_path / "one"
    p = start(args(data, log_dir))
    wait_for_step(log_dir, 22, p)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 75 and "Traceback" not in out, out
    stopped = int(re.search(r"Ctrl-C: stopped at step (\d+); wrote ", out).group(1))
    assert state(log_dir, stopped)["step"] == stopped
    r = run_script(args(data, log_dir))
    assert r.returncode == 0, r.stderr
    assert (log_dir / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(log_dir))

    r = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], cwd=ROOT, env=one_thread(), capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.splitlines() == ["Ctrl-C", "KeyboardInterrupt"], r.stdout + r.stderr


# a process with the trainer's handlers on, given two Ctrl-Cs
SECOND_CTRL_C = """
import os, signal, time
from gptkit.run import Run
run = Run()
run.listen_for_stop_signals()
os.kill(os.getpid(), signal.SIGINT)
print(run.stop_signal, flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
except KeyboardInterrupt:
    print('KeyboardInterrupt', flush=True)
"""


@shares_runs
def test_one_run_per_log_dir(one, data, tmp_path):
    """Issue 21.2: a second launch on a live run's log_dir (here: while the first is paused right
    after a checkpoint) exits at once, non-zero, with one line naming the log_dir and the holder,
    and touches nothing: plain python and torchrun alike. The live run then ends as if alone."""
    log_dir = tmp_path / "log"
    p = start(args(data, log_dir))
    wait_for_step(log_dir, 21, p)
    os.killpg(p.pid, signal.SIGSTOP)  # holds its lock, mid-run
    try:
        before = {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in log_dir.iterdir()}
        for nproc in (None, 2):
            r = run_script(args(data, log_dir), nproc=nproc, timeout=120)
            assert r.returncode != 0, r.stdout
            error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
            assert len(error) == 1 and str(log_dir) in error[0], r.stderr
            assert f"pid {p.pid} on {socket.gethostname()}" in error[0], r.stderr
            assert "| loss" not in r.stdout and "resuming" not in r.stdout
            assert {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in log_dir.iterdir()} == before
    finally:
        os.killpg(p.pid, signal.SIGCONT)
    assert p.wait(timeout=120) == 0, p.stdout.read()
    assert (log_dir / "log.txt").read_text() == (one / "log.txt").read_text()
    assert_same(state(one), state(log_dir))


@pytest.mark.quick
def test_a_log_dir_without_locks_warns_and_runs(tmp_path, monkeypatch, capsys):
    """A file system without locks (Lustre mounted noflock: ENOSYS) must not stop a run: one
    warning that names run.lock, and the run goes on unprotected."""
    import errno
    import fcntl
    from gptkit.run import LogDirLock

    def no_locks(*a):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    assert LogDirLock(str(tmp_path / "log")).acquire() == ""
    out = capsys.readouterr().out
    assert f"warning: cannot lock {tmp_path / 'log' / 'run.lock'}" in out
    assert "Function not implemented" in out


# --- log lines of any kind ----------------------------------------------------------------------

EXTRA_KIND = """
import runpy, sys
from gptkit.run import Run
log = Run.log
def log_more(self, line):  # a kind of line that a user's trainer adds, after each val line
    log(self, line)
    step, kind, _ = line.split()
    if kind == 'val':
        log(self, f"{step} top1 0.{step}")
Run.log = log_more
sys.argv[0] = 'train_gpt2.py'
runpy.run_path('train_gpt2.py', run_name='__main__')
"""


def test_a_log_kind_the_trainer_adds_is_kept_across_a_resume(data, tmp_path):
    """Issue 43.1: a line of a kind that no other file knows, written at an eval step before its
    checkpoint, survives a crash after that checkpoint: the resumed run's log.txt is the
    uninterrupted run's, byte for byte (log.txt is cut back to its size at the checkpoint)."""
    (tmp_path / "extra.py").write_text(EXTRA_KIND)
    short = ["--max_steps=40", "--checkpoint_interval=20"]
    r = run_script(args(data, tmp_path / "whole", *short), script=str(tmp_path / "extra.py"), PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stderr
    whole = (tmp_path / "whole" / "log.txt").read_text()
    assert "\n20 top1 0.20\n" in whole
    copy_checkpoint(tmp_path / "whole", tmp_path / "resumed", 20)  # and the log after it, cut short
    r = run_script(args(data, tmp_path / "resumed", *short), script=str(tmp_path / "extra.py"),
                   PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "resumed" / "log.txt").read_text() == whole


def test_a_checkpoint_without_log_sizes_keeps_the_lines_before_its_step(tmp_path):
    """A checkpoint written before log sizes were kept: the lines of the steps before its own stay,
    whatever their kind, and a line cut short goes."""
    from gptkit.checkpoint import trim_logs
    (tmp_path / "log.txt").write_text("0 val 4.1\n0 top1 0.1\n0 train 4.0\n1 train 3.9\n2 val 3.8\n"
                                      "2 top1 0.2\n2 tr")
    (tmp_path / "samples.txt").write_text("step 0 sample 0: 'a'\nstep 2 sample 0: 'b'\n")
    trim_logs(str(tmp_path), None, 2)
    assert (tmp_path / "log.txt").read_text() == "0 val 4.1\n0 top1 0.1\n0 train 4.0\n1 train 3.9\n"
    assert (tmp_path / "samples.txt").read_text() == "step 0 sample 0: 'a'\n"
    trim_logs(str(tmp_path), {"log.txt": 10}, 2)  # a checkpoint's sizes; none for samples.txt
    assert (tmp_path / "log.txt").read_text() == "0 val 4.1\n"
    assert (tmp_path / "samples.txt").read_text() == ""


@shares_runs
def test_dropout_is_a_setting_that_a_resume_or_init_from_keeps(one, data, tmp_path):
    """Issue 43: dropout is not the model's shape: a run resumed with another dropout goes on
    (it says what changed) and trains with it; init_from's weights train with the dropout asked."""
    copy_checkpoint(one, tmp_path / "resumed", 20)
    r = run_script(args(data, tmp_path / "resumed", "--dropout=0.1", "--max_steps=22"))
    assert r.returncode == 0, r.stderr
    assert "dropout 0.0 -> 0.1" in r.stdout and "model shape" not in r.stderr
    assert read_log(tmp_path / "resumed")["train"][20] != read_log(one)["train"][20]
    from test_model import make_hf
    make_hf(tmp_path / "hf")  # a HF GPT-2 of vocab_size 300
    shards = random_shards(tmp_path / "small", 0, 600, [2000], vocab=300)
    losses = []
    for p in (0.0, 0.1):
        log_dir = tmp_path / f"init_{p}"
        r = run_script(args(shards, log_dir, f"--init_from={tmp_path / 'hf'}", f"--dropout={p}",
                            "--max_steps=1", "--eval_interval=0", "--checkpoint_interval=0"))
        assert r.returncode == 0, r.stderr
        losses.append(read_log(log_dir)["train"][0])
    assert losses[0] != losses[1]
