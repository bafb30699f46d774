"""
HellaSwag: download, render and score, as build-nanogpt does, but batched and distributed.

    python hellaswag.py --model gpt2                # OpenAI GPT-2 124M (HF): acc 0.2859 acc_norm 0.2955
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
import random
import sys
import urllib.request

import torch

from gptkit import cpu
from gptkit.common import UserError, atomic_write
from gptkit.hardware import autocast, pick_device
from gptkit.tokenizer import N_VOCAB, get_gpt2_encoding
from model import load_model

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

    try:  # read whole (about 11 MB) before the folder is made: a failed download leaves nothing behind
        from tqdm import tqdm
        with urllib.request.urlopen(url, timeout=30) as r, tqdm(unit='B', unit_scale=True, desc=split) as bar:
            size, data = int(r.headers.get('Content-Length') or 0) or None, bytearray()
            bar.total = size
            while chunk := r.read(1 << 16):
                data += chunk
                bar.update(len(chunk))
        if size is not None and len(data) != size:
            raise OSError(f"got {len(data)} of {size} bytes")
        os.makedirs(cache_dir, exist_ok=True)
        atomic_write(path, lambda f: f.write(data))
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
            if not (isinstance(endings, list) and len(endings) == 4
                    and all(isinstance(e, str) for e in endings)):
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


def rows_of(rendered, block_size):
    """The rows of rendered examples, 4 per example, as (context, ending) token lists: the ending
    (mask 1), and the context tokens before it. A row longer than block_size loses context tokens
    from the left; its ending must fit."""
    for tokens, mask, _ in rendered:
        for row, m in zip(tokens.tolist(), mask.tolist()):
            start, n = m.index(1), len(m) - m[::-1].index(1)  # the ending is row[start:n]
            cut = max(0, n - block_size)
            if start < cut:
                raise UserError(f"an ending of {n - start} tokens does not fit in block_size={block_size}")
            yield tuple(row[cut:start]), row[start:n]


@torch.no_grad()
def ending_losses(model, rendered, device, dtype="float32", batch_examples=32):
    """(sum, mean) losses (4 * len(rendered),) of the endings of rendered examples: each ending
    token's cross-entropy, in float32, after the tokens before it in its row. The 4 rows of an
    example share its context: it goes through the model once, into a KV cache that the rows then
    read on from, batch_examples contexts of about one length together (ending_states). The output
    layer runs only where an ending token is predicted."""
    rows = list(rows_of(rendered, model.config.block_size))
    of_context = {}  # a context -> its rows
    for r, (context, _) in enumerate(rows):
        of_context.setdefault(context, []).append(r)
    contexts = sorted(of_context, key=len)
    sum_loss, count = torch.zeros(len(rows), device=device), torch.zeros(len(rows), device=device)
    with autocast(device, dtype), cpu.blocks_through_onednn(model):  # CPU, float32: oneDNN's matmul
        for i in range(0, len(contexts), batch_examples):
            batch = contexts[i:i + batch_examples]
            h, scored = ending_states(model, batch, of_context, rows, device, 256 * batch_examples)
            at, targets, owner = torch.tensor(scored, device=device).view(-1, 3).T
            losses = token_losses(model, h, at, targets)
            sum_loss.index_add_(0, owner, losses)
            count.index_add_(0, owner, torch.ones_like(losses))
    return sum_loss, sum_loss / count


def ending_states(model, batch, of_context, rows, device, most_tokens):
    """For a batch of contexts, shortest first: the final hidden states h (N, n_embd) that predict
    their rows' ending tokens, and per ending token (its row of h, the token, its row). The first
    P tokens of every context (P: the shortest's length) go through the model once, into a KV
    cache; each row goes on from there (start_pos=P) with the rest of its context and its ending."""
    P, states, scored = len(batch[0]), [], []
    context_of = {r: j for j, context in enumerate(batch) for r in of_context[context]}
    if P:  # the position P - 1 predicts the first ending token of the rows whose context ends there
        cache = model.new_kv_cache(len(batch), P)
        states.append(model.hidden_states(torch.tensor([c[:P] for c in batch], device=device), cache)[:, -1])
        scored += [(context_of[r], rows[r][1][0], r) for r in context_of if len(rows[r][0]) == P]
    seqs = {r: list(rows[r][0]) + rows[r][1] for r in context_of}
    fed = {r: seq[P:-1] for r, seq in seqs.items() if len(seq) > P + 1}  # the last token is only predicted
    for part in by_length(fed, P, most_tokens):
        n, T, keep = sum(map(len, states)), len(fed[part[-1]]), []
        idx = torch.zeros(len(part), T, dtype=torch.long)  # right-padded: the padding comes after, unseen
        for k, r in enumerate(part):
            idx[k, :len(fed[r])] = torch.tensor(fed[r])
            first = max(len(rows[r][0]) - 1 - P, 0)  # fed[first] predicts an ending token: the first one here
            scored += [(n + len(keep) + i, token, r) for i, token in enumerate(seqs[r][P + first + 1:])]
            keep += range(k * T + first, k * T + len(fed[r]))
        kv = model.new_kv_cache(len(part), P + T)
        if P:  # each row's first P positions, copied from the contexts' cache
            which = torch.tensor([context_of[r] for r in part], device=device)
            for layer, context_layer in zip(kv, cache):
                layer[:, :, :, :P] = context_layer[:, which]
        h = model.hidden_states(idx.to(device), kv, start_pos=P).flatten(0, 1)  # (len(part) * T, n_embd)
        states.append(h[torch.tensor(keep, device=device)])
    return torch.cat(states), scored


def by_length(fed, start, most_tokens):
    """The keys of fed (per row, the tokens it feeds after a KV cache of start positions) in
    batches of about one length, sorted by length: a batch of 256 tokens or more ends where padding
    it to the next row's length would add over 1/8 to its tokens, and it holds at most most_tokens,
    the copies of the cache included."""
    batch, real = [], 0
    for r in sorted(fed, key=lambda r: len(fed[r])):
        n, rows = len(fed[r]), len(batch) + 1
        if batch and (real >= 256 and n * rows > 1.125 * (real + n) or (start + n) * rows > most_tokens):
            yield batch
            batch, real = [], 0
        batch.append(r)
        real += n
    if batch:
        yield batch


def token_losses(model, h, at, targets):
    """-log p(targets[i]) from the output layer applied to h[at[i]], in float32."""
    if h.is_cpu:  # the CPU's way: the vocabulary in blocks that stay in cache (gptkit/cpu.py)
        return cpu.token_losses(h, model.lm_head.weight, at, targets)
    logits = model.lm_head(h).float()  # (N, vocab)
    return torch.logsumexp(logits, dim=1)[at] - logits[at, targets]


def evaluate(model, rendered, device, dtype="float32", rank=0, world=1, batch_examples=32):
    """(examples, correct by acc, correct by acc_norm) over examples i % world == rank; sum these
    over ranks for the whole set."""
    mine = rendered[rank::world]
    long = sum(int(torch.nonzero(mask.sum(0))[-1]) + 1 > model.config.block_size for _, mask, _ in mine)
    if long and rank == 0:
        print(f"hellaswag: {long} examples are longer than block_size={model.config.block_size}: "
              f"their contexts lose tokens from the left")
    sum_loss, avg_loss = ending_losses(model, mine, device, dtype, batch_examples)
    labels = torch.tensor([label for _, _, label in mine], device=device, dtype=torch.long)
    correct = int((sum_loss.view(-1, 4).argmin(1) == labels).sum())
    correct_norm = int((avg_loss.view(-1, 4).argmin(1) == labels).sum())
    return len(mine), correct, correct_norm


def load_for_training(file, model):
    """For train_gpt2.py's evals: the rendered val examples (file, else the cached or downloaded
    split), or None after one warning when there are none; the same answer on every rank."""
    from gptkit import parallel  # the trainer's path only: `python hellaswag.py` needs no DDP or FSDP
    examples, why = None, None
    if model.config.vocab_size < N_VOCAB:
        why = f"vocab_size={model.config.vocab_size} is smaller than GPT-2's {N_VOCAB}"
    else:
        path = file or os.path.join(CACHE_DIR, 'hellaswag_val.jsonl')
        # once per node, as nodes may not share ./hellaswag/; on a shared folder each rename is atomic
        if not file and int(os.environ.get('LOCAL_RANK', 0)) == 0:
            try:
                download('val')  # nothing to do once cached
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
    p.add_argument('--model', default='gpt2', help="gpt2 (or -medium, -large, -xl), a HF model folder, a .pt "
                                                   "checkpoint, or a run's log_dir (its newest checkpoint)")
    p.add_argument('--file', default=None,
                   help="a local HellaSwag jsonl file (default: the split, downloaded once)")
    p.add_argument('--split', default='val', choices=['train', 'val'])
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    p.add_argument('--limit', type=int, default=0, help="score only the first N examples")
    p.add_argument('--batch_examples', type=int, default=32,
                   help="examples per batch (default: %(default)s)")
    args = p.parse_args(argv)
    # here, not atop: `import hellaswag` stays without gptkit/parallel.py (docs/benchmarks.md)
    from gptkit.checkpoint import model_in
    try:
        device = pick_device(args.device)
        examples = list(iterate_examples(args.split, args.file))
    except UserError as e:
        sys.exit(f"error: {e}")
    if device == 'cpu':
        cpu.reuse_freed_memory()  # no page faults per forward (docs/benchmarks.md)
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
            a, b, c = evaluate(model, rendered[i:i + 1024], device, args.dtype, 0, 1, args.batch_examples)
            n, correct, correct_norm = n + a, correct + b, correct_norm + c
            bar.update(a)
    print(f"acc: {correct / n:.4f} acc_norm: {correct_norm / n:.4f}")


if __name__ == "__main__":
    main()
