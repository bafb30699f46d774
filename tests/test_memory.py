"""Issue 29: B = "auto" (opt-in: --B=auto) and running out of memory. memory.py's estimate against a
count on fake tensors and a measured peak; its choices against docs/fsdp.md's table; every rank takes
the least; an out-of-memory error anywhere is one line (with B="auto", naming the B to use instead),
the checkpoint before it stands, and the same command with a smaller B resumes."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, random_shards, read_log, run_script

from gptkit import memory
from gptkit.configurator import parse_config, trainer_defaults
from model import GPTConfig

DEFAULTS = trainer_defaults()  # train_gpt2.py's constants (importing the script would run it)

SHAPES = [  # (n_layer, n_head, n_embd, vocab_size, T, B, dtype): wide and narrow, deep and shallow
    (2, 4, 256, 50304, 256, 4, "float32"), (4, 6, 384, 50304, 256, 8, "bfloat16"),
    (8, 4, 256, 4096, 256, 16, "bfloat16")]


def shape(L, H, C, V, T):
    return GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C)


@pytest.mark.parametrize("L, H, C, V, T, B, dtype", [pytest.param(*SHAPES[0], marks=pytest.mark.quick),
                                                     *SHAPES[1:], (12, 12, 768, 50304, 1024, 3, "bfloat16")])
def test_the_count_of_few_blocks_gives_the_whole_forward(L, H, C, V, T, B, dtype):
    """The activations memory.estimate adds (1 and 2 blocks at B = 1 and 2, extrapolated, and the
    loss over the logits) are what autograd saves in the whole CPU training forward at B, counted on
    fake tensors, to 0.5%."""
    c = shape(L, H, C, V, T)
    fixed, per_seq = memory.activations(c, T, dtype, "cpu", compiled=False)
    whole = memory.saved_bytes(c, B, T, dtype, head=True)
    assert abs(fixed + B * per_seq - whole) < 0.005 * whole, (fixed + B * per_seq, whole)


PEAK = """
import json, re, sys, torch
sys.path.insert(0, {root!r})
from gptkit import memory
from gptkit.cpu import fuse_loss
from gptkit.hardware import autocast
from model import GPT, GPTConfig
L, H, C, V, T, B, dtype = {args!r}
torch.set_num_threads(1)
status = lambda k: int(re.search(rf'{{k}}:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024
base = status('VmRSS')  # before the model: the peak below holds the state and the step
model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C))
fuse_loss(model)  # the trainer's loss on a CPU
opt = model.configure_optimizers(0.1, 1e-3, 'cpu')
x = torch.randint(0, V, (B, T))
for i in range(2):  # the second step has the optimizer's state from the start, as every later one
    if i:
        open('/proc/self/clear_refs', 'w').write('5')  # the peak RSS starts again here
    opt.zero_grad(set_to_none=True)
    with autocast('cpu', dtype):
        model(x, x)[1].backward()
    opt.step()
print(json.dumps(status('VmHWM') - base))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's peak RSS reset")
# float32 only: bf16 is about 130x slower on AVX2
@pytest.mark.parametrize("L, H, C, V, T, B, dtype", [(*s[:-1], "float32") for s in SHAPES])
def test_a_measured_peak_lies_between_the_count_and_the_estimate(L, H, C, V, T, B, dtype):
    """One training step on the CPU as the trainer takes it (its fused loss; glibc's defaults, one
    thread, float32: AVX2-only CPUs emulate bf16, about 130x slower), measured as the process's peak RSS:
    at least the state (16 bytes a parameter) plus the counted activations, and at most the estimate
    (activations x ACTIVATIONS_TIMES, and OVERHEAD): measured 1.06-1.26x the count."""
    c = shape(L, H, C, V, T)
    r = subprocess.run([sys.executable, "-c", PEAK.format(root=ROOT, args=(L, H, C, V, T, B, dtype))],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    peak = json.loads(r.stdout.splitlines()[-1])
    fixed, per_seq = memory.activations(c, T, dtype, "cpu", compiled=False)
    counted = 16 * memory.parameter_count(c) + fixed + B * per_seq
    estimate = memory.estimate(c, T, dtype, "cpu", compiled=False)(B)
    assert counted <= peak <= estimate, (counted / 1e6, peak / 1e6, estimate / 1e6)


def test_the_choices_are_the_docs_table():
    """docs/fsdp.md's table of what B="auto" picks for each GPU preset, on 8 GPUs with 24, 40 and
    80 GB free, DDP and FSDP, compiled and not, is what memory.micro_batch picks."""
    text = open(os.path.join(ROOT, "docs", "fsdp.md")).read()
    rows = re.findall(r"^\| `(gpt2_\w+)\.py` \| ((?:[\d-]+ \| ){11}[\d-]+) \|$", text, re.M)
    assert len(rows) == 4, rows
    for preset, cells in rows:
        c = parse_config([os.path.join(ROOT, "config", preset + ".py"), "--B=auto"], DEFAULTS)
        picks = []
        for parallel in ("ddp", "fsdp"):
            for compiled in (True, False):
                for gb in (24, 40, 80):
                    run = dict(c, dtype="bfloat16", compile=compiled, parallel=parallel)
                    B, _, plan = memory.micro_batch(run, GPTConfig.from_dict(c), "cuda", 8, free=gb * 1e9)
                    picks.append(str(B) if memory.fitting_B(plan) else "-")  # "-": not even B=1
        assert picks == cells.split(" | "), (preset, picks, cells)


@pytest.mark.quick
def test_on_the_cpu_auto_keeps_the_demo_preset():
    """config/demo_cpu.py sets B=16, all 16 sequences of a step in one micro-batch; --B=auto picks
    the same on any CPU with the 1 GB or so it needs, and half on 2 processes."""
    c = parse_config([os.path.join(ROOT, "config", "demo_cpu.py")], DEFAULTS)
    assert c["B"] == 16 and c["total_batch_size"] == 16 * c["T"]
    c = parse_config([os.path.join(ROOT, "config", "demo_cpu.py"), "--B=auto"], DEFAULTS)
    assert c["B"] == "auto"
    for world, B in ((1, 16), (2, 8)):
        run = dict(c, dtype="float32", compile=False)
        chosen, line, _ = memory.micro_batch(run, GPTConfig.from_dict(c), "cpu", world, free=8e9)
        assert chosen == B and line.startswith(f"B={B} (auto): "), line


COMMON = [*TINY, "--vocab_size=512", "--T=16", "--total_batch_size=128", "--val_tokens=256",
          "--sample_interval=0", "--keep_checkpoints=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"), 11, 600, [128 * 9 + 30])


