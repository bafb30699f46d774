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
from gptkit.tokenizer import get_gpt2_encoding
from model import GPT, GPTConfig

WORDS = "a man is seen the woman then they continue to walk dog ball kitchen holds up smiles camera".split()
BLOCK = 64  # the models' block_size here


def make_examples(n, seed=0):
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(rng.choice(WORDS, k))
    return [{"ind": i, "activity_label": "Test", "ctx_a": "", "ctx_b": "", "ctx": words(rng.integers(3, 30)),
             "split": "val", "split_type": "indomain", "label": int(rng.integers(0, 4)),
             "endings": [words(rng.integers(1, 15)) for _ in range(4)], "source_id": f"test~{i}"}
            for i in range(n)]


# The packed row's corner cases: two examples with the same context, an empty context (the ending's
# first token is not scored, as in build-nanogpt, and the endings start at position 0), one-token
# endings (scored from the context's last position alone), endings that share their first words, a
# context too long for BLOCK (it loses tokens from the left), and rows of very different lengths.
CORNER_CASES = [
    dict(ctx="a man is seen", label=0, endings=["a", "the dog", "the dog is", "they walk"]),
    dict(ctx="a man is seen", label=1, endings=["smiles", "a", "then a woman", "camera up"]),
    dict(ctx="", label=2, endings=["a man walks", "the dog holds", "then up", "a ball kitchen"]),
    dict(ctx=" ".join(WORDS * 2), label=3, endings=["a", "to walk the dog", "a ball", "holds a camera up"]),
    dict(ctx=" ".join(["kitchen"] * 100), label=1, endings=["a man", "the dog is seen to walk then smiles",
                                                             "up", "a woman holds the camera up"]),
    dict(ctx="the woman then", label=0, endings=["walks", "a dog", "smiles", "is seen up"]),
]


def write_file(path, examples):
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")


@pytest.fixture(scope="module")
def ours():
    """Our own GPT, tiny and random (seeded), its weights spread so that the endings' losses differ
    clearly. The scorer's tests need nothing of it but what the scorer uses: a model with positions
    of another kind, or other layers, runs them all the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    """A HF GPT2LMHeadModel, random, and our GPT loaded from its folder: for the tests whose subject
    is parity with build-nanogpt's scoring of a HF model, or the tool reading a HF folder."""
    from transformers import GPT2Config, GPT2LMHeadModel
    d = tmp_path_factory.mktemp("hf")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=BLOCK)).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(d)
    return hf, GPT.from_pretrained(str(d)).eval()


def one_sequence_losses(model, example, block_size=BLOCK):
    """build-nanogpt's scoring of one example, by brute force: each ending's (sum, mean) loss (4,).
    The model runs on the context's tokens, then the " " + ending's, as one sequence, alone: no
    packing and no padding (build-nanogpt pads its 4 rows on the right, which changes nothing before
    the padding). An ending token's loss is its cross-entropy predicted from everything before it;
    the sum over the ending picks acc's answer, the mean acc_norm's. Position 0 has nothing before it:
    with an empty context the ending's first token is not scored, as in build-nanogpt. A context too
    long for block_size keeps its last tokens, as many as leave room for the longest ending
    (docs/hellaswag.md), so that every ending sees the same context."""
    enc = get_gpt2_encoding()
    ctx, endings = enc.encode(example["ctx"]), [enc.encode(" " + e) for e in example["endings"]]
    ctx = ctx[max(0, len(ctx) + max(map(len, endings)) - block_size):]
    first = max(1, len(ctx))  # the first scored position
    sums, means = [], []
    with torch.no_grad():
        for ending in endings:
            seq = torch.tensor(ctx + ending)
            # [0]: our forward's logits, or HF's (its output's first field, the loss being None)
            logits = model(seq[None])[0][0].float()  # (len, vocab)
            losses = F.cross_entropy(logits[first - 1:-1], seq[first:], reduction="none")
            sums.append(losses.sum())
            means.append(losses.mean())
    return torch.stack(sums), torch.stack(means)


def brute_forced(model, examples):
    """one_sequence_losses of each example: sums (n, 4), means (n, 4), and the counts evaluate
    should give: [examples, correct by acc (least sum), correct by acc_norm (least mean)]."""
    ref = [one_sequence_losses(model, e) for e in examples]
    sums, means = torch.stack([s for s, _ in ref]), torch.stack([m for _, m in ref])
    labels = torch.tensor([e["label"] for e in examples])
    counts = [len(examples), int((sums.argmin(1) == labels).sum()), int((means.argmin(1) == labels).sum())]
    return sums, means, counts


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


