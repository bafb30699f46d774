"""
HellaSwag: download, render and score, as build-nanogpt does, but batched and distributed.

    python hellaswag.py --model gpt2                 # OpenAI GPT-2 124M (through HF): acc 0.2859 acc_norm 0.2955
    python hellaswag.py --model log/model_19073.pt   # a checkpoint of train_gpt2.py
    python hellaswag.py --model path/to/hf_dir --file hellaswag_val.jsonl --limit 500

An example is a context and 4 endings; each ending is scored by the loss of its tokens after the
context. acc picks the ending of lowest summed loss, acc_norm the lowest mean loss (per token).
Rows are rendered as build-nanogpt renders them (context tokens, then " " + ending tokens, mask 1
over the ending, right-padded), so the figures compare with its published ones.
"""
import argparse
import contextlib
import functools
import http.client
import json
import os
import random
import sys
import urllib.request

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

from gptkit.common import UserError, atomic_write
from gptkit.cpu import reuse_freed_memory
from gptkit.hardware import autocast, pick_device
from model import PackedTokens, load_model
from gptkit.tokenizer import N_VOCAB, get_gpt2_encoding

URLS = {split: f"https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
        for split in ("train", "val", "test")}
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag")


def download(split, cache_dir=CACHE_DIR, url=None):
    """The path of hellaswag_{split}.jsonl in cache_dir, downloaded first if missing (atomically:
    never a half file under the final name)."""
    path = os.path.join(cache_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    url = url or URLS[split]

    def fetch(f):
        from tqdm import tqdm
        with urllib.request.urlopen(url, timeout=30) as r:
            size = int(r.headers.get('Content-Length') or 0) or None
            with tqdm(total=size, unit='B', unit_scale=True, desc=os.path.basename(path)) as bar:
                while chunk := r.read(1 << 16):
                    f.write(chunk)
                    bar.update(len(chunk))
            if size is not None and f.tell() != size:
                raise OSError(f"got {f.tell()} of {size} bytes")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write(path, fetch)
    except (OSError, http.client.HTTPException) as e:
        raise UserError(f"could not download {url} ({type(e).__name__}: {e}); put hellaswag_{split}.jsonl "
                        f"in {cache_dir}, or pass its path (--file)") from None
    return path


def iterate_examples(split="val", file=None, cache_dir=CACHE_DIR):
    """The examples of a HellaSwag jsonl file (file, else the cached/downloaded split), checked."""
    path = file or download(split, cache_dir)
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file (expected HellaSwag jsonl, one example per line)")
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(example, dict) or not isinstance(example.get('ctx'), str):
                raise UserError(f"{path}:{lineno}: expected an object with a string 'ctx'")
            endings = example.get('endings')
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise UserError(f"{path}:{lineno}: expected 4 string endings, got {endings!r:.100}")
            if example.get('label') not in (0, 1, 2, 3):
                raise UserError(f"{path}:{lineno}: label must be 0..3, got {example.get('label')!r}")
            yield example


def render_example(example):
    """(tokens (4, L) long, mask (4, L) long, label): context + " " + ending per row, mask 1 over
    the ending, rows right-padded with 0."""
    enc = get_gpt2_encoding()
    ctx = enc.encode(example['ctx'])
    rows = [ctx + enc.encode(" " + ending) for ending in example['endings']]
    L = max(len(r) for r in rows)
    tokens = torch.zeros((4, L), dtype=torch.long)
    mask = torch.zeros((4, L), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, len(ctx):len(row)] = 1
    return tokens, mask, example['label']


def prefix_tree(tokens, mask, block_size):
    """One rendered example as a prefix tree of its 4 rows, (idx, pos, parent, targets): each
    distinct prefix of the rows is one node, fed once (the context, and the first tokens that
    endings share), with its token, position and parent node (-1 for none); a row's last token
    is only predicted, never fed. targets: (node, token, row) per ending token, the node being the
    one whose output predicts the token. A row longer than block_size loses context tokens from
    the left; its ending must fit."""
    idx, pos, parent, targets, node_of = [], [], [], [], {}
    for r, (row, m) in enumerate(zip(tokens.tolist(), mask.tolist())):
        start, n = m.index(1), len(m) - m[::-1].index(1)  # the ending is row[start:n]
        cut = max(0, n - block_size)
        if start < cut:
            raise UserError(f"an ending of {n - start} tokens does not fit in block_size={block_size}")
        row, start = row[cut:n], start - cut
        node = -1
        for j in range(len(row) - 1):
            key = (node, row[j])  # the same token after the same prefix: the same node
            if key not in node_of:
                node_of[key] = len(idx)
                idx.append(row[j])
                pos.append(j)
                parent.append(node)
            node = node_of[key]
            if j + 1 >= start:
                targets.append((node, row[j + 1], r))
    return idx, pos, parent, targets


# torch.compile's CPU linear (oneDNN); absent from some builds
FUSED_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, '_linear_pointwise')


