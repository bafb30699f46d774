"""
Speed and memory of the training step, the instrument behind every speed claim of this project.

    python bench.py [config/NAME.py] [--key=value ...] [--bench_steps=5] [--bench_warmup=2]
    python bench.py --bench_hellaswag_process=True   # hellaswag.py vs build-nanogpt's loop, whole process
    python bench.py --bench_profile=True   # on CUDA: then one step under torch.profiler, by kernel kind

Takes the trainer's configuration (same constants, files and overrides; dtype and compile
"auto" resolved as the trainer resolves them), runs train_gpt2.py itself for bench_warmup +
bench_steps optimizer steps on a shard of random tokens (no evals, samples or HellaSwag), reads
each step's dt from its output, and prints tok/s, model FLOPs per token,
the achieved FLOP/s as a fraction of the device's matmul rate in the same dtype (measured in this
run; not on a CPU, where no peak holds: hardware.peak_flops), and peak memory. Then, unless
--bench_baseline=False, the same steps as build-nanogpt takes them (full logits, F.cross_entropy,
glibc's default memory handling) on the same model, dtype and batch as the baseline, and both
ratios: time per step and peak memory. Each of the two runs in a process of its own (a clean heap,
its own peak). total_batch_size must be a multiple of B*T.

The step bench also prints DataLoaderLite's time per optimizer step at total_batch_size, in order
and shuffled, on a synthetic shard (documents of ~1,000 tokens), beside the step time (its steps
run on tokens in memory).
"""
import collections
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import hellaswag
from gptkit import memory
from gptkit.configurator import accumulation_steps, parse_config, trainer_defaults
from gptkit.common import UserError
from gptkit.hardware import autocast, choose_precision, cpu_has_bf16, matmul_flops, pick_device, sync
from gptkit.shards import DataLoaderLite
from gptkit.hardware import device_name
from model import GPT, GPTConfig, flops_per_token
from gptkit.tokenizer import EOT, N_VOCAB

ROOT = os.path.dirname(os.path.abspath(__file__))


def seconds(device, f):
    """(seconds, f's result): the wall clock of f(), the work it queued on the device included."""
    sync(device)
    t0 = time.perf_counter()
    result = f()
    sync(device)
    return time.perf_counter() - t0, result


