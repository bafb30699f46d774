"""The token shards fineweb.py writes (build-nanogpt's format: a 1-D uint16 .npy array of GPT-2 ids per file,
*_train_*.npy and *_val_*.npy in one folder): the val tokens, and the train split as one stream."""
import glob
import os

import numpy as np

from gptkit.common import UserError
from gptkit.tokenizer import EOT

MANIFEST = 'fineweb_manifest.json'  # written by fineweb.py: its arguments, its shards, whether it finished
FINEWEB_EDU = 'HuggingFaceFW/fineweb-edu'  # the data GPT-2's reference val loss (plot.py) is measured on


def read_manifest(data_root):
    path = os.path.join(data_root, MANIFEST)
    if not os.path.isfile(path):
        return None
    import json  # only where there is a manifest
    try:
        with open(path) as f:
            manifest = json.load(f)
        manifest['complete'], manifest['args']  # what the trainer reads
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable ({e!r}): delete the folder and run fineweb.py again") from None
    return manifest


def find_shards(data_root, split):
    manifest = read_manifest(data_root)
    if manifest is not None and not manifest['complete']:
        raise UserError(f"{data_root!r} is unfinished: fineweb.py was interrupted or failed there; "
                        f"run the same fineweb.py command again to finish it")
    shards = sorted(glob.glob(os.path.join(data_root, f'*_{split}_*.npy')))
    if shards:
        return shards
    if not os.path.isdir(data_root):
        raise UserError(f"data folder {data_root!r} not found: run `python fineweb.py` to make the token "
                        f"shards, or point data_root at them")
    if split == 'train' and glob.glob(os.path.join(data_root, '*_val_*.npy')):
        raise UserError(f"{data_root!r} holds a val shard and no train shard: its corpus was smaller than "
                        "one --shard_size (shard 0 is the val split); delete it and run the same fineweb.py "
                        "command with a smaller --shard_size, about a tenth of the corpus (docs/data.md)")
    raise UserError(f"no {split} shard (*_{split}_*.npy) in {data_root!r}: run `python fineweb.py`")


def dataset_of(data_root):
    manifest = read_manifest(data_root)
    if manifest is None:
        return None
    args = manifest['args']
    if 'demo' in args:
        return 'demo: the Python standard library'
    return f"{args['dataset']} {args.get('name') or ''}".strip() if 'dataset' in args else 'local files'


def open_shard(path, vocab_size=None, n=None):
    """The first n tokens, memory-mapped, checked below vocab_size now: not a CUDA assert mid-run."""
    try:
        tokens = np.load(path, mmap_mode='r')
    except (ValueError, OSError) as e:
        # numpy takes other bytes for a pickle, and advises allow_pickle: the advice not to take
        why = "not a .npy file" if 'pickle' in str(e) else e
        raise UserError(f"{path}: not a .npy array of token ids as fineweb.py writes them ({why})") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise UserError(f"{path}: expected a 1-D uint16 array of token ids, got {tokens.dtype} of shape "
                        f"{tokens.shape}")
    tokens = tokens[:n]
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        i = int(tokens.argmax())
        raise UserError(f"{path}: token id {tokens[i]} (at token {i:,}) is not below the model's "
                        f"vocab_size={vocab_size}: the shard was made with another tokenizer, or vocab_size "
                        "is too small")
    return tokens


def load_val_tokens(data_root, n_tokens, vocab_size=None):
    tokens = np.zeros(0, dtype=np.uint16)
    for path in find_shards(data_root, 'val'):
        tokens = np.concatenate([tokens, open_shard(path, vocab_size, n_tokens + 1 - len(tokens))])
        if len(tokens) == n_tokens + 1:
            return tokens
    raise UserError(f"the val split in {data_root!r} has {len(tokens)} tokens, fewer than "
                    f"val_tokens + 1 = {n_tokens + 1}: lower val_tokens")


def eot_positions(tokens, block):
    return (np.flatnonzero(tokens[i:i + block] == EOT) + i for i in range(0, len(tokens), block))


def tokens_before_first_eot(tokens):
    return int(next((found[0] for found in eot_positions(tokens, 1 << 16) if len(found)), 0))


class ShuffledDocuments:
    """A shard's documents in rng's order, less the one cut at its start: it would be glued to another."""

    def __init__(self, tokens, rng):
        starts = np.unique(np.concatenate([[0], *eot_positions(tokens, 1 << 24)]))
        order = rng.permutation(len(starts))
        if len(starts) > 1 and tokens[0] != EOT:
            order = order[order != 0]
        self.tokens = tokens
        self.starts = starts[order]
        self.lengths = np.diff(starts, append=len(tokens))[order]
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths)))  # where each starts in this order

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, where):
        a, b, _ = where.indices(len(self))
        # the documents a and b fall in, and of each a slice (s: its start in the file, o: in this order)
        i, j = np.searchsorted(self.offsets[:-1], [a, b], side='right') - 1
        return np.concatenate([self.tokens[s + max(a - o, 0):s + min(b - o, n)] for s, n, o in zip(
            self.starts[i:j + 1], self.lengths[i:j + 1], self.offsets[i:j + 1])])


