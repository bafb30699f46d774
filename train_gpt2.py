"""
Train GPT-2 on FineWeb-Edu token shards, on one CPU/GPU or many GPUs.

    python train_gpt2.py                                   # one process: cuda, mps or cpu
    torchrun --standalone --nproc_per_node=8 train_gpt2.py # one node, 8 GPUs (DDP over NCCL)
    python train_gpt2.py config/NAME.py --max_steps=100 --dtype=float32

Edit the constants below, or override them with config files (Python files that assign some of
these names) and --key=value arguments (Python literals; the type must stay the default's),
applied in the order given. The same command run again resumes from the newest checkpoint in
log_dir; on SIGTERM the run checkpoints and exits with code 75 (see README).
"""
import ast
import builtins
import ctypes
import difflib
import glob
import json
import math
import os
import pickle
import random
import re
import signal
import sys
import time
import types
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from fineweb import atomic_write
from model import GPT, GPTConfig, autocast, cpu_has_bf16, resolve_dtype

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
checkpoint_interval = 1000  # 0: only at the last step (and on SIGTERM / too many bad steps)
keep_checkpoints = 3  # the newest N checkpoints are kept, older ones deleted; 0 keeps all
resume = "auto"  # "auto": continue from the newest valid checkpoint in log_dir, if any; "never": refuse one
max_bad_steps = 5  # non-finite loss or grad norm: skip the update; stop after this many in a row
hellaswag = True  # HellaSwag acc_norm at every eval (all ranks share the 10,042 val examples)
hellaswag_file = ""  # a HellaSwag jsonl file; "" = the val split, downloaded once into ./hellaswag/
# system
device = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps; torchrun uses cuda:LOCAL_RANK
dtype = "auto"  # auto (what the hardware does fast, printed at start), bfloat16, float16 (+ loss scaling), float32
compile = "auto"  # torch.compile the model: auto = on CUDA (slow to start, faster to run), off elsewhere; True, False
cpu_reuse_memory = True  # CPU on Linux: keep freed memory for reuse: ~10% faster steps for ~15% more peak RSS
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
        if type(value) is not type(default) and not (default == 'auto' and type(value) is bool):  # compile=False
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
            if isinstance(defaults.get(key), str) and not isinstance(value, str) and not (
                    defaults[key] == 'auto' and isinstance(value, bool)):
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
    if c['keep_checkpoints'] < 0 or c['max_bad_steps'] < 1:
        raise UserError(f"keep_checkpoints must be >= 0 and max_bad_steps >= 1, got {c['keep_checkpoints']} and {c['max_bad_steps']}")
    if c['resume'] not in ('auto', 'never'):
        raise UserError(f"config key 'resume' must be 'auto' or 'never', got {c['resume']!r}")
    if c['n_embd'] % c['n_head']:
        raise UserError(f"n_embd={c['n_embd']} must be a multiple of n_head={c['n_head']}")
    if c['dtype'] not in ('auto', *PRECISIONS):
        raise UserError(f"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got {c['dtype']!r}")
    if c['compile'] not in (True, False, 'auto'):
        raise UserError(f"config key 'compile' must be True, False or 'auto', got {c['compile']!r}")
    if not isinstance(c['device'], str):
        raise UserError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got {c['device']!r}")
    if c['device'] != 'auto':
        try:
            torch.device(c['device'])
        except RuntimeError:
            raise UserError(f"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got {c['device']!r}") from None


PRECISIONS = ('float32', 'float16', 'bfloat16')  # from the least capable hardware to the most


