"""
Speed and memory of the training step, the instrument behind every speed claim of this project.

    python bench.py [config/NAME.py] [--key=value ...] [--bench_steps=5] [--bench_warmup=2]
    python bench.py --bench_loader_tokens=100000000   # the data loader's memory and time instead
    python bench.py config/demo_cpu.py --bench_hellaswag=True   # HellaSwag scoring speed instead
    python bench.py --bench_hellaswag_process=True   # python hellaswag.py vs build-nanogpt's loop, whole process
    python bench.py --bench_profile=True   # on CUDA: then one step under torch.profiler, by kernel kind
    python bench.py --bench_recipe=True    # the quick start trained per recipe: AdamW/Muon x cosine/WSD
    python bench.py --bench_start=True --bench_steps=3   # --help and a typo against `import torch`

Takes the trainer's configuration (same constants, files and overrides; dtype and compile
"auto" resolved as the trainer resolves them), runs bench_warmup + bench_steps optimizer steps of
train_gpt2.train_step on random tokens (no disk I/O), and prints tok/s, model FLOPs per token,
the achieved FLOP/s as a fraction of the device's matmul rate in the same dtype (measured in this
run; not on a CPU, where no peak holds: hardware.peak_flops), and peak memory. Then, unless --bench_baseline=False, the same steps as build-nanogpt takes
them (full logits, F.cross_entropy, glibc's default memory handling) on the same model, dtype and
batch as the baseline, and both ratios: time per step and peak memory. Each of the two runs in a
process of its own (a clean heap, its own peak). total_batch_size must be a multiple of B*T.

With bench_loader_tokens > 0 it measures the loader instead, on synthetic shards of that many
tokens and of a tenth of it (documents of ~1,000 tokens), in order and shuffled: the anonymous
memory (RssAnon, not the page cache) that DataLoaderLite adds while reading the whole shard, the
time to open it (shuffled: to find its documents and draw their order) and its time per
optimizer step at total_batch_size; and loading the shard whole as int64 tokens (build-nanogpt's
loader), in the same run. The step bench prints the loader's time per step too, in order and
shuffled, beside the step time (its steps run on tokens in memory).

With bench_recipe=True it trains the README quick start once per recipe instead (RECIPES, below).
"""
import json
import os
import re
import resource
import statistics
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
from gptkit.configurator import parse_config
from gptkit.common import UserError
from gptkit.hardware import autocast, choose_precision, cpu_has_bf16, matmul_flops, sync
from model import GPT, GPTConfig, flops_per_token
from gptkit.tokenizer import EOT, N_VOCAB


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


