import http.server
import json
import os
import re
import threading

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import commands
from conftest import one_thread
import hellaswag
from gptkit import hellaswag_eval as scoring
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


@pytest.mark.quick
def test_render_example_as_build_nanogpt(enc):
    """prepare packs an example into one row: its context once, then each ending, at the positions
    right after the context. Every scored token is an ending's, and what predicts it sees exactly
    build-nanogpt's row before it (context tokens, then " " + ending tokens): the context and the
    ending's earlier tokens, at their positions in that row."""
    e = {"ctx": "A man sits", "label": 2, "endings": ["down.", "on a big chair.", "up", "there"]}
    [(x, seg, pos, at, y, row)], labels = scoring.prepare([e], 64, "cpu", 1)
    ctx, endings = enc.encode("A man sits"), [enc.encode(" " + ending) for ending in e["endings"]]
    rows = [ctx + ending for ending in endings]  # build-nanogpt's 4 rows
    c = len(ctx)
    assert x.tolist() == [ctx + sum(endings, [])]
    assert seg.tolist() == [[0] * c + sum(([i + 1] * len(t) for i, t in enumerate(endings)), [])]
    assert pos.tolist() == [list(range(c)) + sum((list(range(c, c + len(t))) for t in endings), [])]
    assert y.tolist() == sum(endings, []) and sorted(set(row.tolist())) == [0, 1, 2, 3]
    assert labels.tolist() == [2]
    flat = lambda t: t.view(-1).tolist()
    for a, token, i in zip(at.tolist(), y.tolist(), row.tolist()):  # i: the ending (one example)
        seen = [t for j, (t, s) in enumerate(zip(flat(x), flat(seg))) if j <= a and s in (0, flat(seg)[a])]
        p = flat(pos)[a]
        assert flat(seg)[a] in (0, i + 1) and seen == rows[i][:p + 1] and token == rows[i][p + 1]
    assert len(at) == sum(map(len, endings))  # every ending token is scored, once


def losses_of(model, examples, batch_examples=32, one_shape=False, dtype="float32", rank=0, world=1):
    """hellaswag.py's (sum, mean) loss of the 4 endings of each of rank's examples, (n, 4) in the
    examples' order (which example each of prepare's rows packs is read back from its tokens), their
    indices in examples, and the counts evaluate gives."""
    prepared = scoring.prepare(examples, model.config.block_size, "cpu", batch_examples, rank, world,
                                 one_shape)
    sums, means = scoring.ending_losses(model, prepared, dtype)
    order = examples_of(prepared, examples)
    return sums.view(-1, 4), means.view(-1, 4), order, scoring.evaluate(model, prepared, dtype).tolist()


