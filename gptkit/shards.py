"""
The token shards that fineweb.py writes (build-nanogpt's format: a 1-D uint16 .npy array of GPT-2
token ids per file, *_train_*.npy and *_val_*.npy in one folder): finding them, opening them
memory-mapped and checked, the val tokens, a shard's documents in a shuffled order, and the train
split as one stream with its position (DataLoaderLite), which train_gpt2.py reads.
"""
import glob
import os

import numpy as np

from gptkit.common import UserError
from gptkit.tokenizer import EOT

MANIFEST = 'fineweb_manifest.json'  # written by fineweb.py: its arguments, its shards, whether it finished
FINEWEB_EDU = 'HuggingFaceFW/fineweb-edu'  # the data GPT-2's reference val loss (plot.py) is measured on


def read_manifest(data_root):
    """fineweb.py's manifest of data_root (its arguments, its shards, whether it finished), or None
    where there is none (build-nanogpt's shards, or others)."""
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
    manifest = read_manifest(data_root)  # None in a folder that is not there
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
                        "command with a smaller --shard_size, about a tenth of the corpus's tokens "
                        "(docs/data.md)")
    raise UserError(f"no {split} shard (*_{split}_*.npy) in {data_root!r}: run `python fineweb.py`")


def dataset_of(data_root):
    """What data_root's shards were made from, as fineweb.py's manifest says: the HF dataset and its
    config ("HuggingFaceFW/fineweb-edu sample-10BT"), the demo, local files; None without a
    manifest. run.json records it; plot.py reads it."""
    manifest = read_manifest(data_root)
    if manifest is None:
        return None
    args = manifest['args']
    if 'demo' in args:
        return 'demo: the Python standard library'
    return f"{args['dataset']} {args.get('name') or ''}".strip() if 'dataset' in args else 'local files'


def open_shard(path, vocab_size=None, n=None):
    """The shard's first n tokens (all of them by default) as a read-only memory map: pages load as
    batches touch them. With vocab_size, every id of those is checked to be below it (one pass as the
    shard is opened): an id the model has no embedding for is one line now, not an IndexError (CPU)
    or a device-side assert (CUDA) when a batch reaches it."""
    try:
        tokens = np.load(path, mmap_mode='r')
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable .npy array ({e})") from None
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
    """The first n_tokens + 1 tokens of the val split, as one uint16 array."""
    tokens = np.zeros(0, dtype=np.uint16)
    for path in find_shards(data_root, 'val'):  # each shard adds what is still missing
        tokens = np.concatenate([tokens, open_shard(path, vocab_size, n_tokens + 1 - len(tokens))])
        if len(tokens) == n_tokens + 1:
            return tokens
    raise UserError(f"the val split in {data_root!r} has {len(tokens)} tokens, fewer than "
                    f"val_tokens + 1 = {n_tokens + 1}: lower val_tokens")


def eot_positions(tokens, block):
    """Where tokens holds <|endoftext|>, an array per block of tokens, read a block at a time: the
    memory is the answer's, not a mask of the whole shard."""
    return (np.flatnonzero(tokens[i:i + block] == EOT) + i for i in range(0, len(tokens), block))


def cut_tail(tokens):
    """How many tokens a shard begins with before its first <|endoftext|>: the tail of a document
    that fineweb.py cut at the shard boundary (0 when the shard begins with one, or has none: then
    it is one piece of text). Read from the start, a block at a time: a document's length, no more."""
    return int(next((found[0] for found in eot_positions(tokens, 1 << 16) if len(found)), 0))


