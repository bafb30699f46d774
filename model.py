"""
GPT-2 in one file: the model, its init, optimizer groups, loading OpenAI/HF weights, generation.
Parameter names follow OpenAI/HF GPT-2 (transformer.wte, transformer.h.N.attn.c_attn, ...), so
weights move between this model and HF's GPT2LMHeadModel with only the Conv1D transposes.
"""
import ctypes
import inspect
import json
import os
import pickle
import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length (positions)
    vocab_size: int = 50257  # 50,000 BPE merges + 256 bytes + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class LinearCrossEntropy(torch.autograd.Function):
    """Training loss: the mean cross-entropy of the output layer's logits h @ weight.T, which
    computes their gradient in the forward pass. The logits (N, V) are the one large tensor: each
    block of rows turns into softmax - onehot in place while it is in cache, and the backward is
    two matmuls. F.linear + F.cross_entropy allocate and stream over four (N, V) tensors (logits,
    log-probabilities, and two gradients) instead: on a CPU this step is ~20-40% faster and peaks
    ~40% lower (bench.py). Same loss and gradients, to float rounding."""

    @staticmethod
    def forward(ctx, h, weight, targets):  # h (N, C), weight (V, C), targets (N,)
        logits = F.linear(h, weight)  # (N, V), in autocast's dtype
        N, V = logits.shape
        rows = max(1, (2 ** 21 if logits.is_cpu else 2 ** 28) // V)  # CPU: ~8 MB of float32, in cache
        loss = torch.zeros((), device=h.device)
        for i in range(0, N, rows):
            block = logits[i:i + rows]
            x = block.float()  # block itself in float32, else a float32 copy: exp and sums in float32
            t = targets[i:i + rows, None]
            lse = torch.logsumexp(x, dim=1, keepdim=True)
            loss += (lse - x.gather(1, t)).sum()
            x.sub_(lse).exp_()  # softmax
            x.scatter_add_(1, t, torch.full_like(t, -1, dtype=x.dtype))  # - onehot
            if x is not block:
                block.copy_(x)
        # the 1/N and the loss scale wait for the backward: in float16, (softmax - onehot) / N
        # of a large batch would underflow, as F.cross_entropy's gradient does before scaling
        ctx.save_for_backward(h, weight, logits)
        return loss / N

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, grad = ctx.saved_tensors  # grad (N, V): softmax - onehot
        scale = grad_loss / grad.size(0)
        grad_h = (grad @ weight.to(grad.dtype)).mul_(scale)  # (N, C)
        grad_w = grad.t() @ (h.to(grad.dtype) * scale)  # (V, C): h scaled first, as F.cross_entropy's float16 gradient
        return grad_h.to(h.dtype), grad_w.to(weight.dtype), None


PRECISIONS = ('float32', 'float16', 'bfloat16')  # from the least capable hardware to the most
AUTOCAST_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


def autocast(device, dtype):
    """Autocast to dtype ("bfloat16" or "float16") on device; a no-op context for "float32"."""
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES.get(dtype, torch.bfloat16),
                          enabled=dtype in AUTOCAST_DTYPES)


def cpu_has_bf16():
    """True where this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 units) and oneDNN uses
    them; elsewhere (AVX2-only CPUs, ARM here) bf16 matmuls are emulated, ~100x slower than float32."""
    caps = getattr(torch.cpu, 'get_capabilities', lambda: {})()  # torch >= 2.10
    try:
        units = bool(caps.get('avx512_bf16') or caps.get('amx_bf16') or torch.cpu._is_avx512_bf16_supported()
                     or torch.cpu._is_amx_tile_supported())
        return units and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # an older torch or a build without oneDNN
        return False


def resolve_dtype(dtype, device):
    """(dtype, why): "auto" made concrete for device, the same answer on every call."""
    if dtype != 'auto':
        return dtype, 'as configured'
    device = torch.device(device)
    if device.type == 'cuda':
        name, cc = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        if cc >= (8, 0):  # Ampere and newer: bf16 tensor cores, float32's range, no loss scaling
            return 'bfloat16', f'auto: {name} (compute capability {cc[0]}.{cc[1]}) has bf16'
        return 'float16', (f'auto: {name} (compute capability {cc[0]}.{cc[1]}) has no bf16; float16 with '
                           f'loss scaling')
    if device.type == 'cpu':
        if cpu_has_bf16():
            return 'bfloat16', 'auto: this CPU has bf16 units, AVX512-BF16 or AMX'
        return 'float32', 'auto: this CPU has no bf16 units; bf16 would be emulated, ~100x slower'
    # MPS: float16 gains memory but no arithmetic speed on Apple GPUs and needs loss scaling; bf16
    # needs macOS 14: float32 is the choice that works everywhere
    return 'float32', f'auto: float32 on {device.type}'


