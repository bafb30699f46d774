"""The ways the host reads a tensor's values, one list for every probe of the suite that counts
them (a TorchFunctionMode sees each as the function called). A read inside another one is not
seen (the mode is off while a function runs), so the outer one must be here: f"{loss:.4f}" is
Tensor.__format__, which reads through item() within it; repr() and np.asarray() likewise."""
import torch
from torch.overrides import TorchFunctionMode

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.cpu, T.numpy, T.__format__,
         T.__repr__, T.__array__}


class HostReads(TorchFunctionMode):
    """While on (a mode: `with HostReads() as mode`, or __enter__), seen lists every host read, by
    name, except while paused (a probe's own work)."""

    def __init__(self):
        super().__init__()
        self.seen, self.paused = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS and not self.paused:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))
