import http.server
import json
import os
import threading

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import forked
from conftest import one_thread
import hellaswag
from gptkit.common import UserError
from model import GPT, GPTConfig

WORDS = "a man is seen the woman then they continue to walk dog ball kitchen holds up smiles camera".split()


def make_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, k))
    return [{"ind": i, "activity_label": "Test", "ctx_a": "", "ctx_b": "", "ctx": words(rng.integers(3, 30)),
             "split": "val", "split_type": "indomain", "label": int(rng.integers(0, 4)),
             "endings": [words(rng.integers(1, 15)) for _ in range(4)], "source_id": f"test~{i}"}
            for i in range(n)]


def write_file(path, examples):
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(d)
    return hf, GPT.from_pretrained(str(d)).eval()


def brute_force(hf, example):
    """build-nanogpt's scoring with HF's full logits, one example at a time."""
    tokens, mask, label = hellaswag.render_example(example)
    with torch.no_grad():
        logits = hf(tokens).logits
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                             reduction="none").view(4, -1) * mask[:, 1:]
    sums = losses.sum(1)
    return sums, sums / mask[:, 1:].sum(1)


def test_render_example_as_build_nanogpt(enc):
    e = {"ctx": "A man sits", "label": 2, "endings": ["down.", "on a big chair.", "up", "there"]}
    tokens, mask, label = hellaswag.render_example(e)
    ctx = enc.encode("A man sits")
    assert label == 2 and tokens.shape == mask.shape == (4, len(ctx) + len(enc.encode(" on a big chair.")))
    assert tokens[1].tolist() == ctx + enc.encode(" on a big chair.")
    down = enc.encode(" down.")
    pad = tokens.size(1) - len(ctx) - len(down)
    assert tokens[0].tolist() == ctx + down + [0] * pad
    assert mask[0].tolist() == [0] * len(ctx) + [1] * len(down) + [0] * pad


def test_batched_equals_one_at_a_time_equals_hf(hf_and_ours):
    hf, ours = hf_and_ours
    examples = make_examples(40)
    rendered = [hellaswag.render_example(e) for e in examples]
    sums, avgs = hellaswag.ending_losses(ours, rendered, "cpu")  # all 40 in one forward
    for i, e in enumerate(examples):
        ref_sum, ref_avg = brute_force(hf, e)
        one_sum, one_avg = hellaswag.ending_losses(ours, [rendered[i]], "cpu")
        for s, a in ((sums[4 * i:4 * i + 4], avgs[4 * i:4 * i + 4]), (one_sum, one_avg)):
            assert torch.allclose(s, ref_sum, atol=1e-4) and torch.allclose(a, ref_avg, atol=1e-5)
            assert s.argmin() == ref_sum.argmin() and a.argmin() == ref_avg.argmin()
    counts = [hellaswag.evaluate(ours, rendered, "cpu", batch_examples=b) for b in (1, 7, 40)]
    assert counts[0] == counts[1] == counts[2]
    ref = [brute_force(hf, e) for e in examples]
    assert counts[0] == (40, sum(int(r[0].argmin() == e["label"]) for r, e in zip(ref, examples)),
                         sum(int(r[1].argmin() == e["label"]) for r, e in zip(ref, examples)))
    # ranks take i % world: the parts add up to the whole
    parts = [hellaswag.evaluate(ours, rendered, "cpu", rank=r, world=3) for r in range(3)]
    assert tuple(map(sum, zip(*parts))) == counts[0]


def test_shared_contexts_of_any_length(hf_and_ours, enc):
    """The context cache's corner cases against brute force: two examples with the same context
    (one cache for both), an empty context (the ending's first token is not scored, as in
    build-nanogpt), one-token endings (scored from the context's last position alone), endings
    that share their first words, contexts of very different lengths in one batch, and any
    batch size."""
    hf, ours = hf_and_ours
    assert len(enc.encode(" a")) == 1
    long_ctx = " ".join(WORDS * 2)
    examples = [dict(ctx="a man is seen", label=0, endings=["a", "the dog", "the dog is", "they walk"]),
                dict(ctx="a man is seen", label=1, endings=["smiles", "a", "then a woman", "camera up"]),
                dict(ctx="", label=2, endings=["a man walks", "the dog holds", "then up", "a ball kitchen"]),
                dict(ctx=long_ctx, label=3, endings=["a", "to walk the dog", "a ball", "holds a camera up"]),
                dict(ctx="the woman then", label=0, endings=["walks", "a dog", "smiles", "is seen up"])]
    rendered = [hellaswag.render_example(e) for e in examples]
    ref = [brute_force(hf, e) for e in examples]
    for batch in (1, 2, 16):
        sums, avgs = hellaswag.ending_losses(ours, rendered, "cpu", batch_examples=batch)
        for i, (ref_sum, ref_avg) in enumerate(ref):
            assert torch.allclose(sums[4 * i:4 * i + 4], ref_sum, atol=1e-4), (batch, i)
            assert torch.allclose(avgs[4 * i:4 * i + 4], ref_avg, atol=1e-5), (batch, i)


