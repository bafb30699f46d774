"""
The CPU's own speed tricks, in one place: a GPU never runs any of this, and none of it changes what
is computed, only how fast a CPU computes it (docs/benchmarks.md has the figures). The trainer and
the tools call each in one line that says it is for the CPU.
"""
import ctypes
import os
import sys

import torch
from torch.nn import functional as F

# torch.compile's kernel cache does not tell a process whose ATen kernels are forced to one CPU
# capability (ATEN_CPU_CAPABILITY=avx2, how the tests play an AVX2-only CPU) from a native one:
# kernels cached by one gave NaNs from step 0, or a corrupted heap, in the other. Such a process
# gets a cache of its own (read by inductor when it compiles, after the trainer imports this).
if os.environ.get('ATEN_CPU_CAPABILITY') and 'TORCHINDUCTOR_CACHE_DIR' not in os.environ:
    import tempfile
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.path.join(tempfile.gettempdir(), (
        f"torchinductor_{getattr(os, 'getuid', int)()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


def reuse_freed_memory():
    """CPU on Linux: glibc hands every large tensor (the logits: B*T*vocab floats) back to the OS
    when it is freed, and the next step page-faults gigabytes of zeroed pages back in: on a CPU
    that system time can be half the step. Serve large blocks from the heap and never trim it
    instead: faster steps for more peak memory (docs/benchmarks.md)."""
    # glibc's (absent on musl; and not on Windows or macOS)
    mallopt = getattr(ctypes.CDLL(None), 'mallopt', None) if sys.platform.startswith('linux') else None
    if mallopt is not None:
        mallopt(-4, 0)  # M_MMAP_MAX = 0: large blocks come from the heap too, never from mmap
        mallopt(-1, -1)  # M_TRIM_THRESHOLD = -1, SIZE_MAX to glibc: the heap is never trimmed


# -----------------------------------------------------------------------------
# training: the output layer and the loss in one pass (fuse_loss, on a CPU)

def fuse_loss(model):
    """On a CPU: the model's training loss (grad on, the mean loss, not compiled) goes through
    LinearCrossEntropy, the output layer and the loss in one pass; every other call is GPT.forward's
    own. The instance's forward, set here, comes before the class's: model.py stays as a reader expects
    it, and a GPU never runs this. Compiled, inductor fuses F.cross_entropy by itself."""
    def forward(idx, targets=None, dropout_keys=None, **kw):
        if targets is None or kw or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return type(model).forward(model, idx, targets, dropout_keys=dropout_keys, **kw)
        h = model.hidden_states(idx, dropout_keys=dropout_keys).flatten(0, 1)  # (B * T, C)
        return None, LinearCrossEntropy.apply(h, model.lm_head.weight, targets.reshape(-1))
    model.forward = forward


class LinearCrossEntropy(torch.autograd.Function):
    """Training loss: the mean cross-entropy of the output layer's logits h @ weight.T, which
    computes their gradient in the forward pass. The logits (N, V) are the one large tensor: each
    block of rows turns into softmax - onehot in place while it is in cache, and the backward is
    two matmuls. F.linear + F.cross_entropy allocate and stream over four (N, V) tensors (logits,
    log-probabilities, and two gradients) instead: on a CPU this step is faster and peaks lower
    (bench.py; the figures are in docs/benchmarks.md). Same loss and gradients, to float rounding."""

    @staticmethod
    def forward(ctx, h, weight, targets):  # h (N, C), weight (V, C), targets (N,)
        logits = F.linear(h, weight)  # (N, V), in autocast's dtype
        N, V = logits.shape
        rows = max(1, (2 ** 21 if logits.is_cpu else 2 ** 28) // V)  # CPU: ~8 MB of float32, in cache
        loss = torch.zeros((), device=h.device)
        for i in range(0, N, rows):
            block = logits[i:i + rows]
            x = block.float()  # block itself in float32, else a float32 copy: exp and sums in float32
            t = targets[i:i + rows, None]
            lse = torch.logsumexp(x, dim=1, keepdim=True)
            loss += (lse - x.gather(1, t)).sum()
            x.sub_(lse).exp_()  # softmax
            x.scatter_add_(1, t, torch.full_like(t, -1, dtype=x.dtype))  # - onehot
            if x is not block:
                block.copy_(x)
        # the 1/N and the loss scale wait for the backward: in float16, (softmax - onehot) / N
        # of a large batch would underflow, as F.cross_entropy's gradient does before scaling
        ctx.save_for_backward(h, weight, logits)
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, grad = ctx.saved_tensors  # grad (N, V): softmax - onehot
        scale = grad_loss / grad.size(0)
        grad_h = (grad @ weight.to(grad.dtype)).mul_(scale)  # (N, C)
        # h scaled first, as F.cross_entropy's float16 gradient is
        grad_w = grad.t() @ (h.to(grad.dtype) * scale)  # (V, C)
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None

