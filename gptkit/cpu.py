"""
The CPU's own speed tricks, in one place: a GPU never runs any of this, and none of it changes what
is computed, only how fast a CPU computes it (docs/benchmarks.md has the figures). The trainer and
the tools call each in one line that says it is for the CPU.
"""
import ctypes
import os
import sys
import tempfile

# torch.compile's kernel cache does not tell a process whose ATen kernels are forced to one CPU
# capability (ATEN_CPU_CAPABILITY=avx2, how the tests play an AVX2-only CPU) from a native one:
# kernels cached by one gave NaNs from step 0, or a corrupted heap, in the other. Such a process
# gets a cache of its own (read by inductor when it compiles, after the trainer imports this).
if os.environ.get('ATEN_CPU_CAPABILITY') and 'TORCHINDUCTOR_CACHE_DIR' not in os.environ:
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getattr(os, 'getuid', int)()}_{os.environ['ATEN_CPU_CAPABILITY']}")


def reuse_freed_memory():
    """CPU on Linux: glibc hands every large tensor (the logits: B*T*vocab floats) back to the OS
    when it is freed, and the next step page-faults gigabytes of zeroed pages back in: on a CPU
    that system time can be half the step. Serve large blocks from the heap and never trim it
    instead: faster steps for more peak memory (docs/benchmarks.md)."""
    if not sys.platform.startswith('linux'):
        return
    mallopt = getattr(ctypes.CDLL(None), 'mallopt', None)  # glibc; absent on musl
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, -1)  # -1 is SIZE_MAX to glibc: never trim