def synthetic_shard(folder, n):
    """folder/bench_train_000000.npy: n random GPT-2 token ids in documents of ~1,000 tokens, as FineWeb-Edu's."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, N_VOCAB, n, dtype=np.uint16)
    tokens[rng.integers(0, n, n // 1000)] = EOT
    path = os.path.join(folder, 'bench_train_000000.npy')
    np.save(path, tokens)
    return path


def time_loader(c, folder, shuffle):
    """(seconds to open the shard, seconds per optimizer step over the whole shard, MiB of anonymous
    memory added) of DataLoaderLite at c's B, T and total_batch_size, one process."""
    B, T = c['B'], c['T']
    accum = max(1, c['total_batch_size'] // (B * T))
    base = rss_anon_mib()
    t0 = time.perf_counter()
    loader = train_gpt2.DataLoaderLite(B, T, 0, 1, 'train', folder, accum, shuffle=shuffle, seed=c['seed'])
    opened = time.perf_counter() - t0  # the shard's length; shuffled: its documents and their order
    t0 = time.perf_counter()
    for _ in range(loader.steps_per_epoch * accum):  # the whole shard
        loader.next_batch()
    return opened, (time.perf_counter() - t0) / loader.steps_per_epoch, rss_anon_mib() - base


def bench_loader(c):
    c = memory.micro_batch_of(c, 'cpu')  # B="auto": as the trainer would choose on this CPU
    n_max, step = c['bench_loader_tokens'], max(c['total_batch_size'], c['B'] * c['T'])
    with tempfile.TemporaryDirectory() as tmp:
        for n in (n_max // 10, n_max):
            folder = os.path.join(tmp, str(n))
            os.makedirs(folder)
            path = synthetic_shard(folder, n)
            for shuffle in (False, True):
                opened, dt, anon = time_loader(c, folder, shuffle)
                print(f"shard of {n:,} tokens, shuffle={shuffle}: DataLoaderLite +{anon:,.1f} MiB anonymous memory, "
                      f"ready in {opened:.2f} s, {dt * 1e3:.1f} ms per step of {step:,} tokens ({(n - 1) // step:,} steps)")
            base = rss_anon_mib()
            tokens = torch.tensor(np.load(path).astype(np.int64))  # the whole shard in memory
            whole = rss_anon_mib() - base
            del tokens
            print(f"shard of {n:,} tokens: build-nanogpt's whole-shard int64 load +{whole:,.1f} MiB")


def peak_memory_mib(device):
    if device.startswith('cuda'):
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 10  # KiB on Linux


def nanogpt_forward(self, idx, targets=None):
    """build-nanogpt's GPT.forward (the same model): the logits in full, then F.cross_entropy."""
    logits = self.lm_head(self.hidden_states(idx))  # (B, T, vocab_size)
    loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
    return logits, loss


def nanogpt_step(state, grad_accum, lr, device, dtype):
    """build-nanogpt's training step: autocast (it knows bf16 only), loss.backward(), clip at 1.0."""
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
    return loss_accum


def time_steps(c, role):
    """In this process (a fresh one per role): seconds per optimizer step (the mean of bench_steps
    after bench_warmup) and peak memory of the trainer's step ("ours": train_gpt2.train_step, with
    cpu_reuse_memory as configured) or of build-nanogpt's ("baseline": its forward and step, and
    glibc's default memory handling). Printed as one JSON line for the parent."""
    _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'] and role == 'ours')  # TF32 on CUDA, as the trainer
    if role == 'baseline':
        GPT.forward = nanogpt_forward
    torch.manual_seed(c['seed'])
    model = GPT(GPTConfig.from_dict(c)).to(device)
    optimizer = model.configure_optimizers(c['weight_decay'], c['max_lr'], torch.device(device).type)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=c['dtype'] == 'float16')
    state = train_gpt2.TrainState(torch.compile(model, dynamic=False) if c['compile'] else model, model, optimizer, scaler,
                                  RandomTokens(c['B'], c['T'], c['vocab_size']))
    grad_accum = c['total_batch_size'] // (c['B'] * c['T'])

    def step():
        if role == 'baseline':
            loss = nanogpt_step(state, grad_accum, c['max_lr'], device, c['dtype'])
        else:
            loss, _, _, _ = train_gpt2.train_step(state, grad_accum, c['max_lr'], c['grad_clip'], device, c['dtype'])
        return loss.item()  # waits for the device, as both trainers do

    for _ in range(c['bench_warmup']):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(c['bench_steps']):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / c['bench_steps']
    if c['bench_profile'] and role == 'ours' and device.startswith('cuda'):
        profile_step(step, dt)
    print(json.dumps({'dt': dt, 'peak': peak_memory_mib(device), 'threads': torch.get_num_threads(), 'device': device,
                      'params': sum(p.numel() for p in model.parameters())}))


# kernel name fragments -> where the time goes; the first match counts: attention before matmul
# (cuDNN's attention kernels are named sm90_..._sdpa_..._flash), fused Triton kernels before
# copies (their names list the ops fused, _to_copy among them)
KERNEL_KINDS = (('attention', ('flash', 'fmha', 'sdpa')), ('matmul', ('gemm', 'nvjet', 'xmma', 'cutlass', 'cublas')),
                ('optimizer', ('adam', 'multi_tensor')), ('communication', ('nccl',)),
                ('fused elementwise/norm/loss', ('triton',)), ('copy/fill', ('memcpy', 'memset', 'copy', 'fill')))


def kernel_kind(name):
    return next((kind for kind, frags in KERNEL_KINDS if any(f in name.lower() for f in frags)), 'other')


def profile_step(step, dt):
    """One more step under torch.profiler: its GPU kernel time by kind and the 12 costliest kernels
    (printed before the JSON line); what the kernels leave of the step's time is the GPU idle."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == 'CUDA']
    own = lambda e: getattr(e, 'self_device_time_total', None) or getattr(e, 'self_cuda_time_total', 0)  # us
    total = sum(own(e) for e in kernels) / 1e3
    kinds = {}
    for e in kernels:
        kinds[kernel_kind(e.key)] = kinds.get(kernel_kind(e.key), 0) + own(e) / 1e3
    print(f"profile of one step: {dt * 1e3:.1f} ms per step untraced; GPU kernels {total:.1f} ms, so the GPU is idle "
          f"for ~{max(0.0, dt * 1e3 - total):.1f} ms of it")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:30s} {ms:8.1f} ms  {ms / max(total, 1e-9):6.1%}")
    print("costliest kernels (ms, calls):")
    for e in sorted(kernels, key=own, reverse=True)[:12]:
        print(f"  {own(e) / 1e3:8.1f} {e.count:6d}  {e.key[:110]}")


def measure(argv, role):
    """time_steps(role) in a new process: each measurement starts from a clean heap, and the peak
    memory is its own."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f"--bench_role={role}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"error: the {role} measurement failed:\n{r.stderr[-3000:]}")
    *profile, result = r.stdout.strip().splitlines()
    print("\n".join(line for line in profile if line.startswith(('profile', '  ', 'costliest'))))
    return json.loads(result)


