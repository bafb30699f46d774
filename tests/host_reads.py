"""The ways the host reads a tensor's values, for every probe of the suite that counts them (a
TorchFunctionMode sees each as the function called). A read inside another one is not seen (the mode
is off while a function runs), so the outer one must be here: f"{loss:.4f}" is Tensor.__format__,
which reads through item() within it; repr() and np.asarray() likewise.

Some calls always wait for the values: those in READS (a Python number or bool; nonzero and
masked_select, whose size the host must learn), and indexing by a bool mask (to read or to write),
which runs nonzero.
A move to the host waits unless it is asked not to, but the tests run on a CPU, where the host and
the device are one, so the probe goes by what the call asks for: .cpu(), and .to() naming the CPU or
copy_() into a CPU tensor without non_blocking=True. Torch's own moves are not counted: they keep a
tensor on its device (clip_grad_norm_ moves each norm to the first one's). Nor are gptkit/cpu.py's,
which a GPU never runs: on a CPU they copy between the step's own tensors."""
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
