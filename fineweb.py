"""
Documents to GPT-2 token shards for train_gpt2.py: FineWeb-Edu (default), local files, or an
offline demo corpus.

    python fineweb.py                                  # FineWeb-Edu sample-10BT -> edu_fineweb10B/
    python fineweb.py --dataset "data/*.jsonl" --out_dir mydata
    python fineweb.py --demo                           # this Python's standard library -> demo_stdlib/

Each document becomes <|endoftext|> followed by its tokens (encode_ordinary); the stream is cut
into shards of shard_size tokens (documents run across shard boundaries), saved with np.save as
uint16 arrays named {prefix}_{split}_{index:06d}.npy: shard 0 is the val split, the rest train,
the last one holds the remainder. The prefix says what they hold: FineWeb-Edu's keep build-nanogpt's
"edufineweb", and for the same documents and shard size its files are byte-identical to
build-nanogpt's fineweb.py, so shards can be mixed and reused; "demo", "local", or another HF
dataset's name (shard_prefix).

Shards are written under a temporary name and renamed, and fineweb_manifest.json records where
each finished shard ends in the document stream: a run that is interrupted and started again
with the same arguments reuses the finished shards and ends with the same bytes.
"""
import argparse
import contextlib
import glob
import hashlib
import inspect
import itertools
import json
import multiprocessing as mp
import os
import random
import sys
import sysconfig
import time

import numpy as np

from gptkit.common import UserError, atomic_write
from gptkit.shards import FINEWEB_EDU, MANIFEST, read_manifest
from gptkit.tokenizer import EOT, get_gpt2_encoding

EXTENSIONS = ('.parquet', '.jsonl', '.txt')


# -----------------------------------------------------------------------------
# documents

def local_files(spec):
    """The files that --dataset names: a file, a folder (searched recursively) or a glob, sorted."""
    spec = os.path.expanduser(spec)
    if os.path.isdir(spec):
        files = [p for p in glob.glob(os.path.join(spec, '**', '*'), recursive=True)
                 if p.endswith(EXTENSIONS)]
    elif glob.has_magic(spec) or os.path.isfile(spec):
        files = glob.glob(spec, recursive=True)
    else:
        raise UserError(f"--dataset {spec!r}: no such file or folder")
    if not files:
        raise UserError(f"--dataset {spec!r}: no {'/'.join(EXTENSIONS)} files found")
    for path in files:
        if not path.endswith(EXTENSIONS):
            raise UserError(f"{path}: unsupported file type, expected one of {', '.join(EXTENSIONS)}")
    return sorted(files)


def is_local(spec):
    """A path, folder or glob (else a HF dataset name such as HuggingFaceFW/fineweb-edu)."""
    return (os.path.exists(spec) or glob.has_magic(spec) or spec.endswith(EXTENSIONS)
            or spec.startswith(('.', '/', '~')))


def check_text(text, where):
    if not isinstance(text, str):
        raise UserError(f"{where}: text is {type(text).__name__}, expected a string")
    return text


def iter_local(files, text_column):
    """Documents from parquet (a column), jsonl (a key of each line) and txt (a whole file) files."""
    for path in files:
        if path.endswith('.parquet'):
            import pyarrow.parquet as pq
            # its columns were checked up front
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024, columns=[text_column])
            for row, text in enumerate(text for batch in batches for text in batch.column(0).to_pylist()):
                yield check_text(text, f"{path} row {row}")
        elif path.endswith('.jsonl'):
            with open(path, 'rb') as f:
                for lineno, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        obj = json.loads(raw)
                    except ValueError as e:  # not JSON, or not UTF-8
                        raise UserError(f"{path}:{lineno}: not valid JSON ({e})") from None
                    if not isinstance(obj, dict) or text_column not in obj:
                        keys = ', '.join(obj) if isinstance(obj, dict) else type(obj).__name__
                        raise UserError(f"{path}:{lineno}: no key {text_column!r}; keys: {keys} "
                                        f"(choose one with --text_column)")
                    yield check_text(obj[text_column], f"{path}:{lineno}")
        else:
            with open(path, 'rb') as f:
                try:
                    yield f.read().decode('utf-8')
                except UnicodeDecodeError as e:
                    raise UserError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def check_parquet_columns(files, text_column):
    import pyarrow.parquet as pq
    for path in files:
        names = pq.read_schema(path).names if path.endswith('.parquet') else [text_column]
        if text_column not in names:
            raise UserError(f"{path}: no column {text_column!r}; columns: {', '.join(names)} "
                            f"(choose one with --text_column)")


