import copy
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import GPT, GPTConfig, flops_per_token

pytestmark = pytest.mark.quick  # every test here: the edit loop's tier

HF_SHAPE = dict(n_layer=2, n_head=4, n_embd=64, n_positions=48, vocab_size=300)


def make_hf(tmp_path, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(GPT2Config(**HF_SHAPE, bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # HF inits biases and LayerNorms to 0/1: make every parameter matter
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    return hf


def test_logits_and_loss_match_hf(tmp_path):
    hf = make_hf(tmp_path)
    model = GPT.from_pretrained(str(tmp_path)).eval()
    assert model.config == GPTConfig(block_size=48, vocab_size=300, n_layer=2, n_head=4, n_embd=64)
    idx = torch.randint(0, 300, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx, labels=idx)
        logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert (logits - ref.logits[:, :-1]).abs().max().item() < 1e-4
    assert abs(loss.item() - ref.loss.item()) < 1e-5


def test_pytorch_model_bin_and_gpt2model_keys(tmp_path):
    """An older save (pytorch_model.bin, keys without 'transformer.', with attn.bias buffers)."""
    hf = make_hf(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors")
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 48, 48).tril()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    model = GPT.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        assert (model(idx)[0] - hf(idx).logits).abs().max().item() < 1e-4


def test_openai_names_go_through_transformers(tmp_path, monkeypatch):
    """gpt2 & co. load through GPT2LMHeadModel.from_pretrained (a download when online); here it
    returns a random HF model, and our logits must match it."""
    import transformers
    hf = make_hf(tmp_path)
    asked = []

    def fake_from_pretrained(name):
        asked.append(name)
        return hf
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", fake_from_pretrained)
    model = GPT.from_pretrained("gpt2-medium").eval()
    assert asked == ["gpt2-medium"]
    idx = torch.randint(0, 300, (2, 30))
    with torch.no_grad():
        assert (model(idx)[0] - hf(idx).logits).abs().max().item() < 1e-4


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an OpenAI GPT-2 name"):
        GPT.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        GPT.from_pretrained(str(tmp_path))
    make_hf(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # the weights are 2 layers; a config of 3 misses layer 2
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_layer=3)))
    with pytest.raises(ValueError, match=r"missing key 'transformer\.h\.2\.ln_1\.weight'"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, vocab_size=256)))
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' has shape \(300, 64\), "
                                         r"expected \(256, 64\)"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, n_inner=128)))
    with pytest.raises(ValueError, match=r"config n_inner=128, this GPT-2 supports \(None, 256\)"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, layer_norm_epsilon=1e-3)))
    with pytest.raises(ValueError, match="layer_norm_epsilon=0.001"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, activation_function="relu")))
    with pytest.raises(ValueError, match="activation_function='relu'"):
        GPT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    sd = load_file(tmp_path / "model.safetensors")
    wrong = {"transformer.h.1.mlp.c_fc.weight": torch.zeros(64, 200)}
    save_file(dict(sd, **wrong), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.mlp\.c_fc\.weight' has shape \(200, 64\) "
                                         r"\(transposed from Conv1D\), expected \(256, 64\)"):
        GPT.from_pretrained(str(tmp_path))
    untied = dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"] + 1})
    save_file(untied, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight differs from transformer.wte.weight"):
        GPT.from_pretrained(str(tmp_path))
    sd["transformer.h.0.attn.extra.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected key 'transformer\.h\.0\.attn\.extra\.weight'"):
        GPT.from_pretrained(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        GPT.from_pretrained(str(tmp_path))


def test_too_long_sequence_is_an_error():
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8))
    model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="length 9 is longer than block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_init_and_tied_weights():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=1000, n_layer=8, n_head=4, n_embd=256))
    assert model.lm_head.weight is model.transformer.wte.weight
    h = model.transformer.h[3]
    assert abs(h.attn.c_attn.weight.std().item() - 0.02) < 1e-3
    assert abs(h.mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    for proj in (h.attn.c_proj, h.mlp.c_proj):  # residual projections: 0.02 / sqrt(2 * n_layer)
        assert abs(proj.weight.std().item() - 0.02 / math.sqrt(16)) < 2e-4
    tables = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert tables and all(abs(w.std().item() - 0.02) < 1e-3 for w in tables)  # every embedding table
    assert h.attn.c_attn.bias.abs().max().item() == 0
    assert torch.equal(h.ln_1.weight, torch.ones(256))


def test_configure_optimizers():
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16))
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=3e-4, device_type="cpu")
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    named = dict(model.named_parameters())  # tied lm_head appears once
    assert {id(p) for p in decay["params"]} == {id(p) for n, p in named.items() if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for n, p in named.items() if p.dim() < 2}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8 and decay["lr"] == 3e-4
    assert decay["fused"]  # every device: a skipped step is found_inf on the device (issue 27)


def greedy_by_recompute(model, idx, n):
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


