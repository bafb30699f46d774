"""The device, its precision (dtype "auto", autocast) and its peak FLOP/s for MFU; why: docs/precision.md."""
import platform

import torch

from gptkit.common import UserError

PRECISIONS = ('float32', 'float16', 'bfloat16')  # from the least capable hardware to the most
AUTOCAST_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


def device_type(device):
    try:  # str(): torch.device(0) would be a GPU
        return torch.device(str(device)).type
    except RuntimeError:
        raise UserError(f"device must be auto, cpu, cuda, cuda:N or mps, got {device!r}") from None


def pick_device(device, local_rank=None):
    """"auto" made concrete (cuda > mps > cpu); a device not here is one line, not CUDA's traceback."""
    n_gpus, mps = torch.cuda.device_count(), torch.backends.mps.is_available()
    picked = device if device != 'auto' else 'cuda' if n_gpus else 'mps' if mps else 'cpu'
    kind = device_type(picked)
    torchrun = kind == 'cuda' and local_rank is not None
    if torchrun or picked == 'cuda':  # under torchrun one GPU per process; set_device needs an index
        picked = f'cuda:{local_rank if torchrun else 0}'
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
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES.get(dtype, torch.bfloat16),
                          enabled=dtype in AUTOCAST_DTYPES)  # float32: a no-op


def cpu_has_bf16():
    """Whether this CPU has bf16 units (AVX512-BF16, AMX) that oneDNN uses: elsewhere bf16 is emulated."""
    caps = torch.cpu.get_capabilities()
    try:  # a build without oneDNN raises
        return bool(caps.get('avx512_bf16') or caps.get('amx_bf16') or torch.cpu._is_avx512_bf16_supported()
                    or torch.cpu._is_amx_tile_supported()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def cpu_has_fp16():
    """Whether oneDNN multiplies float16 natively here (AVX512-FP16, AMX-FP16): elsewhere it is emulated."""
    try:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    except (AttributeError, RuntimeError):
        return False


# a demo_cpu.py step with the matmuls emulated, against float32 on the same AVX2 CPU (docs/precision.md)
CPU_EMULATED_SLOWDOWN = {'bfloat16': 130, 'float16': 150}


def resolve_dtype(dtype, device):
    if dtype != 'auto':
        return dtype, 'as configured'
    if device.startswith('cpu'):
        return (('bfloat16', 'auto: this CPU has bf16 units, AVX512-BF16 or AMX') if cpu_has_bf16() else
                ('float32', f"auto: this CPU has no bf16 units; bf16 would be emulated, "
                            f"~{CPU_EMULATED_SLOWDOWN['bfloat16']}x slower"))
    if device.startswith('cuda'):
        cc = torch.cuda.get_device_capability(device)
        gpu = f'auto: {torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]})'
        # Ampere and newer: bf16 tensor cores, float32's range, no loss scaling
        return (('bfloat16', f'{gpu} has bf16') if cc >= (8, 0) else
                ('float16', f'{gpu} has no bf16; float16 with loss scaling'))
    # MPS: float16 gains memory but no speed on Apple GPUs, and bf16 needs macOS 14: float32 works everywhere
    return 'float32', f'auto: float32 on {torch.device(device).type}'


def choose_precision(config, device):
    """The config with dtype and compile made concrete, the same on every rank; rank 0 says why."""
    from gptkit import distributed  # the trainer's path only: the tools need none of DDP's and FSDP's imports
    dtype, why = resolve_dtype(config['dtype'], device)
    least = PRECISIONS[distributed.min_over_ranks(PRECISIONS.index(dtype))]  # every rank must compute alike
    if least != dtype:
        dtype, why = least, 'auto: the choice of a rank whose hardware has less'
    if distributed.rank() == 0:
        print(f"precision: {dtype} ({why}){', with loss scaling' if dtype == 'float16' else ''}")
        native = {'bfloat16': cpu_has_bf16, 'float16': cpu_has_fp16}.get(dtype, lambda: True)
        if device.startswith('cpu') and not native():
            print(f"warning: this CPU has no {dtype} units: {dtype} is emulated, "
                  f"~{CPU_EMULATED_SLOWDOWN[dtype]}x slower than float32 "
                  f"(dtype='auto' picks {resolve_dtype('auto', device)[0]} here)")
    return dict(config, dtype=dtype,  # compile "auto": on CUDA only
                compile=device.startswith('cuda') if config['compile'] == 'auto' else config['compile'])


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    elif device == 'mps':
        torch.mps.synchronize()


# dense bf16/fp16 tensor-core peaks from NVIDIA's datasheets (FLOP/s), the first name that matches
GPU_PEAK_FLOPS = {'H200': 989e12, 'H100 PCIe': 756e12, 'H100 NVL': 835e12, 'H100': 989e12, 'A100': 312e12,
                  'L40S': 362e12, 'L40': 181e12, 'A10G': 70e12, 'A10': 125e12, 'L4': 121e12,
                  'RTX 4090': 165e12, 'RTX 3090': 71e12, 'V100': 125e12, 'B200': 2250e12}


def matmul_flops(device, dtype, n=None, reps=10):
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


def device_name(device):
    if device == 'cpu':  # torch's name for the processor, else the platform's
        return torch.cpu.get_capabilities().get('cpu_name') or platform.processor() or platform.machine()
    return torch.cuda.get_device_name(device) if device.startswith('cuda') else device


def graph_pieces():
    """How many pieces dynamo's DDP optimizer cut the compiled training graph into (under DDP, compiled,
    after the first step); None if it was off (torch._dynamo.config.optimize_ddp)."""
    from torch._dynamo.utils import counters, get_optimize_ddp_mode
    graphs = counters['stats']['unique_graphs']
    if not graphs or get_optimize_ddp_mode() != 'ddp_optimizer':
        return None
    # AOTAutograd compiles each graph that dynamo captures once (the evals' too), but the one that DDP
    # cut once for each piece: its count beyond one a graph is the pieces after the first
    return counters['aot_autograd']['total'] - graphs + 1
