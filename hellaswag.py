"""
HellaSwag: download, render and score, as build-nanogpt does, but batched and distributed.

    python hellaswag.py --model gpt2                 # OpenAI GPT-2 124M (through HF): acc ~0.2859 acc_norm ~0.2955
    python hellaswag.py --model log/model_19073.pt   # a checkpoint of train_gpt2.py
    python hellaswag.py --model path/to/hf_dir --file hellaswag_val.jsonl --limit 500

An example is a context and 4 endings; each ending is scored by the loss of its tokens after the
context. acc picks the ending of lowest summed loss, acc_norm the lowest mean loss (per token).
Rows are rendered as build-nanogpt renders them (context tokens, then " " + ending tokens, mask 1
over the ending, right-padded), so the figures compare with its published ones.
"""
import argparse
import http.client
import json
import os
import sys
import urllib.request

import torch
from torch.nn import functional as F

from model import autocast
from tokenizer import get_gpt2_encoding

URLS = {split: f"https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
        for split in ("train", "val", "test")}
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hellaswag")


class HellaSwagError(Exception):
    """No data, or bad data: one line that names the file and what to do."""


def download(split, cache_dir=CACHE_DIR, url=None):
    """The path of hellaswag_{split}.jsonl in cache_dir, downloaded first if missing (to a
    temporary name, renamed when complete: never a half file under the final name)."""
    path = os.path.join(cache_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    url = url or URLS[split]
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        from tqdm import tqdm
        with urllib.request.urlopen(url, timeout=30) as r:
            os.makedirs(cache_dir, exist_ok=True)
            f = open(tmp, 'wb')
            size = int(r.headers.get('Content-Length') or 0) or None
            with f, tqdm(total=size, unit='B', unit_scale=True, desc=os.path.basename(path)) as bar:
                while chunk := r.read(1 << 16):
                    f.write(chunk)
                    bar.update(len(chunk))
                if size is not None and f.tell() != size:
                    raise OSError(f"got {f.tell()} of {size} bytes")
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, http.client.HTTPException) as e:
        raise HellaSwagError(f"could not download {url} ({type(e).__name__}: {e}); put hellaswag_{split}.jsonl "
                             f"in {cache_dir}, or pass its path (--file)") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def iterate_examples(split="val", file=None, cache_dir=CACHE_DIR):
    """The examples of a HellaSwag jsonl file (file, else the cached/downloaded split), checked."""
    path = file or download(split, cache_dir)
    if not os.path.isfile(path):
        raise HellaSwagError(f"{path}: no such file (expected HellaSwag jsonl, one example per line)")
    with open(path, encoding='utf-8') as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise HellaSwagError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(example, dict) or not isinstance(example.get('ctx'), str):
                raise HellaSwagError(f"{path}:{lineno}: expected an object with a string 'ctx'")
            endings = example.get('endings')
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise HellaSwagError(f"{path}:{lineno}: expected 4 string endings, got {endings!r:.100}")
            if example.get('label') not in (0, 1, 2, 3):
                raise HellaSwagError(f"{path}:{lineno}: label must be 0..3, got {example.get('label')!r}")
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


def token_losses(model, h, targets, device, dtype, chunk=64):
    """Cross-entropy in float32 of the output layer's predictions from hidden states h (N, n_embd)
    for targets (N,), 64 rows at a time: a (64, vocab) block of logits stays in cache through
    the log-softmax (about 2x faster on CPU than all rows at once)."""
    losses = torch.empty(len(targets), device=device)
    for i in range(0, len(targets), chunk):
        with autocast(device, dtype):
            logits = model.lm_head(h[i:i + chunk])
        logp = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # upcast inside: no float copy
        losses[i:i + chunk] = -logp.gather(1, targets[i:i + chunk, None]).squeeze(1)
    return losses