class ShuffledDocuments:
    """A shard's tokens with its documents in the order rng draws, each whole and in its own token
    order: a slice of it is read from the memory map as the few documents it spans (no copy of the
    shard). Holds three numbers per document (where it starts in the file, its length, and where it
    starts in this order). The tail of a document cut at the shard's start (what cut_tail counts) is
    left out: it has no <|endoftext|> before it, and shuffled it would be glued to an unrelated
    document."""

    def __init__(self, tokens, rng):
        # where the documents start: token 0 (a shard may begin mid-document), then every <|endoftext|>
        # (fineweb.py writes a document as EOT, then its tokens); token 0 may be an EOT itself
        starts = np.unique(np.concatenate([[0], *eot_positions(tokens, 1 << 24)]))
        order = rng.permutation(len(starts))
        if len(starts) > 1 and tokens[0] != EOT:  # starts[0] is the cut tail: it is left out
            order = order[order != 0]  # the others stay in the order drawn
        self.tokens = tokens
        self.starts = starts[order]
        self.lengths = np.diff(starts, append=len(tokens))[order]
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths)))  # where each one starts in this order

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, where):  # a slice [a:b] of the shuffled stream
        a, b, _ = where.indices(len(self))
        # the documents that tokens a and b fall in (in offsets[:-1], where each one starts: the end of
        # the stream falls in the last one)
        i, j = np.searchsorted(self.offsets[:-1], [a, b], side='right') - 1
        # of each, the part from a to b: a slice of the memory map (not an index per token), no more (a
        # document may be far longer than a batch); s: where it starts in the file, o: in this order
        return np.concatenate([self.tokens[s + max(a - o, 0):s + min(b - o, n)] for s, n, o in zip(
            self.starts[i:j + 1], self.lengths[i:j + 1], self.offsets[i:j + 1])])


