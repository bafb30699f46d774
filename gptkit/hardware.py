"""
The device this process computes on: which one ("auto"), in which precision (dtype "auto",
autocast), what its CPU can do (bf16 units), and how fast it
multiplies (peak FLOP/s for MFU). docs/precision.md tells why each choice is made.
"""
import torch

from gptkit.common import UserError

PRECISIONS = ('float32', 'float16', 'bfloat16')  # from the least capable hardware to the most
AUTOCAST_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


def device_type(device):
    """'cpu', 'cuda', 'mps', ... of a device name; a malformed one is a UserError naming it."""
    if isinstance(device, str):
        try:
            return torch.device(device).type
        except RuntimeError:
            pass
    raise UserError(f"device must be auto, cpu, cuda, cuda:N or mps, got {device!r}")


def pick_device(device, local_rank=None):
    """The device to compute on: "auto" made concrete (cuda > mps > cpu), a GPU with its index
    (cuda:0; under torchrun, local_rank given, cuda:LOCAL_RANK whatever was asked: one GPU per
    process), checked: a malformed name or a device that is not here is a UserError naming the
    devices there are, not CUDA's traceback from deep inside the first tensor moved."""
    picked = device if device != 'auto' else (
        'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu')
    kind = device_type(picked)
    if kind == 'cpu':  # always here, and shared by the processes of a node
        return picked
    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    torchrun = kind == 'cuda' and local_rank is not None
    if torchrun:  # one GPU per process
        picked = f'cuda:{local_rank}'
    elif picked == 'cuda':  # set_device needs an index
        picked = 'cuda:0'
    n_gpus = torch.cuda.device_count() if cuda else 0
    if kind == 'cuda' and torch.device(picked).index >= n_gpus:
        why = (f"this torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
               else f"torch sees {n_gpus or 'no'} CUDA GPU{'s' * (n_gpus > 1)}")
    elif kind == 'mps' and not mps:
        why = "torch sees no Apple GPU"
    else:
        return picked
    here = ['cpu'] + [f'cuda:{i}' for i in range(n_gpus)] + ['mps'] * mps
    asked = repr(device) + (f" ({picked} for torchrun's LOCAL_RANK={local_rank})" if torchrun else "")
    raise UserError(f"device={asked} is not on this machine ({why}); devices here: {', '.join(here)} "
                    f"(device='auto' picks the best of them)")


def autocast(device, dtype):
    """Autocast to dtype ("bfloat16" or "float16") on device; a no-op context for "float32"."""
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES.get(dtype, torch.bfloat16),
                          enabled=dtype in AUTOCAST_DTYPES)


def cpu_has_bf16():
    """True where this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 units) and oneDNN uses
    them; elsewhere (AVX2-only CPUs, ARM here) bf16 matmuls are emulated, far slower than float32
    (docs/precision.md has a measure)."""
    caps = torch.cpu.get_capabilities()
    try:  # the units, and a oneDNN that uses them
        return bool(caps.get('avx512_bf16') or caps.get('amx_bf16') or torch.cpu._is_avx512_bf16_supported()
                    or torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_dtype(dtype, device):
    """(dtype, why): "auto" made concrete for device (a name as pick_device gives it), the same answer
    on every call."""
    if dtype != 'auto':
        return dtype, 'as configured'
    if device.startswith('cpu'):
        return (('bfloat16', 'auto: this CPU has bf16 units, AVX512-BF16 or AMX') if cpu_has_bf16() else
                ('float32', 'auto: this CPU has no bf16 units; bf16 would be emulated, ~100x slower'))
    if device.startswith('cuda'):
        cc = torch.cuda.get_device_capability(device)
        gpu = f'auto: {torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})'
        if cc >= (8, 0):  # Ampere and newer: bf16 tensor cores, float32's range, no loss scaling
            return 'bfloat16', f'{gpu} has bf16'
        return 'float16', f'{gpu} has no bf16; float16 with loss scaling'
    # MPS: float16 gains memory but no arithmetic speed on Apple GPUs and needs loss scaling; bf16
    # needs macOS 14: float32 is the choice that works everywhere
    return 'float32', f'auto: float32 on {torch.device(device).type}'


def choose_precision(config, device):
    """The config with dtype and compile made concrete for this device ("auto"), the same on every
    rank; rank 0 says what it chose and why."""
    from gptkit import distributed  # the trainer's path only: the tools need none of DDP's and FSDP's imports
    dtype, why = resolve_dtype(config['dtype'], device)
    least = PRECISIONS[distributed.min_over_ranks(PRECISIONS.index(dtype))]  # every rank must compute alike
    if least != dtype:
        dtype = least
        why = 'auto: the choice of a rank whose hardware has less'
    if distributed.rank() == 0:
        print(f"precision: {dtype} ({why}){', with loss scaling' if dtype == 'float16' else ''}")
        if dtype == 'bfloat16' and device.startswith('cpu') and not cpu_has_bf16():
            print("warning: this CPU has no bf16 units: bfloat16 is emulated, ~100x slower than float32 "
                  "(dtype='auto' picks float32 here)")
    return dict(config, dtype=dtype,  # compile "auto": on CUDA only
                compile=device.startswith('cuda') if config['compile'] == 'auto' else config['compile'])


def sync(device):
    """Wait for the device's queued work (for timing)."""
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    elif device == 'mps':
        torch.mps.synchronize()


# dense bf16/fp16 tensor-core peaks from NVIDIA's datasheets (FLOP/s), the first name that matches
GPU_PEAK_FLOPS = {'H200': 989e12, 'H100 PCIe': 756e12, 'H100 NVL': 835e12, 'H100': 989e12, 'A100': 312e12,
                  'L40S': 362e12, 'L40': 181e12, 'A10G': 70e12, 'A10': 125e12, 'L4': 121e12,
                  'RTX 4090': 165e12, 'RTX 3090': 71e12, 'V100': 125e12, 'B200': 2250e12}


def matmul_flops(device, dtype, n=None, reps=10):
    """FLOP/s of an n x n @ n x n matmul in dtype on device (bf16/fp16 inputs, as autocast makes them)."""
    import time
    n = n or (8192 if device.startswith('cuda') else 2048)
    a, b = torch.randn(2, n, n, device=device, dtype=AUTOCAST_DTYPES.get(dtype, torch.float32))
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def peak_flops(device, dtype):
    """(FLOP/s, where from) for MFU: a known NVIDIA GPU's datasheet peak in bf16/fp16, else a matmul
    measured now (float32, other GPUs, Apple's); on a CPU (None, why): no peak there holds still."""
    if device == 'cpu':  # a matmul timed at start moved 5x between runs on one machine: MFUs over 100%
        return None, ("not shown on a CPU: its matmul rate moves with the load, the threads and the "
                      "shapes, so no peak holds; tok/sec is the figure to compare")
    if device.startswith('cuda') and dtype in AUTOCAST_DTYPES:
        import re
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS.items():  # the longer names first: 'L40' before 'L4'
            if re.search(rf"\b{key}\b", name):
                return flops, f"{name} datasheet"
    return matmul_flops(device, dtype, n=4096, reps=5), "measured matmul"
