"""
Speed and memory of the training step, the instrument behind every speed claim of this project.

    python bench.py [config/NAME.py] [--key=value ...] [--bench_steps=5] [--bench_warmup=2]
    python bench.py --bench_loader_tokens=100000000   # the data loader's memory instead
    python bench.py config/demo_cpu.py --bench_hellaswag=True   # HellaSwag scoring speed instead

Takes the trainer's configuration (same constants, files and overrides), runs bench_warmup +
bench_steps optimizer steps of train_gpt2.train_step on random tokens (no disk I/O), and prints
tok/s, model FLOPs per token, the achieved FLOP/s as a fraction of the device's matmul rate in
the same dtype (measured in this run), and peak memory. Then, unless compile or
--bench_baseline=False, the same steps with the loss computed by plain F.cross_entropy (as
build-nanogpt does) as the baseline, and the speedup over it. One process: total_batch_size must
be a multiple of B*T.

With bench_loader_tokens > 0 it measures the loader instead: the anonymous memory (RssAnon, not
the page cache) that DataLoaderLite adds while reading a shard of that many tokens and of a
tenth of it, against loading the shard whole as int64 tokens (build-nanogpt's loader), in the
same run.
"""
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import model as model_module
import train_gpt2
from model import GPT, GPTConfig, flops_per_token


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    elif device == 'mps':
        torch.mps.synchronize()


def matmul_flops(device, dtype, n=None, reps=10):
    """FLOP/s of an n x n @ n x n matmul in dtype on device (bf16 inputs for bfloat16, as autocast)."""
    n = n or (8192 if device.startswith('cuda') else 2048)
    torch_dtype = torch.bfloat16 if dtype == 'bfloat16' else torch.float32
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


class RandomTokens:
    """Stands in for DataLoaderLite: (x, y) int64 CPU batches of random tokens."""

    def __init__(self, B, T, vocab_size, n=8):
        g = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, vocab_size, (B, T + 1), generator=g) for _ in range(n)]
        self.i = 0

    def next_batch(self):
        buf = self.batches[self.i % len(self.batches)]
        self.i += 1
        return buf[:, :-1], buf[:, 1:]


def rss_anon_mib():
    with open('/proc/self/status') as f:  # Linux
        return next(int(line.split()[1]) for line in f if line.startswith('RssAnon:')) / 1024


def bench_loader(c):
    B, T, n_max = c['B'], c['T'], c['bench_loader_tokens']
    with tempfile.TemporaryDirectory() as tmp:
        for n in (n_max // 10, n_max):
            folder = os.path.join(tmp, str(n))
            os.makedirs(folder)
            path = os.path.join(folder, 'bench_train_000000.npy')
            np.save(path, np.random.default_rng(0).integers(0, 50257, n, dtype=np.uint16))
            base = rss_anon_mib()
            loader = train_gpt2.DataLoaderLite(B, T, 0, 1, 'train', folder)
            steps = n // (B * T) - 1
            t0 = time.perf_counter()
            for _ in range(steps):  # the whole shard
                loader.next_batch()
            dt = time.perf_counter() - t0
            ours = rss_anon_mib() - base
            del loader
            base = rss_anon_mib()
            tokens = torch.tensor(np.load(path).astype(np.int64))  # the whole shard in memory
            whole = rss_anon_mib() - base
            del tokens
            print(f"shard of {n:,} tokens: DataLoaderLite +{ours:,.1f} MiB anonymous memory over {steps:,} batches "
                  f"({steps * B * T / dt / 1e6:,.0f}M tok/s); whole-shard int64 load +{whole:,.1f} MiB "
                  f"(ratio {ours / max(whole, 1e-9):.4f})")


def peak_memory_mib(device):
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def time_steps(c, config, device, grad_accum):
    """Mean seconds per optimizer step of train_gpt2.train_step (after bench_warmup steps), and the model."""
    torch.manual_seed(c['seed'])
    model = GPT(config).to(device)
    optimizer = model.configure_optimizers(c['weight_decay'], c['max_lr'], torch.device(device).type)
    step_model = torch.compile(model) if c['compile'] else model
    loader = RandomTokens(c['B'], c['T'], c['vocab_size'])

    def step():
        loss, _, _ = train_gpt2.train_step(step_model, optimizer, loader, grad_accum, c['max_lr'], c['grad_clip'],
                                           device, c['dtype'], 1)
        return loss.item()  # waits for the device, as the trainer does

    for _ in range(c['bench_warmup']):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(c['bench_steps']):
        step()
    sync(device)
    return (time.perf_counter() - t0) / c['bench_steps'], model


def bench_hellaswag(c, config, device):
    """Examples/s of hellaswag.evaluate (batched, output layer at ending positions only) against
    one example per forward with the output layer everywhere (build-nanogpt), same model, same
    HellaSwag-sized synthetic examples (contexts of 20-45 words, endings of 8-25)."""
    import random
    import hellaswag as hs
    torch.manual_seed(c['seed'])
    model = GPT(config).to(device).eval()
    rng = random.Random(0)
    words = "a man woman is seen the then they continue to walk with dog ball in kitchen holds up smiles".split()
    text = lambda lo, hi: " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    examples = [{"ctx": text(20, 45), "endings": [text(8, 25) for _ in range(4)], "label": i % 4} for i in range(256)]
    rendered = [hs.render_example(e) for e in examples]

    @torch.no_grad()
    def one_per_forward():
        correct = 0
        for tokens, mask, label in rendered:
            tokens, mask = tokens.to(device), mask.to(device)
            with model_module.autocast(device, c['dtype']):
                logits, _ = model(tokens)
            losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                     reduction='none').view(4, -1) * mask[:, 1:]
            correct += int((losses.sum(1) / mask[:, 1:].sum(1)).argmin() == label)
        return correct

    def timed(f):
        f()  # warm-up
        best = float('inf')
        for _ in range(3):  # the best of 3: the least disturbed
            sync(device)
            t0 = time.perf_counter()
            result = f()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return len(rendered) / best, result

    base, base_correct = timed(one_per_forward)
    ours, (_, _, correct) = timed(lambda: hs.evaluate(model, rendered, device, c['dtype']))
    print(f"hellaswag scoring, {len(rendered)} examples, model of {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, device={device} dtype={c['dtype']}")
    print(f"one example per forward, output layer everywhere: {base:,.1f} examples/s")
    print(f"batched, output layer at endings (hellaswag.evaluate): {ours:,.1f} examples/s")
    print(f"speedup: {ours / base:.2f}x (same acc_norm count: {correct == base_correct})")