def test_bf16_forward_float32_loss(hf_and_ours):
    _, ours = hf_and_ours
    rendered = [hellaswag.render_example(e) for e in make_examples(8, seed=1)]
    s32, _ = hellaswag.ending_losses(ours, rendered, "cpu", "float32")
    s16, _ = hellaswag.ending_losses(ours, rendered, "cpu", "bfloat16")
    assert s16.dtype == torch.float32 and torch.allclose(s16, s32, rtol=0.05)


def test_long_examples_lose_context_from_the_left(hf_and_ours, capsys):
    _, ours = hf_and_ours  # block_size 64
    e = make_examples(1)[0]
    e["ctx"] = " ".join(["kitchen"] * 100)
    tokens, mask, label = hellaswag.render_example(e)
    assert tokens.size(1) > 64
    n, _, _ = hellaswag.evaluate(ours, [(tokens, mask, label)], "cpu")
    assert n == 1
    said = "1 examples are longer than block_size=64: their contexts lose tokens from the left"
    assert said in capsys.readouterr().out
    s, _ = hellaswag.ending_losses(ours, [(tokens, mask, label)], "cpu")
    keep = [(t[m.nonzero()[-1] + 1 - 64:m.nonzero()[-1] + 1]) for t, m in zip(tokens, mask)]
    with torch.no_grad():  # the same as scoring the last 64 tokens of each row
        for i, row in enumerate(keep):
            logits, _ = ours(row[None])
            n_end = int(mask[i].sum())
            ref = F.cross_entropy(logits[0, -n_end - 1:-1], row[-n_end:], reduction="sum")
            assert abs(ref.item() - s[i].item()) < 1e-4


def test_bad_lines_name_file_and_line(tmp_path):
    good = make_examples(2)
    three_endings = json.dumps(dict(good[0], endings=["a", "b", "c"]))
    for bad, message in [("not json", r":3: not valid JSON"),
                         (json.dumps(dict(good[0], label=4)), r":3: label must be 0..3, got 4"),
                         (three_endings, r":3: expected 4 string endings")]:
        path = tmp_path / "h.jsonl"
        write_file(path, good)
        with open(path, "a") as f:
            f.write(bad + "\n")
        with pytest.raises(UserError, match=str(path) + message):
            list(hellaswag.iterate_examples(file=str(path)))


class Server:
    """A local HTTP server for the download tests; truncate=True sends half the body."""

    def __init__(self, body, truncate=False):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:len(body) // 2] if truncate else body)

            def log_message(self, *a):
                pass
        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/hellaswag_val.jsonl"
        threading.Thread(target=self.httpd.handle_request, daemon=True).start()


def test_download(tmp_path):
    examples = make_examples(5)
    write_file(tmp_path / "src.jsonl", examples)
    body = (tmp_path / "src.jsonl").read_bytes()
    cache = tmp_path / "cache"
    bad = Server(body, truncate=True)
    with pytest.raises(UserError, match=r"could not download .* put hellaswag_val.jsonl in .*cache"):
        hellaswag.download("val", str(cache), url=bad.url)
    assert not cache.exists()  # no half file, and no folder that it made
    good = Server(body)
    path = hellaswag.download("val", str(cache), url=good.url)
    assert open(path, "rb").read() == body
    assert hellaswag.download("val", str(cache), url="http://127.0.0.1:9/unused") == path  # cached
    assert [e["ind"] for e in hellaswag.iterate_examples("val", cache_dir=str(cache))] == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="could not download http://127.0.0.1:9/"):
        hellaswag.download("train", str(cache), url="http://127.0.0.1:9/hellaswag_train.jsonl")


def test_a_failed_download_leaves_no_folder_it_made(tmp_path):
    """Offline, download fails: the cache folder it made, and the parents it made for it, are gone
    again (no empty hellaswag/ left behind); a folder that was there already stays, empty."""
    for where in (tmp_path / "new", tmp_path / "new" / "deeper"):
        with pytest.raises(UserError, match="could not download http://127.0.0.1:9/"):
            hellaswag.download("val", str(where), url="http://127.0.0.1:9/hellaswag_val.jsonl")
        assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(UserError, match="could not download"):
        hellaswag.download("val", str(tmp_path / "there"), url="http://127.0.0.1:9/hellaswag_val.jsonl")
    assert os.listdir(tmp_path / "there") == []