class DataLoaderLite:
    """Batches of B x T tokens of one split, read as one stream: micro-step m of rank r reads chunk
    m * num_processes + r of its step's tokens: a step is the same at any world size (docs/data.md)."""

    def __init__(self, B, T, process_rank, num_processes, split, data_root, accum_steps=1,
                 vocab_size=None, shuffle=False, seed=1337):
        self.B, self.T, self.rank, self.world, self.accum = B, T, process_rank, num_processes, accum_steps
        self.step_tokens = B * T * num_processes * accum_steps
        self.vocab_size, self.shuffle, self.seed = vocab_size, shuffle, seed
        # a shard too short for a step keeps its place, so that a checkpoint's shard number holds
        self.shards = find_shards(data_root, split)
        self.lengths = [len(t) - (tokens_before_first_eot(t) if shuffle else 0)  # shuffled: never read
                        for t in map(open_shard, self.shards)]
        less = ' less its cut first document' * shuffle
        if max(self.lengths) <= self.step_tokens:
            path, n = max(zip(self.shards, self.lengths), key=lambda shard: shard[1])
            raise UserError(f"no {split} shard in {data_root!r} holds one step of total_batch_size + 1 = "
                            f"{self.step_tokens + 1} tokens (the longest, {path}: {n} tokens{less}): lower "
                            "total_batch_size, or make longer shards (fineweb.py --shard_size)")
        for path, n in zip(self.shards, self.lengths):
            if n <= self.step_tokens and process_rank == 0:
                print(f"{path}: {n} tokens{less}, fewer than one step of {self.step_tokens + 1}: passed over")
        self.n_tokens = sum(self.lengths)
        self.steps_per_epoch = sum((n - 1) // self.step_tokens for n in self.lengths)
        self.open(0, 0, 0)
        self.next_shard_if_short()

    def next_batch(self):
        import torch
        B, T = self.B, self.T
        start = self.pos + (self.micro * self.world + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[start:start + B * T + 1].astype(np.int64))
        self.micro = (self.micro + 1) % self.accum
        if self.micro == 0:  # the step's run is read, by every rank alike
            self.pos += self.step_tokens
            self.next_shard_if_short()
        return buf[:-1].view(B, T), buf[1:].view(B, T)

    def open(self, epoch, shard, pos):
        self.order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)) if self.shuffle
                      else np.arange(len(self.shards)))
        self.epoch, self.shard, self.pos, self.micro = epoch, shard, pos, 0
        tokens = open_shard(self.shards[self.order[shard]], self.vocab_size)
        self.tokens = (ShuffledDocuments(tokens, np.random.default_rng([self.seed, epoch, self.order[shard]]))
                       if self.shuffle else tokens)

    def next_shard_if_short(self):
        while self.pos + self.step_tokens + 1 > len(self.tokens):
            last = self.shard + 1 == len(self.shards)
            self.open(self.epoch + last, 0 if last else self.shard + 1, 0)

    def epoch_begins(self):
        return (self.epoch > 0 and self.pos == 0
                and all(self.lengths[k] <= self.step_tokens for k in self.order[:self.shard]))

    def state_dict(self):
        """The position at a step boundary: the same on every rank, and resumable at any world size."""
        return {'epoch': self.epoch, 'shard': self.shard, 'pos': self.pos, 'shuffle': self.shuffle,
                'seed': self.seed, 'file': os.path.basename(self.shards[self.order[self.shard]])}

    def load_state_dict(self, state):
        if 'epoch' not in state:  # written before shuffling: files and tokens in order
            if self.shuffle and self.rank == 0:
                print("the checkpoint predates shuffling: it resumes in file order (shuffle=False)")
            self.shuffle = False
            state = dict(state, epoch=0, shuffle=False, seed=self.seed)
        if state['shuffle'] != self.shuffle or (self.shuffle and state['seed'] != self.seed):
            raise UserError(f"the checkpoint was written with shuffle={state['shuffle']} "
                            f"seed={state['seed']}: resume with --shuffle={state['shuffle']} "
                            f"--seed={state['seed']}, or point log_dir elsewhere")
        self.open(state['epoch'], min(state['shard'], len(self.shards) - 1), state['pos'])
        file = self.state_dict()['file']
        if state['shard'] >= len(self.shards) or file != state['file']:
            raise UserError(f"the checkpoint was reading train shard {state['file']!r} (number "
                            f"{state['shard']}), but that shard of data_root is {file!r}: resume with the "
                            "same data_root")
        self.next_shard_if_short()  # total_batch_size may have grown


def val_batches(tokens, B, T, rank, world):
    """Sequences r, r + world, ... as (x, y, text: which targets are text), padded (y: -1) to batches."""
    import torch
    seqs = range(rank, (len(tokens) - 1) // T, world)
    rows = np.full((-(-len(seqs) // B) * B, T + 1), -1)
    rows[:len(seqs)] = [tokens[j * T:j * T + T + 1] for j in seqs]
    text = (rows[:, 1:] >= 0) & (rows[:, 1:] < EOT)
    return tuple(torch.from_numpy(a).view(-1, B, T) for a in (rows[:, :-1].clip(0), rows[:, 1:], text))