def choose_precision(config, rank, world, device):
    """The config with dtype and compile made concrete for this device ("auto"), the same on every
    rank; rank 0 says what it chose and why."""
    dtype, why = resolve_dtype(config['dtype'], device)
    if world > 1:  # every rank must compute alike: all take the least capable rank's choice
        t = torch.tensor(PRECISIONS.index(dtype), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        if PRECISIONS[t.item()] != dtype:
            dtype, why = PRECISIONS[t.item()], 'auto: the choice of a rank whose hardware has less'
    if rank == 0:
        print(f"precision: {dtype} ({why}){', with loss scaling' if dtype == 'float16' else ''}")
        if dtype == 'bfloat16' and torch.device(device).type == 'cpu' and not cpu_has_bf16():
            print("warning: this CPU has no bf16 units: bfloat16 is emulated, ~100x slower than float32 (dtype='auto' "
                  "picks float32 here)")
    compiled = torch.device(device).type == 'cuda' if config['compile'] == 'auto' else config['compile']
    return dict(config, dtype=dtype, compile=compiled)


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


def open_shard(path, vocab_size=None):
    """The shard's tokens as a read-only memory map: pages load as batches touch them. With
    vocab_size, every id is checked to be below it (one pass over the shard as it is opened)."""
    try:
        tokens = np.load(path, mmap_mode='r')
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable .npy array ({e})") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: expected a 1-D uint16 array of token ids, got {tokens.dtype} of shape {tokens.shape}")
    check_vocab(tokens, vocab_size, path)
    return tokens


def check_vocab(tokens, vocab_size, path):
    """An id the model has no embedding for: one line now, not an IndexError (CPU) or a device-side
    assert (CUDA) when a batch reaches it."""
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        i = int(tokens.argmax())
        raise UserError(f"{path}: token id {tokens[i]} (at token {i:,}) is not below the model's vocab_size="
                        f"{vocab_size}: the shard was made with another tokenizer, or vocab_size is too small")


class DataLoaderLite:
    """Batches of B sequences of T tokens from the sorted shards of one split.

    One optimizer step reads one contiguous run of B*T*num_processes*accum_steps tokens (+1 for
    the last target); micro-step m of rank r takes the chunk (m * num_processes + r) of it, so
    ranks read disjoint, interleaved chunks that together cover the run. The position (shard,
    pos) is global, the same on every rank, and moves only at step boundaries: all ranks leave
    a shard at the same step, and the token stream does not depend on the number of processes
    (a shard's tail shorter than one step is skipped)."""

    def __init__(self, B, T, process_rank, num_processes, split, data_root, accum_steps=1, vocab_size=None):
        self.B, self.T, self.vocab_size = B, T, vocab_size
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
        self.tokens = open_shard(self.shards[0], self.vocab_size)

    def state(self):
        """The global position, at a step boundary: the same on every rank, for any world size."""
        return {'shard': self.shard, 'pos': self.pos, 'file': os.path.basename(self.shards[self.shard])}

    def load_state(self, state, source):
        name = os.path.basename(self.shards[state['shard']]) if state['shard'] < len(self.shards) else None
        if name != state['file']:
            raise UserError(f"{source} was reading train shard {state['file']!r} (number {state['shard']}), but "
                            f"that shard of data_root is {name!r}: resume with the same data_root")
        self.shard, self.pos, self.micro = state['shard'], state['pos'], 0
        self.tokens = open_shard(self.shards[self.shard], self.vocab_size)
        self.next_shard_if_short()  # total_batch_size may have grown

    def next_shard_if_short(self):
        if self.pos + self.step_tokens + 1 > len(self.tokens):  # no whole step left in this shard
            self.shard = (self.shard + 1) % len(self.shards)
            self.tokens = open_shard(self.shards[self.shard], self.vocab_size)
            self.pos = 0

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
            self.next_shard_if_short()
        return x, y


def load_val_tokens(data_root, n_tokens, vocab_size=None):
    """The first n_tokens + 1 tokens of the val split, as one uint16 array."""
    parts, need = [], n_tokens + 1
    for path in find_shards(data_root, 'val'):
        parts.append(np.array(open_shard(path)[:need]))
        check_vocab(parts[-1], vocab_size, path)
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


@torch.no_grad()  # and no graph per batch: each would hold its batch's activations and logits
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

def train_step(model, optimizer, scaler, loader, grad_accum_steps, lr, grad_clip, device, dtype, world):
    """One optimizer step over grad_accum_steps micro-batches; returns (mean loss, grad norm, ok,
    overflow). A non-finite loss or gradient norm skips the update (ok=False): both are all-reduced
    values, so every rank skips alike. overflow: float16 gradients overflowed at this loss scale,
    which the scaler then halves (normal loss scaling, not a bad step)."""
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
        scaler.scale(loss).backward()  # float16: the loss scaled up so that small gradients survive
    if world > 1:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_accum /= world
    scaler.unscale_(optimizer)  # float16: the gradients back to their true size, before clipping
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
    finite_loss, finite_norm = torch.stack((torch.isfinite(loss_accum), torch.isfinite(norm))).tolist()  # one wait
    ok = finite_loss and finite_norm
    # an overflow at a scale <= 1 is no loss-scaling matter: it counts as a bad step
    overflow = scaler.is_enabled() and finite_loss and not ok and scaler.get_scale() > 1
    if ok:
        for group in optimizer.param_groups:
            group['lr'] = lr
        optimizer.step()
    scaler.update()  # float16: halve the scale after an overflow, double it after 2000 clean steps
    return loss_accum, norm, ok, overflow


