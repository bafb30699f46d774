import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# a model small enough for a few seconds of CPU training
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--compile=False", "--dtype=float32",
        "--device=cpu", "--warmup_steps=2", "--max_lr=1e-2", "--min_lr=1e-3"]


def write_shards(folder, split, arrays, prefix="edufineweb"):
    """np.save each array as a uint16 shard named like fineweb.py's output."""
    os.makedirs(folder, exist_ok=True)
    for i, a in enumerate(arrays):
        np.save(os.path.join(folder, f"{prefix}_{split}_{i:06d}.npy"), np.asarray(a, dtype=np.uint16))


def random_shards(folder, seed, val, train, vocab=512):
    """folder with random token ids below vocab: a val shard of val tokens, train shards of the
    sizes in train."""
    rng = np.random.default_rng(seed)
    write_shards(folder, "val", [rng.integers(0, vocab, val)])
    write_shards(folder, "train", [rng.integers(0, vocab, n) for n in train])
    return folder


def run_script(args, nproc=None, timeout=300):
    """Run train_gpt2.py as a user would: plain python, or real torchrun with nproc processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if nproc is None:
        cmd = [sys.executable, "train_gpt2.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train_gpt2.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_log(log_dir):
    """{kind: {step: value}} from log.txt."""
    out = {}
    with open(os.path.join(log_dir, "log.txt")) as f:
        for line in f:
            step, kind, value = line.split()
            out.setdefault(kind, {})[int(step)] = float(value)
    return out


@pytest.fixture(scope="session")
def enc():
    from tokenizer import get_gpt2_encoding
    return get_gpt2_encoding()
