import http.server
import json
import os
import re
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


def render_example(example):
    """build-nanogpt's rendering: (tokens (4, L), mask (4, L), label), context + " " + ending per row,
    mask 1 over the ending, rows right-padded with 0."""
    from gptkit.tokenizer import get_gpt2_encoding
    enc = get_gpt2_encoding()
    ctx = enc.encode(example['ctx'])
    rows = [ctx + enc.encode(" " + ending) for ending in example['endings']]
    tokens = torch.zeros((4, max(map(len, rows))), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, len(ctx):len(row)] = 1
    return tokens, mask, example['label']


def brute_force(hf, example):
    """build-nanogpt's scoring with HF's full logits, one example at a time."""
    tokens, mask, label = render_example(example)
    with torch.no_grad():
        logits = hf(tokens).logits
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                             reduction="none").view(4, -1) * mask[:, 1:]
    sums = losses.sum(1)
    return sums, sums / mask[:, 1:].sum(1)


def test_render_example_as_build_nanogpt(enc):
    """prepare's rows are build-nanogpt's (context tokens, then " " + ending tokens), and the tokens
    it scores are every ending's, each predicted from the position before it."""
    e = {"ctx": "A man sits", "label": 2, "endings": ["down.", "on a big chair.", "up", "there"]}
    [(ctx, [(which, x, at)], y, row)], labels = hellaswag.prepare([e], 64, "cpu", 1, one_shape=True)
    rows = [enc.encode("A man sits") + enc.encode(" " + ending) for ending in e["endings"]]
    assert sorted(x.tolist()) == sorted(r + [0] * (x.size(1) - len(r)) for r in rows)
    assert sorted(y.tolist()) == sorted(t for ending in e["endings"] for t in enc.encode(" " + ending))
    assert torch.equal(x.view(-1)[at + 1], y) and which.tolist() == [0] * 4
    assert labels.tolist() == [2] and ctx.shape == (1, 0) and sorted(set(row.tolist())) == [0, 1, 2, 3]


def losses_of(model, examples, batch_examples=32, one_shape=False, dtype="float32", rank=0, world=1):
    """hellaswag.py's (sum, mean) loss of every ending and its counts, the endings sorted by their sum
    (prepare orders the examples its own way)."""
    prepared = hellaswag.prepare(examples, model.config.block_size, "cpu", batch_examples, rank, world,
                                 one_shape)
    sums, means = hellaswag.ending_losses(model, prepared, dtype)
    order = sums.argsort()
    return sums[order], means[order], hellaswag.evaluate(model, prepared, dtype).tolist()


def brute_forced(hf, examples):
    """brute_force's (sum, mean) loss of every ending, sorted by sum, and the counts it gives."""
    ref = [brute_force(hf, e) for e in examples]
    sums, means = torch.cat([s for s, _ in ref]), torch.cat([m for _, m in ref])
    counts = [len(examples), sum(int(s.argmin() == e["label"]) for (s, _), e in zip(ref, examples)),
              sum(int(m.argmin() == e["label"]) for (_, m), e in zip(ref, examples))]
    order = sums.argsort()
    return sums[order], means[order], counts


def test_batched_equals_one_at_a_time_equals_hf(hf_and_ours):
    """Every ending's loss and the counts, batched any way, with one shape (the compiled eval's
    padding) or not, equal build-nanogpt's scoring with HF's model, one example at a time."""
    hf, ours = hf_and_ours
    examples = make_examples(40)
    ref_sums, ref_means, ref_counts = brute_forced(hf, examples)
    for batch, one_shape in ((1, False), (7, False), (40, False), (7, True)):
        sums, means, counts = losses_of(ours, examples, batch, one_shape)
        assert torch.allclose(sums, ref_sums, atol=1e-4) and torch.allclose(means, ref_means, atol=1e-5)
        assert counts == ref_counts, (batch, one_shape)
    # ranks deal the examples in turn: the parts add up to the whole
    parts = [losses_of(ours, examples, 7, False, rank=r, world=3)[2] for r in range(3)]
    assert [sum(c) for c in zip(*parts)] == ref_counts


