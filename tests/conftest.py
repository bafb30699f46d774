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


# The quick tier, for the edit loop: `python -m pytest -q tests -m quick`, each file's fastest
# contracts (in-process, or one short run), about 30 s on 2 cores. The README's command and
# CI run everything. A test is in the tier when its name (with its parameters) starts with one of
# its file's prefixes here; a prefix that matches no test is an error, so a rename cannot drop one.
QUICK = {
    "test_bench.py": ["test_kernel_kinds"],
    "test_config.py": ["test_defaults_are", "test_bad_", "test_config_file_sees", "test_broken_config",
                       "test_16_gpus", "test_presets_parse", "test_124M_preset"],
    "test_data.py": ["test_ranks_disjoint", "test_stream_does_not", "test_shards_are_memory",
                     "test_error_paths", "test_unfinished", "test_val_tokens_span", "test_loader_state",
                     "test_token_ids_beyond"],
    "test_docs.py": ["test_resolver", "test_every_code_reference", "test_ddp_guide", "test_config_files_are",
                     "test_one_gpt2_hellaswag", "test_slurm_lead", "test_readme_is"],
    "test_commands.py": ["test_"],
    "test_fineweb.py": ["test_glob_max_tokens", "test_interrupted_then_rerun", "test_error_paths"],
    "test_hellaswag.py": ["test_render_example", "test_bad_lines", "test_download", "test_synthetic_examples",
                          "test_load_for_training", "test_long_examples"],
    "test_layout.py": ["test_"],
    "test_log_dir.py": ["test_a_refused", "test_a_lock_on", "test_a_start_that"],
    "test_memory.py": ["test_bad_B", "test_on_the_cpu_auto",
                       "test_the_count_of_few_blocks_gives_the_whole_forward[2-"],
    "test_model.py": ["test_"],
    "test_parallel.py": ["test_the_process_group_waits"],
    "test_precision.py": ["test_auto_picks", "test_cpu_bf16_units", "test_a_non_finite_norm",
                          "test_overflow_is_loss"],
    "test_recipes.py": ["test_muon_parameter_groups", "test_wsd_learning_rate"],
    "test_resume.py": ["test_a_log_dir_without_locks", "test_resumed_optimizer_keeps"],
    "test_shuffle.py": ["test_every_document_is_read", "test_order_is_drawn", "test_same_tokens_per_step",
                        "test_resume_from_state", "test_without_shuffle", "test_another_seed"],
    "test_slurm.py": ["test_"],
    "test_step.py": ["test_the_step_waits_for_nothing_before_its_update[one-float16]"],
    "test_tokenizer.py": ["test_"],
    "test_tools.py": ["test_gpu_peak_table", "test_smooth_passes", "test_wandb_is_not_imported",
                      "test_training_samples_are_returned"],
    "test_train.py": ["test_evaluate_builds_no_graph", "test_end_to_end_tiny_run",
                      "test_ddp_two_processes_equal_one_process"],  # with dropout: its invariance
}


# The skips that CI's machine (no GPU, Linux, .ci/run sets CI=true) cannot avoid: any other fails there.
CI_SKIPS = ("needs a CUDA GPU", "this machine has an Apple GPU", "a machine without a GPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    allowed = any(why in str(report.longrepr) for why in CI_SKIPS)
    if report.skipped and os.environ.get("CI") == "true" and not allowed:
        report.outcome = "failed"


def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        for prefix in QUICK.get(os.path.basename(str(item.fspath)), ()):
            if item.name.startswith(prefix):
                item.add_marker(pytest.mark.quick)
                used.add((os.path.basename(str(item.fspath)), prefix))
    if any("::" in arg for arg in config.args):  # single tests asked for: the others are not collected
        return
    files = {os.path.basename(str(item.fspath)) for item in items}
    stale = [(f, p) for f, prefixes in QUICK.items() if f in files for p in prefixes if (f, p) not in used]
    if stale:
        raise pytest.UsageError(f"conftest.QUICK names tests that do not exist: {stale}")