def reuse_freed_memory():
    """glibc hands every large tensor (the logits: B*T*vocab floats) back to the OS when it is
    freed, and the next step page-faults gigabytes of zeroed pages back in: on a CPU that system
    time can be half the step. Serve large blocks from the heap and never trim it instead."""
    mallopt = getattr(ctypes.CDLL(None), 'mallopt', None)  # glibc; absent on macOS and musl
    if mallopt is not None:
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        mallopt(M_MMAP_MAX, 0)
        mallopt(M_TRIM_THRESHOLD, -1)  # -1 is SIZE_MAX to glibc: never trim


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # writes into the residual stream: init scaled down
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, kv_cache=None, start_pos=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is None or start_pos == 0:
            mask = None  # plain causal attention over these T tokens
        else:
            # the T new queries sit at positions start_pos.. and see every cached key before them
            mask = torch.ones(T, start_pos + T, dtype=torch.bool, device=x.device).tril(start_pos)
        if kv_cache is not None:  # (2, B, nh, >= start_pos + T, hs), filled up to start_pos
            kv_cache[0, :, :, start_pos:start_pos + T] = k
            kv_cache[1, :, :, start_pos:start_pos + T] = v
            k, v = kv_cache[0, :, :, :start_pos + T], kv_cache[1, :, :, :start_pos + T]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate='tanh')  # GPT-2 was trained with the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, start_pos=0):
        x = x + self.attn(self.ln_1(x), kv_cache, start_pos)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input/output embeddings, as GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, 'RESIDUAL_SCALE_INIT', False):
                std *= (2 * self.config.n_layer) ** -0.5  # two residual additions per layer
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx, kv_cache=None, start_pos=0):
        """The final hidden states (B, T, n_embd), before the output layer. idx: (B, T) token ids;
        kv_cache: None, or per layer a (2, B, nh, L, hs) buffer, L >= start_pos + T (see generate)."""
        B, T = idx.size()
        if start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of length {start_pos + T} is longer than block_size={self.config.block_size}")
        pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, n_embd)
        for i, block in enumerate(self.transformer.h):
            x = block(x, None if kv_cache is None else kv_cache[i], start_pos)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None, start_pos=0):
        # idx: (B, T) token ids; targets: (B, T) or None
        h = self.hidden_states(idx, kv_cache, start_pos)  # (B, T, n_embd)
        if targets is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # training: the loss and its gradient in one pass over the logits, which are not returned
            # (inductor fuses F.cross_entropy by itself, and eval needs no gradient)
            return None, LinearCrossEntropy.apply(h.view(-1, h.size(-1)), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(h)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, device_type):
        # decay the matrices (matmul weights, embeddings); not biases and LayerNorm gains (dim < 2)
        params = [p for p in self.parameters() if p.requires_grad]  # parameters() lists tied ones once
        optim_groups = [
            {'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0},
        ]
        use_fused = device_type == 'cuda' and 'fused' in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=use_fused)

    # -------------------------------------------------------------------------
    # OpenAI / HF weights

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """One of gpt2, gpt2-medium, gpt2-large, gpt2-xl (through HF transformers, downloaded when
        online), or a local directory holding a HF GPT2LMHeadModel (save_pretrained output)."""
        if name_or_dir in ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'):
            try:
                from transformers import GPT2LMHeadModel
            except ImportError as e:
                raise ImportError(f"init from {name_or_dir!r} needs HF transformers: pip install transformers") from e
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
            return cls.from_hf_state_dict(hf.config.to_dict(), hf.state_dict(), name_or_dir)
        if not os.path.isdir(name_or_dir):
            raise FileNotFoundError(f"{name_or_dir!r} is neither an OpenAI GPT-2 name (gpt2, gpt2-medium, "
                                    f"gpt2-large, gpt2-xl) nor a directory")
        config_path = os.path.join(name_or_dir, 'config.json')
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{config_path} not found: {name_or_dir} is not a HF GPT2LMHeadModel directory "
                                    f"(save_pretrained writes config.json and model.safetensors)")
        try:
            with open(config_path) as f:
                hf_config = json.load(f)
        except ValueError as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
        return cls.from_hf_state_dict(hf_config, load_hf_weights(name_or_dir), name_or_dir)

    @classmethod
    def from_hf_state_dict(cls, hf_config, sd_hf, source):
        """Build a GPT from a HF GPT-2 config dict and state dict; errors name `source` and the key."""
        expected = {'model_type': ('gpt2',), 'activation_function': ('gelu_new', 'gelu_pytorch_tanh'),
                    'scale_attn_weights': (True,), 'scale_attn_by_inverse_layer_idx': (False,),
                    'add_cross_attention': (False,), 'tie_word_embeddings': (True,), 'layer_norm_epsilon': (1e-5,)}
        expected['n_inner'] = (None, 4 * hf_config.get('n_embd', 0))  # the MLP's width
        for key, allowed in expected.items():
            if hf_config.get(key, allowed[0]) not in allowed:
                raise ValueError(f"{source}: config {key}={hf_config[key]!r}, this GPT-2 supports {allowed}")
        try:
            config = GPTConfig(block_size=hf_config['n_positions'], vocab_size=hf_config['vocab_size'],
                               n_layer=hf_config['n_layer'], n_head=hf_config['n_head'], n_embd=hf_config['n_embd'])
        except KeyError as e:
            raise ValueError(f"{source}: config has no key {e.args[0]!r}") from None
        model = cls(config)
        sd = model.state_dict()
        # HF keeps the causal mask as buffers; GPT2Model checkpoints (no LM head) lack the prefix
        sd_hf = {k if k.startswith(('transformer.', 'lm_head.')) else 'transformer.' + k: v
                 for k, v in sd_hf.items() if not k.endswith(('.attn.bias', '.attn.masked_bias'))}
        unexpected = sorted(set(sd_hf) - set(sd))
        if unexpected:
            raise ValueError(f"{source}: unexpected key {unexpected[0]!r} ({len(unexpected)} in all) for a GPT-2")
        # HF's Conv1D stores (in, out); nn.Linear wants (out, in)
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        with torch.no_grad():
            for k in sd:
                if k == 'lm_head.weight' and k not in sd_hf:
                    continue  # tied to transformer.wte.weight
                if k not in sd_hf:
                    raise ValueError(f"{source}: missing key {k!r}")
                w = sd_hf[k].t() if k.endswith(transposed) else sd_hf[k]
                if w.shape != sd[k].shape:
                    raise ValueError(f"{source}: key {k!r} has shape {tuple(w.shape)}"
                                     f"{' (transposed from Conv1D)' if k.endswith(transposed) else ''}, "
                                     f"expected {tuple(sd[k].shape)} for {config}")
                sd[k].copy_(w)
            if 'lm_head.weight' in sd_hf and not torch.equal(sd_hf['lm_head.weight'], sd_hf['transformer.wte.weight']):
                raise ValueError(f"{source}: lm_head.weight differs from transformer.wte.weight; GPT-2 ties them")
        return model

    # -------------------------------------------------------------------------
    # generation

    def new_kv_cache(self, B, length):
        """Empty key/value buffers for B sequences of up to `length` positions: per layer
        (2, B, nh, length, hs), in autocast's dtype when it is on (k and v come in that dtype)."""
        nh, hs = self.config.n_head, self.config.n_embd // self.config.n_head
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return [torch.empty(2, B, nh, length, hs, device=device, dtype=dtype) for _ in self.transformer.h]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Append max_new_tokens sampled tokens to idx (B, T) and return it. Keys and values are
        cached, so each new token costs one position's forward. Once the sequence outgrows
        block_size the positions of all tokens shift, and the window is recomputed each step."""
        bs = self.config.block_size
        kv_cache = self.new_kv_cache(idx.size(0), min(bs, idx.size(1) + max_new_tokens))  # the longest window
        n_cached = 0  # positions of idx[:, -bs:] already in the cache
        for _ in range(max_new_tokens):
            if idx.size(1) > bs:  # the window slid: cached positions are stale
                n_cached = 0
            window = idx[:, -bs:]
            logits, _ = self(window[:, n_cached:], kv_cache=kv_cache, start_pos=n_cached)
            n_cached = window.size(1)
            logits = logits[:, -1, :].float() / temperature  # (B, vocab_size)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def load_hf_weights(model_dir):
    """State dict of a HF model directory: model.safetensors, pytorch_model.bin or their sharded
    forms (an *.index.json naming the shards). Never unpickles code."""
    def load(path):
        if path.endswith('.safetensors'):
            from safetensors.torch import load_file
            return load_file(path)
        return torch.load(path, map_location='cpu', weights_only=True)
    for name in ('model.safetensors', 'pytorch_model.bin'):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return load(path)
        if os.path.isfile(path + '.index.json'):
            with open(path + '.index.json') as f:
                shards = sorted(set(json.load(f)['weight_map'].values()))
            sd = {}
            for shard in shards:
                sd.update(load(os.path.join(model_dir, shard)))
            return sd
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or pytorch_model.bin (or their .index.json) found")


class SkipInit(torch.overrides.TorchFunctionMode):
    """Within it, the in-place torch.nn.init functions do nothing: for a model whose weights are
    all loaded next (a missing one is an error), the random init of GPT-2 124M would be ~0.8 s
    of a run's start."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, '__module__', None) == 'torch.nn.init' and func.__name__.endswith('_'):
            return args[0] if args else kwargs['tensor']
        return func(*args, **kwargs)