def test_shared_contexts_of_any_length(hf_and_ours, enc):
    """The shared context's corner cases against brute force: two examples with the same context,
    an empty context (the ending's first token is not scored, as in build-nanogpt), one-token
    endings (scored from the context's last position alone), endings that share their first words,
    contexts of very different lengths in one batch, and any batch size."""
    hf, ours = hf_and_ours
    assert len(enc.encode(" a")) == 1
    long_ctx = " ".join(WORDS * 2)
    examples = [dict(ctx="a man is seen", label=0, endings=["a", "the dog", "the dog is", "they walk"]),
                dict(ctx="a man is seen", label=1, endings=["smiles", "a", "then a woman", "camera up"]),
                dict(ctx="", label=2, endings=["a man walks", "the dog holds", "then up", "a ball kitchen"]),
                dict(ctx=long_ctx, label=3, endings=["a", "to walk the dog", "a ball", "holds a camera up"]),
                dict(ctx="the woman then", label=0, endings=["walks", "a dog", "smiles", "is seen up"])]
    ref_sums, ref_means, ref_counts = brute_forced(hf, examples)
    for batch in (1, 2, 16):
        sums, means, counts = losses_of(ours, examples, batch)
        assert torch.allclose(sums, ref_sums, atol=1e-4) and torch.allclose(means, ref_means, atol=1e-5)
        assert counts == ref_counts, batch


def test_bf16_forward_float32_loss(hf_and_ours):
    _, ours = hf_and_ours
    s32, _, _ = losses_of(ours, make_examples(8, seed=1))
    s16, _, _ = losses_of(ours, make_examples(8, seed=1), dtype="bfloat16")
    assert s16.dtype == torch.float32 and torch.allclose(s16, s32, rtol=0.05)


def test_long_examples_lose_context_from_the_left(hf_and_ours, capsys):
    _, ours = hf_and_ours  # block_size 64
    e = make_examples(1)[0]
    e["ctx"] = " ".join(["kitchen"] * 100)
    tokens, mask, label = render_example(e)
    assert tokens.size(1) > 64
    s, _, (n, _, _) = losses_of(ours, [e])
    assert n == 1
    said = "1 examples are longer than block_size=64: their contexts lose tokens from the left"
    assert said in capsys.readouterr().out
    want = []
    with torch.no_grad():  # the same as scoring the last 64 tokens of each row
        for t, m in zip(tokens, mask):
            end = int(m.nonzero()[-1]) + 1
            row, n_end = t[end - 64:end], int(m.sum())
            logits, _ = ours(row[None])
            want.append(F.cross_entropy(logits[0, -n_end - 1:-1], row[-n_end:], reduction="sum"))
    assert torch.allclose(s, torch.stack(want).sort().values, atol=1e-4)


def test_the_compiled_eval_counts_as_the_eager_one(hf_and_ours):
    """With one shape the eval compiles to one graph (no recompile over its batches, the last one
    padded) and counts what the eager eval counts."""
    import torch._dynamo
    _, ours = hf_and_ours
    examples = make_examples(23, seed=2)
    eager = hellaswag.evaluate(ours, hellaswag.prepare(examples, 64, "cpu", 5))
    torch._dynamo.reset()
    prepared = hellaswag.prepare(examples, 64, "cpu", 5, one_shape=True)
    assert len({(tuple(x.shape), tuple(at.shape)) for _, [(_, x, at)], _, _ in prepared[0]}) == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = hellaswag.evaluate(ours, prepared, compile=True)
    assert compiled.tolist() == eager.tolist()


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
    _, _, (n, c, cn) = losses_of(ours, examples[:15])
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