def iter_hf(dataset, name, text_column, streaming, skip):
    """Documents of a HF dataset's train split, from document `skip` on."""
    import datasets
    try:
        ds = datasets.load_dataset(dataset, name=name, split='train', streaming=streaming)
    except Exception as e:  # offline, a typo, no such config: one line that says which
        raise UserError(f"--dataset {dataset!r} is no local file, folder or glob, and loading it from the HF "
                        f"hub failed: {type(e).__name__}: {str(e)[:300]}") from None
    for i, example in enumerate(ds.skip(skip) if skip else ds, skip):
        if text_column not in example:  # a streamed dataset may know its columns only from its documents
            raise UserError(f"{dataset}: no column {text_column!r}; columns: {', '.join(example)} (document "
                            f"{i}; choose one with --text_column)")
        yield check_text(example[text_column], f"{dataset} document {i}")


def demo_files():
    """The Python standard library's own modules, sorted: no tests, no site-packages, and not the
    generated data modules (pydoc_data's help topics, one huge string; encodings' codec tables)."""
    stdlib = sysconfig.get_paths()['stdlib']
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in ('site-packages', 'dist-packages', 'test', 'tests',
                                                'idle_test', '__pycache__', 'pydoc_data', 'encodings')]
        files += [os.path.join(root, n) for n in names if n.endswith('.py')]
    return sorted(files, key=lambda p: os.path.relpath(p, stdlib))


def iter_demo():
    """The demo corpus: every stdlib source file cut at its top-level definitions (PEP 8 puts two
    blank lines between them) and the docstrings of each built-in module's functions and classes,
    the pieces in a fixed shuffled order (seed 0). The loader reads contiguous tokens, so a corpus
    of whole files would give each small step one module; pieces give it a mix, and the val shard
    comes from the same mix as the train shards."""
    pieces = []
    for path in demo_files():
        with open(path, 'rb') as f:  # bytes that are not UTF-8: none in CPython's stdlib
            pieces += [p for p in f.read().decode('utf-8', 'replace').split('\n\n\n') if p.strip()]
    for name in sorted(sys.builtin_module_names):
        module = __import__(name)
        pieces.append(f"{name}: {module.__doc__ or ''}")
        for attr in sorted(dir(module)):
            # functions and classes, not live objects (sys.stdout); a hook the running program
            # may replace (sys.excepthook under pytest) as originally installed (sys.__excepthook__)
            obj = getattr(module, f"__{attr}__", getattr(module, attr))
            if not attr.startswith('_') and (inspect.isroutine(obj) or inspect.isclass(obj)) and obj.__doc__:
                pieces.append(f"{name}.{attr}: {obj.__doc__}")
    random.Random(0).shuffle(pieces)
    yield from pieces


# -----------------------------------------------------------------------------
# tokens and shards

def tokenize(text):
    return np.array([EOT, *get_gpt2_encoding().encode_ordinary(text)], dtype=np.uint16)  # GPT-2's ids fit


def tokenized(docs, pool):
    """Token arrays of docs, in order. Bounded batches of 1024 documents: memory does not grow with
    the dataset (Pool.imap alone would read the whole input ahead)."""
    for chunk in iter(lambda: list(itertools.islice(docs, 1024)), []):
        yield from (pool.imap(tokenize, chunk, chunksize=16) if pool else map(tokenize, chunk))


