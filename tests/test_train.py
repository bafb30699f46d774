import ast
import glob
import json
import os
import re
import runpy
import shutil

import numpy as np
import pytest
import torch

import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log, run_script, write_shards
from gptkit.hardware import cpu_has_bf16
from model import GPT, GPTConfig
from test_hellaswag import make_examples, write_file
from test_resume import wrapper
from gptkit.hardware import autocast
from gptkit.shards import load_val_tokens
from gptkit.tokenizer import EOT, get_gpt2_encoding

VOCAB = 50304  # GPT-2's padded vocabulary: its EOT (50256) is below it

TEXT = ("The quick brown fox jumps over the lazy dog. A language model predicts the next token. "
        "Gradient descent lowers the loss one small step at a time. ") * 40


def val_reference(model, tokens, T, dtype, enc):
    """(mean loss, bits per byte) of model over the len(tokens) // T sequences of T tokens, one
    sequence at a time, from the logits: the reference for the trainer's batched, all-reduced eval."""
    losses, text_bits, n_bytes = [], 0.0, 0
    with torch.no_grad(), autocast("cpu", dtype):
        for j in range((len(tokens) - 1) // T):
            seq = torch.tensor(tokens[j * T:j * T + T + 1].astype(np.int64))
            logits, _ = model(seq[None, :-1])
            loss = torch.nn.functional.cross_entropy(logits[0].float(), seq[1:], reduction="none")
            sizes = [len(enc.decode_single_token_bytes(t)) if t < 50256 else 0 for t in seq[1:].tolist()]
            losses += loss.tolist()
            text_bits += sum(v for v, b in zip(loss.tolist(), sizes) if b) / np.log(2)
            n_bytes += sum(sizes)
    return float(np.mean(losses)), text_bits / n_bytes


@pytest.mark.quick
def test_end_to_end_tiny_run(tmp_path, enc):
    """dtype="auto" (bf16 autocast on a CPU with bf16 units, float32 elsewhere), real GPT-2 vocab:
    the loss falls, log.txt keeps build-nanogpt's line formats, samples are written, and
    checkpoints load with weights_only=True."""
    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    tokens = np.array(enc.encode_ordinary(TEXT), dtype=np.uint16)
    data, log_dir = tmp_path / "data", tmp_path / "log"
    write_shards(data, "val", [tokens[:600]])
    write_shards(data, "train", [tokens[600:], tokens])
    write_file(tmp_path / "hella.jsonl", make_examples(12))
    prompt = "The quick brown fox"
    r = run_script([*TINY, "--dtype=auto", f"--data_root={data}", f"--log_dir={log_dir}", "--B=4", "--T=32",
                    f"--hellaswag_file={tmp_path / 'hella.jsonl'}",
                    "--total_batch_size=256", "--max_steps=20", "--eval_interval=8", "--val_tokens=512",
                    "--sample_interval=10", "--sample_length=8", f"--sample_prompt={prompt}",
                    "--checkpoint_interval=10", "--keep_checkpoints=0"])
    assert r.returncode == 0, r.stderr
    assert f"\n  data_root = {str(data)!r}\n" in r.stdout  # the effective configuration, printed once
    header = "config, where it differs from the defaults (run.json holds it all):\n"
    assert r.stdout.count(header) == 1 and r.stdout.count(f"precision: {dtype} (auto: ") == 1
    # issue 57.5: only what differs (max_steps here, not weight_decay), and why step 10 evaluates
    assert "\n  max_steps = 20\n" in r.stdout and "  weight_decay = " not in r.stdout
    assert r.stdout.count("note: a checkpoint step evaluates too (a checkpoint holds its own val loss): "
                          "every checkpoint_interval=10 steps, besides eval_interval=8") == 1
    assert re.search(r"step     3 \| loss \d+\.\d{6} \| lr \d\.\d{4}e-\d\d \| norm \d+\.\d{4} "
                     r"\| dt \d+\.\d\dms \| tok/sec \d+", r.stdout)

    # build-nanogpt's "{step} {kind} {value}" lines, in its formats for its kinds (epoch: where the train
    # data starts again, docs/data.md); a kind the trainer adds is free to have its own
    formats = {"train": r"\d+\.\d{6}", "val": r"\d+\.\d{4}", "bpb": r"\d+\.\d{4}", "hella": r"\d\.\d{4}",
               "epoch": r"\d+"}
    for line in (log_dir / "log.txt").read_text().splitlines():
        step, kind, value = line.split()
        assert step.isdigit() and re.fullmatch(formats.get(kind, r"\S+"), value), line
    log = read_log(log_dir)
    # every eval_interval, at the last step, and at each checkpoint so that it holds its own val loss
    assert sorted(log["train"]) == list(range(20)) and sorted(log["val"]) == [0, 8, 10, 16, 20]
    assert sorted(log["hella"]) == [0, 8, 10, 16, 20]
    assert all(abs(v * 12 - round(v * 12)) < 1e-3 for v in log["hella"].values())  # k/12
    assert log["train"][19] < log["train"][0] - 3
    assert log["val"][20] < log["val"][0] - 3

    samples = (log_dir / "samples.txt").read_text().splitlines()
    assert len(samples) == 8 and samples[0].startswith("step 10 sample 0: ")
    assert samples[4].startswith("step 20 sample 0: ")
    assert all(ast.literal_eval(s.split(": ", 1)[1]).startswith(prompt) for s in samples)  # each continues it

    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00010.pt", "model_00020.pt", "run.json",
                                          "samples.txt"]  # run.lock: removed as the run ended
    assert abs(torch.load(log_dir / "model_00010.pt", weights_only=True)["val_loss"] - log["val"][10]) <= 5e-5
    ckpt = torch.load(log_dir / "model_00020.pt", weights_only=True)
    assert ckpt["step"] == 20 and abs(ckpt["val_loss"] - log["val"][20]) <= 5e-5
    assert ckpt["train_config"]["max_steps"] == 20 and ckpt["train_config"]["dtype"] == dtype
    model = GPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])  # plain keys: no _orig_mod. or module. prefixes
    # the checkpoint is the model that was evaluated at step 20
    val, bpb = val_reference(model.eval(), load_val_tokens(str(data), 512), 32, dtype, enc)
    assert abs(val - ckpt["val_loss"]) < 1e-4 and abs(bpb - log["bpb"][20]) < 1e-4


