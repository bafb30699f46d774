"""
Train GPT-2 on FineWeb-Edu token shards, on one CPU/GPU or many GPUs.

    python train_gpt2.py                                   # one process: cuda, mps or cpu
    torchrun --standalone --nproc_per_node=8 train_gpt2.py # one node, 8 GPUs (DDP over NCCL)
    python train_gpt2.py config/NAME.py --max_steps=100 --dtype=float32

Edit the constants below, or override them with config files (Python files that assign some of
these names) and --key=value arguments (Python literals; the type must stay the default's),
applied in the order given.
"""
import ast
import builtins
import ctypes
import difflib
import glob
import json
import math
import os
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fineweb import atomic_write
from model import GPT, GPTConfig, autocast

# -----------------------------------------------------------------------------
# config: the defaults reproduce GPT-2 124M on 10B tokens of FineWeb-Edu (build-nanogpt's run)
# I/O
data_root = "edu_fineweb10B"  # folder of *_train_*.npy / *_val_*.npy uint16 shards (fineweb.py)
log_dir = "log"  # log.txt, samples.txt and checkpoints go here
init_from = "scratch"  # "scratch", an OpenAI name (gpt2, gpt2-medium, ...) or a HF model directory
# model (ignored when init_from is not "scratch": the weights bring their own shape)
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024  # longest sequence the model can see
vocab_size = 50304  # GPT-2's 50257 tokens, padded to a multiple of 128 for faster matmuls
# batch: total_batch_size tokens per optimizer step = B * T * world_size * grad_accum_steps
total_batch_size = 524288  # 2**19, ~0.5M tokens, as GPT-3 124M
B = 64  # micro-batch: sequences per forward/backward, per process
T = 1024  # sequence length
# optimizer: AdamW, linear warmup then cosine decay to min_lr at max_steps
max_lr = 6e-4
min_lr = 6e-5
warmup_steps = 715  # 375M tokens, as GPT-3
max_steps = 19073  # 10B tokens / 2**19 tokens per step = one epoch of sample-10BT
weight_decay = 0.1
grad_clip = 1.0  # clip the global gradient norm to this; 0 disables
# evaluation, samples, checkpoints (every N steps and at the last step; 0 turns it off)
eval_interval = 250
val_tokens = 10485760  # first 10M tokens of the val split, whatever the number of processes
sample_interval = 250
sample_prompt = "Hello, I'm a language model,"
sample_length = 32  # new tokens in each of the 4 samples
checkpoint_interval = 5000  # 0: only at the last step
hellaswag = True  # HellaSwag acc_norm at every eval (all ranks share the 10,042 val examples)
hellaswag_file = ""  # a HellaSwag jsonl file; "" = the val split, downloaded once into ./hellaswag/
# system
device = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps; torchrun uses cuda:LOCAL_RANK
dtype = "bfloat16"  # bfloat16 (autocast; parameters and optimizer stay float32) or float32
compile = True  # torch.compile the model (slow to start, faster to run)
cpu_reuse_memory = False  # CPU on Linux: keep freed memory for reuse, ~1.4-2x faster steps, ~+40% peak RSS
seed = 1337
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))}


class UserError(Exception):
    """Bad configuration or data: reported as one line, without a traceback."""


def parse_config(argv, defaults):
    """defaults, updated by config files and --key=value arguments, in the order given."""
    config = dict(defaults)

    def set_key(key, value, source):
        if key not in config:
            close = difflib.get_close_matches(key, list(config), n=3, cutoff=0.0)
            raise UserError(f"unknown config key {key!r} in {source}; closest valid names: {', '.join(close)}")
        default = config[key]
        if isinstance(default, float) and type(value) is int:
            value = float(value)  # --max_lr=1 means 1.0
        if type(value) is not type(default):
            raise UserError(f"config key {key!r} in {source} must be {type(default).__name__} "
                            f"like its default {default!r}, got {type(value).__name__} {value!r}")
        config[key] = value

    for arg in argv:
        if arg.startswith('--'):
            key, eq, text = arg[2:].partition('=')
            if not eq:
                raise UserError(f"expected --key=value, got {arg!r}")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text  # a bare word is a string: --init_from=gpt2
            if isinstance(defaults.get(key), str) and not isinstance(value, str):
                value = text  # a string key takes the text as typed: --data_root=123
            set_key(key, value, arg)
        else:
            if not os.path.isfile(arg):
                raise UserError(f"config file {arg!r} not found (expected a Python file of constants, e.g. config/NAME.py)")
            namespace = dict(config)  # a file may use the constants: max_steps = 2 * warmup_steps
            try:
                with open(arg) as f:
                    exec(builtins.compile(f.read(), arg, 'exec'), namespace)  # `compile` is a constant here
            except Exception as e:
                raise UserError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from None
            for key, value in namespace.items():
                if key.startswith('_') or callable(value) or type(value).__name__ == 'module':
                    continue
                if key not in config or value is not config[key]:
                    set_key(key, value, arg)
    check_config(config)
    return config


