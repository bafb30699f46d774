"""
GPU check: the real launch path on one GPU, measured.

    python gpu_check.py [--key=value ...]

Runs `torchrun --standalone --nproc_per_node=1 train_gpt2.py` (NCCL on CUDA) with the default
124M config, dtype="auto" (bf16 from Ampere on, float16 with loss scaling before; --dtype=float16
checks the loss scaling on any GPU) and compile=True, for 30 steps on random-token shards written to
a temporary folder, then prints the trainer's tok/s (median of the steps after compilation) and the
matmul fraction: the model FLOP/s over this GPU's bf16 matmul rate, measured in the same run (the
trainer's console prints MFU, over the datasheet's peak: docs/benchmarks.md). Extra
--key=value arguments go to the trainer too (e.g. --B=32 on a smaller GPU).

Then the resume path on the GPU (CUDA RNG state, fused AdamW state, NCCL): the run's checkpoint
at step 10 is resumed in a new folder to step 30, and the largest differences of its train losses
and final weights from the uninterrupted run are printed (bf16 and compiled kernels need not be
bit-exact on a GPU; on CPU in float32 the tests require bit equality). With --parallel=fsdp the
same runs go through FSDP2 (one process is one shard: the code path of many GPUs, on one).

Last, unless --check_evals=0, the time of the trainer's two evals at the default sizes, in this
process: the val loss over val_tokens (default 10M tokens; compiled, as the trainer runs it) and
HellaSwag over check_evals synthetic examples (default 10,042, the val split's count; as long as its
first ones).
"""
import os
import re
import shutil
import statistics
import sys
import tempfile

import numpy as np
import torch

import hellaswag
from gptkit import hellaswag_eval as scoring
from bench import print_flops, run_python, seconds, synthetic_shard
from gptkit import memory
from gptkit.configurator import parse_config, trainer_defaults
from gptkit.common import UserError
from gptkit.hardware import autocast, choose_precision, pick_device
from gptkit.hardware import device_name
from gptkit.shards import val_batches
from model import GPT, GPTConfig
from gptkit.tokenizer import N_VOCAB
from plot import read_log


def time_evals(c, device, n_examples):
    """Seconds of one val eval over c['val_tokens'] random tokens and of one HellaSwag eval over
    n_examples synthetic examples, each as the trainer runs it (compiled when c['compile'], after a
    warm-up that compiles it), on a fresh model of the run's shape; HellaSwag's counts are printed
    beside the eager scorer's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_dict(c)).to(device)
    compiled = torch.compile(model, dynamic=False) if c['compile'] else model  # as the trainer compiles it
    n_tokens = c['val_tokens'] // c['T'] * c['T'] + 1
    tokens = np.random.default_rng(0).integers(0, N_VOCAB, n_tokens).astype(np.uint16)
    x, y, _ = (t.to(device) for t in val_batches(tokens, c['B'], c['T'], 0, 1))  # as the trainer makes them

    @torch.no_grad()
    def val_eval(n):  # the trainer's val loop over the first n batches: the summed losses read once
        total = torch.zeros((), device=device)
        for xb, yb in zip(x[:n], y[:n]):
            with autocast(device, c['dtype']):
                total += compiled(xb, yb, reduction='none')[1].sum().float()
        return total.item()
    val_eval(2)  # compiles
    val_s, _ = seconds(device, lambda: val_eval(len(x)))
    batch = scoring.examples_per_batch(c['B'], c['T'])  # as the trainer prepares them
    examples = hellaswag.synthetic_examples(n_examples)
    prepared = scoring.prepare(examples, c['block_size'], device, batch, one_shape=c['compile'])
    scoring.evaluate(model, prepared, c['dtype'], c['compile'])  # compiles
    hella_s, counts = seconds(device, lambda: scoring.evaluate(model, prepared, c['dtype'], c['compile']))
    eager = scoring.evaluate(model, prepared, c['dtype'])
    print(f"hellaswag (examples, acc, acc_norm): {counts.tolist()}, eager: {eager.tolist()}")
    return val_s, hella_s


def main():
    defaults = dict(trainer_defaults(), check_evals=10042)
    try:
        c = parse_config(sys.argv[1:], defaults, __doc__)
    except UserError as e:
        sys.exit(f"error: {e}")
    eval_tokens, n_hella = c['val_tokens'], c['check_evals']  # for the evals' timing (the runs' are small)
    mine = ('--check_evals=', '--val_tokens=')  # the rest of the arguments go to the trainer
    overrides = ["--max_steps=30", "--eval_interval=10", f"--val_tokens={c['total_batch_size']}",
                 "--hellaswag=False", "--sample_interval=0", "--checkpoint_interval=10",
                 "--keep_checkpoints=0", "--dtype=auto", "--compile=True",
                 *(a for a in sys.argv[1:] if not a.startswith(mine))]
    c = parse_config(overrides, defaults)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("synthetic_val_000000", "synthetic_train_000001", "synthetic_train_000002"):
            synthetic_shard(tmp, 2 * c['total_batch_size'] + 1, name)

        def launch(log_dir):
            args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train_gpt2.py",
                    f"--data_root={tmp}", f"--log_dir={log_dir}", *overrides]
            print("running: python", " ".join(args), flush=True)
            out, _ = run_python(args, "the trainer")  # a failure: the end of its stderr
            print(out.stdout[-3000:], out.stderr[-3000:], sep="\n")
            return out

        out = launch(os.path.join(tmp, 'log'))
        os.makedirs(os.path.join(tmp, 'resumed'))
        shutil.copy(os.path.join(tmp, 'log', 'model_00010.pt'), os.path.join(tmp, 'resumed'))
        resumed = launch(os.path.join(tmp, 'resumed'))
        assert "resuming from" in resumed.stdout
        logs = [dict(zip(*read_log(os.path.join(tmp, d))['train'])) for d in ('log', 'resumed')]
        loss_diff = max(abs(logs[0][s] - logs[1][s]) for s in range(10, 30))
        paths = [os.path.join(tmp, d, 'model_00030.pt') for d in ('log', 'resumed')]
        a, b = (torch.load(p, map_location='cpu', weights_only=True)['model'] for p in paths)
        param_diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    rates = [float(r) for r in re.findall(r"tok/sec (\d+\.\d+)", out.stdout)]
    first_dt = float(re.search(r"dt (\d+\.\d+)ms", out.stdout).group(1)) / 1000
    steady = rates[len(rates) // 3:]  # the first steps compile
    tok_per_s = statistics.median(steady)
    device = pick_device(c['device'])  # this process: no DDP
    torch.set_float32_matmul_precision('high')  # as the trainer sets it on CUDA
    c = memory.micro_batch_of(choose_precision(c, device), device)  # the run's precision and B
    print(f"device: {device_name(device)}")
    print(f"tok/s (median of steps {len(rates) - len(steady)}..{len(rates) - 1}): {tok_per_s:,.0f}")
    print_flops(c, device, tok_per_s)
    print(f"first step, compilation included: {first_dt:.1f} s "
          f"(a step: {c['total_batch_size'] / tok_per_s:.2f} s)")
    print(f"resume from step 10 to 30 vs uninterrupted: max |train loss diff| {loss_diff:.2e}, "
          f"max |weight diff| {param_diff:.2e}")
    if n_hella:
        val_s, hella_s = time_evals(dict(c, val_tokens=eval_tokens), device, n_hella)
        print(f"val eval, {eval_tokens:,} tokens at B={c['B']}: {val_s:.1f} s; "
              f"HellaSwag eval, {n_hella:,} synthetic examples: {hella_s:.1f} s")


if __name__ == "__main__":
    main()