def run_python(args, what, cwd=ROOT):
    """(the finished process, its seconds): `python args`, output captured. An exit code other than
    0 ends the bench with the end of its stderr: a crash must not be timed as an answer."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"error: {what} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r, time.perf_counter() - t0


class RandomTokens:
    """Stands in for DataLoaderLite: (x, y) int64 CPU batches of random tokens, 8 in turn."""

    def __init__(self, B, T, vocab_size):
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, vocab_size, (B, T + 1), generator=g) for _ in range(8)]
        self.batches = itertools.cycle(batches)

    def next_batch(self):
        buf = next(self.batches)
        return buf[:, :-1], buf[:, 1:]


def synthetic_shard(folder, n, name='bench_train_000000', vocab=N_VOCAB):
    """folder/name.npy: n random token ids below vocab (GPT-2's) in documents of ~1,000 tokens, as
    FineWeb-Edu's."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, min(vocab, N_VOCAB), n, dtype=np.uint16)
    tokens[rng.integers(0, n, n // 1000)] = min(EOT, vocab - 1)
    np.save(os.path.join(folder, name + '.npy'), tokens)


def time_loader(c, folder, shuffle):
    """Seconds per optimizer step of DataLoaderLite over the whole shard in folder at c's B, T and
    total_batch_size, one process."""
    B, T = c['B'], c['T']
    accum = max(1, c['total_batch_size'] // (B * T))
    loader = DataLoaderLite(B, T, 0, 1, 'train', folder, accum, shuffle=shuffle, seed=c['seed'])
    t0 = time.perf_counter()
    for _ in range(loader.steps_per_epoch * accum):  # the whole shard
        loader.next_batch()
    return (time.perf_counter() - t0) / loader.steps_per_epoch


def peak_memory_mib(device):
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def nanogpt_forward(self, idx, targets):
    """build-nanogpt's GPT.forward (the same model): the logits in full, then F.cross_entropy."""
    logits = self.lm_head(self.hidden_states(idx))  # (B, T, vocab_size)
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def nanogpt_step(model, optimizer, loader, grad_accum, c, device):
    """build-nanogpt's training step: autocast (it knows bf16 only), loss.backward(), clip at 1.0,
    c's max_lr (the arguments of the step it is timed against)."""
    lr, dtype = c['max_lr'], c['dtype']
    optimizer.zero_grad()
    loss_accum = 0.0
    for _ in range(grad_accum):
        x, y = loader.next_batch()
        x, y = x.to(device), y.to(device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss = loss / grad_accum
        loss_accum += loss.detach()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for group in optimizer.param_groups:
        group['lr'] = lr
    optimizer.step()
    return loss_accum


def time_baseline(c):
    """In this process (a fresh one): seconds per optimizer step (the mean of bench_steps after
    bench_warmup) and peak memory of build-nanogpt's step (its forward and step, glibc's default
    memory handling) on c's model, dtype and batch, on random tokens. Printed as one JSON line."""
    device = pick_device(c['device'])
    if device.startswith('cuda'):
        torch.set_float32_matmul_precision('high')  # TF32, as build-nanogpt sets it
    GPT.forward = nanogpt_forward
    torch.manual_seed(c['seed'])
    model = GPT(GPTConfig.from_dict(c)).to(device)
    optimizer = model.configure_optimizers(c['weight_decay'], c['max_lr'], torch.device(device).type)
    compiled = torch.compile(model, dynamic=False) if c['compile'] else model
    loader = RandomTokens(c['B'], c['T'], c['vocab_size'])
    grad_accum = accumulation_steps(c['total_batch_size'], c['B'], c['T'], 1)
    args = (compiled, optimizer, loader, grad_accum, c, device)
    step = lambda: nanogpt_step(*args).item()  # .item() waits for the device, as both trainers do
    for _ in range(c['bench_warmup']):
        step()
    dt = seconds(device, lambda: [step() for _ in range(c['bench_steps'])])[0] / c['bench_steps']
    print(json.dumps({'dt': dt, 'peak': peak_memory_mib(device), 'threads': torch.get_num_threads(),
                      'params': sum(p.numel() for p in model.parameters())}))


# The trainer as `python train_gpt2.py ARGS` runs it, then its peak memory and threads as one JSON
# line; with BENCH_PROFILE set, the step after the warmup (BENCH_PROFILE steps) under torch.profiler.
OURS = r"""
import json, os, resource, runpy, sys, torch
from gptkit.run import Run
sys.argv = ['train_gpt2.py', *sys.argv[1:]]
warmup, prof = int(os.environ.get('BENCH_PROFILE', -1)), None
if warmup >= 0 and torch.cuda.is_available():
    import bench
    from torch.profiler import ProfilerActivity, profile
    log, steps, prof = Run.log, [], profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    def counting(run, line):  # rank 0 logs each step's train loss once its step is done
        steps.append(line) if ' train ' in line else None
        if len(steps) == warmup and ' train ' in line:
            prof.start()
        if len(steps) == warmup + 1 and ' train ' in line:
            torch.cuda.synchronize()
            prof.stop()
        log(run, line)
    Run.log = counting
runpy.run_path('train_gpt2.py', run_name='__main__')
if prof is not None:
    bench.print_profile(prof)
cuda = torch.cuda.is_available()
peak = (torch.cuda.max_memory_allocated() / 2 ** 20 if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10)
print(json.dumps({'peak': peak, 'threads': torch.get_num_threads()}))
"""


def time_ours(c, argv):
    """train_gpt2.py itself, in a process of its own, on a shard of random tokens: seconds per step
    (the mean of the dt it prints for bench_steps steps after bench_warmup), peak memory (torch's on a
    GPU, the process's RSS on a CPU), its threads and parameters."""
    steps = c['bench_warmup'] + c['bench_steps']
    with tempfile.TemporaryDirectory() as tmp:
        synthetic_shard(tmp, (steps + 1) * c['total_batch_size'] + 1, vocab=c['vocab_size'])
        args = [*argv, f"--data_root={tmp}", f"--log_dir={os.path.join(tmp, 'log')}", f"--max_steps={steps}",
                "--eval_interval=0", "--sample_interval=0", "--hellaswag=False", "--checkpoint_interval=0",
                "--shuffle=False", "--wandb_log=False"]
        env = dict(os.environ, BENCH_PROFILE=str(c['bench_warmup'] if c['bench_profile'] else -1))
        r = subprocess.run([sys.executable, "-c", OURS, *args], cwd=None, capture_output=True, text=True,
                           env=dict(env, PYTHONPATH=ROOT))
        if r.returncode:
            sys.exit(f"error: the trainer exited {r.returncode}:\n{r.stderr[-3000:]}")
    out = r.stdout.strip().splitlines()
    dts = [float(m[1]) / 1e3 for line in out if (m := re.search(r'\| dt (\d+\.\d+)ms', line))]
    for line in out[next(i for i, line in enumerate(out) if line.startswith('step')):]:
        if line.startswith(('profile', 'costliest', '  ')):  # print_profile's lines, after the config's
            print(line)
    result = json.loads(out[-1])
    result['params'] = int(re.search(r'^parameters: ([\d,]+)', r.stdout, re.M)[1].replace(',', ''))
    return dict(result, dt=sum(dts[c['bench_warmup']:]) / c['bench_steps'])


# kernel name fragments -> where the time goes; the first match counts: attention before matmul
# (cuDNN's attention kernels are named sm90_..._sdpa_..._flash), fused Triton kernels before
# copies (their names list the ops fused, _to_copy among them)
KERNEL_KINDS = (('attention', ('flash', 'fmha', 'sdpa')),
                ('matmul', ('gemm', 'nvjet', 'xmma', 'cutlass', 'cublas')),
                ('optimizer', ('adam', 'multi_tensor')), ('communication', ('nccl',)),
                ('fused elementwise/norm/loss', ('triton',)),
                ('copy/fill', ('memcpy', 'memset', 'copy', 'fill')))


def kernel_kind(name):
    return next((kind for kind, frags in KERNEL_KINDS if any(f in name.lower() for f in frags)), 'other')


def print_profile(prof):
    """One step under torch.profiler: its GPU kernel time by kind and the 12 costliest kernels
    (printed before the JSON line)."""
    kernels = sorted((e for e in prof.key_averages() if e.device_type.name == 'CUDA'),
                     key=lambda e: -e.self_device_time_total)  # microseconds
    kinds = collections.Counter()
    for e in kernels:
        kinds[kernel_kind(e.key)] += e.self_device_time_total / 1e3
    total = sum(kinds.values())
    print(f"profile of one step: GPU kernels {total:.1f} ms (the GPU idles for the rest of its dt)")
    for kind, ms in kinds.most_common():
        print(f"  {kind:30s} {ms:8.1f} ms  {ms / max(total, 1e-9):6.1%}")
    print("costliest kernels (ms, calls):")
    for e in kernels[:12]:
        print(f"  {e.self_device_time_total / 1e3:8.1f} {e.count:6d}  {e.key[:110]}")


def measure(argv, c):
    """time_baseline in a new process: it starts from a clean heap, and the peak memory is its own."""
    bench = [f"--bench_{k}={c[f'bench_{k}']}" for k in ('steps', 'warmup')]
    r, _ = run_python([os.path.abspath(__file__), *argv, *bench, "--bench_role=baseline"],
                      "the baseline measurement", cwd=None)  # the caller's folder: its config files
    return json.loads(r.stdout.strip().splitlines()[-1])


def print_flops(c, device, tok_per_s):
    """The model FLOPs per token of c's model and the FLOP/s that tok_per_s achieves; on a GPU also
    the matmul fraction: that over the device's matmul rate in c's dtype, measured now (MFU, the
    console's, is over the datasheet's peak; on a CPU no peak holds: gptkit/hardware.py).
    gpu_check.py prints the same lines."""
    fpt = flops_per_token(GPTConfig.from_dict(c), c['T'])
    print(f"model FLOPs/token: {fpt / 1e6:.1f} MFLOP")
    print(f"achieved: {tok_per_s * fpt / 1e12:.3f} TFLOP/s")
    if device != 'cpu':
        peak = matmul_flops(device, c['dtype'])
        print(f"device matmul ({c['dtype']}): {peak / 1e12:.3f} TFLOP/s, measured now")
        print(f"matmul fraction (achieved / that matmul; not MFU): {tok_per_s * fpt / peak:.3f}")


def bench_step(c, argv, device):
    """The trainer's step against build-nanogpt's, same model, dtype and batch, one process each."""
    c = choose_precision(c, device)  # prints the precision chosen
    c = memory.micro_batch_of(c, device)  # B="auto": as the trainer chooses, printed
    B, T, step_tokens = c['B'], c['T'], c['total_batch_size']
    grad_accum = accumulation_steps(step_tokens, B, T, 1)  # no multiple of B*T: the trainer's error
    argv = [*argv, f"--dtype={c['dtype']}", f"--compile={c['compile']}", f"--B={B}"]  # the same in both
    ours = time_ours(c, argv)
    base = measure(argv, c) if c['bench_baseline'] else None

    print(f"model: {ours['params'] / 1e6:.2f}M parameters, n_layer={c['n_layer']} n_head={c['n_head']} "
          f"n_embd={c['n_embd']} vocab={c['vocab_size']}")
    print(f"batch: B={B} T={T} grad_accum={grad_accum} ({step_tokens} tokens/step), "
          f"device={device} dtype={c['dtype']} compile={c['compile']} threads={ours['threads']} "
          f"cpu_reuse_memory={c['cpu_reuse_memory']}")
    if device == 'cpu':
        print(f"cpu: {device_name('cpu')}, bf16 units: {cpu_has_bf16()}, "
              f"kernels: {torch.backends.cpu.get_cpu_capability()}")
    print(f"step time: {ours['dt'] * 1000:.1f} ms (mean of {c['bench_steps']} after {c['bench_warmup']} "
          f"warmup)")
    with tempfile.TemporaryDirectory() as tmp:  # the data loader's share, on 20 steps of synthetic documents
        synthetic_shard(tmp, 20 * max(step_tokens, B * T) + 1)
        loader_ms = [time_loader(c, tmp, shuffle) * 1e3 for shuffle in (False, True)]
    print(f"data loader: {loader_ms[0]:.2f} ms per step in order, {loader_ms[1]:.2f} ms shuffled (the step "
          f"above runs on tokens in memory)")
    print(f"tok/s: {step_tokens / ours['dt']:,.0f}")
    print_flops(c, device, step_tokens / ours['dt'])
    what = "max allocated by torch" if device.startswith('cuda') else "peak RSS of the process"
    print(f"peak memory: {ours['peak']:,.0f} MiB ({what})")
    if base is not None:
        print(f"baseline, build-nanogpt's step (full logits, F.cross_entropy, default malloc), measured now: "
              f"{base['dt'] * 1000:.1f} ms/step, {step_tokens / base['dt']:,.0f} tok/s, "
              f"peak memory {base['peak']:,.0f} MiB")
        ratio = ours['dt'] / base['dt']
        print(f"time per step vs baseline: {ratio:.3f}x (speedup {1 / ratio:.3f}x); "
              f"peak memory vs baseline: {ours['peak'] / base['peak']:.3f}x")


# build-nanogpt's hellaswag.py evaluation, rewritten for the whole-process comparison: HF's
# GPT2LMHeadModel, one example (4 rows) per forward, logits at every position, the shifted logits
# made contiguous, F.cross_entropy with reduction='none', masked sum and mean, argmin. Arguments:
# model folder, jsonl file, number of examples. Prints the same last line as hellaswag.py.
HELLASWAG_REFERENCE = r"""
import json, sys
import torch
from torch.nn import functional as F
from tqdm import tqdm
from transformers import GPT2LMHeadModel
from gptkit.tokenizer import get_gpt2_encoding  # tiktoken's GPT-2 encoding, from local files (offline)

model_dir, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
enc = get_gpt2_encoding()
model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
with open(path) as f:
    examples = [json.loads(line) for line in f][:limit]
n = correct = correct_norm = 0
with torch.no_grad():
    for example in tqdm(examples):
        ctx = enc.encode(example["ctx"])
        rows = [ctx + enc.encode(" " + ending) for ending in example["endings"]]
        tokens = torch.zeros((4, max(map(len, rows))), dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
            mask[i, len(ctx):len(row)] = 1
        logits = model(tokens).logits  # (4, L, vocab): every position
        shift_logits, shift_tokens = logits[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        losses = F.cross_entropy(shift_logits.view(-1, logits.size(-1)), shift_tokens.view(-1),
                                 reduction="none")
        shift_mask = mask[:, 1:].contiguous()
        sum_loss = (losses.view(4, -1) * shift_mask).sum(1)
        avg_loss = sum_loss / shift_mask.sum(1)
        n += 1
        correct += int(sum_loss.argmin().item() == example["label"])
        correct_norm += int(avg_loss.argmin().item() == example["label"])
print(f"acc: {correct / n:.4f} acc_norm: {correct_norm / n:.4f}")
"""


def bench_hellaswag_process(c):
    """Whole-process wall clock (imports, tokenizer, model load, scoring) of `python hellaswag.py`
    in float32 against HELLASWAG_REFERENCE (build-nanogpt's per-example loop), each a fresh process
    on the same HF model folder (random weights, the configured shape, GPT-2's vocabulary) and the
    same bench_hellaswag_examples synthetic examples; both must print the same acc and acc_norm."""
    from transformers import GPT2Config, GPT2LMHeadModel
    n = c['bench_hellaswag_examples']
    with tempfile.TemporaryDirectory() as tmp:
        path, model_dir = os.path.join(tmp, 'hellaswag.jsonl'), os.path.join(tmp, 'model')
        hellaswag.write_synthetic(path, n, c['seed'])
        torch.manual_seed(c['seed'])
        config = GPT2Config(n_layer=c['n_layer'], n_head=c['n_head'], n_embd=c['n_embd'],
                            n_positions=c['block_size'], vocab_size=N_VOCAB)
        GPT2LMHeadModel(config).save_pretrained(model_dir)
        runs = {}
        for name, cmd in (("ours", ["hellaswag.py", "--model", model_dir, "--file", path, "--limit", str(n),
                                    "--device", "cpu", "--dtype", "float32"]),
                          ("reference", ["-c", HELLASWAG_REFERENCE, model_dir, path, str(n)])):
            r, t = run_python(cmd, name)
            runs[name] = t, (r.stdout.strip().splitlines() or [""])[-1]
    (ours, ours_out), (ref, ref_out) = runs["ours"], runs["reference"]
    print(f"hellaswag whole process, {n} examples, n_layer={c['n_layer']} n_embd={c['n_embd']} "
          f"vocab={N_VOCAB}, float32, cpu kernels: {torch.backends.cpu.get_cpu_capability()}, "
          f"threads: {torch.get_num_threads()}")
    print(f"python hellaswag.py: {ours:.1f} s ({ours_out})")
    print(f"build-nanogpt's loop (HF, one example per forward): {ref:.1f} s ({ref_out})")
    print(f"speedup: {ref / ours:.2f}x; same acc and acc_norm: {ours_out == ref_out}")


def main():
    defaults = dict(trainer_defaults(), bench_steps=5, bench_warmup=2, bench_baseline=True, bench_role="",
                    bench_hellaswag_process=False, bench_hellaswag_examples=500, bench_profile=False)
    try:
        c = parse_config(sys.argv[1:], defaults, __doc__)
        if c['bench_role']:  # a child process of bench_step
            return time_baseline(c)
        if c['bench_hellaswag_process']:
            return bench_hellaswag_process(c)
        device = pick_device(c['device'])
        return bench_step(c, [a for a in sys.argv[1:] if not a.startswith('--bench_')], device)
    except UserError as e:  # a key, a value or a device that is not right here
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