def check_config(c):
    for key in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size', 'total_batch_size', 'B', 'T'):
        if c[key] <= 0:
            raise UserError(f"config key {key!r} must be positive, got {c[key]}")
    for key in ('max_steps', 'warmup_steps', 'eval_interval', 'val_tokens', 'sample_interval', 'sample_length',
                'checkpoint_interval'):
        if c[key] < 0:
            raise UserError(f"config key {key!r} must be >= 0, got {c[key]}")
    if c['n_embd'] % c['n_head']:
        raise UserError(f"n_embd={c['n_embd']} must be a multiple of n_head={c['n_head']}")
    if c['dtype'] not in ('bfloat16', 'float32'):
        raise UserError(f"config key 'dtype' must be 'bfloat16' or 'float32', got {c['dtype']!r}")
    if c['device'] != 'auto':
        try:
            torch.device(c['device'])
        except RuntimeError:
            raise UserError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got {c['device']!r}") from None


def get_lr(step, max_lr, min_lr, warmup_steps, max_steps):
    if step < warmup_steps:  # linear warmup, never exactly 0
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


# -----------------------------------------------------------------------------
# data: the uint16 token shards of fineweb.py (and build-nanogpt's), memory-mapped

def find_shards(data_root, split):
    if not os.path.isdir(data_root):
        raise UserError(f"data folder {data_root!r} not found: run `python fineweb.py` to make the token "
                        f"shards, or point data_root at them")
    manifest = os.path.join(data_root, 'fineweb_manifest.json')  # written by fineweb.py
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                complete = json.load(f)['complete']
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{manifest}: unreadable ({e!r})") from None
        if not complete:
            raise UserError(f"{data_root!r} is unfinished: fineweb.py was interrupted or failed there; "
                            f"run the same fineweb.py command again to finish it")
    shards = sorted(glob.glob(os.path.join(data_root, f'*_{split}_*.npy')))
    if not shards:
        raise UserError(f"no {split} shard (*_{split}_*.npy) in {data_root!r}: run `python fineweb.py`")
    return shards


def open_shard(path):
    """The shard's tokens as a read-only memory map: pages load as batches touch them."""
    try:
        tokens = np.load(path, mmap_mode='r')
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable .npy array ({e})") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: expected a 1-D uint16 array of token ids, got {tokens.dtype} of shape {tokens.shape}")
    return tokens


class DataLoaderLite:
    """Batches of B sequences of T tokens from the sorted shards of one split.

    One optimizer step reads one contiguous run of B*T*num_processes*accum_steps tokens (+1 for
    the last target); micro-step m of rank r takes the chunk (m * num_processes + r) of it, so
    ranks read disjoint, interleaved chunks that together cover the run. The position (shard,
    pos) is global, the same on every rank, and moves only at step boundaries: all ranks leave
    a shard at the same step, and the token stream does not depend on the number of processes
    (a shard's tail shorter than one step is skipped)."""

    def __init__(self, B, T, process_rank, num_processes, split, data_root, accum_steps=1):
        self.B, self.T = B, T
        self.rank, self.world, self.accum = process_rank, num_processes, accum_steps
        self.step_tokens = B * T * num_processes * accum_steps
        self.shards = find_shards(data_root, split)
        for path in self.shards:  # fail now, not hours into the run
            n = len(open_shard(path))
            if n < self.step_tokens + 1:
                raise UserError(f"{path}: {n} tokens, shorter than one batch of B*T*world_size*grad_accum_steps + 1 "
                                f"= {B}*{T}*{num_processes}*{accum_steps} + 1 = {self.step_tokens + 1} tokens")
        self.reset()

    def reset(self):
        self.shard, self.pos, self.micro = 0, 0, 0
        self.tokens = open_shard(self.shards[0])

    def next_batch(self):
        B, T = self.B, self.T
        start = self.pos + (self.micro * self.world + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[start:start + B * T + 1].astype(np.int64))  # only this chunk
        x = buf[:-1].view(B, T)  # inputs
        y = buf[1:].view(B, T)  # targets
        self.micro += 1
        if self.micro == self.accum:  # this step's run is read: every rank advances alike
            self.micro = 0
            self.pos += self.step_tokens
            if self.pos + self.step_tokens + 1 > len(self.tokens):
                self.shard = (self.shard + 1) % len(self.shards)
                self.tokens = open_shard(self.shards[self.shard])
                self.pos = 0
        return x, y


