"""bench.py's profile: the kernels of a compiled GPT-2 step on an H200 go to the right kinds."""
import pytest

import forked
from conftest import one_thread
from bench import kernel_kind

# the first five as torch.profiler listed them on an H200 (torch 2.11, CUDA 13, compiled 124M step); the
# rest in the forms of PyTorch's own CUDA kernels
SEEN = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0": "attention",
    "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_eq_expand_nll_loss_backward_nll_l":
        "fused elementwise/norm/loss",
    "triton_per_fused__to_copy_add_native_layer_norm_backward_view_9": "fused elementwise/norm/loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
    "Memcpy HtoD (Pageable -> Device)": "copy/fill",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy/fill",
    "void at::native::reduce_kernel<512, 1>": "other",
}


@pytest.mark.parametrize("name,kind", SEEN.items())
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_bench_recipe_prints_each_recipe_against_the_first(tmp_path):
    """Issue 22: `bench.py --bench_recipe=True` trains once per recipe (here two, made tiny by the
    extra arguments, which every run takes) and prints the final val loss and bpb, ms per step and
    the step at which each reached the first recipe's final val loss."""
    import re
    import sys
    from conftest import ROOT, TINY, random_shards
    data = random_shards(tmp_path / "data", 0, 600, [5000], vocab=50257)
    tiny = [a for a in TINY if not a.startswith(("--warmup_steps", "--max_lr", "--min_lr"))]
    r = forked.run([sys.executable, "bench.py", "--bench_recipe=True", "--bench_recipes=adamw+cosine,muon+wsd",
                        f"--data_root={data}", *tiny, "--T=32", "--B=2", "--total_batch_size=64", "--max_steps=20",
                        "--val_tokens=256", "--warmup_steps=2", f"--bench_recipe_dir={tmp_path / 'logs'}"], cwd=ROOT,
                   capture_output=True, text=True, timeout=300, env=one_thread())
    assert r.returncode == 0, r.stderr
    assert "cpu: " in r.stdout and "muon+wsd: --optimizer=muon --lr_schedule=wsd" in r.stdout
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        r"^(adamw\+cosine|muon\+wsd) +([\d.]+) +([\d.]+) +(\d+) +(\d+ of 20 = [\d.]+x|not reached)$", r.stdout, re.M)}
    assert rows.keys() == {"adamw+cosine", "muon+wsd"}, r.stdout
    assert rows["adamw+cosine"][3] == "20 of 20 = 1.00x"  # the first recipe reaches its own final loss at the end
    assert float(rows["muon+wsd"][1]) > 0 and "steps to val " + rows["adamw+cosine"][0] in r.stdout
    for name in ("adamw+cosine", "muon+wsd"):  # kept for plot.py, as the last line says
        assert (tmp_path / "logs" / name / "log.txt").exists() and str(tmp_path / "logs" / name) in r.stdout
    for bad_args, error in (("--bench_recipes=sgd", "bench_recipes='sgd': expected a comma-separated list of adamw+cosine"),
                            (f"--bench_recipe_dir={tmp_path / 'logs'}", f"{tmp_path / 'logs' / 'adamw+cosine'} exists")):
        bad = forked.run([sys.executable, "bench.py", "--bench_recipe=True", bad_args], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=one_thread())
        assert bad.returncode == 1 and error in bad.stderr, bad.stderr


def test_bench_step_takes_B_auto_as_the_trainer_does():
    """Issue 29: bench.py with B="auto" (the default) chooses as the trainer does, says so, and
    measures that B in its child process."""
    import sys
    from conftest import ROOT
    tiny = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=512", "--device=cpu",
            "--dtype=float32", "--compile=False"]
    r = forked.run([sys.executable, "bench.py", *tiny, "--T=32", "--total_batch_size=128", "--bench_baseline=False",
                        "--bench_steps=1", "--bench_warmup=0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                   env=one_thread())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "B=4 (auto): " in r.stdout and "batch: B=4 T=32 grad_accum=1 " in r.stdout, r.stdout[-3000:]


def test_bench_start_times_the_first_answer_against_import_torch():
    """bench.py --bench_start (issue 31.3's measure): --help and a typo, each a whole process, beside
    `import torch` in the same run; the figures are the bench's, not asserted here."""
    import re
    import subprocess
    import sys
    from conftest import ROOT
    r = subprocess.run([sys.executable, "bench.py", "--bench_start=True", "--bench_steps=1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=one_thread())
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"first answer, best of 1 processes, cpu: \w+\nimport torch: [\d.]+ s\n"
                        r"--help: [\d.]+ s \([+-][\d.]+ s on import torch\)\n"
                        r"a typo: [\d.]+ s \([+-][\d.]+ s on import torch\)\n", r.stdout), r.stdout
