"""
Speed and memory of the training step, the instrument behind every speed claim of this project.

    python bench.py [config/NAME.py] [--key=value ...] [--bench_steps=5] [--bench_warmup=2]
    python bench.py --bench_hellaswag_process=True   # hellaswag.py vs build-nanogpt's loop, whole process
    python bench.py --bench_profile=True   # on CUDA: then one step under torch.profiler, by kernel kind

Takes the trainer's configuration (same constants, files and overrides; dtype and compile
"auto" resolved as the trainer resolves them), runs bench_warmup + bench_steps optimizer steps of
train_gpt2.train_step on random tokens (no disk I/O), and prints tok/s, model FLOPs per token,
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
import train_gpt2
from gptkit.configurator import accumulation_steps, parse_config
from gptkit.common import UserError
from gptkit.hardware import autocast, choose_precision, cpu_has_bf16, matmul_flops, sync
from gptkit.run_record import device_name
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


def synthetic_shard(folder, n, name='bench_train_000000'):
    """folder/name.npy: n random GPT-2 token ids in documents of ~1,000 tokens, as FineWeb-Edu's."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, N_VOCAB, n, dtype=np.uint16)
    tokens[rng.integers(0, n, n // 1000)] = EOT
    np.save(os.path.join(folder, name + '.npy'), tokens)


def time_loader(c, folder, shuffle):
    """Seconds per optimizer step of DataLoaderLite over the whole shard in folder at c's B, T and
    total_batch_size, one process."""
    B, T = c['B'], c['T']
    accum = max(1, c['total_batch_size'] // (B * T))
    loader = train_gpt2.DataLoaderLite(B, T, 0, 1, 'train', folder, accum, shuffle=shuffle, seed=c['seed'])
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


def nanogpt_step(state, grad_accum, lr, grad_clip, device, dtype):
    """build-nanogpt's training step: autocast (it knows bf16 only), loss.backward(), clip at 1.0
    (whatever grad_clip: the arguments are train_step's, and so is the loss first in what it returns)."""
    state.optimizer.zero_grad()
    loss_accum = 0.0
    for _ in range(grad_accum):
        x, y = state.loader.next_batch()
        x, y = x.to(device), y.to(device)
        with autocast(device, dtype):
            _, loss = state.model(x, y)
        loss = loss / grad_accum
        loss_accum += loss.detach()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
    for group in state.optimizer.param_groups:
        group['lr'] = lr
    state.optimizer.step()
    return (loss_accum,)


def time_steps(c, role):
    """In this process (a fresh one per role): seconds per optimizer step (the mean of bench_steps
    after bench_warmup) and peak memory of the trainer's step ("ours": train_gpt2.train_step, with
    cpu_reuse_memory as configured) or of build-nanogpt's ("baseline": its forward and step, and
    glibc's default memory handling). Printed as one JSON line for the parent."""
    ours = role == 'ours'
    _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'] and ours)  # TF32 on CUDA
    if not ours:
        GPT.forward = nanogpt_forward
    torch.manual_seed(c['seed'])
    model = GPT(GPTConfig.from_dict(c)).to(device)
    device_type = torch.device(device).type
    optimizer = model.configure_optimizers(c['weight_decay'], c['max_lr'], device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=c['dtype'] == 'float16')
    compiled = torch.compile(model, dynamic=False) if c['compile'] else model
    loader = RandomTokens(c['B'], c['T'], c['vocab_size'])
    state = train_gpt2.TrainState(compiled, model, optimizer, scaler, loader)
    grad_accum = accumulation_steps(c['total_batch_size'], c['B'], c['T'], 1)
    args = (grad_accum, c['max_lr'], c['grad_clip'], device, c['dtype'])
    train_step = train_gpt2.train_step if ours else nanogpt_step
    step = lambda: train_step(state, *args)[0].item()  # .item() waits for the device, as both trainers do
    for _ in range(c['bench_warmup']):
        step()
    dt = seconds(device, lambda: [step() for _ in range(c['bench_steps'])])[0] / c['bench_steps']
    if c['bench_profile'] and ours and device.startswith('cuda'):
        profile_step(step, dt)
    print(json.dumps({'dt': dt, 'peak': peak_memory_mib(device), 'threads': torch.get_num_threads(),
                      'params': sum(p.numel() for p in model.parameters())}))


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


def profile_step(step, dt):
    """One more step under torch.profiler: its GPU kernel time by kind and the 12 costliest kernels
    (printed before the JSON line); what the kernels leave of the step's time is the GPU idle."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.key_averages() if e.device_type.name == 'CUDA'),
                     key=lambda e: -e.self_device_time_total)  # microseconds
    kinds = collections.Counter()
    for e in kernels:
        kinds[kernel_kind(e.key)] += e.self_device_time_total / 1e3
    total = sum(kinds.values())
    print(f"profile of one step: {dt * 1e3:.1f} ms per step untraced; GPU kernels {total:.1f} ms, so the GPU "
          f"is idle for ~{max(0.0, dt * 1e3 - total):.1f} ms of it")
    for kind, ms in kinds.most_common():
        print(f"  {kind:30s} {ms:8.1f} ms  {ms / max(total, 1e-9):6.1%}")
    print("costliest kernels (ms, calls):")
    for e in kernels[:12]:
        print(f"  {e.self_device_time_total / 1e3:8.1f} {e.count:6d}  {e.key[:110]}")


def measure(argv, role):
    """time_steps(role) in a new process: each measurement starts from a clean heap, and the peak
    memory is its own."""
    r, _ = run_python([os.path.abspath(__file__), *argv, f"--bench_role={role}"], f"the {role} measurement",
                      cwd=None)  # the caller's folder: its config files are relative to it
    *profile, result = r.stdout.strip().splitlines()
    for line in profile:
        if line.startswith(('profile', '  ', 'costliest')):  # profile_step's lines
            print(line)
    return json.loads(result)


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
    ours = measure(argv, 'ours')
    base = measure(argv, 'baseline') if c['bench_baseline'] else None

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
    defaults = dict(train_gpt2.DEFAULTS, bench_steps=5, bench_warmup=2, bench_baseline=True, bench_role="",
                    bench_hellaswag_process=False, bench_hellaswag_examples=500, bench_profile=False)
    try:
        c = parse_config(sys.argv[1:], defaults, __doc__)
        if c['bench_role']:  # a child process of bench_step
            return time_steps(c, c['bench_role'])
        if c['bench_hellaswag_process']:
            return bench_hellaswag_process(c)
        _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'])  # TF32 on CUDA, as trained
        return bench_step(c, sys.argv[1:], device)
    except UserError as e:  # a key, a value or a device that is not right here
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
