"""The CUDA paths against the CPU float32 reference: fused AdamW, the loss layer in bf16, flash
attention, compile, KV-cached generation, the CUDA RNG state in checkpoints. Skipped without a GPU
(scripts/gpu_checks.sh runs them on one)."""
import re

import pytest
import torch
import torch.nn.functional as F

from gptkit import checkpoint
from conftest import ROOT, TINY, random_shards, read_log, run_script
from gptkit.hardware import autocast, resolve_dtype
from gptkit.cpu import LinearCrossEntropy
from model import GPT, GPTConfig, flops_per_token

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CONFIG = GPTConfig(block_size=128, vocab_size=1024, n_layer=2, n_head=4, n_embd=128)


@pytest.fixture(autouse=True)
def exact_float32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # the CPU's float32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def batches(n, B=4, T=64, vocab=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, T + 1), generator=g) for _ in range(n)]


class Loader:
    def __init__(self, data):
        self.data, self.i = data, 0

    def next_batch(self):
        buf = self.data[self.i % len(self.data)]
        self.i += 1
        return buf[:, :-1], buf[:, 1:]


def test_auto_precision_is_bf16_on_ampere_and_newer():
    dtype, why = resolve_dtype('auto', 'cuda')
    assert dtype == ('bfloat16' if torch.cuda.get_device_capability() >= (8, 0) else 'float16'), why


# A wrapper of the trainer (run as python runs it, after these lines): float32 matmuls without TF32 (as
# the CPU's), and, with POISON_STEP set, that step's gradient norm made NaN (a bad step, skipped on
# the device); with SYNC_DEBUG set, torch.cuda.set_sync_debug_mode('error') from each step's first
# batch to its optimizer.step(): anything that makes the host wait for the GPU there raises.
WRAPPER = """
import os, runpy, torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from gptkit.shards import DataLoaderLite
torch.set_float32_matmul_precision = lambda precision: None
clip, steps, poison = torch.nn.utils.clip_grad_norm_, [0], int(os.environ.get('POISON_STEP', -1))
def clipped(*a, **k):
    norm = clip(*a, **k)
    steps[0] += 1
    return norm * float('nan') if steps[0] - 1 == poison else norm
torch.nn.utils.clip_grad_norm_ = clipped
if os.environ.get('SYNC_DEBUG'):
    next_batch = DataLoaderLite.next_batch
    def watched(self):
        if self.micro == 0:  # a step's first batch
            torch.cuda.set_sync_debug_mode('error')
        return next_batch(self)
    DataLoaderLite.next_batch = watched
    register_optimizer_step_pre_hook(lambda *a: torch.cuda.set_sync_debug_mode(0))
runpy.run_path(os.path.join(os.environ['PYTHONPATH'], 'train_gpt2.py'), run_name='__main__')
"""


def run_wrapped(tmp_path, args, **env):
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPER)
    return run_script(args, script=str(script), PYTHONPATH=ROOT, **env)


def tiny_run(tmp_path, device, *extra):
    data = random_shards(tmp_path / "data", 0, val=4096, train=[20000], vocab=1024)
    return [a for a in TINY if not a.startswith(("--device", "--n_", "--block_size"))] + [
        "--n_layer=2", "--n_head=4", "--n_embd=128", "--block_size=128", f"--data_root={data}",
        "--vocab_size=1024", "--B=4", "--T=64", "--total_batch_size=512", "--max_steps=3",
        "--eval_interval=0", "--hellaswag=False", "--sample_interval=0", "--shuffle=False",
        f"--device={device}", f"--log_dir={tmp_path / device}", *extra]