def examples_of(prepared, examples):
    """The index in examples of each example prepare packed, in its order: read from each row's
    tokens (context, then the 4 endings, by seg) and matched with the examples' own."""
    from gptkit.tokenizer import get_gpt2_encoding
    enc = get_gpt2_encoding()
    ctxs = [enc.encode(e["ctx"]) for e in examples]
    index = {}  # the 4 endings: the examples that have them
    for j, e in enumerate(examples):
        index.setdefault(tuple(tuple(enc.encode(" " + t)) for t in e["endings"]), []).append(j)
    batches, labels = prepared
    order = {}
    for x, seg, pos, at, y, row in batches:
        L = x.size(1)
        for a, k in zip(at.tolist(), row.tolist()):
            if k == 4 * len(labels):  # padding
                continue
            r = a // L
            ctx, endings = x[r][seg[r] == 0].tolist(), [x[r][seg[r] == i] for i in range(1, 5)]
            # the context, or its end (a long one loses tokens from the left)
            (j,) = [j for j in index[tuple(tuple(t.tolist()) for t in endings)]
                    if ctxs[j][len(ctxs[j]) - len(ctx):] == ctx]
            assert order.setdefault(k // 4, j) == j
    assert sorted(order) == list(range(len(labels)))
    found = [order[k] for k in range(len(labels))]
    assert [examples[j]["label"] for j in found] == labels.tolist()
    return found


def brute_forced(hf, examples):
    """brute_force's (sum, mean) loss of each example's 4 endings, (n, 4), and the counts it gives."""
    ref = [brute_force(hf, e) for e in examples]
    sums, means = torch.stack([s for s, _ in ref]), torch.stack([m for _, m in ref])
    counts = [len(examples), sum(int(s.argmin() == e["label"]) for (s, _), e in zip(ref, examples)),
              sum(int(m.argmin() == e["label"]) for (_, m), e in zip(ref, examples))]
    return sums, means, counts


def assert_as_brute_force(ours, hf, examples, batches):
    """Example by example, every ending's summed and mean loss as build-nanogpt's scoring with HF's
    model gives it, and the same counts, for each (batch_examples, one_shape) in batches; and dealt
    to 3 ranks, the ranks' examples are all the examples, each once, scored alike."""
    ref_sums, ref_means, ref_counts = brute_forced(hf, examples)
    for batch, one_shape in batches:
        sums, means, order, counts = losses_of(ours, examples, batch, one_shape)
        assert sorted(order) == list(range(len(examples))), (batch, one_shape)
        assert torch.allclose(sums, ref_sums[order], atol=1e-4), (batch, one_shape)
        assert torch.allclose(means, ref_means[order], atol=1e-5), (batch, one_shape)
        assert counts == ref_counts, (batch, one_shape)
    parts = [losses_of(ours, examples, 7, False, rank=r, world=3) for r in range(3)]
    assert sorted(j for _, _, order, _ in parts for j in order) == list(range(len(examples)))
    for sums, means, order, _ in parts:
        assert torch.allclose(sums, ref_sums[order], atol=1e-4)
        assert torch.allclose(means, ref_means[order], atol=1e-5)
    assert [sum(c) for c in zip(*(counts for *_, counts in parts))] == ref_counts


def test_batched_equals_one_at_a_time_equals_hf(hf_and_ours):
    """Every ending's loss and the counts, batched any way, with one shape (the compiled eval's
    padding) or not, on one rank or dealt to 3, equal build-nanogpt's scoring with HF's model, one
    example at a time, example by example."""
    hf, ours = hf_and_ours
    assert_as_brute_force(ours, hf, make_examples(40),
                          ((1, False), (7, False), (40, False), (7, True)))


def test_packed_rows_of_any_shape(hf_and_ours, enc):
    """The packed row's corner cases against brute force, example by example: two examples with the
    same context, an empty context (the ending's first token is not scored, as in build-nanogpt,
    and the endings start at position 0), one-token endings (scored from the context's last position
    alone), endings that share their first words, and rows of very different lengths in one batch,
    at any batch size, with one shape or not."""
    hf, ours = hf_and_ours
    assert len(enc.encode(" a")) == 1
    long_ctx = " ".join(WORDS * 2)
    examples = [dict(ctx="a man is seen", label=0, endings=["a", "the dog", "the dog is", "they walk"]),
                dict(ctx="a man is seen", label=1, endings=["smiles", "a", "then a woman", "camera up"]),
                dict(ctx="", label=2, endings=["a man walks", "the dog holds", "then up", "a ball kitchen"]),
                dict(ctx=long_ctx, label=3, endings=["a", "to walk the dog", "a ball", "holds a camera up"]),
                dict(ctx="the woman then", label=0, endings=["walks", "a dog", "smiles", "is seen up"])]
    assert_as_brute_force(ours, hf, examples, ((1, False), (2, False), (16, False), (2, True), (16, True)))


def test_bf16_forward_float32_loss(hf_and_ours):
    _, ours = hf_and_ours
    s32, _, order32, _ = losses_of(ours, make_examples(8, seed=1))
    s16, _, order16, _ = losses_of(ours, make_examples(8, seed=1), dtype="bfloat16")
    assert order16 == order32
    assert s16.dtype == torch.float32 and torch.allclose(s16, s32, rtol=0.05)
    assert not torch.equal(s16, s32)  # the forward did run in bf16


@pytest.mark.quick
def test_long_examples_lose_context_from_the_left(hf_and_ours, capsys, enc):
    """An example longer than block_size keeps the last tokens of its context that leave room for
    its longest ending: each ending is scored as that context, then the ending, in one sequence
    within block_size; one line says how many examples lost tokens."""
    _, ours = hf_and_ours  # block_size 64
    e = dict(make_examples(1)[0], ctx=" ".join(["kitchen"] * 100),
             endings=["a man", "the dog is seen to walk then smiles", "up", "a woman holds the camera up"])
    tokens, _, _ = render_example(e)
    assert tokens.size(1) > 64
    s, _, _, (n, _, _) = losses_of(ours, [e])
    assert n == 1
    said = "1 examples are longer than block_size=64: their contexts lose tokens from the left"
    assert said in capsys.readouterr().out
    ctx, endings = enc.encode(e["ctx"]), [enc.encode(" " + ending) for ending in e["endings"]]
    keep = 64 - max(map(len, endings))
    assert len(set(map(len, endings))) == 4 and 0 < keep < len(ctx)
    want = []
    with torch.no_grad():  # the context's last `keep` tokens, then the ending, through the plain forward
        for ending in endings:
            row = torch.tensor(ctx[-keep:] + ending)
            logits, _ = ours(row[None])
            want.append(F.cross_entropy(logits[0, keep - 1:-1], row[keep:], reduction="sum"))
    assert torch.allclose(s[0], torch.stack(want), atol=1e-4), (s, want)


def test_the_compiled_eval_counts_as_the_eager_one(hf_and_ours):
    """With one shape the eval compiles to one graph (no recompile over its batches, the last one
    padded) and counts what the eager eval counts."""
    import torch._dynamo
    _, ours = hf_and_ours
    examples = make_examples(23, seed=2)
    eager = scoring.evaluate(ours, scoring.prepare(examples, 64, "cpu", 5))
    torch._dynamo.reset()
    prepared = scoring.prepare(examples, 64, "cpu", 5, one_shape=True)
    assert len({(tuple(x.shape), tuple(at.shape)) for x, _, _, at, _, _ in prepared[0]}) == 1
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = scoring.evaluate(ours, prepared, compile=True)
    assert counters["stats"]["unique_graphs"] == 1  # it was compiled, to one graph
    assert compiled.tolist() == eager.tolist()


@pytest.mark.quick
def test_bad_lines_name_file_and_line(tmp_path):
    good = make_examples(2)
    three_endings = json.dumps(dict(good[0], endings=["a", "b", "c"]))
    for bad, message in [("not json", r":3: not valid JSON"),
                         (json.dumps(dict(good[0], label=4)), r":3: expected .* 0\.\.3, got .*'label': 4"),
                         (three_endings, r":3: expected .* 4 string 'endings'.*\['a', 'b', 'c'\]"),
                         ("[1, 2]", r":3: expected an object .* got \[1, 2\]")]:
        path = tmp_path / "h.jsonl"
        write_file(path, good)
        with open(path, "a") as f:
            f.write(bad + "\n")
        with pytest.raises(UserError, match=str(path) + message):
            list(scoring.iterate_examples(file=str(path)))


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


@pytest.mark.quick
def test_download(tmp_path):
    examples = make_examples(5)
    write_file(tmp_path / "src.jsonl", examples)
    body = (tmp_path / "src.jsonl").read_bytes()
    cache = tmp_path / "cache"
    bad = Server(body, truncate=True)
    with pytest.raises(UserError, match=r"could not download .* put hellaswag_val.jsonl in .*cache"):
        scoring.download("val", str(cache), url=bad.url)
    assert not cache.exists()  # no half file, and no folder that it made
    good = Server(body)
    path = scoring.download("val", str(cache), url=good.url)
    assert open(path, "rb").read() == body
    assert scoring.download("val", str(cache), url="http://127.0.0.1:9/unused") == path  # cached
    assert [e["ind"] for e in scoring.iterate_examples("val", cache_dir=str(cache))] == [0, 1, 2, 3, 4]
    with pytest.raises(UserError, match="could not download http://127.0.0.1:9/"):
        scoring.download("train", str(cache), url="http://127.0.0.1:9/hellaswag_train.jsonl")


def test_a_failed_download_leaves_no_folder_it_made(tmp_path):
    """Offline, download fails: the cache folder it made, and the parents it made for it, are gone
    again (no empty hellaswag/ left behind); a folder that was there already stays, empty."""
    for where in (tmp_path / "new", tmp_path / "new" / "deeper"):
        with pytest.raises(UserError, match="could not download http://127.0.0.1:9/"):
            scoring.download("val", str(where), url="http://127.0.0.1:9/hellaswag_val.jsonl")
        assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    with pytest.raises(UserError, match="could not download"):
        scoring.download("val", str(tmp_path / "there"), url="http://127.0.0.1:9/hellaswag_val.jsonl")
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
    *_, (n, c, cn) = losses_of(ours, examples[:15])
    want = f"acc: {c / n:.4f} acc_norm: {cn / n:.4f}"
    torch.save({"model": ours.state_dict(), "config": ours.config.__dict__}, tmp_path / "model_00001.pt")
    def run(*args):
        return commands.run([sys.executable, "hellaswag.py", *args], cwd=ROOT, capture_output=True, text=True,
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


@pytest.mark.quick
def test_synthetic_examples_are_what_write_synthetic_writes(tmp_path):
    """The benchmarks' examples: valid HellaSwag lines, seeded, and the same bytes as the ones
    docs/benchmarks.md's figures were measured on (500 examples, seed 0)."""
    import hashlib
    hellaswag.write_synthetic(tmp_path / "s.jsonl", 7, seed=3)
    written = list(scoring.iterate_examples(file=str(tmp_path / "s.jsonl")))
    assert written == hellaswag.synthetic_examples(7, seed=3)
    assert hellaswag.synthetic_examples(7, seed=4) != hellaswag.synthetic_examples(7, seed=3)
    hellaswag.write_synthetic(tmp_path / "500.jsonl", 500)
    assert hashlib.sha256((tmp_path / "500.jsonl").read_bytes()).hexdigest() == \
        "b6d28b7768d39827d5e4e9215bb674221a90f44220e790a0c3bd5a6e1645f1ce"


@pytest.mark.quick
def test_load_for_training_in_one_process(tmp_path, hf_and_ours):
    """The examples of the file, prepared; else one line that says why and what to pass."""
    _, ours = hf_and_ours
    write_file(tmp_path / "h.jsonl", make_examples(3))
    got = scoring.load_for_training(str(tmp_path / "h.jsonl"), ours, 2, 256, "cpu")  # 2 examples a batch
    want = scoring.prepare(make_examples(3), 64, "cpu", 2)
    assert scoring.evaluate(ours, got).tolist() == scoring.evaluate(ours, want).tolist()
    flat = lambda prepared: [t.tolist() for t in torch.utils._pytree.tree_leaves(prepared)]
    assert flat(got) == flat(want)
    advice = "; pass --hellaswag_file=PATH (a HellaSwag val jsonl file) or --hellaswag=False"
    with pytest.raises(UserError) as e:
        scoring.load_for_training(str(tmp_path / "missing.jsonl"), ours, 2, 256, "cpu")
    assert str(e.value) == f"no HellaSwag eval: {tmp_path / 'missing.jsonl'} not found" + advice
    small = GPT(GPTConfig(block_size=16, vocab_size=300, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(UserError) as e:
        scoring.load_for_training(str(tmp_path / "h.jsonl"), small, 2, 256, "cpu")
    assert str(e.value) == "no HellaSwag eval: vocab_size=300 is smaller than GPT-2's 50257" + advice


EVAL_PROBE = """
import os, runpy, sys, torch
from gptkit import hellaswag_eval
ROOT = __ROOT__
from gptkit.shards import DataLoaderLite
from torch.overrides import TorchFunctionMode
T = torch.Tensor
from tests.host_reads import READS
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
mode, evaluate, next_batch = Count(), hellaswag_eval.evaluate, DataLoaderLite.next_batch
def counting(*a, **k):  # from the first eval's first forward...
    hellaswag_eval.evaluate = evaluate
    mode.__enter__()
    return evaluate(*a, **k)
def stop(self):  # ...to the next training step's first batch
    if hellaswag_eval.evaluate is evaluate:  # the eval has run
        mode.__exit__(None, None, None)
        print(f"from HellaSwag to the next step: {Count.seen}", flush=True)
        DataLoaderLite.next_batch = next_batch
    return next_batch(self)
hellaswag_eval.evaluate, DataLoaderLite.next_batch = counting, stop
sys.argv[0] = os.path.join(ROOT, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_the_trainers_hellaswag_eval_reads_the_host_once_whatever_its_size(tmp_path):
    """Issue 36.1: from the HellaSwag eval's first forward to the next training step, the host reads
    as many values, and runs as many ops whose output's size depends on the data, with 16 examples
    as with 64, one example a batch: the counts are read once, after the all-reduce."""
    from conftest import ROOT, TINY, random_shards, run_script
    data = random_shards(tmp_path / "data", 7, 600, [2000, 2000])
    (tmp_path / "probe.py").write_text(EVAL_PROBE.replace("__ROOT__", repr(ROOT)))
    seen = {}
    for n in (16, 64):
        hella = tmp_path / f"{n}.jsonl"
        write_file(hella, make_examples(n))
        args = [*TINY, f"--data_root={data}", f"--log_dir={tmp_path / str(n)}", "--B=2", "--T=32",
                "--total_batch_size=64", "--max_steps=1", "--eval_interval=1", "--val_tokens=128",
                "--sample_interval=0", "--checkpoint_interval=0", f"--hellaswag_file={hella}"]
        r = run_script(args, script=str(tmp_path / "probe.py"), PYTHONPATH=ROOT)
        assert r.returncode == 0, r.stderr
        assert "hellaswag acc_norm " in r.stdout and f"/{n} = " in r.stdout, r.stdout
        assert r.stdout.count("from HellaSwag to the next step: ") == 1, r.stdout
        seen[n] = re.search(r"from HellaSwag to the next step: (.*)", r.stdout).group(1)
        # the probe sat between step 0's eval and step 0's update, which came after it
        assert r.stdout.index("from HellaSwag") < r.stdout.index("step     0 | loss"), r.stdout
    assert seen[16] == seen[64] == "['tolist']", seen  # the counts, after the all-reduce