def load_model(name, device):
    """An OpenAI name, a HF model folder, or a train_gpt2.py checkpoint (.pt)."""
    if name in ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'):  # through HF, which has its own init
        return GPT.from_pretrained(name).to(device).eval()
    with SkipInit():
        if name.endswith('.pt'):
            try:
                ckpt = torch.load(name, map_location='cpu', weights_only=True, mmap=True)
                model = GPT(GPTConfig(**ckpt['config']))
                model.load_state_dict(ckpt['model'])  # strict: every weight
            except (RuntimeError, KeyError, TypeError, AttributeError, pickle.UnpicklingError) as e:  # not ours
                raise ValueError(f"{name}: not a readable train_gpt2.py checkpoint ({type(e).__name__}: {e})") from None
        else:
            model = GPT.from_pretrained(name)  # every weight, or an error
    return model.to(device).eval()


def flops_per_token(config, T):
    """Model FLOPs to train on one token (forward + backward) at sequence length T: 6 per
    parameter that multiplies (the position table only adds), plus attention's QK^T and AV."""
    n = config.n_layer * 12 * config.n_embd ** 2 + config.vocab_size * config.n_embd
    attn = config.n_layer * 2 * 2 * T * config.n_embd  # QK^T and AV, each 2 * T * n_embd per token
    return 6 * n + 3 * attn