def test_load_for_training_in_one_process(tmp_path, hf_and_ours):
    """The examples of the file, prepared; else one line that says why and what to pass."""
    _, ours = hf_and_ours
    write_file(tmp_path / "h.jsonl", make_examples(3))
    got = hellaswag.load_for_training(str(tmp_path / "h.jsonl"), ours, 2, "cpu")
    want = hellaswag.prepare(make_examples(3), 64, "cpu", 2)
    assert hellaswag.evaluate(ours, got).tolist() == hellaswag.evaluate(ours, want).tolist()
    flat = lambda prepared: [t.tolist() for t in torch.utils._pytree.tree_leaves(prepared)]
    assert flat(got) == flat(want)
    advice = "; pass --hellaswag_file=PATH (a HellaSwag val jsonl file) or --hellaswag=False"
    with pytest.raises(UserError) as e:
        hellaswag.load_for_training(str(tmp_path / "missing.jsonl"), ours, 2, "cpu")
    assert str(e.value) == f"no HellaSwag eval: {tmp_path / 'missing.jsonl'} not found" + advice
    small = GPT(GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(UserError) as e:
        hellaswag.load_for_training(str(tmp_path / "h.jsonl"), small, 2, "cpu")
    assert str(e.value) == "no HellaSwag eval: vocab_size=300 is smaller than GPT-2's 50257" + advice


def test_onednn_routing_is_undone_on_the_way_out():
    """gptkit/cpu.py's blocks_through_onednn patches the blocks' linear layers for the scoring
    only: after the block (an error inside included) the model is the model it was."""
    from gptkit import cpu
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16))
    layers = [m for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(3, layer.in_features) for layer in layers]
    want = [layer(x) for layer, x in zip(layers, xs)]
    with pytest.raises(RuntimeError, match="inside"):
        with cpu.blocks_through_onednn(model):
            assert all(("forward" in m.__dict__) == cpu.ONEDNN_LINEAR for m in layers)
            assert all(torch.allclose(layer(x), w, atol=1e-6) for layer, x, w in zip(layers, xs, want))
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in layers)



EVAL_PROBE = """
import sys, torch, hellaswag, train_gpt2
from torch.overrides import TorchFunctionMode
T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.cpu, T.numpy}
DATA_SIZED = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.unique, T.unique,
              torch.unique_consecutive, torch.masked_select, T.masked_select}
class Count(TorchFunctionMode):  # host reads, and ops whose output's size depends on the data
    seen = []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        index = args[1] if func in (T.__getitem__, T.__setitem__) else ()
        by_mask = any(torch.is_tensor(i) and i.dtype == torch.bool
                      for i in (index if isinstance(index, tuple) else (index,)))
        if func in READS or func in DATA_SIZED or by_mask:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))
mode, evaluate, step = Count(), hellaswag.evaluate, train_gpt2.train_step
def counting(*a, **k):  # from the eval's first forward...
    mode.__enter__()
    return evaluate(*a, **k)
def stop(*a, **k):  # ...to the next training step
    mode.__exit__(None, None, None)
    print(f"from HellaSwag to the next step: {Count.seen}", flush=True)
    train_gpt2.train_step = step
    return step(*a, **k)
hellaswag.evaluate, train_gpt2.train_step = counting, stop
train_gpt2.main(sys.argv[1:])
"""


def test_the_trainers_hellaswag_eval_reads_the_host_once_whatever_its_size(tmp_path):
    """Issue 36.1: from the HellaSwag eval's first forward to the next training step, the host reads
    as many values, and runs as many ops whose output's size depends on the data, with 16 examples
    as with 64, one example a batch: the counts are read once, after the all-reduce."""
    import sys
    from conftest import ROOT, TINY, random_shards
    data = random_shards(tmp_path / "data", 7, 600, [2000, 2000])
    seen = {}
    for n in (16, 64):
        hella = tmp_path / f"{n}.jsonl"
        write_file(hella, make_examples(n))
        args = [*TINY, f"--data_root={data}", f"--log_dir={tmp_path / str(n)}", "--B=2", "--T=32",
                "--total_batch_size=64", "--max_steps=1", "--eval_interval=1", "--val_tokens=128",
                "--sample_interval=0", "--checkpoint_interval=0", f"--hellaswag_file={hella}"]
        r = forked.run([sys.executable, "-c", EVAL_PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                       env=one_thread())
        assert r.returncode == 0, r.stderr
        assert "hellaswag acc_norm " in r.stdout and f"/{n} = " in r.stdout, r.stdout
        seen[n] = re.search(r"from HellaSwag to the next step: (.*)", r.stdout).group(1)
    assert seen[16] == seen[64] == "['tolist']", seen  # the counts, after the all-reduce