def free_for(B, world=1, extra=()):
    """Free bytes where the tiny model fits B but not the next B up (on world processes)."""
    c = parse_config([*COMMON, "--B=auto", *extra], DEFAULTS)
    bytes_at = memory.estimate(GPTConfig.from_dict(c), 16, "float32", "cpu", False, world)
    return int(bytes_at(B) / memory.HEADROOM) + 1


# the trainer with the device's free memory as FREE_<rank> says, and an out-of-memory error (or a
# crash, os._exit) where FAULT says: in a step's forward from step 3 on, or at the step-4 evals
FAULTY = """
import os, runpy, sys, time, torch
from gptkit import memory
from gptkit.shards import DataLoaderLite
from model import GPT
ROOT = __ROOT__
rank = os.environ.get('RANK', '0')
if os.environ.get('FREE_' + rank):
    memory.free_and_total = lambda device: (int(os.environ['FREE_' + rank]),) * 2
fault, steps = os.environ.get('FAULT', ''), [0]
next_batch = DataLoaderLite.next_batch
def counting(self):  # a training step starts with its first micro-batch
    steps[0] += self.micro == 0
    return next_batch(self)
DataLoaderLite.next_batch = counting
hidden = GPT.hidden_states
def faulty(self, idx, *a, **k):  # HellaSwag's packed rows come with their own positions
    pos = k.get('pos', a[2] if len(a) > 2 else None)
    phase = 'train' if torch.is_grad_enabled() else 'hella' if pos is not None else 'val'
    real = not isinstance(idx, torch._subclasses.fake_tensor.FakeTensor)  # not memory.py's count
    # the 4th step (step 3), or the evals after it (step 4)
    if real and fault.endswith(phase) and steps[0] >= 4:
        if fault.startswith('crash'):  # once the checkpoint before it is on disk (issue 56: a crash
            # kills a write in flight on rank 0's writer thread, and the checkpoint before stands)
            log_dir = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--log_dir='))
            while not any(n.endswith('.pt') for n in os.listdir(log_dir)):
                time.sleep(0.01)
            os._exit(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
    return hidden(self, idx, *a, **k)
GPT.hidden_states = faulty
sys.argv[0] = os.path.join(ROOT, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
""".replace("__ROOT__", repr(ROOT))


def launch(tmp_path, args, nproc, env):
    """FAULTY run as a user runs train_gpt2.py: torchrun with nproc processes, or plain python
    (nproc None)."""
    (tmp_path / "faulty.py").write_text(FAULTY)
    return run_script(args, nproc=nproc, script=str(tmp_path / "faulty.py"), PYTHONPATH=ROOT, **env)