def bench_step(c, argv, device):
    """The trainer's step against build-nanogpt's, same model, dtype and batch, one process each."""
    c = choose_precision(c, device)  # prints the precision chosen
    c = memory.micro_batch_of(c, device)  # B="auto": as the trainer chooses, printed
    if c['total_batch_size'] % (c['B'] * c['T']):
        sys.exit(f"error: total_batch_size={c['total_batch_size']} is not a multiple of B*T={c['B'] * c['T']}")
    argv = [*argv, f"--dtype={c['dtype']}", f"--compile={c['compile']}", f"--B={c['B']}"]  # the same in both processes
    ours = measure(argv, 'ours')
    base = measure(argv, 'baseline') if c['bench_baseline'] else None

    config = GPTConfig.from_dict(c)
    tok_per_s = c['total_batch_size'] / ours['dt']
    fpt = flops_per_token(config, c['T'])
    peak_flops = matmul_flops(device, c['dtype']) if device != 'cpu' else None  # on a CPU no peak holds (gptkit/hardware.py)
    mem_what = "max allocated by torch" if device.startswith('cuda') else "peak RSS of the process"
    print(f"model: {ours['params'] / 1e6:.2f}M parameters, n_layer={config.n_layer} n_head={config.n_head} "
          f"n_embd={config.n_embd} vocab={config.vocab_size}")
    print(f"batch: B={c['B']} T={c['T']} grad_accum={c['total_batch_size'] // (c['B'] * c['T'])} "
          f"({c['total_batch_size']} tokens/step), device={device} dtype={c['dtype']} compile={c['compile']} "
          f"threads={ours['threads']} cpu_reuse_memory={c['cpu_reuse_memory']}")
    if device == 'cpu':
        print(describe_cpu())
    print(f"step time: {ours['dt'] * 1000:.1f} ms (mean of {c['bench_steps']} after {c['bench_warmup']} warmup)")
    with tempfile.TemporaryDirectory() as tmp:  # the data loader's share, on 20 steps of synthetic documents
        synthetic_shard(tmp, 20 * max(c['total_batch_size'], c['B'] * c['T']) + 1)
        loader_ms = [time_loader(c, tmp, shuffle)[1] * 1e3 for shuffle in (False, True)]
    print(f"data loader: {loader_ms[0]:.2f} ms per step in order, {loader_ms[1]:.2f} ms shuffled (the step above "
          f"runs on tokens in memory)")
    print(f"tok/s: {tok_per_s:,.0f}")
    print(f"model FLOPs/token: {fpt / 1e6:.1f} MFLOP")
    print(f"achieved: {tok_per_s * fpt / 1e12:.3f} TFLOP/s")
    if peak_flops:
        print(f"device matmul ({c['dtype']}): {peak_flops / 1e12:.3f} TFLOP/s, measured now")
        print(f"MFU vs that matmul: {tok_per_s * fpt / peak_flops:.3f}")
    print(f"peak memory: {ours['peak']:,.0f} MiB ({mem_what})")
    if base is not None:
        print(f"baseline, build-nanogpt's step (full logits, F.cross_entropy, default malloc), measured now: "
              f"{base['dt'] * 1000:.1f} ms/step, {c['total_batch_size'] / base['dt']:,.0f} tok/s, "
              f"peak memory {base['peak']:,.0f} MiB")
        print(f"time per step vs baseline: {ours['dt'] / base['dt']:.3f}x (speedup {base['dt'] / ours['dt']:.3f}x); "
              f"peak memory vs baseline: {ours['peak'] / base['peak']:.3f}x")