# past block_size=24 the window slides
@pytest.mark.parametrize("prompt,new_tokens", [(5, 10), (5, 30), (30, 6)])
def test_kv_cache_generation_equals_recompute(prompt, new_tokens):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, vocab_size=97, n_layer=3, n_head=4, n_embd=32)).eval()
    with torch.no_grad():  # larger weights so that the greedy path is not one repeated token
        for p in model.parameters():
            p.mul_(20)
    idx = torch.randint(0, 97, (3, prompt))
    out = model.generate(idx, new_tokens, top_k=1)
    ref = greedy_by_recompute(model, idx, new_tokens)
    assert out.shape == (3, prompt + new_tokens)
    assert torch.equal(out, ref)
    assert len(set(out[0, prompt:].tolist())) > 3  # a test that varied tokens can pass


def test_sampling_is_seeded():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.zeros(2, 1, dtype=torch.long)
    a = model.generate(idx, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    b = model.generate(idx, 10, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_flops_per_token_counts_matmuls():
    c = GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768)
    model = GPT(c)
    # the weights of the Linear layers, each once: the blocks' and the output layer's (the token
    # embedding, tied); a position table is looked up, not multiplied
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    n_matmul = sum(w.numel() for w in weights.values())
    assert flops_per_token(c, 1024) == 6 * n_matmul + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("bfloat16", 1.6e-2), ("float16", 2e-3)])  # 2 ulps
def test_linear_cross_entropy_matches_torch(dtype, rtol):
    """The CPU's training loss (gptkit/cpu.py: output layer + cross-entropy, gradient computed in
    the forward, in blocks of rows) against F.linear + F.cross_entropy in float32, under each
    autocast: same loss, same gradients for the hidden states and the (tied) weight."""
    import torch.nn.functional as F
    from gptkit.cpu import LinearCrossEntropy
    from gptkit.hardware import autocast
    g = torch.Generator().manual_seed(0)
    N, C, V = 100, 64, 50304  # 41 rows per block on CPU: 3 blocks, the last one short
    h, w = torch.randn(N, C, generator=g), torch.randn(V, C, generator=g) * 0.1
    targets = torch.randint(0, V, (N,), generator=g)
    grads = []
    for fused in (True, False):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        with autocast("cpu", dtype):
            if fused:
                loss = LinearCrossEntropy.apply(a, b, targets)
            else:
                loss = F.cross_entropy(F.linear(a, b).float(), targets)
        (2.5 * loss).backward()  # a scale, as the 1/grad_accum_steps (and float16's loss scale)
        grads.append((loss, a.grad, b.grad))
    (loss, gh, gw), (ref, rh, rw) = grads
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 1e-5 * ref.item()
    assert gh.dtype == gw.dtype == torch.float32
    for x, y in ((gh, rh), (gw, rw)):  # within 2 roundings of the autocast dtype of the largest entry
        assert (x - y).abs().max().item() <= rtol * y.abs().max().item()
        assert y.abs().max().item() > 1e-4  # not trivially small


def test_training_loss_and_gradients_match_hf(tmp_path):
    """model(x, y) while training on a CPU (the fused loss that gptkit/cpu.py:fuse_loss gives the
    trainer's model there, no logits returned) against HF transformers' GPT2LMHeadModel with the same
    weights: the same loss, and the same gradient for every parameter (Conv1D ones transposed). In
    eval the logits come back, with the same loss."""
    from gptkit.cpu import fuse_loss
    from model import HF_CONV1D_WEIGHTS
    hf = make_hf(tmp_path)
    model = GPT.from_pretrained(str(tmp_path))
    fuse_loss(model)
    idx = torch.randint(0, 300, (3, 48), generator=torch.Generator().manual_seed(2))
    x, y = idx[:, :-1], idx[:, 1:]
    logits, loss = model(x, y)
    assert logits is None
    loss.backward()
    ref = hf(idx, labels=idx)  # HF shifts the labels itself
    ref.loss.backward()
    assert abs(loss.item() - ref.loss.item()) < 1e-5
    hf_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        want = hf_grads[name].grad
        want = want.t() if name.endswith(HF_CONV1D_WEIGHTS) else want
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        logits, val = model(x, y)
    assert logits.shape == (3, 47, 300) and abs(val.item() - ref.loss.item()) < 1e-5


