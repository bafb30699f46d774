"""HellaSwag's scoring, batched, for hellaswag.py and the trainer: an ending's loss after its context, as
build-nanogpt renders them (its figures compare); acc picks the least summed loss, acc_norm the least mean."""
import json
import os

import torch

from gptkit.common import UserError, atomic_write
from gptkit.hardware import autocast
from gptkit.tokenizer import N_VOCAB, get_gpt2_encoding

CACHE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hellaswag")


def download(split, cache_dir=CACHE_DIR, url=None):
    path = os.path.join(cache_dir, f"hellaswag_{split}.jsonl")
    if os.path.isfile(path):
        return path
    url = url or f"https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"
    import http.client
    import urllib.request

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
                        f"in {cache_dir}, or pass a file of your own") from None
    return path


def iterate_examples(split="val", file=None, cache_dir=CACHE_DIR):
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
            endings = example.get('endings') if isinstance(example, dict) else None
            if not (isinstance(endings, list) and len(endings) == 4
                    and all(isinstance(e, str) for e in endings) and isinstance(example.get('ctx'), str)
                    and example.get('label') in (0, 1, 2, 3)):
                got = ({k: example.get(k) for k in ('ctx', 'endings', 'label')} if isinstance(example, dict)
                       else example)
                raise UserError(f"{path}:{lineno}: expected an object with a string 'ctx', 4 string "
                                f"'endings' and a 'label' 0..3, got {got!r:.300}")
            yield example


def prepare(examples, block_size, device, batch_examples=32, rank=0, world=1, one_shape=False):
    """This rank's examples as (batches, labels) on device, an example a row: its context, then each ending at
    the positions right after it. A batch: x, seg (0 context, 1-4 an ending, 5 padding), pos, each (E, L);
    at (where in x.view(-1) each ending token is predicted), y (the token), row (its ending), each (M,)."""
    enc, packed, long = get_gpt2_encoding(), [], 0
    for example in examples:
        ctx = enc.encode(example['ctx'])
        endings = [enc.encode(" " + ending) for ending in example['endings']]  # as build-nanogpt renders them
        cut = max(0, len(ctx) + max(map(len, endings)) - block_size)
        if cut > len(ctx):
            raise UserError(f"an ending of {max(map(len, endings))} tokens does not fit in "
                            f"block_size={block_size}")
        long += cut > 0
        ctx = ctx[cut:]
        cells = [(t, 0, p) for p, t in enumerate(ctx)] + [  # (token, seg, position) per token
            (t, i + 1, len(ctx) + p) for i, ending in enumerate(endings) for p, t in enumerate(ending)]
        targets = [(k - 1 if p > len(ctx) else p - 1, t, s - 1)  # (where its predictor is, token, ending)
                   for k, (t, s, p) in enumerate(cells) if s > 0 and p > 0]
        packed.append(dict(cells=cells, targets=targets, context=len(ctx), label=example['label']))
    if long and rank == 0:
        print(f"hellaswag: {long} examples are longer than block_size={block_size}: "
              f"their contexts lose tokens from the left")
    mine = sorted(packed, key=lambda p: len(p['cells']))[rank::world]  # a batch's rows are about as long
    groups = [mine[i:i + batch_examples] for i in range(0, len(mine), batch_examples)]
    # (E, L, M) of each batch: its rows, their length, its ending tokens
    shapes = [(len(g), max(len(p['cells']) for p in g), sum(len(p['cells']) - p['context'] for p in g))
              for g in groups]
    if one_shape:  # compiled: one graph
        shapes = [(batch_examples, max(s[1] for s in shapes), max(s[2] for s in shapes))] * len(groups)
    batches = []
    for b, (g, (E, L, M)) in enumerate(zip(groups, shapes)):
        grid = ([p['cells'] + [(0, 5, 0)] * (L - len(p['cells'])) for p in g]
                + [[(0, 5, 0)] * L] * (E - len(g)))  # padding: token 0, seg 5, position 0
        x, seg, pos = torch.tensor(grid).unbind(-1)  # (E, L) each
        targets = [(r * L + k, t, 4 * (b * batch_examples + r) + i)
                   for r, p in enumerate(g) for k, t, i in p['targets']]
        # padding up to M: token 0, predicted at 0, summed in a row past the rank's endings
        at, y, row = torch.tensor(targets + [(0, 0, 4 * len(mine))] * (M - len(targets))).unbind(-1)
        batches.append(tuple(t.to(device) for t in (x, seg, pos, at, y, row)))
    return batches, torch.tensor([p['label'] for p in mine], device=device)