# --bench_recipe=True: the trainer's arguments for each recipe, after config/demo_cpu.py (the README
# quick start); the learning rates are the best of the sweep in docs/benchmarks.md
RECIPES = {
    'adamw+cosine': ['--optimizer=adamw', '--lr_schedule=cosine', '--max_lr=1.5e-3'],
    'adamw+wsd': ['--optimizer=adamw', '--lr_schedule=wsd', '--max_lr=1.5e-3'],
    'muon+wsd': ['--optimizer=muon', '--lr_schedule=wsd', '--max_lr=1.5e-3', '--muon_lr=4.5e-3'],
    'muon+cosine': ['--optimizer=muon', '--lr_schedule=cosine', '--max_lr=1.5e-3', '--muon_lr=4.5e-3'],
}


def describe_cpu():
    cpu = torch.cpu.get_capabilities().get('cpu_name', '?') if hasattr(torch.cpu, 'get_capabilities') else '?'
    return f"cpu: {cpu}, bf16 units: {cpu_has_bf16()}, kernels: {torch.backends.cpu.get_cpu_capability()}"


def bench_recipe(c, argv):
    """The README quick start (config/demo_cpu.py on demo_stdlib/: the same model, tokens and
    steps) trained once per recipe of bench_recipes, each in a process of its own, val every 10
    steps: final val loss and bits per byte, median ms per step, and the first val step at which
    each reaches the first recipe's final val loss, as a share of its steps. Other --key=value
    arguments (not bench_*) go to every run, after the recipe's own. bench_recipe_dir: keep each
    run's log_dir there, as DIR/RECIPE (for plot.py), instead of in a temporary folder."""
    import plot
    names = c['bench_recipes'].split(',')
    if any(name not in RECIPES for name in names):
        sys.exit(f"error: bench_recipes={c['bench_recipes']!r}: expected a comma-separated list of {', '.join(RECIPES)}")
    extra = [a for a in argv if a.startswith('--') and not a.startswith('--bench_')]
    print(describe_cpu())
    keep = c['bench_recipe_dir']
    taken = [os.path.join(keep, name) for name in names if keep and os.path.exists(os.path.join(keep, name))]
    if taken:  # a run there would resume, not start afresh
        sys.exit(f"error: {taken[0]} exists: remove it, or choose another --bench_recipe_dir")
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            log_dir = os.path.abspath(os.path.join(keep, name)) if keep else tmp
            cmd = [sys.executable, 'train_gpt2.py', 'config/demo_cpu.py', *RECIPES[name], '--eval_interval=10',
                   '--sample_interval=0', '--checkpoint_interval=0', *extra, f'--log_dir={log_dir}']
            r = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"error: the {name} run failed:\n{r.stderr[-3000:]}")
            curves = plot.read_log(log_dir)
        val, bpb = dict(zip(*curves['val'])), dict(zip(*curves['bpb']))
        ms = statistics.median(float(m) for m in re.findall(r"\| dt ([\d.]+)ms", r.stdout)[1:])  # after the first
        results[name] = val, bpb, ms
        precision = next(line for line in r.stdout.splitlines() if line.startswith('precision:'))
        print(f"{name}: {' '.join(RECIPES[name] + extra)}; {precision}; val loss {val[max(val)]:.4f}, "
              f"{ms:.0f} ms/step", flush=True)
    target = results[names[0]][0][max(results[names[0]][0])]
    print(f"\n{'recipe':<14} {'final val':>9} {'val bpb':>8} {'ms/step':>8}   steps to val {target:.4f} ({names[0]}'s final)")
    for name, (val, bpb, ms) in results.items():
        last = max(val)
        reach = next((s for s in sorted(val) if val[s] <= target), None)
        when = f"{reach} of {last} = {reach / last:.2f}x" if reach is not None else "not reached"
        print(f"{name:<14} {val[last]:>9.4f} {bpb[last]:>8.4f} {ms:>8.0f}   {when}")
    if keep:
        print(f"logs: {', '.join(os.path.join(keep, name) for name in names)}; overlaid: python plot.py "
              f"{' '.join(os.path.join(keep, name) for name in names)} --out recipes.png")