def test_every_rank_takes_the_least(data, tmp_path):
    """--B=auto on 2 processes over gloo, rank 1 told it has room for B=2 only, rank 0 for all of its
    share (4): both train with B=2 (2 micro-steps), rank 0 says why, and run.json records B=2 and the
    line."""
    log_dir = tmp_path / "log"
    env = {"FREE_0": str(10 ** 11), "FREE_1": str(free_for(2, world=2))}
    r = launch(tmp_path, [*COMMON, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=2",
                          "--hellaswag=False", "--B=auto"], 2, env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "grad_accum_steps=2" in r.stdout and "B=2 (auto): " in r.stdout, r.stdout[-3000:]
    assert "another rank has less free memory (B=4 fits here)" in r.stdout, r.stdout[-3000:]
    entry = json.load(open(log_dir / "run.json"))[-1]
    assert entry["config"]["B"] == 2 and entry["config"]["micro_batch"].startswith("B=2 (auto): ")


def newest_checkpoint(log_dir):
    return os.path.basename(sorted(glob.glob(str(log_dir / "model_*.pt")))[-1])


# the one line for each B: a number (nothing was counted), or "auto" (the count said B=4 fits)
OUT_OF_MEMORY = {
    "4": r"error: out of memory at B=4 on the device: lower B, or free the device's memory \(the last "
         r"checkpoint stands\)\n",
    "auto": r"error: out of memory at B=4 on cpu \(.*\): the estimate said B=4 fits, so try B=2: run the "
            r"same command with --B=2 \(the last checkpoint stands\)\n"}


@pytest.mark.parametrize("B", ["4", "auto"])
@pytest.mark.parametrize("fault", ["train", "val", "hella"])
def test_out_of_memory_is_one_line_and_the_checkpoint_before_it_resumes(data, tmp_path, fault, B):
    """An out-of-memory error (injected) in the step, the val loss or HellaSwag, at B=4 (--B=4, or
    --B=auto where the estimate says B=4 fits): one line that names the B (and with "auto" the B to
    use), no traceback, exit 1, step 2's checkpoint the newest. The same command with --B=2 resumes
    from it; in the step, exactly as it does after a crash at the same point (os._exit: nothing
    written after it)."""
    hella = tmp_path / "hellaswag.jsonl"
    import hellaswag
    hellaswag.write_synthetic(str(hella), 6)
    runs, vocab = {}, ["--vocab_size=50304"] if fault == "hella" else []  # HellaSwag needs GPT-2's tokens
    free = {"FREE_0": str(free_for(4, extra=vocab))}  # B="auto" takes 4, not 8
    for kind in ("oom", "crash") if fault == "train" and B == "4" else ("oom",):
        log_dir = tmp_path / kind
        args = [*COMMON, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=4", "--eval_interval=2",
                "--checkpoint_interval=2", f"--hellaswag={fault == 'hella'}", f"--hellaswag_file={hella}",
                f"--B={B}", *vocab]
        r = launch(tmp_path, args, None, dict(free, FAULT=("" if kind == "oom" else "crash-") + fault))
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
        assert "grad_accum_steps=2" in r.stdout, r.stdout[-2000:]  # B=4 however it came
        assert ("B=4 (auto): " in r.stdout) == (B == "auto"), r.stdout[-2000:]
        assert newest_checkpoint(log_dir) == "model_00002.pt", r.stdout[-2000:] + r.stderr[-3000:]
        if kind == "oom":
            assert "Traceback" not in r.stderr, r.stderr[-3000:]
            assert re.fullmatch(OUT_OF_MEMORY[B], r.stderr), r.stderr
        r = launch(tmp_path, [*args, "--B=2"], None, free)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resuming from" in r.stdout and "model_00002.pt" in r.stdout, r.stderr[-3000:]
        assert "grad_accum_steps=4" in r.stdout, r.stdout[-2000:]
        runs[kind] = (read_log(log_dir), torch.load(log_dir / "model_00004.pt", weights_only=True)["model"])
    log, model = runs["oom"]
    assert sorted(log["train"]) == [0, 1, 2, 3], log
    if "crash" in runs:  # the same log and weights as after a crash at the same point
        crash_log, crash_model = runs["crash"]
        assert log == crash_log
        assert all(torch.equal(model[k], crash_model[k]) for k in model)


@pytest.mark.quick
def test_bad_B_is_one_line(tmp_path):
    """B is a number of sequences or "auto" (opt-in); anything else is one line, from parse_config
    and from the script as a user runs it (exit 1, no traceback)."""
    from gptkit.common import UserError
    assert DEFAULTS["B"] == 64 and parse_config(["--B=auto"], DEFAULTS)["B"] == "auto"
    assert parse_config(["--B=8"], DEFAULTS)["B"] == 8
    with pytest.raises(UserError, match=r"config key 'B' must be 'auto' or a number of sequences, got 'big'"):
        parse_config(["--B=big"], DEFAULTS)
    with pytest.raises(UserError, match=r"config key 'B' must be positive, got 0"):
        parse_config(["--B=0"], DEFAULTS)
    r = run_script([*TINY, "--B=big", f"--log_dir={tmp_path / 'log'}"])
    assert r.returncode == 1 and r.stderr == ("error: config key 'B' must be 'auto' or a number of "
                                              "sequences, got 'big'\n"), r.stderr
    assert not (tmp_path / "log").exists()
