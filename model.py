"""GPT-2 in one file: the model, its init and optimizer, OpenAI/HF weights in and out, generation.
Parameter names are HF's (transformer.h.N.attn.c_attn, ...): weights move with Conv1D transposes."""
import json
import os
from dataclasses import dataclass, fields
from typing import Callable

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
    def from_dict(cls, d):  # a checkpoint's 'config', or the trainer's whole config
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Context:
    """What a block needs from the forward that calls it, besides x: one per block and call."""
    kv_cache: torch.Tensor = None  # (2, B, nh, start_pos + T, hs): keys and values so far, x's last
    mask: torch.Tensor = None  # which keys each query sees (True); None: causal over these T tokens
    drop: Callable = lambda y, j: y  # dropout of the block's residual branch j (GPT.drop)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v for all heads in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True  # writes into the residual stream: init scaled down
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, ctx=Context()):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if ctx.kv_cache is not None:
            ctx.kv_cache[:, :, :, -T:] = torch.stack((k, v))  # x's, after the cached ones
            k, v = ctx.kv_cache  # every key and value so far
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask,
                                           is_causal=ctx.mask is None)  # (B, nh, T, hs)
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

    def forward(self, x, ctx=Context()):
        x = x + ctx.drop(self.attn(self.ln_1(x), ctx), 0)
        x = x + ctx.drop(self.mlp(self.ln_2(x)), 1)
        return x


def hash32(x):
    # each int64's low 32 bits hashed into [0, 2**32): the same bits on any device, eager or compiled
    x = x & 0xFFFFFFFF
    for _ in range(2):
        x = (x ^ (x >> 16)) * 0x45D9F3B & 0xFFFFFFFF  # no product reaches 2**63
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
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if hasattr(module, 'RESIDUAL_SCALE_INIT') else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def drop(self, x, keys, site):
        """Dropout of x (B, ...) in training: sequence b's mask depends on keys[b] (int64) and site alone,
        so on any number of devices (no keys: drawn). Not of attention: SDPA's masks are batch-wide."""
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
        """The final hidden states (B, T, n_embd) of idx (B, T). Packed rows (hellaswag) give their
        own positions pos (B, T) and mask (B, 1, T, T); kv_cache: a buffer per layer (generate)."""
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
            kv = None if kv_cache is None else kv_cache[i][:, :, :, :start_pos + T]  # so far
            x = block(x, Context(kv, mask, drop))
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None, start_pos=0, reduction='mean', dropout_keys=None):
        # targets (B, T): -1 where nothing is predicted; reduction='none': each target's loss (B, T)
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
        """AdamW, decaying matrices but not biases and gains; optimizer='muon': the blocks' matrices
        go to Muon at muon_lr (its lr_scale, muon_lr / learning_rate, scales the trainer's lr)."""
        params = [p for p in self.parameters() if p.requires_grad]  # parameters() lists tied ones once
        to_muon = ({id(p) for block in self.transformer.h for p in block.parameters() if p.dim() == 2}
                   if optimizer == 'muon' else set())
        muon, rest = [p for p in params if id(p) in to_muon], [p for p in params if id(p) not in to_muon]
        optim_groups = [
            {'params': [p for p in rest if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in rest if p.dim() < 2], 'weight_decay': 0.0},
        ]
        # fused on every device (device_type is kept for callers): a step told to skip is none
        adamw = dict(lr=learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=True)
        if optimizer != 'muon':
            return torch.optim.AdamW(optim_groups, **adamw)
        from gptkit.optim import MuonAdamW
        muon_groups = [{'params': muon, 'weight_decay': weight_decay, 'lr_scale': muon_lr / learning_rate}]
        return MuonAdamW(muon_groups, optim_groups, dict(lr=muon_lr, momentum=muon_momentum, nesterov=True,
                                                         adjust_lr_fn='match_rms_adamw'), adamw)

    @classmethod
    def empty(cls, config, device='cpu'):
        """A GPT of config on device, not initialised: for weights that are all loaded next."""
        with torch.device('meta'):  # no memory, no init, no draw from the RNG
            model = cls(config)
        model.to_empty(device=device)
        model.lm_head.weight = model.transformer.wte.weight  # to_empty unties them
        return model

    @classmethod
    def from_pretrained(cls, name_or_dir):
        """One of OPENAI_MODELS (through HF transformers), or a HF GPT2LMHeadModel's folder."""
        if name_or_dir in OPENAI_MODELS:
            from transformers import GPT2LMHeadModel
            hf = GPT2LMHeadModel.from_pretrained(name_or_dir)
            return cls.from_hf_state_dict(hf.config.to_dict(), hf.state_dict(), name_or_dir)
        if not os.path.isdir(name_or_dir):
            raise FileNotFoundError(f"{name_or_dir!r} is neither an OpenAI GPT-2 name "
                                    f"({', '.join(OPENAI_MODELS)}) nor a directory")
        config_path = os.path.join(name_or_dir, 'config.json')
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{config_path} not found: not a HF model's folder")
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
            raise ValueError(f"{source}: unexpected key {unexpected[0]!r} ({len(unexpected)} in all)")
        with torch.no_grad():
            for k in sd:
                if k == 'lm_head.weight':
                    continue  # tied to transformer.wte.weight (tie_word_embeddings), as HF ties it
                if k not in sd_hf:
                    raise ValueError(f"{source}: missing key {k!r}")
                w = sd_hf[k].t() if k.endswith(HF_CONV1D_WEIGHTS) else sd_hf[k]
                if w.shape != sd[k].shape:
                    conv1d = ' (transposed from Conv1D)' if k.endswith(HF_CONV1D_WEIGHTS) else ''
                    raise ValueError(f"{source}: key {k!r} has shape {tuple(w.shape)}{conv1d}, "
                                     f"expected {tuple(sd[k].shape)} for {config}")
                sd[k].copy_(w)
            head = sd_hf.get('lm_head.weight')
            if head is not None and not torch.equal(head, sd['lm_head.weight']):
                raise ValueError(f"{source}: lm_head.weight differs from transformer.wte.weight; "
                                 f"GPT-2 ties them")
        return model

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """idx (B, T) with max_new_tokens sampled tokens appended; keys and values are cached."""
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
    """A HF folder's state dict, never unpickling code (torch.load's weights_only)."""
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
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or pytorch_model.bin (or shards)")


def flops_per_token(config, T):
    """FLOPs to train on one token at length T: 6 per parameter that multiplies, and attention's."""
    n = config.n_layer * 12 * config.n_embd ** 2 + config.vocab_size * config.n_embd
    attn = config.n_layer * 2 * 2 * T * config.n_embd  # QK^T and AV, each 2 * T * n_embd per token
    return 6 * n + 3 * attn