def bench_hellaswag(c, config, device):
    """Examples/s of hellaswag.evaluate (batched, output layer at ending positions only) against
    one example per forward with the output layer everywhere (build-nanogpt), same model, the same
    256 synthetic examples (hellaswag.synthetic_examples: contexts of 6-36 words, endings of 3-20,
    as the val split's first ones; before 2026-12-01 this bench made its own, of 20-45 and 8-25)."""
    torch.manual_seed(c['seed'])
    model = GPT(config).to(device).eval()
    rendered = [hellaswag.render_example(e) for e in hellaswag.synthetic_examples(256)]

    @torch.no_grad()
    def one_per_forward():
        correct = 0
        for tokens, mask, label in rendered:
            tokens, mask = tokens.to(device), mask.to(device)
            with autocast(device, c['dtype']):
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
    ours, (_, _, correct) = timed(lambda: hellaswag.evaluate(model, rendered, device, c['dtype']))
    print(f"hellaswag scoring, {len(rendered)} examples, model of {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, device={device} dtype={c['dtype']}")
    print(f"one example per forward, output layer everywhere: {base:,.1f} examples/s")
    print(f"batched, output layer at endings (hellaswag.evaluate): {ours:,.1f} examples/s")
    print(f"speedup: {ours / base:.2f}x (same acc_norm count: {correct == base_correct})")



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
        losses = F.cross_entropy(shift_logits.view(-1, logits.size(-1)), shift_tokens.view(-1), reduction="none")
        shift_mask = mask[:, 1:].contiguous()
        sum_loss = (losses.view(4, -1) * shift_mask).sum(1)
        avg_loss = sum_loss / shift_mask.sum(1)
        n += 1
        correct += int(sum_loss.argmin().item() == example["label"])
        correct_norm += int(avg_loss.argmin().item() == example["label"])
print(f"acc: {correct / n:.4f} acc_norm: {correct_norm / n:.4f}")
"""


def bench_start(c):
    """The first answer: `python train_gpt2.py --help` and a mistyped key, each against
    `python -c "import torch"` on this machine (best of bench_steps whole processes each): what
    comes on top of torch's own import."""
    root = os.path.dirname(os.path.abspath(__file__))
    best = {}
    for name, cmd in (("import torch", ["-c", "import torch"]), ("--help", ["train_gpt2.py", "--help"]),
                      ("a typo", ["train_gpt2.py", "--max_step=3"])):
        times = []
        for _ in range(c['bench_steps']):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, *cmd], cwd=root, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if r.returncode != (1 if name == "a typo" else 0):  # a crash would be timed as an answer
                sys.exit(f"error: {name} exited {r.returncode}:\n{r.stderr[-2000:]}")
        best[name] = min(times)
    print(f"first answer, best of {c['bench_steps']} processes, cpu: {torch.backends.cpu.get_cpu_capability()}")
    for name, t in best.items():
        print(f"{name}: {t:.2f} s" + (f" ({t - best['import torch']:+.2f} s on import torch)" if name != "import torch" else ""))