RECORD_DROPOUT = """
import json, model
seen, init = [], model.GPT.__init__
def record(module, args, kwargs):  # each training forward's batch and dropout keys
    if kwargs.get('dropout_keys') is not None:
        seen.append([args[0].tolist(), args[1].tolist(), kwargs['dropout_keys'].tolist()])
def probed(self, *a, **k):  # a hook on every GPT sees its calls, whatever forward it was given
    init(self, *a, **k)
    self.register_forward_pre_hook(record, with_kwargs=True)
model.GPT.__init__ = probed
"""


@pytest.mark.quick
def test_ddp_two_processes_equal_one_process(tmp_path):
    """torchrun, 2 processes x 2 micro-steps vs 1 process x 4 micro-steps, with dropout 0.1 (issue
    43): same losses, same parameters. Shards are sized so that the run changes shard and wraps
    around, and hold documents that each epoch shuffles. Each sequence's dropout mask comes from a
    key of its own (the trainer's, seen here by a hook on the model's calls), the same on any number
    of ranks: the first step's loss is rebuilt here from the initial model, its batches and their
    keys, and it is not the loss without dropout; the val eval runs without dropout (its step-0 loss
    is the initial model's in eval mode)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    write_shards(data, "val", [rng.integers(0, 512, 600)])
    # documents (EOT-separated), shuffled in a new order each epoch: every rank must draw the same order
    docs = [np.where(rng.random(n) < 0.1, EOT, rng.integers(0, 512, n)) for n in (128 * 3 + 50, 128 * 2 + 8)]
    write_shards(data, "train", docs)
    common = [*TINY, f"--data_root={data}", f"--vocab_size={VOCAB}", "--B=2", "--T=16",
              "--total_batch_size=128", "--max_steps=8", "--eval_interval=4", "--val_tokens=464",
              "--sample_interval=0", "--hellaswag=False",
              # the attention key bias has an exactly-zero gradient (softmax ignores a constant shift);
              # Adam scales its float noise up to steps of ~lr, so a small lr keeps that noise < 1e-5
              "--max_lr=1e-3", "--min_lr=1e-4", "--dropout=0.1", "--seed=1337"]
    probe = wrapper(tmp_path, "probe.py", RECORD_DROPOUT, after="print('forwards:', json.dumps(seen))")
    one = run_script([*common, f"--log_dir={tmp_path / 'one'}"], script=probe, PYTHONPATH=ROOT)
    assert one.returncode == 0, one.stderr
    forwards = json.loads(one.stdout.split("forwards:")[1])
    assert "grad_accum_steps=4" in one.stdout
    two = run_script([*common, f"--log_dir={tmp_path / 'two'}"], nproc=2)
    assert two.returncode == 0, two.stderr
    assert "world_size=2" in two.stdout and "grad_accum_steps=2" in two.stdout
    assert two.stdout.count("config, where it differs from the defaults") == 1  # rank 0 alone prints

    log1, log2 = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert sorted(log1["train"]) == sorted(log2["train"]) == list(range(8))
    for step in range(8):
        assert abs(log1["train"][step] - log2["train"][step]) <= 1e-5, (step, log1["train"], log2["train"])
    assert sorted(log2["val"]) == [0, 4, 8]
    for step in (0, 4, 8):  # the same 29 val sequences, all on 1 rank or 8 and 7 batches on 2
        assert abs(log1["val"][step] - log2["val"][step]) <= 1.5e-4
    assert log1["train"][7] != log1["train"][0]

    p1 = torch.load(tmp_path / "one" / "model_00008.pt", weights_only=True)["model"]
    p2 = torch.load(tmp_path / "two" / "model_00008.pt", weights_only=True)["model"]
    init = GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)).state_dict()
    for k in p1:
        assert (p1[k] - p2[k]).abs().max().item() <= 1e-5, k
    assert any((p1[k] - init[k]).abs().max().item() > 1e-3 for k in p1)  # training did move them
    assert not glob.glob(str(tmp_path / "*" / "*.tmp*"))

    # 8 steps of 4 micro-steps of 2 sequences: every sequence of every step has a key of its own
    assert len(forwards) == 8 * 4 and len({k for *_, keys in forwards for k in keys}) == 8 * 4 * 2
    torch.manual_seed(1337)  # the run's seed, then its model: the same initial weights
    model = GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32))
    model.dropout = 0.1
    first_step = [tuple(map(torch.tensor, forward)) for forward in forwards[:4]]
    with torch.no_grad():
        dropped = [model(x, y, dropout_keys=keys)[1] for x, y, keys in first_step]
        plain = [model.eval()(x, y)[1] for x, y, _ in first_step]
    assert abs(torch.stack(dropped).mean().item() - log1["train"][0]) < 1e-5
    assert abs(torch.stack(plain).mean().item() - log1["train"][0]) > 5e-5  # 5x the rebuild's bound
    val, _ = val_reference(model, load_val_tokens(str(data), 464), 16, "float32", get_gpt2_encoding())
    assert abs(val - log1["val"][0]) < 1e-4  # log.txt holds 4 decimals


def test_compile_matches_eager(tmp_path):
    """compile=True (inductor on CPU): same losses as eager, with dropout 0.1 (issue 43: the same
    masks, drawn by the same integer hash); eval and samples work with it."""
    rng = np.random.default_rng(1)
    data = tmp_path / "data"
    write_shards(data, "val", [rng.integers(0, 50257, 300)])
    write_shards(data, "train", [rng.integers(0, 50257, 1000)])
    write_file(tmp_path / "hella.jsonl", make_examples(10))
    common = [*TINY, f"--data_root={data}", "--B=2", "--T=16", "--total_batch_size=64", "--max_steps=3",
              "--eval_interval=3", "--val_tokens=256", "--sample_interval=3", "--sample_length=4",
              f"--hellaswag_file={tmp_path / 'hella.jsonl'}", "--dropout=0.1"]
    eager = run_script([*common, f"--log_dir={tmp_path / 'eager'}"])
    assert eager.returncode == 0, eager.stderr
    compiled = run_script([*common, "--compile=True", f"--log_dir={tmp_path / 'compiled'}"])
    assert compiled.returncode == 0, compiled.stderr
    a, b = read_log(tmp_path / "eager"), read_log(tmp_path / "compiled")
    # step 0: the same weights, the same counts; after training the weights differ by float rounding
    # (compiled: F.cross_entropy, eager: the fused loss), and a random model's 4 ending scores are
    # near ties that rounding flips (seen with AVX2-only kernels): there, HellaSwag just has to run
    assert a["hella"][0] == b["hella"][0] and sorted(a["hella"]) == sorted(b["hella"]) == [0, 3]
    for kind in ("train", "val"):
        assert a[kind].keys() == b[kind].keys()
        for step in a[kind]:
            assert abs(a[kind][step] - b[kind][step]) < 2e-4, (kind, step, a, b)
    assert len((tmp_path / "compiled" / "samples.txt").read_text().splitlines()) == 4


def test_torchrun_error_is_one_clean_line(tmp_path):
    """Every rank hits the same bad input: rank 0 alone reports it, all exit, nothing hangs."""
    missing = tmp_path / "missing"
    r = run_script([*TINY, f"--data_root={missing}", f"--log_dir={tmp_path / 'log'}"], nproc=2, timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    said = [line for line in out.splitlines() if line.startswith("error: ")]  # torchrun's report aside
    assert len(said) == 1 and said[0].startswith(f"error: data folder '{missing}' not found: run `python "
                                                 f"fineweb.py`"), out
    # torchrun's own agent prints a ChildFailedError traceback; our processes print none
    assert 'train_gpt2.py", line' not in out and "terminate called" not in out


def test_quick_start_pipeline(tmp_path):
    """fineweb.py --demo, then config/demo_cpu.py (shortened, its steps a quarter): the README's quick
    start."""
    import sys
    from conftest import ROOT
    data, log_dir = tmp_path / "demo", tmp_path / "log"
    r = commands.run([sys.executable, "fineweb.py", "--demo", "--out_dir", str(data)], cwd=ROOT,
                   capture_output=True, text=True, env=one_thread())
    assert r.returncode == 0, r.stderr
    r = run_script(["config/demo_cpu.py", f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=4",
                    "--warmup_steps=2", "--eval_interval=4", "--sample_interval=4", "--sample_length=8",
                    "--val_tokens=4096", "--total_batch_size=1024", "--B=4"])
    assert r.returncode == 0, r.stderr
    log = read_log(log_dir)
    assert sorted(log["train"]) == [0, 1, 2, 3] and log["val"][4] < log["val"][0] - 1
    assert (log_dir / "model_00004.pt").exists()
    samples = (log_dir / "samples.txt").read_text().splitlines()
    prompt = runpy.run_path(os.path.join(ROOT, "config", "demo_cpu.py"))["sample_prompt"]
    assert len(samples) == 4 and all(re.match(r"step 4 sample \d: ", s) for s in samples), samples
    assert all(ast.literal_eval(s.split(": ", 1)[1]).startswith(prompt) for s in samples), (prompt, samples)


def test_hellaswag_in_training_same_for_any_world_size(tmp_path):
    """HellaSwag at each eval: 2 processes (examples i % 2 == rank, counts all-reduced) log what 1 logs."""
    data = random_shards(tmp_path / "data", 2, 300, [1000], vocab=50257)
    write_file(tmp_path / "hella.jsonl", make_examples(31, seed=3))
    common = [*TINY, f"--data_root={data}", "--B=2", "--T=16", "--total_batch_size=64", "--max_steps=2",
              "--eval_interval=2", "--val_tokens=256", "--sample_interval=0",
              f"--hellaswag_file={tmp_path / 'hella.jsonl'}"]
    one = run_script([*common, f"--log_dir={tmp_path / 'one'}"])
    two = run_script([*common, f"--log_dir={tmp_path / 'two'}"], nproc=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    a, b = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert sorted(a["hella"]) == [0, 2] and a["hella"] == b["hella"]
    assert re.search(r"hellaswag acc_norm \d+/31 = ", two.stdout)


@pytest.mark.quick
def test_evaluate_builds_no_graph(tmp_path):
    """The val eval runs without autograd: a graph per val batch would hold its activations and logits
    until the end of the eval (gigabytes per batch at the default sizes). Every forward of the trainer's
    val eval (reduction='none') is seen, in a run that evaluates twice."""
    data = random_shards(tmp_path / "data", 0, 16 * 5 + 1, [2000])
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, runpy, sys, torch, model\n"
        "seen, forward = [], model.GPT.forward\n"
        "def probe(self, idx, targets=None, **kw):\n"
        "    out = forward(self, idx, targets, **kw)\n"
        "    seen.append((kw.get('reduction', 'mean'), torch.is_grad_enabled(), out[1].requires_grad))\n"
        "    return out\n"
        "model.GPT.forward = probe\n"
        "try:\n"
        "    runpy.run_path(os.path.join(os.environ['PYTHONPATH'], 'train_gpt2.py'), run_name='__main__')\n"
        "finally:\n"
        "    print('SEEN', sorted(set(seen)), sum(s[0] == 'none' for s in seen))\n")
    r = run_script([*TINY, f"--data_root={data}", f"--log_dir={tmp_path / 'log'}", "--vocab_size=512",
                    "--B=2", "--T=16", "--total_batch_size=32", "--max_steps=2", "--eval_interval=2",
                    "--val_tokens=80",
                    "--sample_interval=0", "--hellaswag=False"], script=str(probe),
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    # 5 sequences of 16 in batches of 2: 3 batches per eval, evals at steps 0 and 2
    assert "SEEN [('none', False, False)] 6" in r.stdout, r.stdout[-2000:]


def test_empty_hellaswag_file_is_one_line_before_training(tmp_path):
    """Issue 21.4: an empty hellaswag_file stops the run before step 0 with one line naming it (it
    was a ZeroDivisionError traceback at the first eval)."""
    data = random_shards(tmp_path / "data", 0, 600, [2000])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    r = run_script([*TINY, "--vocab_size=50304", f"--data_root={data}", f"--log_dir={tmp_path / 'log'}",
                    "--B=2", "--T=16", "--total_batch_size=32", "--max_steps=2", "--val_tokens=64",
                    f"--hellaswag_file={empty}"])
    assert r.returncode == 1 and r.stderr.strip() == f"error: {empty}: no HellaSwag examples in it"
    assert "| loss" not in r.stdout


def test_a_run_that_cannot_score_hellaswag_stops_before_training(tmp_path):
    """Issue 37.4: with hellaswag=True (the default) and no HellaSwag file to be had (here a
    hellaswag_file that is not there; offline, a failed download), the run stops before step 0 with
    one line that names what to pass, on one process and on two; it was a warning, then hours of
    training without a HellaSwag curve."""
    data = random_shards(tmp_path / "data", 0, 600, [2000])
    missing = tmp_path / "missing.jsonl"
    for nproc in (None, 2):
        log_dir = tmp_path / str(nproc)
        r = run_script([*TINY, "--vocab_size=50304", f"--data_root={data}", f"--log_dir={log_dir}", "--B=2",
                        "--T=16", "--total_batch_size=64", "--max_steps=2", "--val_tokens=64",
                        f"--hellaswag_file={missing}"], nproc=nproc)
        assert r.returncode == 1 and "| loss" not in r.stdout, r.stdout
        line = (f"error: no HellaSwag eval: {missing} not found; pass --hellaswag_file=PATH (a HellaSwag val "
                f"jsonl file) or --hellaswag=False\n")
        # rank 0's, once (torchrun's report quotes it, indented)
        assert r.stderr.splitlines(True).count(line) == 1, r.stderr
        assert "Traceback" not in r.stderr.split(line)[0], r.stderr


VAL_PROBE = """
import os, runpy, sys, torch, model
from gptkit.shards import DataLoaderLite
from tests.host_reads import HostReads
mode, gpt_eval, next_batch, on = HostReads(), model.GPT.eval, DataLoaderLite.next_batch, []
def counting(self):  # from the first eval's model.eval()...
    if not on:
        on.append(True)
        mode.__enter__()
    return gpt_eval(self)