def test_training_steps_match_cpu_float32(tmp_path):
    """Three steps of the trainer (2 micro-steps, clipping, fused AdamW) on CUDA against the same on
    the CPU, float32 without TF32: losses, norms and weights agree to float32 rounding."""
    out = {}
    for device in ('cpu', 'cuda'):
        r = run_wrapped(tmp_path, tiny_run(tmp_path, device))
        assert r.returncode == 0, r.stderr[-2000:]
        norms = [float(n) for n in re.findall(r"\| norm ([\d.]+) \|", r.stdout)]
        ckpt = torch.load(tmp_path / device / "model_00003.pt", map_location='cpu', weights_only=True)
        out[device] = read_log(tmp_path / device)["train"], norms, ckpt["model"]
    (cpu_loss, cpu_norm, cpu_sd), (gpu_loss, gpu_norm, gpu_sd) = out['cpu'], out['cuda']
    assert len(cpu_norm) == len(gpu_norm) == 3
    for step in range(3):
        assert gpu_loss[step] == pytest.approx(cpu_loss[step], rel=1e-5)
        assert gpu_norm[step] == pytest.approx(cpu_norm[step], rel=1e-3)  # printed to 4 decimals
    assert max((cpu_sd[k] - gpu_sd[k]).abs().max().item() for k in cpu_sd) < 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_host_never_waits_before_the_update(tmp_path, optimizer):
    """Issue 27.2 and 27.8 on the GPU, in the trainer itself: torch.cuda.set_sync_debug_mode('error')
    from each step's first batch to its optimizer.step() (a NaN step among them): nothing makes the
    host wait for the device, the batches' copies included (pinned memory); and the skipped step is
    logged as skipped and changes no weight (the checkpoint after it holds the one before's)."""
    args = tiny_run(tmp_path, 'cuda', "--dtype=bfloat16", f"--optimizer={optimizer}", "--muon_lr=3e-3",
                    "--max_steps=4", "--checkpoint_interval=1", "--keep_checkpoints=0")
    r = run_wrapped(tmp_path, args, SYNC_DEBUG="1", POISON_STEP="2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 skip 1" in (tmp_path / "cuda" / "log.txt").read_text().splitlines()
    weights = [torch.load(tmp_path / "cuda" / f"model_0000{n}.pt", map_location='cpu',
                          weights_only=True)["model"] for n in (2, 3, 4)]  # after updates 0-1, 2 (skipped), 3
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not all(torch.equal(weights[1][k], weights[2][k]) for k in weights[0])


def test_bf16_loss_layer_matches_cross_entropy():  # the CPU's fused loss, kept right on any device
    """LinearCrossEntropy under CUDA bf16 autocast against F.linear + F.cross_entropy on the same
    bf16 inputs, in float32 arithmetic (and several row blocks: 2**28 // V rows each)."""
    torch.manual_seed(0)
    N, C, V = 12288, 256, 50304  # 3 row blocks
    h = torch.randn(N, C, device='cuda', requires_grad=True)
    w = (torch.randn(V, C, device='cuda') * 0.05).requires_grad_()
    t = torch.randint(0, V, (N,), device='cuda')
    with autocast('cuda', 'bfloat16'):
        loss = LinearCrossEntropy.apply(h, w, t)
    loss.backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy(F.linear(h.bfloat16(), w.bfloat16()).float(), t)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    for got, want in zip(grads, (h.grad, w.grad)):
        assert ((got - want).norm() / want.norm()).item() < 1e-2


def test_flash_attention_serves_the_model():
    """The model's attention (bf16, head size 64, causal, no mask) runs on the flash kernel: with
    every other SDPA backend disabled it still runs, and matches the float32 math reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, 256, 64, device='cuda', dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    model = GPT(GPTConfig(block_size=256, vocab_size=1024, n_layer=1, n_head=12, n_embd=768)).cuda()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), autocast('cuda', 'bfloat16'):
        model(torch.randint(0, 1024, (2, 256), device='cuda'))


def test_compiled_model_matches_eager():
    """torch.compile (the logits + F.cross_entropy path inside the graph) against the same model
    eager (on a GPU the same path: LinearCrossEntropy is the CPU's): the same loss and gradients,
    in float32."""
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda()
    x, y = (t.cuda() for t in Loader(batches(1)).next_batch())
    _, loss = model(x, y)
    loss.backward()
    eager = loss.item(), [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _, loss = torch.compile(model)(x, y)
    loss.backward()
    assert loss.item() == pytest.approx(eager[0], rel=1e-5)
    for p, g in zip(model.parameters(), eager[1]):
        assert ((p.grad - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-4


def test_cached_generation_matches_recomputation():
    """generate's KV cache on CUDA: greedy tokens equal a full forward's argmax at every step."""
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda().eval()
    idx = torch.randint(0, 1024, (3, 5), device='cuda')
    out = model.generate(idx, 20, top_k=1)
    with torch.no_grad():
        logits, _ = model(out[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), out[:, 5:])
    with autocast('cuda', 'bfloat16'):  # the trainer's samples: bf16 keys and values
        assert model.generate(idx, 8, top_k=50).shape == (3, 13)


def test_cuda_rng_state_round_trips():
    """A checkpoint's RNG state holds the GPU's generator, and restoring it replays the draws."""
    torch.cuda.manual_seed(123)
    state = checkpoint.rng_state('cuda:0')
    assert 'cuda' in state
    first = torch.rand(5, device='cuda')
    checkpoint.set_rng_state(state, 'cuda:0')
    assert torch.equal(torch.rand(5, device='cuda'), first)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_plain_python_run_on_the_gpu(tmp_path, device):
    """`python train_gpt2.py` (no torchrun) on the GPU, as a user's first try: it trains, evals and
    checkpoints, and its losses are the CPU's to TF32 rounding."""
    data = random_shards(tmp_path / "data", 0, val=4096, train=[20000])
    args = [a for a in TINY if not a.startswith("--device")] + [
        f"--data_root={data}", "--vocab_size=512", "--B=4", "--T=32", "--total_batch_size=256",
        "--max_steps=4", "--eval_interval=2", "--val_tokens=512", "--hellaswag=False", "--sample_interval=0"]
    logs, outs = {}, {}
    for d in (device, "cpu"):
        outs[d] = run_script([*args, f"--device={d}", f"--log_dir={tmp_path / d}"])
        assert outs[d].returncode == 0, outs[d].stderr[-2000:]
        logs[d] = read_log(tmp_path / d)
    assert "device=cuda:0" in outs[device].stdout
    # MFU = tok/s x model FLOPs per token / peak (float32: a matmul measured at start), never above 100%
    out = outs[device].stdout
    (peak, fpt), = re.findall(r"mfu: against ([\d.e+]+) TFLOP/s per process \(measured matmul\), "
                              r"([\d.e+]+) MFLOP per token", out)
    lines = re.findall(r"^step +\d+ \| loss .* \| tok/sec ([\d.]+) \| mfu ([\d.]+)% \| eta ", out, re.M)
    tiny = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, vocab_size=512)
    assert len(lines) == 4 and float(fpt) == pytest.approx(flops_per_token(tiny, 32) / 1e6, rel=1e-3)
    for tok_s, mfu in lines:
        flops = float(tok_s) * float(fpt) * 1e6
        assert float(mfu) == pytest.approx(flops / (float(peak) * 1e12) * 100, rel=2e-3, abs=0.06)
        assert float(mfu) <= 100
    for step, loss in logs["cpu"]["train"].items():
        assert logs[device]["train"][step] == pytest.approx(loss, abs=5e-3)
    assert (tmp_path / device / "model_00004.pt").is_file()
