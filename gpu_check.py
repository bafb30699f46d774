"""
GPU check: the real launch path on one GPU, measured.

    python gpu_check.py [--key=value ...]

Runs `torchrun --standalone --nproc_per_node=1 train_gpt2.py` (NCCL on CUDA) with the default
124M config, dtype="auto" (bf16 from Ampere on, float16 with loss scaling before; --dtype=float16
checks the loss scaling on any GPU) and compile=True, for 30 steps on random-token shards written to a temporary
folder, then prints the trainer's tok/s (median of the steps after compilation) and the model
FLOPs utilisation against this GPU's bf16 matmul rate, measured in the same run. Extra
--key=value arguments go to the trainer too (e.g. --B=32 on a smaller GPU).

Then the resume path on the GPU (CUDA RNG state, fused AdamW state, NCCL): the run's checkpoint
at step 10 is resumed in a new folder to step 30, and the largest differences of its train losses
and final weights from the uninterrupted run are printed (bf16 and compiled kernels need not be
bit-exact on a GPU; on CPU in float32 the tests require bit equality).
"""
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

import train_gpt2
from bench import matmul_flops
from model import GPTConfig, flops_per_token


def main():
    defaults = dict(train_gpt2.DEFAULTS)
    c = train_gpt2.parse_config(sys.argv[1:], defaults, __doc__)
    overrides = ["--max_steps=30", "--eval_interval=10", f"--val_tokens={c['total_batch_size']}", "--hellaswag=False",
                 "--sample_interval=0", "--checkpoint_interval=10", "--keep_checkpoints=0",
                 "--dtype=auto", "--compile=True", *sys.argv[1:]]
    c = train_gpt2.parse_config(overrides, defaults)
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        step_tokens = c['total_batch_size']
        for name in ("synthetic_val_000000", "synthetic_train_000001", "synthetic_train_000002"):
            np.save(os.path.join(tmp, name + ".npy"), rng.integers(0, 50257, 2 * step_tokens + 1, dtype=np.uint16))

        def launch(log_dir):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_gpt2.py",
                   f"--data_root={tmp}", f"--log_dir={log_dir}", *overrides]
            print("running:", " ".join(cmd), flush=True)
            out = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True)
            print(out.stdout[-3000:], out.stderr[-3000:], sep="\n")
            if out.returncode != 0:
                sys.exit(f"trainer failed with exit code {out.returncode}")
            return out

        out = launch(os.path.join(tmp, 'log'))
        os.makedirs(os.path.join(tmp, 'resumed'))
        shutil.copy(os.path.join(tmp, 'log', 'model_00010.pt'), os.path.join(tmp, 'resumed'))
        resumed = launch(os.path.join(tmp, 'resumed'))
        assert "resuming from" in resumed.stdout
        logs = [{int(s): float(v) for s, v in re.findall(r"^(\d+) train (\S+)$", open(os.path.join(tmp, d, 'log.txt')).read(), re.M)}
                for d in ('log', 'resumed')]
        loss_diff = max(abs(logs[0][s] - logs[1][s]) for s in range(10, 30))
        a, b = (torch.load(os.path.join(tmp, d, 'model_00030.pt'), map_location='cpu', weights_only=True)['model']
                for d in ('log', 'resumed'))
        param_diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    rates = [float(r) for r in re.findall(r"tok/sec (\d+\.\d+)", out.stdout)]
    steady = rates[len(rates) // 3:]  # the first steps compile
    tok_per_s = statistics.median(steady)
    _, _, _, _, device = train_gpt2.setup_device(c['device'], c['cpu_reuse_memory'])  # the trainer's choice, in this process
    c = train_gpt2.choose_precision(c, 0, 1, device)  # the precision the run used
    peak = matmul_flops(device, c['dtype'])
    config = GPTConfig(block_size=c['block_size'], vocab_size=c['vocab_size'], n_layer=c['n_layer'],
                       n_head=c['n_head'], n_embd=c['n_embd'])
    fpt = flops_per_token(config, c['T'])
    name = torch.cuda.get_device_name() if device.startswith('cuda') else device
    print(f"device: {name}")
    print(f"tok/s (median of steps {len(rates) - len(steady)}..{len(rates) - 1}): {tok_per_s:,.0f}")
    print(f"model FLOPs/token: {fpt / 1e6:.1f} MFLOP; achieved {tok_per_s * fpt / 1e12:.1f} TFLOP/s")
    print(f"{c['dtype']} matmul, measured now: {peak / 1e12:.1f} TFLOP/s")
    print(f"MFU: {tok_per_s * fpt / peak:.3f}")
    print(f"resume from step 10 to 30 vs uninterrupted: max |train loss diff| {loss_diff:.2e}, "
          f"max |weight diff| {param_diff:.2e}")


if __name__ == "__main__":
    main()