class DataLoaderLite:
    """Batches of B sequences of T tokens from the shards of one split, read as one stream whose
    position (epoch, shard, pos) is global, the same on every rank, and moves by whole steps: a step
    reads one run of B*T*num_processes*accum_steps (+1) tokens, and micro-step m of rank r takes its
    chunk m * num_processes + r, so the tokens of a step do not depend on the number of processes.
    shuffle: each epoch orders the shards and their documents anew from (seed, epoch) alone; else
    files and tokens in order (docs/data.md). state() and load_state() resume it exactly."""

    def __init__(self, B, T, process_rank, num_processes, split, data_root, accum_steps=1,
                 vocab_size=None, shuffle=False, seed=1337):
        self.B, self.T, self.rank, self.world, self.accum = B, T, process_rank, num_processes, accum_steps
        self.step_tokens = B * T * num_processes * accum_steps
        self.vocab_size, self.shuffle, self.seed = vocab_size, shuffle, seed
        # The shards' lengths (shuffled: less the cut first document, never read), checked now, not
        # hours into a run: one must hold a step. A shorter one, like the remainder fineweb.py writes
        # last, keeps its place in the list (a checkpoint's shard number means the same whatever
        # total_batch_size) and is passed over when its turn comes (rank 0 says which).
        self.shards = find_shards(data_root, split)
        self.lengths = [len(t) - (cut_tail(t) if shuffle else 0) for t in map(open_shard, self.shards)]
        less = ' less its cut first document' * shuffle
        # a step reads step_tokens + 1 tokens: its inputs and its last target
        if max(self.lengths) <= self.step_tokens:
            longest = int(np.argmax(self.lengths))
            raise UserError(f"no {split} shard in {data_root!r} holds one step of total_batch_size + 1 = "
                            f"{self.step_tokens + 1} tokens (the longest, {self.shards[longest]}: "
                            f"{self.lengths[longest]} tokens{less}): lower total_batch_size, or make longer "
                            "shards (fineweb.py --shard_size)")
        for path, n in zip(self.shards, self.lengths):
            if n <= self.step_tokens and process_rank == 0:
                print(f"{path}: {n} tokens{less}, fewer than one step of {self.step_tokens + 1}: passed over")
        self.n_tokens = sum(self.lengths)
        self.steps_per_epoch = sum((n - 1) // self.step_tokens for n in self.lengths)
        self.open(0, 0, 0)
        self.next_shard_if_short()  # the first may be a shard too short for one step

    def next_batch(self):
        import torch
        B, T = self.B, self.T
        start = self.pos + (self.micro * self.world + self.rank) * B * T
        buf = torch.from_numpy(self.tokens[start:start + B * T + 1].astype(np.int64))  # only this chunk
        self.micro = (self.micro + 1) % self.accum
        if self.micro == 0:  # this step's run is read: every rank advances alike
            self.pos += self.step_tokens
            self.next_shard_if_short()
        return buf[:-1].view(B, T), buf[1:].view(B, T)  # inputs, targets

    def open(self, epoch, shard, pos):
        """Shard number `shard` in epoch's order of the shards, from token pos of its stream."""
        # shuffled: (seed, epoch) orders the shards, and (seed, epoch, shard) a shard's documents, whatever
        # the world size
        self.order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)) if self.shuffle
                      else np.arange(len(self.shards)))
        # the position, at a step boundary; micro: the micro-steps of this step read so far
        self.epoch, self.shard, self.pos, self.micro = epoch, shard, pos, 0
        tokens = open_shard(self.shards[self.order[shard]], self.vocab_size)
        self.tokens = (ShuffledDocuments(tokens, np.random.default_rng([self.seed, epoch, self.order[shard]]))
                       if self.shuffle else tokens)

    def next_shard_if_short(self):
        """Past shards shorter than one step (__init__ made sure one is longer): while no
        whole step is left, the next shard, or the next epoch."""
        while self.pos + self.step_tokens + 1 > len(self.tokens):
            last = self.shard + 1 == len(self.shards)
            self.open(self.epoch + last, 0 if last else self.shard + 1, 0)

    def epoch_begins(self):
        """Whether this step begins an epoch after the first: none of it read yet, and the shards
        before this one too short to hold a step."""
        return (self.epoch > 0 and self.pos == 0
                and all(self.lengths[k] <= self.step_tokens for k in self.order[:self.shard]))

    def state(self):
        """The global position, at a step boundary: the same on every rank, for any world size."""
        return {'epoch': self.epoch, 'shard': self.shard, 'pos': self.pos, 'shuffle': self.shuffle,
                'seed': self.seed, 'file': os.path.basename(self.shards[self.order[self.shard]])}

    def load_state(self, state, source):
        """Resume at a checkpoint's position (source: its path, for the errors)."""
        if 'epoch' not in state:  # written before shuffling: files and tokens in order
            if self.shuffle and self.rank == 0:
                print(f"{source} was written before the data was shuffled: it resumes in file order "
                      f"(shuffle=False)")
            self.shuffle = False
            state = dict(state, epoch=0, shuffle=False, seed=self.seed)
        if state['shuffle'] != self.shuffle or (self.shuffle and state['seed'] != self.seed):
            raise UserError(f"{source} was written with shuffle={state['shuffle']} seed={state['seed']}: "
                            f"resume with --shuffle={state['shuffle']} --seed={state['seed']}, or point "
                            f"log_dir elsewhere")
        self.open(state['epoch'], min(state['shard'], len(self.shards) - 1), state['pos'])
        if state['shard'] >= len(self.shards) or self.state()['file'] != state['file']:
            raise UserError(f"{source} was reading train shard {state['file']!r} (number {state['shard']}), "
                            f"but that shard of data_root is {self.state()['file']!r}: resume with the "
                            f"same data_root")
        self.next_shard_if_short()  # total_batch_size may have grown


def val_batches(tokens, B, T, rank, world):
    """The val tokens as this rank's batches, made once: (x, y, text), each (batches, B, T), int64 and
    bool. Rank r takes the sequences of T tokens r, r + world, ...: the values summed over the ranks do
    not depend on world. Rows past a rank's last sequence are padding (target -1, no loss), so every
    batch has one shape: one compiled graph. text: the targets that decode to text, for bits per byte
    (<|endoftext|> and padding: 0 bytes)."""
    import torch
    seqs = range(rank, (len(tokens) - 1) // T, world)  # this rank's sequences of T tokens (and a target)
    rows = np.full((-(-len(seqs) // B) * B, T + 1), -1)  # whole batches of B rows
    rows[:len(seqs)] = [tokens[j * T:j * T + T + 1] for j in seqs]
    # the targets that decode to text: GPT-2's ids below <|endoftext|>, each one byte or more
    text = (rows[:, 1:] >= 0) & (rows[:, 1:] < EOT)
    # x (a padding row's inputs: token 0), y and text
    return tuple(torch.from_numpy(a).view(-1, B, T) for a in (rows[:, :-1].clip(0), rows[:, 1:], text))