def load_val_tokens(data_root, n_tokens):
    """The first n_tokens + 1 tokens of the val split, as one uint16 array."""
    parts, need = [], n_tokens + 1
    for path in find_shards(data_root, 'val'):
        parts.append(np.array(open_shard(path)[:need]))
        need -= len(parts[-1])
        if need == 0:
            return np.concatenate(parts)
    raise UserError(f"the val split in {data_root!r} has {n_tokens + 1 - need} tokens, fewer than "
                    f"val_tokens + 1 = {n_tokens + 1}: lower val_tokens")


@torch.no_grad()
def load_hellaswag(file, model, rank, world, device):
    """The rendered HellaSwag val examples, or None after one warning when there are none; the
    same answer on every rank."""
    import hellaswag as hs
    examples, why = None, None
    if model.config.vocab_size < 50257:
        why = f"vocab_size={model.config.vocab_size} is smaller than GPT-2's 50257"
    else:
        path = file or os.path.join(hs.CACHE_DIR, 'hellaswag_val.jsonl')
        if not file and rank == 0:
            try:
                hs.download('val')  # nothing to do once cached
            except hs.HellaSwagError as e:
                why = str(e)
        if world > 1:
            dist.barrier()  # rank 0's download first
        if os.path.isfile(path):
            try:
                examples = [hs.render_example(e) for e in hs.iterate_examples(file=path)]
            except hs.HellaSwagError as e:
                raise UserError(str(e)) from None
        else:
            why = why or f"{path} not found"
    found = torch.tensor(int(examples is not None), device=device)
    if world > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MIN)  # e.g. a node without the file: nobody evaluates
    if rank == 0 and not found.item():
        print(f"warning: no HellaSwag eval: {why or 'not on every node'}; training goes on without it")
    return examples if found.item() else None


def evaluate(model, tokens, B, T, rank, world, device, dtype):
    """Mean loss over the len(tokens) // T sequences of T tokens in tokens, all ranks together.
    Rank r scores the sequences r, r + world, ...: the value does not depend on world."""
    model.eval()
    n_seq = (len(tokens) - 1) // T
    mine = range(rank, n_seq, world)
    loss_sum = torch.zeros((), device=device)
    for i in range(0, len(mine), B):
        rows = np.stack([tokens[j * T:j * T + T + 1] for j in mine[i:i + B]]).astype(np.int64)  # (b, T+1)
        x = torch.from_numpy(rows[:, :-1]).to(device)
        y = torch.from_numpy(rows[:, 1:]).to(device)
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss_sum += loss.float() * y.numel()
    if world > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
    model.train()
    return loss_sum.item() / (n_seq * T)


# -----------------------------------------------------------------------------
# training