# dense bf16/fp16 tensor-core peaks from NVIDIA's datasheets (FLOP/s), the first name that matches
GPU_PEAK_FLOPS = (('H200', 989e12), ('H100 PCIe', 756e12), ('H100 NVL', 835e12), ('H100', 989e12), ('A100', 312e12),
                  ('L40S', 362e12), ('L40', 181e12), ('A10G', 70e12), ('A10', 125e12), ('L4', 121e12),
                  ('RTX 4090', 165e12), ('RTX 3090', 71e12), ('V100', 125e12), ('B200', 2250e12))


def sync(device):
    """Wait for the device's queued work (for timing)."""
    if device.startswith('cuda'):
        torch.cuda.synchronize()
    elif device == 'mps':
        torch.mps.synchronize()


def matmul_flops(device, dtype, n=None, reps=10):
    """FLOP/s of an n x n @ n x n matmul in dtype on device (bf16/fp16 inputs, as autocast makes them)."""
    n = n or (8192 if device.startswith('cuda') else 2048)
    a, b = (torch.randn(n, n, device=device, dtype=AUTOCAST_DTYPES.get(dtype, torch.float32)) for _ in range(2))
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def peak_flops(device, dtype):
    """(FLOP/s, where from) for MFU: a known NVIDIA GPU's datasheet peak in bf16/fp16, else a
    small matmul measured now (CPUs, float32, other GPUs)."""
    if device.startswith('cuda') and dtype in AUTOCAST_DTYPES:
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:  # the longer names first: 'L40' before 'L4'
            if re.search(rf"\b{key}\b", name):
                return flops, f"{name} datasheet"
    return matmul_flops(device, dtype, n=512 if device == 'cpu' else 4096, reps=5), "measured matmul"