def onednn_linear(layer, x):
    """layer(x) through oneDNN (blocks_through_onednn routes a layer here only on CPU in float32)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")


@contextlib.contextmanager
def blocks_through_onednn(model):
    """Within it, the nn.Linear layers of the model's blocks multiply through oneDNN on CPU in
    float32: HellaSwag scores faster than with torch's default float32 matmul (MKL, which keeps
    to AVX2 on AMD CPUs). The GELU stays the model's own pass (oneDNN's fused GELU epilogue was
    no faster), and the output layer keeps torch's matmul (token_losses). docs/benchmarks.md has
    the figures. The layers' own forward is back on the way out."""
    w = model.lm_head.weight
    on = FUSED_LINEAR and w.is_cpu and w.dtype == torch.float32 and not torch.is_autocast_enabled('cpu')
    layers = [m for m in model.transformer.h.modules() if isinstance(m, nn.Linear)] if on else []  # else as it is
    before = [layer.__dict__.get('forward') for layer in layers]  # None: the class's (nested use keeps the outer)
    try:
        for layer in layers:
            layer.forward = functools.partial(onednn_linear, layer)  # the instance's, before the class's
        yield
    finally:
        for layer, forward in zip(layers, before):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def token_losses(model, h, rows, targets, device, dtype):
    """-log p(targets[i]) from the output layer applied to h[rows[i]] (h: (N, n_embd)), in
    float32. On CPU the logits go 512 words of the vocabulary at a time: each (N, 512) block
    stays in cache from the matmul through its log-sum-exp (faster than whole rows:
    docs/benchmarks.md), and a target's logit is picked from its block."""
    weight = model.lm_head.weight  # (vocab, n_embd); the output layer has no bias
    V = weight.size(0)
    chunk = 512 if h.device.type == 'cpu' else V
    lse = torch.empty(len(h), (V + chunk - 1) // chunk, device=device)
    picked = torch.empty(len(targets), device=device)
    for c, v in enumerate(range(0, V, chunk)):
        with autocast(device, dtype):  # torch's own matmul (MKL) here: faster than oneDNN for these thin products
            logits = F.linear(h, weight[v:v + chunk])
        logits = logits.float()  # no copy in float32
        lse[:, c] = torch.logsumexp(logits, dim=1)
        here = (targets >= v) & (targets < v + chunk)
        picked[here] = logits[rows[here], targets[here] - v]
    return torch.logsumexp(lse, dim=1)[rows] - picked


@torch.no_grad()
def ending_losses(model, rendered, device, dtype="float32"):
    """(sum, mean) losses (4 * len(rendered),) of the endings of several rendered examples, in one
    forward. Each example is packed as its prefix tree (the context once, then each ending's
    tokens attending to the context and to themselves, at their positions in the row), the trees
    end to end, and the output layer applied only where an ending token is predicted, its
    cross-entropy in float32."""
    trees = [prefix_tree(tokens, mask, model.config.block_size) for tokens, mask, _ in rendered]
    B, T = len(trees), max(len(idx) for idx, _, _, _ in trees)
    allowed = np.zeros((B, T, T), dtype=bool)  # (B, T, T): row = a node, True at its ancestors and itself
    allowed[:, range(T), range(T)] = True  # padding attends to itself only
    idx, pos, slots, targets = [], [], [], []
    for b, (i, p, parent, tg) in enumerate(trees):
        see = allowed[b]
        for node, up in enumerate(parent):  # parents come before their children: their rows are done
            if up >= 0:
                see[node, :up + 1] |= see[up, :up + 1]  # numpy rows: faster than torch's here
        targets += [(len(idx) + node, token, 4 * b + r) for node, token, r in tg]
        idx += i
        pos += p
        slots += range(b * T, b * T + len(i))
    allowed = torch.from_numpy(allowed)
    nodes, tokens, rows = torch.tensor(targets, device=device).T
    used, at = torch.unique(nodes, return_inverse=True)  # the output layer once per predicting node
    idx, pos, slots = (torch.tensor(a, device=device) for a in (idx, pos, slots))
    packed = PackedTokens(pos, slots, allowed[:, None].to(device), keep=used)
    with autocast(device, dtype), blocks_through_onednn(model):
        h = model.hidden_states(idx, packed=packed)  # (len(used), n_embd)
    losses = token_losses(model, h, at, tokens, device, dtype)
    sum_loss = torch.zeros(4 * B, device=device).index_add_(0, rows, losses)
    count = torch.zeros(4 * B, device=device).index_add_(0, rows, torch.ones_like(losses))
    return sum_loss, sum_loss / count


def evaluate(model, rendered, device, dtype="float32", rank=0, world=1, batch_examples=32):
    """(examples, correct by acc, correct by acc_norm) over examples i % world == rank; sum these
    over ranks for the whole set."""
    mine = rendered[rank::world]
    long = sum(int(torch.nonzero(mask.sum(0))[-1]) + 1 > model.config.block_size for _, mask, _ in mine)
    if long and rank == 0:
        print(f"hellaswag: {long} examples are longer than block_size={model.config.block_size}: "
              f"their contexts lose tokens from the left")
    # examples of about the same size share a forward: little padding
    mine = sorted(mine, key=lambda r: int(r[1].sum()) + int(r[1][0].argmax()))  # ending tokens + context
    n = correct = correct_norm = 0
    was_training = model.training
    model.eval()
    for i in range(0, len(mine), batch_examples):
        batch = mine[i:i + batch_examples]
        sum_loss, avg_loss = ending_losses(model, batch, device, dtype)
        labels = torch.tensor([label for _, _, label in batch], device=device)
        correct += int((sum_loss.view(-1, 4).argmin(1) == labels).sum())
        correct_norm += int((avg_loss.view(-1, 4).argmin(1) == labels).sum())
        n += len(batch)
    model.train(was_training)
    return n, correct, correct_norm


def load_for_training(file, model):
    """For train_gpt2.py's evals: the rendered val examples (file, else the cached or downloaded
    split), or None after one warning when there are none; the same answer on every rank."""
    from gptkit import parallel  # the trainer's path only: `python hellaswag.py` needs none of DDP's and FSDP's imports
    examples, why = None, None
    if model.config.vocab_size < N_VOCAB:
        why = f"vocab_size={model.config.vocab_size} is smaller than GPT-2's {N_VOCAB}"
    else:
        path = file or os.path.join(CACHE_DIR, 'hellaswag_val.jsonl')
        if not file and int(os.environ.get('LOCAL_RANK', 0)) == 0:  # once per node: nodes may not share ./hellaswag/
            try:
                download('val')  # nothing to do once cached; on a shared folder the nodes' renames are each atomic
            except UserError as e:
                why = str(e)
        parallel.wait_for_all()  # each node's download first, however long it takes
        if os.path.isfile(path):
            examples = [render_example(e) for e in iterate_examples(file=path)]  # bad data: UserError
            if not examples:  # every rank reads the same file: all stop here, before step 0
                raise UserError(f"{path}: no HellaSwag examples in it")
        else:
            why = why or f"{path} not found"
    found = parallel.agree(examples is not None, 'min')  # e.g. a node without the file: nobody evaluates
    if parallel.rank() == 0 and not found:
        print(f"warning: no HellaSwag eval: {why or 'not on every node'}; training goes on without it")
    return examples if found else None


def synthetic_examples(n, seed=0):
    """n made-up examples in HellaSwag's format, for benchmarks and checks: as long as the val
    split's first ones (ActivityNet captions, the ones --limit takes), contexts of 6-36 words,
    endings of 3-20."""
    rng = random.Random(seed)
    words = ("a the man woman boy girl people is are then seen shown standing holding ball dog camera "
             "while with on in into front of water field kitchen begins continues to walk talk play "
             "smiles jumps runs pushes pulls down up around and his her their").split()
    text = lambda lo, hi: " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
    return [{"ind": i, "activity_label": "Synthetic", "ctx": text(6, 36).capitalize() + ". the man",
             "split": "val", "label": rng.randrange(4), "endings": [text(3, 20) + "." for _ in range(4)]}
            for i in range(n)]


def write_synthetic(path, n, seed=0):
    """synthetic_examples(n, seed) as a HellaSwag jsonl file, one example per line."""
    with open(path, 'w') as f:
        for example in synthetic_examples(n, seed):
            f.write(json.dumps(example) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='gpt2', help="gpt2 (or -medium, -large, -xl), a HF model folder, a .pt checkpoint, "
                                                   "or a run's log_dir (its newest checkpoint)")
    p.add_argument('--file', default=None, help="a local HellaSwag jsonl file (default: the split, downloaded once)")
    p.add_argument('--split', default='val', choices=['train', 'val'])
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--limit', type=int, default=0, help="score only the first N examples")
    p.add_argument('--batch_examples', type=int, default=32, help="examples per forward pass (default: %(default)s)")
    args = p.parse_args(argv)
    from gptkit.checkpoint import model_in  # here, not atop: `import hellaswag` stays without gptkit/parallel.py (benchmarks.md)
    try:
        device = pick_device(args.device)
        examples = list(iterate_examples(args.split, args.file))
    except UserError as e:
        sys.exit(f"error: {e}")
    if device == 'cpu':
        reuse_freed_memory()  # no page faults per forward (docs/benchmarks.md)
    if args.limit:
        examples = examples[:args.limit]
    try:
        model = load_model(model_in(args.model), device)
    except (UserError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    from tqdm import tqdm
    rendered = [render_example(e) for e in tqdm(examples, desc="render", leave=False)]
    n = correct = correct_norm = 0
    with tqdm(total=len(rendered), desc="score") as bar:
        for i in range(0, len(rendered), 1024):
            a, b, c = evaluate(model, rendered[i:i + 1024], device, args.dtype, batch_examples=args.batch_examples)
            n, correct, correct_norm = n + a, correct + b, correct_norm + c
            bar.update(a)
    print(f"acc: {correct / n:.4f} acc_norm: {correct_norm / n:.4f}")


if __name__ == "__main__":
    main()