def test_standalone_cli(tmp_path, hf_and_ours):
    """python hellaswag.py --model <HF dir> --file ... prints what evaluate counts; a .pt checkpoint and
    a run's log_dir too."""
    import sys
    from conftest import ROOT
    hf, ours = hf_and_ours
    examples = make_examples(20, seed=7)
    write_file(tmp_path / "h.jsonl", examples)
    hf.save_pretrained(tmp_path / "hfdir")
    n, c, cn = hellaswag.evaluate(ours, [hellaswag.render_example(e) for e in examples[:15]], "cpu")
    want = f"acc: {c / n:.4f} acc_norm: {cn / n:.4f}"
    torch.save({"model": ours.state_dict(), "config": ours.config.__dict__}, tmp_path / "model_00001.pt")
    def run(*args):
        return forked.run([sys.executable, "hellaswag.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=one_thread())
    data = str(tmp_path / "h.jsonl")
    for model in (tmp_path / "hfdir", tmp_path / "model_00001.pt", tmp_path):  # a log_dir: its newest
        r = run("--model", str(model), "--file", data, "--device", "cpu", "--limit", "15")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == want
    newest = f"{tmp_path}: its newest checkpoint, {tmp_path / 'model_00001.pt'}\n"
    assert r.stderr.startswith(newest), r.stderr
    r = run("--model", str(tmp_path / "hfdir"), "--file", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: {tmp_path / 'missing.jsonl'}: no such file "
                                f"(expected HellaSwag jsonl, one example per line)")


def test_synthetic_examples_are_what_write_synthetic_writes(tmp_path):
    """The benchmarks' examples: valid HellaSwag lines, seeded, and the same bytes as the ones
    docs/benchmarks.md's figures were measured on (500 examples, seed 0)."""
    import hashlib
    hellaswag.write_synthetic(tmp_path / "s.jsonl", 7, seed=3)
    written = list(hellaswag.iterate_examples(file=str(tmp_path / "s.jsonl")))
    assert written == hellaswag.synthetic_examples(7, seed=3)
    assert hellaswag.synthetic_examples(7, seed=4) != hellaswag.synthetic_examples(7, seed=3)
    hellaswag.write_synthetic(tmp_path / "500.jsonl", 500)
    assert hashlib.sha256((tmp_path / "500.jsonl").read_bytes()).hexdigest() == \
        "b6d28b7768d39827d5e4e9215bb674221a90f44220e790a0c3bd5a6e1645f1ce"


def test_load_for_training_in_one_process(tmp_path, hf_and_ours, capsys):
    """The rendered examples of the file; else None and one warning that says why."""
    _, ours = hf_and_ours
    write_file(tmp_path / "h.jsonl", make_examples(3))
    got = hellaswag.load_for_training(str(tmp_path / "h.jsonl"), ours)
    want = [hellaswag.render_example(e) for e in make_examples(3)]
    assert [(t.tolist(), m.tolist(), label) for t, m, label in got] == \
        [(t.tolist(), m.tolist(), label) for t, m, label in want]
    assert hellaswag.load_for_training(str(tmp_path / "missing.jsonl"), ours) is None
    assert capsys.readouterr().out == (f"warning: no HellaSwag eval: {tmp_path / 'missing.jsonl'} not found; "
                                       f"training goes on without it\n")
    small = GPT(GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=1, n_embd=8))
    assert hellaswag.load_for_training(str(tmp_path / "h.jsonl"), small) is None
    assert capsys.readouterr().out == ("warning: no HellaSwag eval: vocab_size=300 is smaller than GPT-2's "
                                       "50257; training goes on without it\n")


def test_onednn_routing_is_undone_on_the_way_out():
    """gptkit/cpu.py's blocks_through_onednn patches the blocks' linear layers for the scoring
    only: after the block (an error inside included, a nested use too) the model is the model it
    was."""
    from gptkit import cpu
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    layers = [m for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(3, layer.in_features) for layer in layers]
    want = [layer(x) for layer, x in zip(layers, xs)]
    with pytest.raises(RuntimeError, match="inside"):
        with cpu.blocks_through_onednn(model):
            with cpu.blocks_through_onednn(model):
                pass
            assert all(("forward" in m.__dict__) == cpu.ONEDNN_LINEAR for m in layers)  # the outer's stays
            assert all(torch.allclose(layer(x), w, atol=1e-6) for layer, x, w in zip(layers, xs, want))
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in layers)