def batch_losses(model, x, seg, pos, at, y):
    """The losses (M,) of a batch's ending tokens, in float32; no shape depends on the data: one graph."""
    # (E, L, L): what each token sees, up to itself: the context, and its own ending
    sees = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).tril() & (
        (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None]))
    # (M, n_embd): the hidden states where an ending token is next; the output layer runs only there
    h = model.hidden_states(x, pos=pos, mask=sees[:, None]).flatten(0, 1)[at]
    logits = model.lm_head(h).float()  # (M, vocab)
    return torch.logsumexp(logits, dim=1) - logits.gather(1, y[:, None])[:, 0]


def ending_losses(model, prepared, dtype="float32", compile=False):
    """(sum, mean) loss of every ending of prepare's output, 4 per example in its order."""
    (batches, labels), device = prepared, model.lm_head.weight.device
    model.eval()  # no dropout (the trainer's step sets train mode again)
    f = torch.compile(batch_losses, dynamic=False) if compile else batch_losses  # one graph: dynamo keeps it
    sums = torch.zeros(2, 4 * len(labels) + 1, device=device)  # per row: summed losses, scored tokens
    with torch.no_grad(), autocast(device, dtype):
        for *batch, row in batches:  # each token: its loss, and 1 to count it
            sums.index_add_(1, row, torch.stack((f(model, *batch), torch.ones(row.shape, device=device))))
    return sums[0, :-1], sums[0, :-1] / sums[1, :-1]


def evaluate(model, prepared, dtype="float32", compile=False):
    """(examples, correct by acc, correct by acc_norm) on the model's device: sum it over the ranks."""
    labels = prepared[1]
    picks = torch.stack(ending_losses(model, prepared, dtype, compile)).view(2, -1, 4).argmin(2)
    return torch.cat((labels.new_tensor([len(labels)]), (picks == labels).sum(1)))


def examples_per_batch(B, T):
    # about a training micro-batch's tokens (an example packs fewer than 256): it fits where a step fits
    return max(1, min(32, B * T // 256))


def load_for_training(file, model, B, T, device, one_shape=False):
    """This rank's val examples, prepared once; if they cannot be scored, every rank stops before step 0."""
    from gptkit import distributed  # the trainer's path only: `python hellaswag.py` needs no process group
    examples, why = None, None
    if model.config.vocab_size < N_VOCAB:
        why = f"vocab_size={model.config.vocab_size} is smaller than GPT-2's {N_VOCAB}"
    else:
        path = file or os.path.join(CACHE_DIR, 'hellaswag_val.jsonl')
        # downloaded once per node, as nodes may not share ./hellaswag/ (where they do, a rename is atomic)
        if not file:
            if int(os.environ.get('LOCAL_RANK', 0)) == 0:
                try:
                    download('val')  # nothing to do once cached
                except UserError as e:
                    why = str(e)
            distributed.barrier()  # each node's download first, however long
        examples = list(iterate_examples(file=path)) if os.path.isfile(path) else None  # bad data: UserError
        if examples == []:  # every rank reads the same file: all stop here, before step 0
            raise UserError(f"{path}: no HellaSwag examples in it")
    if not distributed.min_over_ranks(examples is not None):  # e.g. a node without the file: every rank stops
        why = why or (f"{path} not found" if examples is None else "not on every node")
        raise UserError(f"no HellaSwag eval: {why}; pass --hellaswag_file=PATH "
                        f"(a HellaSwag val jsonl file) or --hellaswag=False")
    return prepare(examples, model.config.block_size, device, examples_per_batch(B, T), distributed.rank(),
                   distributed.world_size(), one_shape)
