import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no internet here: the hub's offline mode, read at its import
sys.path.insert(0, ROOT)
from gptkit import cpu  # noqa: E402,F401 -- first: a compile cache of its own under ATEN_CPU_CAPABILITY
import commands  # noqa: E402 -- how the suite runs a command (commands.py)

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


def one_thread(**extra):
    """The environment for a command run by a test (and extra): one thread, as xdist runs two tests
    at once (README)."""
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def run_script(args, nproc=None, timeout=300, script="train_gpt2.py", **env):
    """Run train_gpt2.py (or a script that wraps it, with more environment variables) as a user would:
    plain python, or real torchrun with nproc processes (commands.py)."""
    env = one_thread(PYTHONUNBUFFERED="1", **env)
    if nproc is None:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               script, *args]
    return commands.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


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
    from gptkit.tokenizer import get_gpt2_encoding
    return get_gpt2_encoding()


# The skips that CI's machine (no GPU, Linux, .ci/run sets CI=true) cannot avoid: any other fails there,
# a test's or a whole module's.
CI_SKIPS = ("needs a CUDA GPU", "this machine has an Apple GPU", "a machine without a GPU")


def fail_a_skip_ci_could_run(report):
    allowed = hasattr(report, "wasxfail") or any(why in str(report.longrepr) for why in CI_SKIPS)
    if report.skipped and os.environ.get("CI") == "true" and not allowed:
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    fail_a_skip_ci_could_run((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    fail_a_skip_ci_could_run((yield).get_result())
