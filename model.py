"""
GPT-2 in one file: the model, its init, optimizer groups, OpenAI/HF weights in and out, the tools'
checkpoint reader, generation. Parameter names follow OpenAI/HF GPT-2 (transformer.wte,
transformer.h.N.attn.c_attn, ...), so weights move between this model and HF's GPT2LMHeadModel
with only the Conv1D transposes.
"""
import json
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F

from gptkit.tokenizer import N_VOCAB

OPENAI_MODELS = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')  # through HF transformers
# HF's GPT-2 keeps these weights as Conv1D, (in, out); nn.Linear holds (out, in)
HF_CONV1D_WEIGHTS = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
HF_MASK_BUFFERS = ('.attn.bias', '.attn.masked_bias')  # HF's causal mask, in older saves: not weights


@dataclass
class GPTConfig:
    block_size: int = 1024  # max sequence length (positions)
    vocab_size: int = N_VOCAB  # GPT-2's tokens
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768

    @classmethod
    def from_dict(cls, d):
        """The shape from a dict that holds these five keys, and maybe more: a checkpoint's
        'config', or the trainer's whole config."""
        return cls(**{f.name: d[f.name] for f in fields(cls)})


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, \
            f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # writes into the residual stream: init scaled down
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, mask=None, kv_cache=None, start_pos=0):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if kv_cache is not None:  # (2, B, nh, >= start_pos + T, hs), filled up to start_pos
            kv_cache[:, :, :, start_pos:start_pos + T] = torch.stack((k, v))
            k, v = kv_cache[:, :, :, :start_pos + T]  # every key and value so far
        # mask: which keys each query sees (True); None: plain causal attention over these T tokens
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

    def forward(self, x, mask=None, kv_cache=None, start_pos=0, drop=lambda y, j: y):
        # drop(y, j): dropout of residual branch j's output in training (GPT.drop); by default, none
        x = x + drop(self.attn(self.ln_1(x), mask, kv_cache, start_pos), 0)
        x = x + drop(self.mlp(self.ln_2(x)), 1)
        return x


def hash32(x):
    """A hash of each value of an int64 tensor (its low 32 bits), into [0, 2**32): the same bits on
    every device, eager or compiled (no product reaches 2**63)."""
    x = x & 0xFFFFFFFF
    for _ in range(2):
        x = (x ^ (x >> 16)) * 0x45D9F3B & 0xFFFFFFFF
    return x ^ (x >> 16)