def train_step(model, optimizer, loader, grad_accum_steps, lr, grad_clip, device, dtype, world):
    """One optimizer step over grad_accum_steps micro-batches; returns (mean loss, grad norm)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_accum = torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if world > 1:  # all-reduce the gradients only once, after the last micro-step
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss = loss / grad_accum_steps  # the gradient of the mean over all micro-batches
        loss_accum += loss.detach()
        loss.backward()
    if world > 1:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_accum /= world
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
    for group in optimizer.param_groups:
        group['lr'] = lr
    optimizer.step()
    return loss_accum, norm


def reuse_freed_memory():
    """glibc hands every large tensor (the logits: B*T*vocab floats) back to the OS when it is
    freed, and the next step page-faults gigabytes of zeroed pages back in: on a CPU that system
    time can be half the step. Serve large blocks from the heap and never trim it instead."""
    mallopt = getattr(ctypes.CDLL(None), 'mallopt', None)  # glibc; absent on macOS and musl
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, -1)  # -1 is SIZE_MAX to glibc: never trim


def setup_device(device, cpu_reuse_memory=False):
    """(ddp, rank, local_rank, world_size, device): torchrun's RANK means DDP, one process per device."""
    ddp = 'RANK' in os.environ
    rank, local_rank, world = 0, 0, 1
    if ddp:
        rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    if ddp and device.startswith('cuda'):
        device = f'cuda:{local_rank}'  # one GPU per process, whatever index was asked for
    if device.startswith('cuda'):
        torch.cuda.set_device(device)
    if device == 'cpu' and cpu_reuse_memory and sys.platform.startswith('linux'):
        reuse_freed_memory()
    if ddp:
        cuda = device.startswith('cuda')
        dist.init_process_group(backend='nccl' if cuda else 'gloo', device_id=torch.device(device) if cuda else None)
    return ddp, rank, local_rank, world, device


def main(argv=None):
    master = int(os.environ.get('RANK', 0)) == 0
    argv = sys.argv[1:] if argv is None else argv
    if '-h' in argv or '--help' in argv:
        print(__doc__ + "\nconstants and their defaults:\n" + "\n".join(f"  --{k}={v!r}" for k, v in DEFAULTS.items()))
        return
    try:
        config = parse_config(argv, DEFAULTS)
    except UserError as e:
        sys.exit(f"error: {e}" if master else 1)
    globals().update(config)  # the rest reads the constants, as overridden
    ddp, rank, local_rank, world, dev = setup_device(device, cpu_reuse_memory)
    ok = False
    try:
        run(config, rank, world, dev)
        ok = True
    except UserError as e:
        if master:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if ddp:
            try:
                if ok:
                    dist.barrier()  # no rank tears down while rank 0 still writes its last checkpoint
            finally:
                dist.destroy_process_group()


