"""bench.py's profile: the kernels of a compiled GPT-2 step on an H200 go to the right kinds."""
import pytest

import commands
from conftest import one_thread
from bench import kernel_kind

# the first five as torch.profiler listed them on an H200 (torch 2.11, CUDA 13, compiled 124M step); the
# rest in the forms of PyTorch's own CUDA kernels
SEEN = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_splitK_NTN": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_"
    "kernel0_0": "attention",
    "triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_add_arange_eq_expand_nll_loss_"
    "backward_nll_l": "fused elementwise/norm/loss",
    "triton_per_fused__to_copy_add_native_layer_norm_backward_view_9": "fused elementwise/norm/loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
    "Memcpy HtoD (Pageable -> Device)": "copy/fill",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy/fill",
    "void at::native::reduce_kernel<512, 1>": "other",
}


@pytest.mark.quick
@pytest.mark.parametrize("name,kind", SEEN.items())
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_bench_step_takes_B_auto_as_the_trainer_does():
    """Issue 29: bench.py with B="auto" chooses as the trainer does, says so, and measures that B in
    the trainer's run."""
    import sys
    from conftest import ROOT
    tiny = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--vocab_size=512", "--device=cpu",
            "--dtype=float32", "--compile=False"]
    args = [*tiny, "--B=auto", "--T=32", "--total_batch_size=128", "--bench_baseline=False",
            "--bench_steps=1", "--bench_warmup=0"]
    r = commands.run([sys.executable, "bench.py", *args], cwd=ROOT, capture_output=True, text=True,
                     timeout=300, env=one_thread())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "B=4 (auto): " in r.stdout and "batch: B=4 T=32 grad_accum=1 " in r.stdout, r.stdout[-3000:]

