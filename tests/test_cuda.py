"""The CUDA paths against the CPU float32 reference: fused AdamW, the loss layer in bf16, flash
attention, compile, KV-cached generation, the CUDA RNG state in checkpoints. Skipped without a GPU
(scripts/gpu_checks.sh runs them on one)."""
import re

import pytest
import torch
import torch.nn.functional as F

from gptkit import checkpoint
import train_gpt2
from conftest import TINY, random_shards, read_log, run_script
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


def test_training_steps_match_cpu_float32():
    """Three steps of train_step (2 micro-steps, clipping, fused AdamW on CUDA) against the same on
    the CPU (plain AdamW): losses, norms and weights agree to float32 rounding."""
    data = batches(6)
    out = {}
    for device in ('cpu', 'cuda'):
        torch.manual_seed(0)
        model = GPT(CONFIG).to(device)
        optimizer = model.configure_optimizers(0.1, 1e-3, device)
        assert optimizer.defaults['fused']  # on every device: found_inf skips a step there (issue 27)
        scaler = torch.amp.GradScaler(device, enabled=False)
        loader = Loader(data)
        state = train_gpt2.TrainState(model, model, optimizer, scaler, loader)
        steps = [train_gpt2.train_step(state, 2, 1e-3, 1.0, device, 'float32')[:2] for _ in range(3)]
        out[device] = [(loss.item(), norm.item()) for loss, norm in steps], model.state_dict()
    (cpu_steps, cpu_sd), (gpu_steps, gpu_sd) = out['cpu'], out['cuda']
    for (a_loss, a_norm), (b_loss, b_norm) in zip(cpu_steps, gpu_steps):
        assert b_loss == pytest.approx(a_loss, rel=1e-5) and b_norm == pytest.approx(a_norm, rel=1e-4)
    assert max((cpu_sd[k] - gpu_sd[k].cpu()).abs().max().item() for k in cpu_sd) < 1e-5


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_host_never_waits_before_the_update(optimizer):
    """Issue 27.2 and 27.8 on the GPU: torch.cuda.set_sync_debug_mode('error') from a step's start
    to its optimizer.step() (a NaN step among them): nothing makes the host wait for the device,
    the batches' copies included (pinned memory); and the skipped step changes nothing."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    torch.manual_seed(0)
    model = GPT(CONFIG).to('cuda')
    opt = model.configure_optimizers(0.1, 1e-3, 'cuda', optimizer, 3e-3)
    scaler = torch.amp.GradScaler('cuda', enabled=False)
    state = train_gpt2.TrainState(model, model, opt, scaler, Loader(batches(8)))
    hook = register_optimizer_step_pre_hook(lambda *a: torch.cuda.set_sync_debug_mode(0))
    try:
        for step in range(4):
            poison = model.lm_head.weight.register_hook(lambda g: g * float('nan')) if step == 2 else None
            before = [p.detach().clone() for p in model.parameters()]
            torch.cuda.set_sync_debug_mode('error')
            _, _, ok, _ = train_gpt2.train_step(state, 2, 1e-3, 1.0, 'cuda', 'bfloat16')
            torch.cuda.set_sync_debug_mode(0)
            if poison:
                poison.remove()
            assert ok == (step != 2)
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) == (step == 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        hook.remove()


def test_bf16_loss_layer_matches_cross_entropy():
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