@torch.no_grad()
def ending_losses(model, rendered, device, dtype="float32"):
    """(sum, mean) losses (4 * len(rendered),) of the endings of several rendered examples, in one
    forward: rows right-padded to a common length (causal attention: padding after a row changes
    nothing in it), the output layer applied only where an ending token is predicted, and the
    cross-entropy taken in float32. A row longer than block_size loses context tokens from the
    left; its ending must fit."""
    block_size = model.config.block_size
    rows, masks = [], []
    for tokens, mask, _ in rendered:
        for t, m in zip(tokens, mask):
            n = int(torch.nonzero(m)[-1]) + 1  # the row's length
            cut = max(0, n - block_size)
            if m[:cut].any():
                raise HellaSwagError(f"an ending of {int(m.sum())} tokens does not fit in block_size={block_size}")
            rows.append(t[cut:n])
            masks.append(m[cut:n])
    L = max(len(r) for r in rows)
    idx = torch.zeros((len(rows), L), dtype=torch.long)
    sel = torch.zeros((len(rows), L), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        idx[i, :len(r)] = r
        sel[i, :len(m)] = m.bool()
    idx, sel = idx.to(device), sel[:, 1:].to(device)  # token j is predicted at position j - 1
    with autocast(device, dtype):
        h = model.hidden_states(idx)[:, :-1]  # (R, L-1, n_embd)
    losses = token_losses(model, h[sel], idx[:, 1:][sel], device, dtype)  # the output layer where it matters
    row_of = sel.nonzero()[:, 0]
    sum_loss = torch.zeros(len(rows), device=device).index_add_(0, row_of, losses)
    return sum_loss, sum_loss / sel.sum(1)


@torch.no_grad()
def shared_context_losses(model, rendered, device, dtype="float32"):
    """ending_losses for examples whose contexts have the same length (and fit in block_size):
    each context runs once, its keys and values are cached and shared by its 4 endings, and the
    output layer runs once for the first ending token (all 4 are predicted at the context's end)."""
    Lc = int(torch.nonzero(rendered[0][1][0])[0])  # context length: where the mask starts
    K = len(rendered)
    ends = [t[i, Lc:Lc + int(m[i].sum())] for t, m, _ in rendered for i in range(4)]
    Le = max(len(e) for e in ends)
    idx = torch.zeros((4 * K, Le), dtype=torch.long)
    sel = torch.zeros((4 * K, Le), dtype=torch.bool)
    for i, e in enumerate(ends):
        idx[i, :len(e)] = e
        sel[i, :len(e)] = True
    ctx = torch.stack([t[0, :Lc] for t, _, _ in rendered]).to(device)  # (K, Lc)
    idx, sel = idx.to(device), sel.to(device)
    with autocast(device, dtype):
        cache = model.new_kv_cache(K, Lc + Le)
        first = model.lm_head(model.hidden_states(ctx, cache, 0)[:, -1])  # (K, vocab): each ending's 1st token
        cache = [c.repeat_interleave(4, dim=1) for c in cache]  # (2, 4K, nh, Lc + Le, hs): 4 endings each
        h = model.hidden_states(idx, cache, Lc)[:, :-1]  # (4K, Le-1, n_embd): ending tokens 2.. on
    first_logp = F.log_softmax(first, dim=-1, dtype=torch.float32)  # once per context, for its 4 endings
    first_loss = -first_logp[torch.arange(4 * K, device=device) // 4, idx[:, 0]]
    losses = token_losses(model, h[sel[:, 1:]], idx[:, 1:][sel[:, 1:]], device, dtype)
    sum_loss = first_loss.index_add(0, sel[:, 1:].nonzero()[:, 0], losses)
    return sum_loss, sum_loss / sel.sum(1)


def evaluate(model, rendered, device, dtype="float32", rank=0, world=1, batch_examples=16):
    """(examples, correct by acc, correct by acc_norm) over examples i % world == rank; sum these
    over ranks for the whole set."""
    # batches of examples whose contexts have the same length share the work of their contexts;
    # the rare example longer than block_size (key -1) goes through ending_losses alone
    groups = {}
    for r in rendered[rank::world]:
        fits = int(torch.nonzero(r[1].sum(0))[-1]) + 1 <= model.config.block_size
        groups.setdefault(int(torch.nonzero(r[1][0])[0]) if fits else -1, []).append(r)
    if -1 in groups and rank == 0:
        print(f"hellaswag: {len(groups[-1])} examples are longer than block_size={model.config.block_size}: "
              f"their contexts lose tokens from the left")
    batches = [(length, g[i:i + batch_examples]) for length, g in sorted(groups.items())
               for i in range(0, len(g), batch_examples)]
    n = correct = correct_norm = 0
    was_training = model.training
    model.eval()
    for length, batch in batches:
        score = shared_context_losses if length >= 0 else ending_losses
        sum_loss, avg_loss = score(model, batch, device, dtype)
        labels = torch.tensor([label for _, _, label in batch], device=device)
        correct += int((sum_loss.view(-1, 4).argmin(1) == labels).sum())
        correct_norm += int((avg_loss.view(-1, 4).argmin(1) == labels).sum())
        n += len(batch)
    model.train(was_training)
    return n, correct, correct_norm


def load_model(name, device):
    """An OpenAI name, a HF model folder, or a train_gpt2.py checkpoint (.pt)."""
    from model import GPT, GPTConfig
    if name.endswith('.pt'):
        ckpt = torch.load(name, map_location='cpu', weights_only=True)
        model = GPT(GPTConfig(**ckpt['config']))
        model.load_state_dict(ckpt['model'])
    else:
        model = GPT.from_pretrained(name)
    return model.to(device).eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--model', default='gpt2', help="gpt2 (or -medium, -large, -xl), a HF model folder, or a .pt checkpoint")
    p.add_argument('--file', default=None, help="a local HellaSwag jsonl file (default: the split, downloaded once)")
    p.add_argument('--split', default='val', choices=['train', 'val'])
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
    p.add_argument('--limit', type=int, default=0, help="score only the first N examples")
    p.add_argument('--batch_examples', type=int, default=16, help="examples per forward pass")
    args = p.parse_args(argv)
    device = args.device
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
    try:
        examples = list(iterate_examples(args.split, args.file))
    except HellaSwagError as e:
        sys.exit(f"error: {e}")
    if args.limit:
        examples = examples[:args.limit]
    model = load_model(args.model, device)
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