class GPT(nn.Module):
    dropout = 0.0  # the fraction of activations dropped in training: the trainer's setting, not the shape

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
            # the layers that write into the residual stream: scaled down for its two additions per layer
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if hasattr(module, 'RESIDUAL_SCALE_INIT') else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def drop(self, x, keys, site):
        """x (B, ...) with a fraction self.dropout of its values zeroed and the rest scaled up, in
        training. Sequence b's mask is a function of keys[b] (int64) and the site alone: the same
        whatever else the batch holds, on any device, eager or compiled (the trainer's keys: the
        seed, the step and the sequence's place in it; without keys, torch's generator draws them).
        Attention weights are not dropped: SDPA draws their masks from the batch as a whole."""
        if not self.training or self.dropout == 0:
            return x
        if keys is None:
            keys = torch.randint(2 ** 62, (x.size(0),), device=x.device)
        key = hash32(hash32(hash32(keys >> 32) + keys) + site).view(-1, *[1] * (x.dim() - 1))  # (B, 1, ..)
        place = torch.arange(x[0].numel(), device=x.device).view(x.shape[1:])  # < 2**27 in x[b]
        where = (key << 27) + place  # one number per (sequence, value)
        keep = hash32(hash32(where >> 32) + where) >= round(self.dropout * 2 ** 32)
        return x * keep / (1 - self.dropout)

    def hidden_states(self, idx, kv_cache=None, start_pos=0, pos=None, mask=None, dropout_keys=None):
        """The final hidden states (B, T, n_embd), before the output layer. idx: (B, T) token ids;
        kv_cache: None, or per layer a (2, B, nh, L, hs) buffer, L >= start_pos + T (see generate).
        Sequences that pack several texts (hellaswag.py: a context, then its endings) give their own
        positions pos (B, T) and attention mask (B, 1, T, T): which keys each query sees. In training
        with dropout, dropout_keys (B,) int64 draw each sequence's masks (drop)."""
        B, T = idx.size()
        if pos is None and start_pos + T > self.config.block_size:
            raise ValueError(f"sequence of length {start_pos + T} is longer than "
                             f"block_size={self.config.block_size}")
        if pos is None:
            pos = torch.arange(start_pos, start_pos + T, dtype=torch.long, device=idx.device)  # (T,)
        if mask is None and start_pos > 0:  # the T new queries see every cached key before them
            mask = torch.ones(T, start_pos + T, dtype=torch.bool, device=idx.device).tril(start_pos)
        x = self.drop(self.transformer.wte(idx) + self.transformer.wpe(pos), dropout_keys, 0)  # (B, T, C)
        for i, block in enumerate(self.transformer.h):  # block i's dropout sites: 1 + 2i and 2 + 2i
            drop = lambda y, j, i=i: self.drop(y, dropout_keys, 1 + 2 * i + j)  # noqa: E731
            x = block(x, mask, None if kv_cache is None else kv_cache[i], start_pos, drop)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None, start_pos=0, reduction='mean', dropout_keys=None):
        # idx: (B, T) token ids; targets: (B, T) or None, -1 where nothing is to be predicted;
        # reduction='none': the loss of each target, (B, T), 0 where it is -1; dropout_keys: see drop
        h = self.hidden_states(idx, kv_cache, start_pos, dropout_keys=dropout_keys)  # (B, T, n_embd)
        logits = self.lm_head(h)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1),
                                   ignore_index=-1, reduction=reduction)
            loss = loss.view(targets.shape) if reduction == 'none' else loss
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, device_type, optimizer='adamw', muon_lr=None,
                             muon_momentum=0.95):
        """AdamW (betas 0.9, 0.95) over every parameter, decaying the matrices (matmul weights,
        embeddings) but not biases and LayerNorm gains (dim < 2). optimizer="muon": the blocks'
        matmul weights go to Muon instead (peak lr muon_lr; its groups carry lr_scale = muon_lr /
        learning_rate, by which the trainer scales its scheduled lr), the rest stays with AdamW. AdamW is
        the fused kernel whatever device_type (kept for callers): the trainer skips a step on the device
        through its found_inf, as GradScaler does."""
        params = [p for p in self.parameters() if p.requires_grad]  # parameters() lists tied ones once
        # with Muon: the blocks' matmul weights go to it
        to_muon = ({id(p) for block in self.transformer.h for p in block.parameters() if p.dim() == 2}
                   if optimizer == 'muon' else set())
        muon, rest = [p for p in params if id(p) in to_muon], [p for p in params if id(p) not in to_muon]
        optim_groups = [
            {'params': [p for p in rest if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in rest if p.dim() < 2], 'weight_decay': 0.0},
        ]
        # fused on every device: one kernel, and a step it is told to skip (found_inf) changes nothing
        adamw = dict(lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=True)
        if optimizer != 'muon':
            return torch.optim.AdamW(optim_groups, **adamw)
        from gptkit.optim import MuonAdamW
        muon_groups = [{'params': muon, 'weight_decay': weight_decay, 'lr_scale': muon_lr / learning_rate}]
        return MuonAdamW(muon_groups, optim_groups, dict(lr=muon_lr, momentum=muon_momentum, nesterov=True,
                                                         adjust_lr_fn='match_rms_adamw'), adamw)

    # -------------------------------------------------------------------------
    # OpenAI / HF weights, into this model (to_hf_state_dict, below, is the way out)

    @classmethod
    def empty(cls, config, device='cpu'):
        """A GPT of config on device, its weights not initialised: for weights that are all loaded
        next (a missing one is an error), the random init is wasted time at a start (docs/benchmarks.md
        has how much, for GPT-2 124M)."""
        with torch.device('meta'):  # no memory, no init, no draw from the RNG
            model = cls(config)
        model.to_empty(device=device)
        model.lm_head.weight = model.transformer.wte.weight  # to_empty unties them
        return model

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """One of OPENAI_MODELS (through HF transformers, downloaded when online), or a local
        directory holding a HF GPT2LMHeadModel (save_pretrained output)."""
        if name_or_dir in OPENAI_MODELS:
            try:
                from transformers import GPT2LMHeadModel
            except ImportError as e:
                raise ImportError(f"init from {name_or_dir!r} needs HF transformers: "
                                  f"pip install transformers") from e
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
            return cls.from_hf_state_dict(hf.config.to_dict(), hf.state_dict(), name_or_dir)
        if not os.path.isdir(name_or_dir):
            raise FileNotFoundError(f"{name_or_dir!r} is neither an OpenAI GPT-2 name "
                                    f"({', '.join(OPENAI_MODELS)}) nor a directory")
        config_path = os.path.join(name_or_dir, 'config.json')
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{config_path} not found: {name_or_dir} is not a HF GPT2LMHeadModel "
                                    f"directory (save_pretrained writes config.json and model.safetensors)")
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
                    'add_cross_attention': (False,), 'tie_word_embeddings': (True,),
                    'layer_norm_epsilon': (1e-5,)}
        expected['n_inner'] = (None, 4 * hf_config.get('n_embd', 0))  # the MLP's width
        for key, allowed in expected.items():
            if hf_config.get(key, allowed[0]) not in allowed:
                raise ValueError(f"{source}: config {key}={hf_config[key]!r}, this GPT-2 supports {allowed}")
        try:
            config = GPTConfig(block_size=hf_config['n_positions'], vocab_size=hf_config['vocab_size'],
                               n_layer=hf_config['n_layer'], n_head=hf_config['n_head'],
                               n_embd=hf_config['n_embd'])
        except KeyError as e:
            raise ValueError(f"{source}: config has no key {e.args[0]!r}") from None
        model = cls.empty(config)
        sd = model.state_dict()
        # HF keeps the causal mask as buffers; GPT2Model checkpoints (no LM head) lack the prefix
        sd_hf = {k if k.startswith(('transformer.', 'lm_head.')) else 'transformer.' + k: v
                 for k, v in sd_hf.items() if not k.endswith(HF_MASK_BUFFERS)}
        unexpected = sorted(set(sd_hf) - set(sd))
        if unexpected:
            raise ValueError(f"{source}: unexpected key {unexpected[0]!r} ({len(unexpected)} in all) "
                             f"for a GPT-2")
        with torch.no_grad():
            for k in sd:
                if k == 'lm_head.weight' and k not in sd_hf:
                    continue  # tied to transformer.wte.weight
                if k not in sd_hf:
                    raise ValueError(f"{source}: missing key {k!r}")
                w = sd_hf[k].t() if k.endswith(HF_CONV1D_WEIGHTS) else sd_hf[k]
                if w.shape != sd[k].shape:
                    conv1d = ' (transposed from Conv1D)' if k.endswith(HF_CONV1D_WEIGHTS) else ''
                    raise ValueError(f"{source}: key {k!r} has shape {tuple(w.shape)}{conv1d}, "
                                     f"expected {tuple(sd[k].shape)} for {config}")
                sd[k].copy_(w)
            if 'lm_head.weight' in sd_hf and not torch.equal(sd_hf['lm_head.weight'],
                                                             sd_hf['transformer.wte.weight']):
                raise ValueError(f"{source}: lm_head.weight differs from transformer.wte.weight; "
                                 f"GPT-2 ties them")
        return model

    # -------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Append max_new_tokens sampled tokens to idx (B, T) and return it. Keys and values are
        cached, so each new token costs one position's forward. Once the sequence outgrows
        block_size the positions of all tokens shift, and the window is recomputed each step."""
        bs, nh, hs = self.config.block_size, self.config.n_head, self.config.n_embd // self.config.n_head
        dtype = (torch.get_autocast_dtype(idx.device.type) if torch.is_autocast_enabled(idx.device.type)
                 else self.lm_head.weight.dtype)  # of k and v
        # per layer, its keys and values: (2, B, nh, window, hs)
        kv_cache = [torch.empty(2, idx.size(0), nh, min(bs, idx.size(1) + max_new_tokens), hs,
                                device=idx.device, dtype=dtype) for _ in self.transformer.h]
        n_cached = 0  # positions of idx[:, -bs:] already in the cache
        for _ in range(max_new_tokens):
            n_cached = n_cached if idx.size(1) <= bs else 0  # once the window slides, the cache is stale
            logits, _ = self(idx[:, -bs:][:, n_cached:], kv_cache=kv_cache, start_pos=n_cached)  # new ones
            n_cached = min(idx.size(1), bs)  # the window's positions, all in the cache now
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
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or pytorch_model.bin "
                            f"(or their .index.json) found")


def to_hf_state_dict(state, vocab_size):
    """Our state dict as HF GPT2LMHeadModel's, in float32: Conv1D weights transposed, the
    vocabulary cut to vocab_size (a padded one's extra rows dropped), lm_head left out (tied to
    transformer.wte.weight)."""
    out = {}
    for k, v in state.items():
        if k == 'lm_head.weight':
            continue
        v = v.float()
        if k.endswith(HF_CONV1D_WEIGHTS):
            v = v.t()
        if k == 'transformer.wte.weight':
            v = v[:vocab_size]
        out[k] = v.contiguous()
    return out


def flops_per_token(config, T):
    """Model FLOPs to train on one token (forward + backward) at sequence length T: 6 per
    parameter that multiplies (the position table only adds), plus attention's QK^T and AV."""
    n = config.n_layer * 12 * config.n_embd ** 2 + config.vocab_size * config.n_embd
    attn = config.n_layer * 2 * 2 * T * config.n_embd  # QK^T and AV, each 2 * T * n_embd per token
    return 6 * n + 3 * attn