def stop(self):  # ...to the first training step's first batch
    if on == [True]:
        on[0] = False
        mode.__exit__(None, None, None)
        print(f"val eval reads: {mode.seen}", flush=True)
    return next_batch(self)
model.GPT.eval, DataLoaderLite.next_batch = counting, stop
sys.argv[0] = 'train_gpt2.py'
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_the_val_eval_reads_the_host_once_whatever_its_size(tmp_path):
    """Issue 45.3: the val batches are made on the device once, at the start; from the val eval's
    model.eval() to the next training step, the host reads one thing, the all-reduced sums, with 1
    val batch as with 8 (a read per batch would show as 8)."""
    data = random_shards(tmp_path / "data", 3, 2100, [2000])
    (tmp_path / "probe.py").write_text(VAL_PROBE)
    for val_tokens in (32, 256):  # B*T = 32 tokens a batch: 1 batch, then 8
        shutil.rmtree(tmp_path / "log", ignore_errors=True)
        r = run_script([*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=32",
                        "--max_steps=1", f"--val_tokens={val_tokens}", "--sample_interval=0",
                        "--hellaswag=False", f"--data_root={data}", f"--log_dir={tmp_path / 'log'}"],
                       script=str(tmp_path / "probe.py"), PYTHONPATH=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "val eval reads: ['tolist']\n" in r.stdout, r.stdout[-2000:]


def test_more_cpu_processes_than_cores_are_said(tmp_path):
    """Issue 57.5: torchrun with one CPU process more than this machine's cores: rank 0 says so once,
    with the number that would be faster; the run goes on."""
    from gptkit.common import cpu_cores
    data = random_shards(tmp_path / "data", 0, 600, [4000])
    n = cpu_cores() + 1
    r = run_script([*TINY, f"--data_root={data}", f"--log_dir={tmp_path / 'log'}", "--B=2", "--T=16",
                    f"--total_batch_size={32 * n}", "--max_steps=1", "--eval_interval=0", "--hellaswag=False",
                    "--val_tokens=64"], nproc=n)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(f"warning: {n} processes on {n - 1} CPU cores: they take turns, each step as slow "
                          f"as the last of them; --nproc_per_node={n - 1} is faster") == 1, r.stdout
