"""The ways the host reads a tensor's values, for every probe of the suite that counts them (a
TorchFunctionMode sees each as the function called; a read inside another is not seen, so the outer one
is here: f"{loss:.4f}" is Tensor.__format__, which reads through item()).

Always a read: READS (a Python number or bool; nonzero and masked_select, whose size the host must
learn) and indexing by a bool mask. A move to the host waits unless asked not to; the tests run on a CPU,
where host and device are one, so the probe goes by what the call asks for: .cpu(), .to() naming the
CPU, copy_() into a CPU tensor, without non_blocking=True. Not counted: torch's own moves (clip_grad_norm_
keeps each norm on its device) and gptkit/cpu.py's, which a GPU never runs."""
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from gptkit import cpu

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.cpu, T.numpy, T.__format__,
         T.__repr__, T.__array__, torch.equal, T.equal, torch.allclose, T.allclose, torch.nonzero, T.nonzero,
         torch.masked_select, T.masked_select}
NOT_MOVES = (os.path.dirname(torch.__file__) + os.sep, cpu.__file__)


def reads(func, args, kwargs, caller):
    """Whether func(*args, **kwargs), called from the file caller, reads values to the host."""
    if func in (T.__getitem__, T.__setitem__):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
    if func not in (T.to, T.copy_) or kwargs.get("non_blocking") or caller.startswith(NOT_MOVES):
        return func in READS
    if func is T.copy_:
        return args[0].is_cpu
    to = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device, T))), None))
    return to is not None and (to.is_cpu if torch.is_tensor(to) else torch.device(to).type == "cpu")


class HostReads(TorchFunctionMode):
    """While on (a mode: `with HostReads() as mode`, or __enter__), seen lists every host read, by
    name, except while paused (a probe's own work)."""

    def __init__(self):
        super().__init__()
        self.seen, self.paused = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused and reads(func, args, kwargs, sys._getframe(1).f_code.co_filename):
            self.seen.append(func.__name__)
        return func(*args, **kwargs)
