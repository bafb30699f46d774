"""
The CPU's own speed tricks, in one place: a GPU never runs any of this, and none of it changes
what is computed, only how fast (docs/benchmarks.md has the figures).
"""
import ctypes
import os
import sys
import types

import torch
from torch.nn import functional as F

# inductor's kernel cache does not tell a process forced to one CPU capability (ATEN_CPU_CAPABILITY:
# the tests play an AVX2-only CPU) from a native one, and shared kernels gave NaNs: a cache of its own
if os.environ.get('ATEN_CPU_CAPABILITY') and 'TORCHINDUCTOR_CACHE_DIR' not in os.environ:
    import tempfile
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.path.join(tempfile.gettempdir(), (
        f"torchinductor_{getattr(os, 'getuid', int)()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


def speed_up(model, reuse_memory):
    """The trainer's CPU tricks: the fused training loss, and large freed blocks kept for reuse."""
    fuse_loss(model)
    if reuse_memory:
        reuse_freed_memory()


def reuse_freed_memory():
    """glibc gives each large freed tensor (the logits) back to the OS, and paging it back in can take
    half a CPU step: keep large blocks in a heap that is never trimmed, for more peak memory."""
    mallopt = getattr(ctypes.CDLL(None), 'mallopt', None) if sys.platform.startswith('linux') else None
    if mallopt is not None:
        mallopt(-4, 0)  # M_MMAP_MAX = 0: large blocks come from the heap too, never from mmap
        mallopt(-1, -1)  # M_TRIM_THRESHOLD = -1, SIZE_MAX to glibc: the heap is never trimmed


def fuse_loss(model):
    """The training loss (grad on, eager) through LinearCrossEntropy; any other call is GPT's own.
    Set on the instance, so model.py stays plain; compiled, inductor fuses the loss by itself."""
    def forward(self, idx, targets=None, dropout_keys=None, **kw):
        if targets is None or kw or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return type(self).forward(self, idx, targets, dropout_keys=dropout_keys, **kw)
        h = self.hidden_states(idx, dropout_keys=dropout_keys).flatten(0, 1)  # (B * T, C)
        return None, LinearCrossEntropy.apply(h, self.lm_head.weight, targets.reshape(-1))
    # a method, not a closure over model: copy.deepcopy (an EMA) binds the copy's to the copy
    model.forward = types.MethodType(forward, model)


class LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of the logits h @ weight.T, its gradient made in the forward: each block
    of rows turns into softmax - onehot in place while in cache, where F.cross_entropy streams four
    (N, V) tensors. On a CPU: faster, a lower peak; the same loss and gradients, to float rounding."""

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