# -----------------------------------------------------------------------------
# checkpoints: everything a run needs to continue exactly, written by rank 0, read by every rank

CHECKPOINT_NAME = re.compile(r'model_(\d+)\.pt')
RESUME_KEYS = ('model', 'optimizer', 'config', 'train_config', 'step', 'evaluated', 'loader', 'rng', 'bad_steps',
               'checksum')
EXIT_PREEMPTED = 75  # SIGTERM: checkpoint written, run the same command again (EX_TEMPFAIL: "try again")
stop_requested = False  # set by SIGTERM; the ranks agree on it at every step boundary


def on_sigterm(signum, frame):
    global stop_requested
    stop_requested = True  # finish the step in flight, then checkpoint and exit


def any_rank(flag, world, device):
    """True on every rank when flag is True on any: decisions that all ranks must take together."""
    if world == 1:
        return flag
    t = torch.tensor(int(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def checksum(obj):
    """The sum of every tensor in obj (nested) read as integers: a byte of a checkpoint flipped or
    zeroed on disk changes it (torch.load checks no CRC: such a file loads without complaint)."""
    if torch.is_tensor(obj):
        t = obj.detach().contiguous().view(-1)
        return t.view(torch.int32 if t.element_size() == 4 else torch.uint8).sum(dtype=torch.int64).item()
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(checksum(v) for v in obj) % 2 ** 62 if isinstance(obj, (list, tuple)) else 0


def list_checkpoints(log_dir):
    """[(step, path)] of the model_NNNNN.pt files in log_dir, newest first."""
    names = os.listdir(log_dir) if os.path.isdir(log_dir) else []
    found = [(int(m.group(1)), os.path.join(log_dir, n)) for n in names if (m := CHECKPOINT_NAME.fullmatch(n))]
    return sorted(found, reverse=True)


def read_checkpoint(path):
    """The checkpoint at path, checked for what resuming needs; ValueError says what is wrong with
    it, OSError that it could not be read.
    Tensors stay memory-mapped (read once for the checksum); their shapes are checked against a
    model and an optimizer built on the meta device (no memory) from the checkpoint's own config."""
    with open(path, 'rb') as f:  # a read error (I/O, permissions) shows here, and proves nothing about the file
        while f.read(1 << 24):
            pass
    try:
        try:
            ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)  # no pickled code runs
        except pickle.UnpicklingError as e:  # torch's advice (weights_only=False) is the one not to take
            why = [line for line in str(e).splitlines() if 'GLOBAL' in line or 'Unsupported' in line]
            raise ValueError(f"it holds pickled objects that a weights-only load refuses ({' '.join(why) or e})") from None
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise ValueError(f"no {', '.join(missing)}: not a checkpoint this trainer can resume from")
        if checksum([v for k, v in ckpt.items() if k != 'checksum']) != ckpt['checksum']:
            raise ValueError("the tensors do not match the checksum written with them: the file is corrupt")
        with torch.device('meta'):
            model = GPT(GPTConfig(**ckpt['config']))
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = {k: tuple(v.shape) for k, v in ckpt['model'].items()}
        if have != want:
            k = next(k for k in sorted(want.keys() | have.keys()) if want.get(k) != have.get(k))
            raise ValueError(f"'model' does not match its config {ckpt['config']}: {k} is {have.get(k)}, expected {want.get(k)}")
        optimizer = model.configure_optimizers(0.0, 0.0, 'cpu')
        optimizer.load_state_dict(ckpt['optimizer'])  # group and parameter counts
        for p, state in optimizer.state.items():
            if state['exp_avg'].shape != p.shape or state['exp_avg_sq'].shape != p.shape:
                raise ValueError(f"'optimizer' state of shape {tuple(state['exp_avg'].shape)} for a parameter of shape {tuple(p.shape)}")
        return ckpt
    except (ValueError, MemoryError):
        raise  # MemoryError: the file may well be fine
    except Exception as e:  # truncated (torch.load says OSError for some cuts), not a zip, wrong keys or shapes
        raise ValueError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None


def pick_checkpoint(log_dir):
    """Rank 0: (step, path, checkpoint) of the newest checkpoint that loads, or (-1, None, None)
    when log_dir holds none. Newer ones that do not load are reported and renamed aside (*.bad),
    out of the way of the next resume and of keep_checkpoints."""
    bad = []
    for step, path in list_checkpoints(log_dir):
        try:
            ckpt = read_checkpoint(path)
        except ValueError as e:
            print(f"warning: cannot resume from {path}: {e}")
            bad.append(path)
            continue
        except (OSError, MemoryError) as e:
            raise UserError(f"cannot read {path} ({type(e).__name__}: {e}); that is no proof the checkpoint is bad, so "
                            f"nothing falls back: fix the cause and run again") from None
        for p in bad:
            aside = next(f"{p}.bad{i or ''}" for i in range(1000) if not os.path.exists(f"{p}.bad{i or ''}"))
            os.replace(p, aside)
            print(f"warning: renamed {p} to {aside}; resuming from the previous checkpoint, {path}")
        return step, path, ckpt
    if bad:
        raise UserError(f"{log_dir!r} holds checkpoints but none can be resumed from (see above): move them "
                        f"away to start afresh, or point log_dir elsewhere")
    return -1, None, None


def find_checkpoint(log_dir, rank, world, device):
    """(path, checkpoint) to resume from, the same on every rank, or (None, None) for a fresh run.
    Rank 0 chooses; the other ranks read the same file (log_dir must be on a filesystem they share)."""
    step, path, ckpt, error = -1, None, None, None
    if rank == 0:
        try:
            step, path, ckpt = pick_checkpoint(log_dir)
        except UserError as e:
            error = str(e)
    failed = error is not None
    if world > 1:
        t = torch.tensor(-2 if failed else step, device=device)
        dist.broadcast(t, 0)
        step = t.item()
        if rank > 0 and step >= 0:
            path = os.path.join(log_dir, f"model_{step:05d}.pt")
            try:
                ckpt = read_checkpoint(path)
            except (ValueError, OSError, MemoryError) as e:
                print(f"error: rank {rank} cannot read {path}: {e}", file=sys.stderr)
                failed = True
        failed = any_rank(failed or step == -2, world, device)
    if failed:
        raise UserError(error or f"another rank could not read {path}: log_dir must be on a filesystem that every node sees")
    return path, ckpt


def rng_state(device):
    """Every random generator's state (the same on every rank: all are seeded and used alike)."""
    np_state = np.random.get_state()
    state = {'torch': torch.get_rng_state(), 'python': random.getstate(),
             'numpy': (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}
    if torch.device(device).type == 'cuda':
        state['cuda'] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state['torch'])
    random.setstate(state['python'])
    name, keys, *rest = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if torch.device(device).type == 'cuda' and 'cuda' in state:
        torch.cuda.set_rng_state(state['cuda'], device)


def trim_lines(path, step_field, keep):
    """Rewrite path (atomically) with only its whole lines whose step (word step_field) passes
    keep(step, words): what a crashed run wrote after its last checkpoint is dropped, and the
    resumed run writes it again."""
    if not os.path.exists(path):
        return
    lines = []
    with open(path) as f:
        for line in f:
            words = line.split()
            try:
                step = int(words[step_field])
            except (ValueError, IndexError):
                continue
            if line.endswith('\n') and keep(step, words):  # a line cut by a crash has no '\n'
                lines.append(line)
    atomic_write(path, lambda f: f.write(''.join(lines).encode()))


def torch_save(obj, f):
    """torch.save into the open file f. A failed write (no space, a quota) raises its OSError:
    torch.save itself would only say 'unexpected pos'."""
    errors = []

    def write(data):
        try:
            return f.write(data)
        except OSError as e:
            errors.append(e)
            raise
    try:
        torch.save(obj, types.SimpleNamespace(write=write, flush=f.flush))
    except RuntimeError:
        if errors:
            raise errors[0] from None
        raise


def save_checkpoint(make_state, rank, world, device):
    """Rank 0 writes log_dir/model_{step:05d}.pt atomically, then deletes the checkpoints beyond
    the newest keep_checkpoints. Every rank learns whether it worked: a failed write (a full
    disk) stops the run, with the earlier checkpoints untouched."""
    error = None
    if rank == 0:
        ckpt = make_state()
        ckpt['checksum'] = checksum(list(ckpt.values()))
        path = os.path.join(log_dir, f"model_{ckpt['step']:05d}.pt")
        for name in ('log.txt', 'samples.txt'):  # the lines the checkpoint vouches for reach the disk first
            if os.path.exists(os.path.join(log_dir, name)):
                with open(os.path.join(log_dir, name), 'a') as f:
                    os.fsync(f.fileno())
        try:  # temporary file, fsync, rename: a checkpoint is whole or absent
            atomic_write(path, lambda f: torch_save(ckpt, f))
        except (OSError, RuntimeError) as e:  # the OS's reason (torch_save), or torch.save's own failure
            error = (f"could not write the checkpoint {path} ({e}); "
                     f"the earlier checkpoints are untouched: fix that (free some space, say) and run the same command again to resume")
        else:
            older = [p for s, p in list_checkpoints(log_dir) if s < ckpt['step']]
            for p in older[max(keep_checkpoints - 1, 0):] if keep_checkpoints > 0 else []:
                os.remove(p)  # only now that a newer one is complete
    if any_rank(error is not None, world, device):
        raise UserError(error or "rank 0 could not write a checkpoint")


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
        store = None
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') == 'True':  # torchrun, its agent's store
            # the store outlives a worker group: a restarted group would read the dead group's keys
            # (a hang or a failed connect); one node's agent counts the attempts, so they key it
            if int(os.environ.get('GROUP_WORLD_SIZE', 1)) == 1:
                store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), world,
                                      is_master=False, timeout=timedelta(minutes=10))
                store = dist.PrefixStore(f"train_gpt2/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
            elif rank == 0 and int(os.environ.get('TORCHELASTIC_MAX_RESTARTS', 0)) > 0:  # nodes count apart
                print("warning: restarts on several nodes: a restarted worker group can read the dead group's keys in "
                      "torchrun's shared store; launch torchrun with --rdzv-backend=c10d and "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each group meets in a new store (see README)")
        dist.init_process_group(backend='nccl' if cuda else 'gloo', store=store, rank=rank, world_size=world,
                                device_id=torch.device(device) if cuda else None)
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
    code = None
    try:
        config = choose_precision(config, rank, world, dev)
        globals().update(config)
        code = run(config, rank, world, dev)
    except UserError as e:
        if master:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if ddp:
            try:
                if code is not None:
                    dist.barrier()  # no rank tears down while rank 0 still writes its last checkpoint
            finally:
                dist.destroy_process_group()
    if code:
        sys.exit(code)


def resumed_model_config(ckpt, path, config, master):
    """The checkpoint's model shape, once the config is known not to change it."""
    old = ckpt['train_config']
    if old.get('init_from') != config['init_from']:
        raise UserError(f"{path} continues a run with init_from={old.get('init_from')!r}, but the config says "
                        f"init_from={config['init_from']!r}: set it back, or point log_dir elsewhere to start afresh")
    have = ckpt['config']
    diff = [k for k in have if config['init_from'] == 'scratch' and config[k] != have[k]]
    if diff:
        raise UserError(f"{path} holds a model with {', '.join(f'{k}={have[k]}' for k in diff)}, but the "
                        f"config asks for {', '.join(f'{k}={config[k]}' for k in diff)}: a run resumes only into the "
                        f"same model shape; set them back, or point log_dir elsewhere to start afresh")
    changed = [f"{k} {old[k]!r} -> {v!r}" for k, v in config.items() if k in old and old[k] != v]
    if master and changed:
        print(f"resuming with changed settings: {', '.join(changed)}")
    return GPTConfig(**have)


def run(config, rank, world, device):
    """Train; returns the exit code: 0, or EXIT_PREEMPTED after a SIGTERM checkpoint."""
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

    # the data first: a missing folder or split is reported before a model is built or downloaded
    for split in ('train', 'val') if eval_interval > 0 else ('train',):
        find_shards(data_root, split)

    # resume="auto": continue from the newest checkpoint of log_dir that loads (a restarted job
    # with an unchanged command line resumes by itself); none there: a fresh run
    found = list_checkpoints(log_dir)
    if resume == 'never' and found:
        raise UserError(f"{log_dir!r} holds checkpoints of an earlier run ({found[0][1]}) and "
                        f"resume='never': point log_dir elsewhere, or move them away")
    ckpt_path, ckpt = find_checkpoint(log_dir, rank, world, device)

    if ckpt is not None:  # the weights come from the checkpoint: nothing to download
        model = GPT(resumed_model_config(ckpt, ckpt_path, config, master))
    elif init_from == 'scratch':
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
    vocab = model.config.vocab_size  # every token id is checked against it as a shard is opened
    train_loader = DataLoaderLite(B, T, rank, world, 'train', data_root, grad_accum_steps, vocab)
    val_data = load_val_tokens(data_root, val_tokens // T * T, vocab) if eval_interval > 0 else None
    model.to(device)
    raw_model = model  # plain module: state_dict without prefixes, generation, evaluation
    optimizer = raw_model.configure_optimizers(weight_decay, max_lr, device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')  # a no-op in other precisions
    start, evaluated, bad_steps = 0, False, 0
    if ckpt is not None:
        raw_model.load_state_dict(ckpt['model'])
        if ckpt.get('scaler'):  # a float16 run's loss scale (empty in other precisions)
            scaler.load_state_dict(ckpt['scaler'])
        decay = [group['weight_decay'] for group in optimizer.param_groups]
        optimizer.load_state_dict(ckpt['optimizer'])
        for group, wd in zip(optimizer.param_groups, decay):
            group['weight_decay'] = wd  # the config's, should it have changed
        for st in optimizer.state.values():  # on CPU these would alias the checkpoint's memory map
            st.update({k: v.clone() for k, v in st.items() if torch.is_tensor(v) and v.device.type == 'cpu'})
        train_loader.load_state(ckpt['loader'], ckpt_path)
        set_rng_state(ckpt['rng'], device)
        start, evaluated, bad_steps = ckpt['step'], ckpt['evaluated'], ckpt['bad_steps']
        if bad_steps >= max_bad_steps:  # not for an automatic restart to push on: a person decides
            raise UserError(f"{ckpt_path} was written after {bad_steps} steps in a row with a non-finite loss or "
                            f"gradient norm, and max_bad_steps={max_bad_steps}: to go on (after lowering max_lr, say), "
                            f"raise max_bad_steps above {bad_steps}, or point log_dir elsewhere to start afresh")
        del ckpt  # the memory map
        if master:
            print(f"resuming from {ckpt_path}: step {start}, train data at {train_loader.state()['file']} "
                  f"token {train_loader.pos:,}")
        if start > max_steps or (start == max_steps and evaluated):
            if master:
                print(f"nothing to do: {ckpt_path} is step {start} and max_steps={max_steps}; raise max_steps to "
                      f"train on, or point log_dir elsewhere to start afresh")
            return 0
    if master:
        print(f"parameters: {sum(p.numel() for p in raw_model.parameters()):,}")
    if compile:
        model = torch.compile(model)
    eval_model = model  # not DDP-wrapped: ranks may run different numbers of eval batches
    if world > 1:
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == 'cuda' else None)
    hella_data = load_hellaswag(hellaswag_file, raw_model, rank, world, device) if hellaswag and eval_interval > 0 else None

    log_file = os.path.join(log_dir, 'log.txt')
    if master:
        os.makedirs(log_dir, exist_ok=True)
        for tmp in glob.glob(os.path.join(glob.escape(log_dir), 'model_*.pt.tmp*')):
            os.remove(tmp)  # a checkpoint write that a crash cut short
        # drop the lines a crashed run wrote after the checkpoint (all of them for a fresh run):
        # no step is logged twice; the val/hella lines of the checkpoint's own step stay when it has them
        trim_lines(log_file, 0, lambda s, words: s < start or (s == start and evaluated and words[1:2] in (['val'], ['hella'])))
        trim_lines(os.path.join(log_dir, 'samples.txt'), 1, lambda s, words: s < start or (s == start and evaluated))

    def log(line):
        with open(log_file, 'a') as f:
            f.write(line + '\n')

    def checkpoint_state(step, val_loss, evaluated):  # rank 0; 'model', 'config', 'step', 'val_loss' as build-nanogpt's
        return {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'config': asdict(raw_model.config),
                'train_config': config, 'step': step, 'val_loss': val_loss, 'evaluated': evaluated,
                'loader': train_loader.state(), 'rng': rng_state(device), 'bad_steps': bad_steps,
                'scaler': scaler.state_dict()}

    # step = number of optimizer updates done: eval, sample and checkpoint the model as it is
    # after `step` updates, then (unless it is the last) take the update step -> step + 1
    signal.signal(signal.SIGTERM, on_sigterm)  # from here on, SIGTERM stops at the next step boundary with a checkpoint
    for step in range(start, max_steps + 1):
        last_step = step == max_steps
        checkpoint = last_step or (checkpoint_interval > 0 and step > 0 and step % checkpoint_interval == 0)
        do_eval = eval_interval > 0 and (step % eval_interval == 0 or last_step or checkpoint)  # a checkpoint has its own
        do_sample = sample_interval > 0 and step > 0 and (step % sample_interval == 0 or last_step)
        done = step == start and evaluated  # resumed from a checkpoint that did this step's evals
        stop = any_rank(stop_requested, world, device)  # SIGTERM during the last step: no evals, checkpoint now
        busy = not done and not stop and (do_eval or do_sample or checkpoint)  # the same on every rank
        val_loss = None
        if busy and do_eval:
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
        if busy and do_sample and master:
            sample(raw_model, step, device)
        if busy and checkpoint:
            save_checkpoint(lambda: checkpoint_state(step, val_loss, True), rank, world, device)
        if busy:
            stop = any_rank(stop_requested, world, device)  # SIGTERM during the evals
        if stop and not (last_step and busy):  # preemption (at the last step: the run is complete)
            if not done and not (busy and checkpoint):  # the state after `step` updates, its evals done or not
                save_checkpoint(lambda: checkpoint_state(step, val_loss, busy), rank, world, device)
            if master:
                print(f"SIGTERM: stopped at step {step}; wrote {os.path.join(log_dir, f'model_{step:05d}.pt')}; run "
                      f"the same command again to resume (exit code {EXIT_PREEMPTED})")
            return EXIT_PREEMPTED
        if last_step:
            break

        t0 = time.time()
        lr = get_lr(step, max_lr, min_lr, warmup_steps, max_steps)
        loss, norm, ok, overflow = train_step(model, optimizer, scaler, train_loader, grad_accum_steps, lr, grad_clip,
                                              device, dtype, world)
        loss = loss.item()
        dt = time.time() - t0
        bad_steps = 0 if ok else bad_steps if overflow else bad_steps + 1  # an overflow is neither
        if master:
            tok_per_sec = total_batch_size / dt
            print(f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm.item():.4f} | "
                  f"dt {dt * 1000:.2f}ms | tok/sec {tok_per_sec:.2f}" +
                  ("" if ok else f" | float16 overflow: update skipped, loss scale now {scaler.get_scale():g}" if overflow
                   else f" | non-finite: update skipped ({bad_steps} in a row, max_bad_steps={max_bad_steps})"))
            log(f"{step} train {loss:.6f}")
            if overflow:
                log(f"{step} overflow {scaler.get_scale():g}")
            elif not ok:
                log(f"{step} skip {bad_steps}")

        if bad_steps >= max_bad_steps:  # stop with a checkpoint: the weights are the last good update's
            save_checkpoint(lambda: checkpoint_state(step + 1, None, False), rank, world, device)
            raise UserError(f"stopped after {bad_steps} steps in a row with a non-finite loss or gradient norm "
                            f"(max_bad_steps={max_bad_steps}); {os.path.join(log_dir, f'model_{step + 1:05d}.pt')} "
                            f"holds the last good weights, with the data position after the skipped batches; "
                            f"lower max_lr or check the data, then raise max_bad_steps to resume from it")
    return 0


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