def bench_hellaswag_process(c):
    """Whole-process wall clock (imports, tokenizer, model load, scoring) of `python hellaswag.py`
    in float32 against HELLASWAG_REFERENCE (build-nanogpt's per-example loop), each a fresh process
    on the same HF model folder (random weights, the configured shape, GPT-2's vocabulary) and the
    same bench_hellaswag_examples synthetic examples; both must print the same acc and acc_norm."""
    from transformers import GPT2Config, GPT2LMHeadModel
    root = os.path.dirname(os.path.abspath(__file__))
    n = c['bench_hellaswag_examples']
    with tempfile.TemporaryDirectory() as tmp:
        path, model_dir = os.path.join(tmp, 'hellaswag.jsonl'), os.path.join(tmp, 'model')
        hellaswag.write_synthetic(path, n, c['seed'])
        torch.manual_seed(c['seed'])
        GPT2LMHeadModel(GPT2Config(n_layer=c['n_layer'], n_head=c['n_head'], n_embd=c['n_embd'],
                                   n_positions=c['block_size'], vocab_size=N_VOCAB)).save_pretrained(model_dir)
        runs = {}
        for name, cmd in (("ours", ["hellaswag.py", "--model", model_dir, "--file", path, "--limit", str(n),
                                    "--device", "cpu", "--dtype", "float32"]),
                          ("reference", ["-c", HELLASWAG_REFERENCE, model_dir, path, str(n)])):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, *cmd], cwd=root, capture_output=True, text=True)
            runs[name] = time.perf_counter() - t0, r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
            if r.returncode != 0:
                sys.exit(f"error: {name} failed:\n{r.stderr[-3000:]}")
    (ours, ours_out), (ref, ref_out) = runs["ours"], runs["reference"]
    print(f"hellaswag whole process, {n} examples, n_layer={c['n_layer']} n_embd={c['n_embd']} vocab={N_VOCAB}, "
          f"float32, cpu kernels: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()}")
    print(f"python hellaswag.py: {ours:.1f} s ({ours_out})")
    print(f"build-nanogpt's loop (HF, one example per forward): {ref:.1f} s ({ref_out})")
    print(f"speedup: {ref / ours:.2f}x; same acc and acc_norm: {ours_out == ref_out}")


def main():
    defaults = dict(train_gpt2.DEFAULTS)
    defaults.update(bench_steps=5, bench_warmup=2, bench_loader_tokens=0, bench_baseline=True, bench_hellaswag=False,
                    bench_role="", bench_hellaswag_process=False, bench_hellaswag_examples=500,
                    bench_profile=False, bench_recipe=False, bench_recipes=",".join(RECIPES), bench_recipe_dir="",
                    bench_start=False)
    try:
        c = parse_config(sys.argv[1:], defaults, __doc__)
    except UserError as e:
        sys.exit(f"error: {e}")
    if c['bench_role']:  # a child process of bench_step
        return time_steps(c, c['bench_role'])
    if c['bench_loader_tokens'] > 0:
        return bench_loader(c)
    if c['bench_hellaswag_process']:
        return bench_hellaswag_process(c)
    if c['bench_recipe']:
        return bench_recipe(c, sys.argv[1:])
    if c['bench_start']:
        return bench_start(c)
    try:
        _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'])  # TF32 on CUDA, as the trainer
    except UserError as e:  # a device that is not here
        sys.exit(f"error: {e}")
    config = GPTConfig.from_dict(c)
    if c['bench_hellaswag']:
        return bench_hellaswag(c, config, device)
    return bench_step(c, sys.argv[1:], device)


if __name__ == "__main__":
    main()
