"""
The micro-batch that fits the device (B = "auto"), and the one line for running out of memory.

What one process holds while it trains is counted, not tried (no trial step, no recompile):
- the state: float32 weights, gradients and AdamW's two moments, 16 bytes a parameter under DDP
  (gradients in DDP's buckets, no second copy); under FSDP 16/world_size, plus 4 for the whole
  gradients accumulated between micro-steps or the whole weights gathered for the evals;
- the activations autograd saves for one micro-batch, counted on fake tensors (no memory, no
  compute) for the blocks: every block saves the same, so 1 and 2 blocks at B = 1 and 2 give
  any depth and any B;
- the loss over the B*T*vocab_size logits, the largest tensors of a step, at its peak on each path;
- OVERHEAD: what no count sees (cuBLAS workspaces, the allocator's rounding, temporaries).
It fits when that is at most HEADROOM of the memory the device has free. docs/fsdp.md has the
choices for 24, 40 and 80 GB GPUs and how the figures were measured.
"""
import dataclasses
import functools
import os
import re

import torch

from gptkit.distributed import min_over_ranks

HEADROOM = 0.9  # of the free memory: fragmentation and every rank's own extras
OVERHEAD = {'cuda': 2.5e9, 'mps': 1.0e9, 'cpu': 0.3e9}  # bytes; H200, 124M, B=64: 2.2 GB past the count
# the CPU's peak RSS over the count: the backward's passing gradients and glibc's heap; measured
# 1.06-1.26x with glibc's defaults (tests/test_memory.py), and cpu_reuse_memory keeps freed blocks
# (+25%, docs/benchmarks.md)
ACTIVATIONS_TIMES = {'cpu': 1.5}  # on a GPU the logits' bytes below are measured peaks: 1
# peak bytes per logit of the loss on a GPU (F.cross_entropy), fitted to the H200's max_memory_allocated
# at 124M, B=64 (docs/benchmarks.md): eager keeps the float32 log-probabilities (4) and its backward makes
# two more float32 tensors (8): 61,007 MiB (build-nanogpt's step, the same loss); compiled, inductor's
# fused kernels peak near 6: 42,222 MiB. On a CPU the fused loss (gptkit/cpu.py) keeps the logits in
# autocast's dtype: counted exactly.
GPU_LOGIT_BYTES = {True: 6, False: 12}  # compiled: bytes
MAX_B = 64


def free_and_total(device):
    """(bytes free, bytes in all) on device: CUDA's driver figures, MPS's recommended maximum, or
    the RAM Linux says is available (else all of it)."""
    kind = torch.device(device).type
    if kind == 'cuda':  # under set_per_process_memory_fraction: that share of it, less what torch holds
        free, total = torch.cuda.mem_get_info(device)
        cap = torch.cuda.get_per_process_memory_fraction(device) * total
        return min(free, cap - torch.cuda.memory_reserved(device)), min(total, cap)
    if kind == 'mps':
        total = torch.mps.recommended_max_memory()
        return total - torch.mps.driver_allocated_memory(), total
    total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    try:
        with open('/proc/meminfo') as f:
            return int(re.search(r'MemAvailable:\s+(\d+) kB', f.read()).group(1)) * 1024, total
    except (OSError, AttributeError):
        return total, total