def losses_of(model, examples, batch_examples=32, one_shape=False, dtype="float32", rank=0, world=1,
              prepared=None):
    """The scorer's (sum, mean) loss of the 4 endings of each of rank's examples, (n, 4) in the
    examples' order (which example each of prepare's rows packs is read back from its tokens), their
    indices in examples, and the counts evaluate gives. prepared: the batches, made already."""
    prepared = prepared or scoring.prepare(examples, model.config.block_size, "cpu", batch_examples, rank,
                                           world, one_shape)
    sums, means = scoring.ending_losses(model, prepared, dtype)
    order = examples_of(prepared, examples)
    return sums.view(-1, 4), means.view(-1, 4), order, scoring.evaluate(model, prepared, dtype).tolist()


def examples_of(prepared, examples):
    """The index in examples of each example prepare packed, in its order: read from each row's
    tokens (context, then the 4 endings, by seg) and matched with the examples' own."""
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


def assert_scored_as(reference, scored, where):
    """The scorer's losses_of output equals the brute force's, example by example, and its counts."""
    ref_sums, ref_means, ref_counts = reference
    sums, means, order, counts = scored
    assert sorted(order) == list(range(len(ref_sums))), where  # every example, once
    assert torch.allclose(sums, ref_sums[order], atol=1e-4), where
    assert torch.allclose(means, ref_means[order], atol=1e-5), where
    assert counts == ref_counts, where


def assert_as_brute_force(model, examples, batches, reference=None):
    """For each (batch_examples, one_shape) in batches, every ending's summed and mean loss, and the
    counts, as the brute force gives them (brute_forced: our own model unless reference says);
    dealt to 3 ranks, the ranks' examples are all the examples, each once, scored alike, and their
    counts add up to the brute force's."""
    reference = reference or brute_forced(model, examples)
    for batch, one_shape in batches:
        assert_scored_as(reference, losses_of(model, examples, batch, one_shape), (batch, one_shape))
    parts = [losses_of(model, examples, 3, False, rank=r, world=3) for r in range(3)]
    assert sorted(j for _, _, order, _ in parts for j in order) == list(range(len(examples)))
    for r, (sums, means, order, _) in enumerate(parts):
        assert torch.allclose(sums, reference[0][order], atol=1e-4), r
        assert torch.allclose(means, reference[1][order], atol=1e-5), r
    assert [sum(c) for c in zip(*(counts for *_, counts in parts))] == reference[2]


def test_batched_equals_each_ending_alone(ours):
    """Every ending's loss and the counts, batched any way, with one shape (the compiled eval's
    padding) or not, on one rank or dealt to 3, equal the brute force with our own model: each
    ending run alone after its context, example by example."""
    examples = make_examples(16)
    reference = brute_forced(ours, examples)
    sums, means, _ = reference
    assert (sums.argmin(1) != means.argmin(1)).any()  # acc and acc_norm pick apart: both are checked
    assert_as_brute_force(ours, examples, ((1, False), (5, False), (16, False), (5, True)), reference)


def test_packed_rows_of_any_shape(ours, enc):
    """The packed row's corner cases (CORNER_CASES) against the brute force with our own model,
    example by example, at any batch size, with one shape or not."""
    assert len(enc.encode(" a")) == 1
    assert_as_brute_force(ours, CORNER_CASES, ((1, False), (2, False), (16, False), (2, True), (16, True)))


def test_scores_as_build_nanogpt_with_a_hf_model(hf_and_ours):
    """HF parity: on our GPT loaded from a HF GPT-2 folder, the scorer gives every ending the loss
    build-nanogpt's scoring gives it with HF's model, and the same counts."""
    hf, ours = hf_and_ours
    examples = make_examples(12, seed=3) + CORNER_CASES
    reference = brute_forced(hf, examples)
    assert_scored_as(reference, losses_of(ours, examples, 7), "hf")


def test_bf16_forward_float32_loss(ours):
    s32, _, order32, _ = losses_of(ours, make_examples(8, seed=1))
    s16, _, order16, _ = losses_of(ours, make_examples(8, seed=1), dtype="bfloat16")
    assert order16 == order32
    assert s16.dtype == torch.float32 and torch.allclose(s16, s32, rtol=0.05)
    assert not torch.equal(s16, s32)  # the forward did run in bf16


@pytest.mark.quick
def test_long_examples_lose_context_from_the_left(ours, capsys, enc):
    """An example longer than block_size keeps the last tokens of its context that leave room for
    its longest ending: each ending is scored as that context, then the ending, in one sequence
    within block_size; one line says how many examples lost tokens."""
    e = CORNER_CASES[4]
    ctx, endings = enc.encode(e["ctx"]), [enc.encode(" " + ending) for ending in e["endings"]]
    assert len(set(map(len, endings))) == 4 and 0 < BLOCK - max(map(len, endings)) < len(ctx)
    s, _, _, (n, _, _) = losses_of(ours, [e])
    assert n == 1
    said = f"1 examples are longer than block_size={BLOCK}: their contexts lose tokens from the left"
    assert said in capsys.readouterr().out
    want, _ = one_sequence_losses(ours, e)
    assert torch.allclose(s[0], want, atol=1e-4), (s, want)