def test_the_loss_path_is_chosen_by_the_device(monkeypatch):
    """Issues 27.4 and 42: GPT.forward's training loss is F.cross_entropy on every device (the meta
    device stands in for CUDA here), the code that torch.compile fuses, so turning compile off to
    debug a GPU run changes no loss code; the CPU's fused loss is an instance's own forward, set by
    gptkit/cpu.py:fuse_loss (the trainer calls it on a CPU only), and only for a training step. The
    per-target losses of reduction='none' are -log softmax at the target, computed here by hand in
    float64, and 0 where a target is -1."""
    from gptkit import cpu
    calls = []
    fused = cpu.LinearCrossEntropy.apply
    monkeypatch.setattr(cpu.LinearCrossEntropy, "apply",
                        lambda h, *a: calls.append(h.device.type) or fused(h, *a))
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=2, n_embd=32)
    for device in ("cpu", "meta"):
        model = GPT(config).to(device)
        x, y = torch.randint(0, 300, (2, 3, 16), device=device)
        logits, loss = model(x, y)
        assert logits is not None and loss.shape == ()
    assert calls == []
    cpu.fuse_loss(model := GPT(config))
    x, y = torch.randint(0, 300, (2, 3, 16))
    assert model(x, y)[0] is None and calls == ["cpu"]
    with torch.no_grad():
        assert model(x, y)[0] is not None and calls == ["cpu"]
    model = GPT(config)
    x, y = torch.randint(0, 300, (2, 3, 16))
    y[0, :5] = -1
    with torch.no_grad():
        logits, losses = model(x, y, reduction="none")
    z = logits.double()
    z = z - z.max(-1, keepdim=True).values
    # -log softmax at the target: log sum exp - the target's logit
    ref = z.exp().sum(-1).log() - z.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    ref[y == -1] = 0
    assert losses.shape == (3, 16) and (losses[0, :5] == 0).all() and (losses[0, 5:] > 0).all()
    torch.testing.assert_close(losses.double(), ref, rtol=1e-6, atol=1e-6)


def test_a_copy_of_the_cpu_model_computes_with_its_own_weights():
    """An EMA of the weights starts as copy.deepcopy(model): on a CPU, where fuse_loss gave the model
    its fused training loss, the copy's loss comes from the copy's weights (it equals a fresh unfused
    GPT's with them, not the original's), and the copy keeps the fused loss."""
    from gptkit.cpu import fuse_loss
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=2, n_embd=32)
    fuse_loss(model := GPT(config))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    fresh = GPT(config)
    fresh.load_state_dict(ema.state_dict())
    x, y = torch.randint(0, 300, (2, 3, 16))
    logits, loss = ema(x, y)
    assert logits is None  # the fused loss
    assert abs(loss.item() - model(x, y)[1].item()) > 1e-3
    assert abs(loss.item() - fresh(x, y)[1].item()) < 1e-5


@pytest.mark.parametrize("grad", [True, False])
def test_forward_compiles_to_one_graph(grad):
    """torch.compile traces GPT.forward (targets given: the trainer's step with grad, its val loss
    without) into one graph: no graph break, under which the fused CPU loss or anything else would
    run outside the compiled code; and the compiled loss is the eager F.cross_entropy one."""
    import torch._dynamo
    torch.manual_seed(0)
    from gptkit.cpu import fuse_loss
    model = GPT(GPTConfig(block_size=16, vocab_size=300, n_layer=2, n_head=2, n_embd=32))
    fuse_loss(model)  # as the trainer's model on a CPU: compiled, its own forward steps aside
    x, y = torch.randint(0, 300, (2, 3, 16))
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        explained = torch._dynamo.explain(model)(x, y)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        _, loss = torch.compile(model, backend="eager", fullgraph=True)(x, y)  # a break: an error
        with torch.no_grad():
            _, ref = model(x, y)  # no grad: the plain F.cross_entropy, not the fused loss
    assert abs(loss.item() - ref.item()) < 1e-6


def test_dropout_masks_follow_each_sequence_and_train_mode_alone():
    """Issue 43: dropout (an attribute, not the shape) drops about its fraction of values, scaled
    up; each sequence's masks follow its key, not its row in the batch or what else the batch
    holds; other keys draw other masks, and without keys torch's generator draws them; eval mode or
    dropout 0 drop nothing. HellaSwag scores in eval mode whatever mode the model came in."""
    from gptkit import hellaswag_eval as hellaswag
    from test_hellaswag import make_examples
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32))
    assert "dropout" not in model.config.__dict__ and GPT.dropout == 0.0
    x = torch.randint(0, 512, (4, 16))
    keys = torch.arange(4) + (12345 << 32)
    plain = model.hidden_states(x)
    model.dropout = 0.25
    dropped = model.hidden_states(x, dropout_keys=keys)
    assert not torch.allclose(plain, dropped)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(model.hidden_states(x[perm], dropout_keys=keys[perm]), dropped[perm])
    assert torch.equal(model.hidden_states(x[:1], dropout_keys=keys[:1]), dropped[:1])  # alone
    assert not torch.allclose(model.hidden_states(x, dropout_keys=keys + 1), dropped)
    ones = model.drop(torch.ones(64, 32, 32), torch.arange(64), 3)
    assert abs((ones == 0).float().mean().item() - 0.25) < 0.01 and ones.max().item() == pytest.approx(4 / 3)
    assert not torch.allclose(model.hidden_states(x), plain)  # no keys: drawn
    assert torch.equal(model.eval().hidden_states(x, dropout_keys=keys), plain)
    examples = make_examples(8)
    prepared = hellaswag.prepare(examples, 64, "cpu")
    want = hellaswag.evaluate(model, prepared)
    assert torch.equal(hellaswag.evaluate(model.train(), prepared), want) and not model.training