def save_manifest(out_dir, manifest):
    atomic_write(os.path.join(out_dir, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def open_output(out_dir, fingerprint):
    """The manifest of out_dir: a fresh one, or the one of an earlier run with the same arguments."""
    manifest = read_manifest(out_dir)
    if manifest is None and glob.glob(os.path.join(out_dir, '*.npy')):
        raise UserError(f"{out_dir} already holds .npy shards that this script did not record "
                        f"(no {MANIFEST}): delete them or choose another --out_dir")
    if manifest is None or not manifest['shards']:  # a new folder, or a run stopped before its first shard
        return {'args': fingerprint, 'shards': [], 'complete': False}
    old = manifest['args']
    if old != fingerprint:
        diff = [f"{k}: {old.get(k)!r} there, {fingerprint.get(k)!r} now"
                for k in sorted({*fingerprint, *old}) if old.get(k) != fingerprint.get(k)]
        raise UserError(f"{out_dir} holds shards made with other arguments ({'; '.join(diff)[:500]}): "
                        f"delete the folder or choose another --out_dir")
    for shard in manifest['shards']:
        p = os.path.join(out_dir, shard['file'])
        if not os.path.isfile(p) or os.path.getsize(p) != shard['bytes']:
            raise UserError(f"{p} is missing or changed since it was written: delete {out_dir} and start "
                            f"again")
    return manifest


def build(docs, out_dir, manifest, shard_size, max_tokens, num_proc):
    """Write the remaining shards of the token stream of docs (resumed where the manifest ends),
    named with manifest['prefix']; (tokens in all shards, documents read by this run)."""
    shards = manifest['shards']
    doc_i, offset = (shards[-1]['next_doc'], shards[-1]['next_offset']) if shards else (0, 0)
    total = sum(s['tokens'] for s in shards)  # tokens in the shards and in buf
    buf = np.empty(shard_size, dtype=np.uint16)
    filled = n_docs = 0  # tokens in buf; documents read

    def write_shard(next_doc, next_offset):
        name = f"{manifest['prefix']}_{'train' if shards else 'val'}_{len(shards):06d}.npy"
        path = os.path.join(out_dir, name)
        atomic_write(path, lambda f: np.save(f, buf[:filled]))
        shards.append({'file': name, 'tokens': filled, 'bytes': os.path.getsize(path),
                       'next_doc': next_doc, 'next_offset': next_offset})
        save_manifest(out_dir, manifest)  # after the rename: a listed shard is always whole

    from tqdm import tqdm
    bar = tqdm(total=max_tokens or None, initial=total, unit='tok', unit_scale=True, dynamic_ncols=True)
    with (mp.Pool(num_proc) if num_proc > 1 else contextlib.nullcontext()) as pool:
        for doc_i, tokens in enumerate(tokenized(docs, pool), doc_i):
            end = len(tokens) if not max_tokens else min(len(tokens), offset + max_tokens - total)
            bar.update(end - offset)
            while offset < end:
                take = min(shard_size - filled, end - offset)
                buf[filled:filled + take] = tokens[offset:offset + take]
                filled += take
                offset += take
                total += take
                if filled == shard_size:
                    write_shard(doc_i + (offset == len(tokens)), offset % len(tokens))  # next shard starts
                    filled = 0
            offset = 0  # only the first document may begin in an earlier shard
            n_docs += 1
            if max_tokens and total >= max_tokens:
                break
    bar.close()
    if filled:
        write_shard(doc_i + 1, 0)
    return total, n_docs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--dataset', default=FINEWEB_EDU,
                   help="HF dataset name, or local .parquet/.jsonl/.txt files: a file, a folder or a quoted "
                        "glob (default: %(default)s)")
    p.add_argument('--name', default='sample-10BT',
                   help="HF dataset config: sample-10BT, sample-100BT, ... (default: %(default)s; ignored "
                        "for local files)")
    p.add_argument('--text_column', default='text',
                   help="column (parquet, HF) or key (jsonl) holding the text; .txt files are one document "
                        "each (default: %(default)s)")
    p.add_argument('--out_dir',
                   help="output folder (default: edu_fineweb10B, demo_stdlib with --demo)")
    p.add_argument('--shard_size', type=int,
                   help="tokens per shard (default: 100,000,000; 500,000 with --demo)")
    p.add_argument('--num_proc', type=int, default=os.cpu_count(),
                   help="tokenizer processes (default: all cores)")
    p.add_argument('--streaming', action='store_true',
                   help="HF only: tokenize while downloading, without keeping the raw dataset on disk")
    p.add_argument('--max_tokens', type=int, default=0, help="stop after this many tokens (default: 0, all)")
    p.add_argument('--demo', action='store_true',
                   help="offline demo corpus: this Python's standard library sources and built-in docstrings")
    args = p.parse_args(argv)
    try:
        run(**vars(args))
    except UserError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: finished shards are kept; run the same command again to resume")


def run(dataset, name, text_column, out_dir, shard_size, num_proc, streaming=False, max_tokens=0, demo=False):
    out_dir = out_dir or ('demo_stdlib' if demo else 'edu_fineweb10B')
    shard_size = shard_size or (500_000 if demo else 100_000_000)
    if shard_size <= 0 or max_tokens < 0 or num_proc <= 0:
        raise UserError("--shard_size and --num_proc must be positive, --max_tokens >= 0")
    # what decides the bytes written (not streaming or num_proc): a rerun must match it to resume.
    # The prefix of the shards' names: build-nanogpt's for FineWeb-Edu, else one that says what they
    # hold (the trainer globs *_{split}_*.npy, so no '_' in it; the manifest names the dataset fully).
    fingerprint = {'shard_size': shard_size, 'max_tokens': max_tokens}
    if demo:
        prefix = 'demo'
        fingerprint.update(demo=sys.version, demo_version=2, stdlib=sysconfig.get_paths()['stdlib'],
                           files=len(demo_files()))
        docs = iter_demo()  # a generator: nothing read before the skip below
    elif is_local(dataset):
        prefix = 'local'
        files = local_files(dataset)
        check_parquet_columns(files, text_column)
        fingerprint.update(text_column=text_column, files=files_digest(files))
        docs = iter_local(files, text_column)
    else:
        alnum = ''.join(c for c in dataset.split('/')[-1].lower() if c.isalnum()) or 'data'
        prefix = 'edufineweb' if dataset == FINEWEB_EDU else alnum
        fingerprint.update(dataset=dataset, name=name, text_column=text_column)
        docs = None  # iter_hf skips on HF's side

    manifest = open_output(out_dir, fingerprint)
    done = list(manifest['shards'])  # finished by an earlier run
    reused = f"{len(done)} shards ({sum(s['tokens'] for s in done):,} tokens)"
    if manifest['complete']:
        print(f"{out_dir} is complete already: reused all {reused}, nothing to do")
        return
    skip = done[-1]['next_doc'] if done else 0
    docs = iter_hf(dataset, name, text_column, streaming, skip) if docs is None else \
        itertools.islice(docs, skip, None)
    first = next(docs, None)  # fail before writing anything: a missing column, an empty dataset
    if first is None and not done:
        raise UserError(f"{'the demo corpus' if demo else dataset}: no documents")
    os.makedirs(out_dir, exist_ok=True)
    for tmp in glob.glob(os.path.join(out_dir, '*.tmp[0-9]*')):  # what a killed run's atomic_write left
        os.remove(tmp)
    if done:
        print(f"resuming: reused {reused} in {out_dir}, continuing at document {skip:,}")
    save_manifest(out_dir, manifest)

    t0 = time.time()
    docs = itertools.chain([] if first is None else [first], docs)  # none left: killed before 'complete'
    # resumed: the names it began with (an older fineweb.py's folder holds edufineweb_ shards of any data)
    manifest['prefix'] = done[0]['file'].rsplit('_val_', 1)[0] if done else prefix
    total, n_docs = build(docs, out_dir, manifest, shard_size, max_tokens, num_proc)
    manifest['complete'] = True
    save_manifest(out_dir, manifest)
    n_shards = len(manifest['shards'])
    print(f"done: {total:,} tokens in {n_shards} shards ({n_shards - len(done)} new) in {out_dir}; this run: "
          f"{n_docs:,} documents in {time.time() - t0:.1f} s")
    if n_shards == 1:
        print("warning: only the val shard was written; train_gpt2.py also needs train shards: lower "
              "--shard_size")


def files_digest(files):
    """Names, sizes and modification times of the input files: a rerun must see the same input."""
    h = hashlib.sha256()
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{len(files)} files, sha256 {h.hexdigest()[:16]}"


if __name__ == "__main__":
    main()