def test_the_compiled_eval_counts_as_the_eager_one(ours):
    """With one shape the eval compiles to one graph (no recompile over its batches, the last one
    padded) and counts what the eager eval counts, and the brute force."""
    import torch._dynamo
    examples = make_examples(23, seed=2)
    eager = scoring.evaluate(ours, scoring.prepare(examples, BLOCK, "cpu", 5))
    torch._dynamo.reset()
    prepared = scoring.prepare(examples, BLOCK, "cpu", 5, one_shape=True)
    assert len({(tuple(x.shape), tuple(at.shape)) for x, _, _, at, _, _ in prepared[0]}) == 1
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = scoring.evaluate(ours, prepared, compile=True)
    assert counters["stats"]["unique_graphs"] == 1  # it was compiled, to one graph
    assert compiled.tolist() == eager.tolist() == brute_forced(ours, examples)[2]


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


def run_tool(*args):
    import sys
    from conftest import ROOT
    return commands.run([sys.executable, "hellaswag.py", *args], cwd=ROOT, capture_output=True, text=True,
                        env=one_thread())


def test_standalone_cli(tmp_path, ours):
    """python hellaswag.py --model <a .pt checkpoint> --file ... prints the counts of the brute force
    with that model; a run's log_dir too (its newest checkpoint); a missing file is one line."""
    examples = make_examples(20, seed=7)
    write_file(tmp_path / "h.jsonl", examples)
    n, c, cn = brute_forced(ours, examples[:15])[2]
    want = f"acc: {c / n:.4f} acc_norm: {cn / n:.4f}"
    torch.save({"model": ours.state_dict(), "config": ours.config.__dict__}, tmp_path / "model_00001.pt")
    data = str(tmp_path / "h.jsonl")
    for model in (tmp_path / "model_00001.pt", tmp_path):  # a log_dir: its newest
        r = run_tool("--model", str(model), "--file", data, "--device", "cpu", "--limit", "15")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == want
    newest = f"{tmp_path}: its newest checkpoint, {tmp_path / 'model_00001.pt'}\n"
    assert r.stderr.startswith(newest), r.stderr
    r = run_tool("--model", str(tmp_path / "model_00001.pt"), "--file", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: {tmp_path / 'missing.jsonl'}: no such file "
                                f"(expected HellaSwag jsonl, one example per line)")


def test_standalone_cli_reads_a_hf_folder(tmp_path, hf_and_ours):
    """python hellaswag.py --model <HF dir> prints the counts of build-nanogpt's scoring with the HF
    model itself."""
    hf, _ = hf_and_ours
    examples = make_examples(15, seed=7)
    write_file(tmp_path / "h.jsonl", examples)
    hf.save_pretrained(tmp_path / "hfdir")
    n, c, cn = brute_forced(hf, examples)[2]
    r = run_tool("--model", str(tmp_path / "hfdir"), "--file", str(tmp_path / "h.jsonl"), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == f"acc: {c / n:.4f} acc_norm: {cn / n:.4f}"


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
def test_load_for_training_in_one_process(tmp_path, ours):
    """The examples of the file, prepared in batches of examples_per_batch(B, T): a batch holds no
    more tokens than a training micro-batch (B x T), or one example, and they score as the brute
    force with our own model, with one shape or not. Else one line that says why and what to pass."""
    examples = make_examples(12)
    write_file(tmp_path / "h.jsonl", examples)
    reference = brute_forced(ours, examples)
    for B, T, one_shape in ((1, 64, False), (2, 256, False), (4, 512, True), (16, 1024, False)):
        got = scoring.load_for_training(str(tmp_path / "h.jsonl"), ours, B, T, "cpu", one_shape)
        for x, *_ in got[0]:
            assert x.size(0) <= scoring.examples_per_batch(B, T) and x.numel() <= max(B * T, x.size(1))
        assert_scored_as(reference, losses_of(ours, examples, prepared=got), (B, T, one_shape))
    assert len(got[0]) == 1  # 16 x 1024 tokens: the 12 examples in one batch
    flat = lambda prepared: [t.tolist() for t in torch.utils._pytree.tree_leaves(prepared)]
    got = scoring.load_for_training(str(tmp_path / "h.jsonl"), ours, 2, 256, "cpu")  # 2 examples a batch
    assert flat(got) == flat(scoring.prepare(examples, BLOCK, "cpu", 2))
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
from tests.host_reads import reads
# besides the host reads (nonzero and mask indexing among them), the other ops whose output's size
# depends on the data
DATA_SIZED = {torch.argwhere, T.argwhere, torch.unique, T.unique, torch.unique_consecutive}
class Count(TorchFunctionMode):
    seen = []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads(func, args, kwargs, sys._getframe(1).f_code.co_filename) or func in DATA_SIZED:
            self.seen.append(func.__name__)
        return func(*args, **kwargs)
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