def main():
    defaults = dict(train_gpt2.DEFAULTS)
    defaults.update(bench_steps=5, bench_warmup=2, bench_loader_tokens=0, bench_baseline=True, bench_hellaswag=False)
    try:
        c = train_gpt2.parse_config(sys.argv[1:], defaults)
    except train_gpt2.UserError as e:
        sys.exit(f"error: {e}")
    if c['bench_loader_tokens'] > 0:
        return bench_loader(c)
    _, _, _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'])
    if c['total_batch_size'] % (c['B'] * c['T']):
        sys.exit(f"error: total_batch_size={c['total_batch_size']} is not a multiple of B*T={c['B'] * c['T']}")
    grad_accum = c['total_batch_size'] // (c['B'] * c['T'])
    if device.startswith('cuda'):
        torch.set_float32_matmul_precision('high')
    config = GPTConfig(block_size=c['block_size'], vocab_size=c['vocab_size'], n_layer=c['n_layer'],
                       n_head=c['n_head'], n_embd=c['n_embd'])
    if c['bench_hellaswag']:
        return bench_hellaswag(c, config, device)
    dt, model = time_steps(c, config, device, grad_accum)
    peak_mem = peak_memory_mib(device)
    dt_base = None
    if c['bench_baseline'] and not c['compile']:  # compiled, the model uses F.cross_entropy anyway
        plain = model_module.cross_entropy
        model_module.cross_entropy = lambda logits, targets: F.cross_entropy(logits, targets)
        try:
            if device.startswith('cuda'):
                torch.cuda.reset_peak_memory_stats()
            dt_base, _ = time_steps(c, config, device, grad_accum)
            peak_mem_base = peak_memory_mib(device)  # on CPU: the process's peak so far, >= ours
        finally:
            model_module.cross_entropy = plain

    tok_per_s = c['total_batch_size'] / dt
    fpt = flops_per_token(config, c['T'])
    peak_flops = matmul_flops(device, c['dtype'])
    mem_what = "max allocated by torch" if device.startswith('cuda') else "peak RSS of the process"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, n_layer={config.n_layer} n_head={config.n_head} "
          f"n_embd={config.n_embd} vocab={config.vocab_size}")
    print(f"batch: B={c['B']} T={c['T']} grad_accum={grad_accum} ({c['total_batch_size']} tokens/step), "
          f"device={device} dtype={c['dtype']} compile={c['compile']} threads={torch.get_num_threads()}")
    print(f"step time: {dt * 1000:.1f} ms (mean of {c['bench_steps']} after {c['bench_warmup']} warmup)")
    print(f"tok/s: {tok_per_s:,.0f}")
    print(f"model FLOPs/token: {fpt / 1e6:.1f} MFLOP")
    print(f"achieved: {tok_per_s * fpt / 1e12:.3f} TFLOP/s")
    print(f"device matmul ({c['dtype']}): {peak_flops / 1e12:.3f} TFLOP/s, measured now")
    print(f"MFU vs that matmul: {tok_per_s * fpt / peak_flops:.3f}")
    print(f"peak memory: {peak_mem:,.0f} MiB ({mem_what})")
    if dt_base is not None:
        print(f"baseline, same step with plain F.cross_entropy (build-nanogpt's loss), measured now: "
              f"{c['total_batch_size'] / dt_base:,.0f} tok/s, peak memory {peak_mem_base:,.0f} MiB")
        print(f"speedup over baseline: {dt_base / dt:.3f}x; peak memory ratio: {peak_mem / peak_mem_base:.3f}")


if __name__ == "__main__":
    main()