def saved_bytes(model_config, B, T, dtype, head=False):
    """Bytes autograd saves in one forward of B sequences of T tokens, counted on fake tensors: the
    blocks and the final layer norm (hidden_states), or with head the whole CPU training forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from model import GPT
    saved = {}

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # the parameters are the state, not activations
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(model_config)
        if head:  # the trainer's CPU loss: the output layer and the loss in one pass (gptkit/cpu.py)
            from gptkit.cpu import fuse_loss
            fuse_loss(model)
        x = torch.zeros(B, T, dtype=torch.long)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype != 'float32'):  # fp16 saves as bf16
            model(x, x) if head else model.hidden_states(x)
    return sum(saved.values())


def activations(model_config, T, dtype, device, compiled):
    """(fixed, per_sequence): the activations of a micro-batch of B sequences are fixed + B * per_sequence
    bytes: the blocks' as counted (1 and 2 blocks at B = 1 and 2: every block saves the same) and the
    loss's over the logits, as the device's path keeps them (see GPU_LOGIT_BYTES)."""
    def blocks(B):  # all n_layer blocks at B: the first block, and the second one's bytes for each other
        one, two = (saved_bytes(dataclasses.replace(model_config, n_layer=n), B, T, dtype) for n in (1, 2))
        return one + (model_config.n_layer - 1) * (two - one)
    b1 = blocks(1)
    b2 = blocks(2)
    logit = GPU_LOGIT_BYTES[bool(compiled)]
    if torch.device(device).type == 'cpu':  # the fused loss keeps the logits in autocast's dtype
        logit = 4 if dtype == 'float32' else 2
    loss = T * (model_config.vocab_size * logit + model_config.n_embd * 4)  # the logits, and the float32 h
    return 2 * b1 - b2, b2 - b1 + loss


def estimate(model_config, T, dtype, device, compiled, world=1, fsdp=False):
    """B -> bytes one process needs to train with micro-batch B (see the top of this file)."""
    state = parameter_count(model_config) * (16 / world + 4 if fsdp else 16)
    kind = torch.device(device).type
    fixed, per_seq = activations(model_config, T, dtype, device, compiled)
    times = ACTIVATIONS_TIMES.get(kind, 1)
    overhead = OVERHEAD.get(kind, OVERHEAD['cuda'])
    return lambda B: state + times * (fixed + B * per_seq) + overhead


def parameter_count(model_config):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from model import GPT
    with FakeTensorMode():
        return sum(p.numel() for p in GPT(model_config).parameters())


def micro_batch(c, model_config, device, world=1, free=None):
    """(B, line) for the run configured as c (its B, total_batch_size, T, dtype, compile and
    parallel, dtype and compile concrete) with a model shaped as model_config: c's B if a number
    (line None); for "auto" the largest B that divides a rank's share of total_batch_size, is at
    most MAX_B and fits the device's free memory (free: bytes, else asked of the device) on every
    rank, and the line that says why. Every rank calls it. Also the plan, what it saw, for the
    out-of-memory line: {'need': B -> bytes, 'free', 'total', 'device', 'fsdp', 'divisors': the B that
    divide a rank's share of total_batch_size, up to MAX_B}."""
    B, T, fsdp = c['B'], c['T'], c['parallel'] == 'fsdp' and world > 1  # one process: FSDP is off
    # counted when first asked: at the start for "auto", else only if memory runs out (it takes ~1 s)
    counted = functools.cache(lambda: estimate(model_config, T, c['dtype'], device, c['compile'] is True,
                                               world, fsdp))
    need = lambda b: counted()(b)  # bytes at B = b
    free, total = free_and_total(device) if free is None else (free, free)
    share = max(1, c['total_batch_size'] // (T * world))  # a rank's sequences per step
    plan = dict(need=need, free=free, total=total, device=device, fsdp=fsdp,
                divisors=[b for b in range(1, min(MAX_B, share) + 1) if share % b == 0])
    if B != 'auto':
        return B, None, plan
    fits = fitting_B(plan)
    mine = fits or 1
    B = min_over_ranks(mine)  # the rank with the least memory decides
    more = min((b for b in plan['divisors'] if b > B), default=None)
    line = (f"B={B} (auto): {need(B) / 1e9:.1f} GB needed of {free / 1e9:.1f} GB free on {device} "
            f"({total / 1e9:.1f} GB)")
    if more:
        line += f", B={more} would need {need(more) / 1e9:.1f}"
    else:
        line += ", all of a rank's share of total_batch_size"
    if B < mine:
        line += f"; another rank has less free memory (B={mine} fits here)"
    if not fits:
        line += "; even B=1 does not fit by the estimate"
    return B, line, plan


def micro_batch_of(c, device):
    """micro_batch for a whole config c with its dtype and compile made concrete, in one process
    (bench.py, gpu_check.py): c with B a number, and the line, printed."""
    from model import GPTConfig
    B, line, _ = micro_batch(c, GPTConfig.from_dict(c), device)
    if line:
        print(line)
    return dict(c, B=B)


def fitting_B(plan):
    """The largest B, a divisor of the share at most MAX_B, that fits plan's free memory; or 0."""
    return max((b for b in plan['divisors'] if plan['need'](b) <= HEADROOM * plan['free']), default=0)


def out_of_memory(B, plan=None):
    """The one line for the device out of memory at micro-batch B (gptkit/run.py:Run.excepthook prints it)."""
    if not plan:  # B is a number: nothing was counted
        return (f"error: out of memory at B={B} on the device: lower B, or free the device's memory "
                f"(the last checkpoint stands)")
    where = f"{plan['device']} ({plan['total'] / 1e9:.1f} GB, {plan['free'] / 1e9:.1f} free at the start)"
    fits = fitting_B(plan)
    if fits >= B:  # the estimate said B fits (fragmentation, another process): the next B down
        fits = max((b for b in plan['divisors'] if b < B), default=0)
        advice = f"the estimate said B={B} fits, so try B={fits}" if fits else "B=1 does not fit"
    else:
        advice = f"B={fits} fits by the estimate" if fits else "even B=1 does not fit by the estimate"
    if fits:
        advice += f": run the same command with --B={fits}"
    elif plan['fsdp']:
        advice += ": more GPUs or a smaller model"
    else:
        advice += ": parallel='fsdp' under torchrun shards the state"
    return f"error: out of memory at B={B} on {where}: {advice} (the last checkpoint stands)"