def run(config, rank, world, device):
    master = rank == 0
    device_type = torch.device(device).type
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    if device_type == 'cuda':
        torch.set_float32_matmul_precision('high')  # TF32 for the float32 matmuls

    tokens_per_micro = B * T * world
    if total_batch_size % tokens_per_micro:
        lo = total_batch_size // tokens_per_micro * tokens_per_micro
        valid = f"{lo} or {lo + tokens_per_micro}" if lo else f"{tokens_per_micro}"
        raise UserError(f"total_batch_size={total_batch_size} is not a multiple of B*T*world_size = "
                        f"{B}*{T}*{world} = {tokens_per_micro}; try {valid}, or change B")
    grad_accum_steps = total_batch_size // tokens_per_micro
    if eval_interval > 0 and val_tokens < T:
        raise UserError(f"val_tokens={val_tokens} is less than one sequence of T={T} tokens")
    if master:
        print("config:\n" + "\n".join(f"  {k} = {v!r}" for k, v in config.items()))
        print(f"world_size={world} device={device} grad_accum_steps={grad_accum_steps}")

    # the data first: a missing folder is reported before a model is built or downloaded
    train_loader = DataLoaderLite(B, T, rank, world, 'train', data_root, accum_steps=grad_accum_steps)
    val_data = load_val_tokens(data_root, val_tokens // T * T) if eval_interval > 0 else None

    if init_from == 'scratch':
        model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    else:
        try:
            model = GPT.from_pretrained(init_from)
        except (ValueError, OSError) as e:  # not a GPT-2, a missing folder, no download
            raise UserError(f"init_from={init_from!r}: {e}") from None
        if master:
            print(f"init_from={init_from}: model shape from the weights: {model.config}")
    if T > model.config.block_size:
        raise UserError(f"T={T} is longer than the model's block_size={model.config.block_size}")
    model.to(device)
    raw_model = model  # plain module: state_dict without prefixes, generation, evaluation
    if master:
        print(f"parameters: {sum(p.numel() for p in raw_model.parameters()):,}")
    if compile:
        model = torch.compile(model)
    eval_model = model  # not DDP-wrapped: ranks may run different numbers of eval batches
    if world > 1:
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == 'cuda' else None)
    optimizer = raw_model.configure_optimizers(weight_decay, max_lr, device_type)
    hella_data = load_hellaswag(hellaswag_file, raw_model, rank, world, device) if hellaswag and eval_interval > 0 else None

    log_file = os.path.join(log_dir, 'log.txt')
    if master:
        os.makedirs(log_dir, exist_ok=True)
        open(log_file, 'w').close()  # a fresh run starts a fresh log

    def log(line):
        with open(log_file, 'a') as f:
            f.write(line + '\n')

    # step = number of optimizer updates done: eval, sample and checkpoint the model as it is
    # after `step` updates, then (unless it is the last) take the update step -> step + 1
    for step in range(max_steps + 1):
        last_step = step == max_steps
        checkpoint = last_step or (checkpoint_interval > 0 and step > 0 and step % checkpoint_interval == 0)
        val_loss = None
        if eval_interval > 0 and (step % eval_interval == 0 or last_step or checkpoint):  # a checkpoint has its own
            val_loss = evaluate(eval_model, val_data, B, T, rank, world, device, dtype)
            if master:
                print(f"step {step:5d} | val loss {val_loss:.4f}")
                log(f"{step} val {val_loss:.4f}")
            if hella_data is not None:  # the plain module: works the same with compile and DDP
                import hellaswag as hs
                counts = torch.tensor(hs.evaluate(raw_model, hella_data, device, dtype, rank, world), device=device)
                if world > 1:
                    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
                n, correct, correct_norm = counts.tolist()
                if master:
                    print(f"step {step:5d} | hellaswag acc_norm {correct_norm}/{n} = {correct_norm / n:.4f} "
                          f"(acc {correct / n:.4f})")
                    log(f"{step} hella {correct_norm / n:.4f}")
        if master and sample_interval > 0 and step > 0 and (step % sample_interval == 0 or last_step):
            sample(raw_model, step, device)
        if master and checkpoint:  # 'config' is the model's, as build-nanogpt's checkpoints
            ckpt = {'model': raw_model.state_dict(), 'config': asdict(raw_model.config),
                    'train_config': config, 'step': step, 'val_loss': val_loss}
            # temporary file, fsync, rename: a checkpoint is whole or absent
            atomic_write(os.path.join(log_dir, f"model_{step:05d}.pt"), lambda f: torch.save(ckpt, f))
        if last_step:
            break

        t0 = time.time()
        lr = get_lr(step, max_lr, min_lr, warmup_steps, max_steps)
        loss, norm = train_step(model, optimizer, train_loader, grad_accum_steps, lr, grad_clip, device, dtype, world)
        loss = loss.item()  # waits for the device
        dt = time.time() - t0
        if master:
            tok_per_sec = total_batch_size / dt
            print(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm.item():.4f} | "
                  f"dt {dt * 1000:.2f}ms | tok/sec {tok_per_sec:.2f}")
            log(f"{step} train {loss:.6f}")


def sample(model, step, device):
    """Rank 0: 4 continuations of sample_prompt, printed and appended to log_dir/samples.txt."""
    from tokenizer import get_gpt2_encoding
    enc = get_gpt2_encoding()
    if model.config.vocab_size < enc.n_vocab:
        print(f"step {step}: no samples, vocab_size={model.config.vocab_size} is smaller than GPT-2's {enc.n_vocab}")
        return
    model.eval()
    idx = torch.tensor([enc.encode(sample_prompt)] * 4, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(42 + step)
    with autocast(device, dtype):
        out = model.generate(idx, sample_length, top_k=50, generator=generator)
    texts = [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]  # padded ids are no text
    lines = [f"step {step} sample {i}: {text!r}" for i, text in enumerate(texts)]
    print("\n".join(lines))
    with open(os.path.join(log_dir, 'samples.txt'), 'a') as f:
        f.write("\n".join(lines) + "\n")
    model.train()


if __name__ == "__main__":
    main()
