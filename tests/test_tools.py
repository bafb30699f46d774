"""What a run leaves and the tools that read it: plot.py, sample.py, export_hf.py, run.json, W&B,
and the ETA (and no MFU on a CPU) on the console."""
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import plot
import sample
import commands
from conftest import ROOT, TINY, one_thread, random_shards, read_log, run_script
from model import GPT

# the tests that share this module's runs (its fixtures) go to one xdist worker: each run happens once
shares_runs = pytest.mark.xdist_group("test_tools")


ARGS = [*TINY, "--B=2", "--T=16", "--total_batch_size=64", "--eval_interval=3", "--val_tokens=64",
        "--hellaswag=False", "--sample_interval=0", "--checkpoint_interval=3"]


def tool(*args, env=None):
    return commands.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                      env=dict(one_thread(), **(env or {})))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny CPU run of 6 steps with GPT-2's padded vocabulary (50304), resumed once from step 3."""
    tmp = tmp_path_factory.mktemp("run")
    data = random_shards(tmp / "data", 0, 2000, [2000])
    log_dir = tmp / "log"
    first = run_script([*ARGS, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=3"])
    assert first.returncode == 0, first.stderr
    second = run_script([*ARGS, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=6"])
    assert second.returncode == 0, second.stderr
    return log_dir, first.stdout + second.stdout


# --- the console and run.json --------------------------------------------------------------------

@shares_runs
def test_step_line_shows_eta_and_no_mfu_on_a_cpu(run):
    """Issue 31.2: on a CPU no peak holds (a matmul timed at start gave MFUs of 20-292%), so each
    start says MFU is not shown and the step lines have none; the ETA counts down to 0 at the last
    step. The MFU formula is checked on a GPU (test_cuda.py)."""
    _, out = run
    assert len(re.findall(r"^mfu: not shown on a CPU: .*; tok/sec is the figure to compare$", out, re.M)) == 2
    lines = re.findall(r"^step +(\d+) \| loss .* \| tok/sec ([\d.]+) \| eta (\d+)h(\d\d)m(\d\d)s$", out, re.M)
    assert [int(s) for s, *_ in lines] == list(range(6)) and "mfu " not in out
    assert tuple(map(int, lines[-1][2:])) == (0, 0, 0) and tuple(map(int, lines[2][2:])) == (0, 0, 0)


@pytest.mark.quick
@pytest.mark.parametrize("name,flops", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10G", 70e12),
                                        ("NVIDIA L40", 181e12), ("NVIDIA L4", 121e12),
                                        ("Tesla V100-SXM2-16GB", 125e12)])
def test_gpu_peak_table(monkeypatch, name, flops):
    from gptkit import hardware
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert hardware.peak_flops("cuda:0", "bfloat16") == (flops, f"{name} datasheet")


@shares_runs
def test_run_json_records_each_start(run):
    log_dir, _ = run
    entries = json.loads((log_dir / "run.json").read_text())
    assert [e["start_step"] for e in entries] == [0, 3]
    assert entries[0]["resumed_from"] is None and entries[1]["resumed_from"].endswith("model_00003.pt")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    for e in entries:
        assert e["git_commit"] == (head or None) and e["git_modified"] == (bool(status) if head else None)
        assert e["torch"] == torch.__version__ and e["python"] == ".".join(map(str, sys.version_info[:3]))
        assert e["world_size"] == 1 and len(e["hosts"]) == 1 and e["devices"][0].startswith("cpu: ")
        assert e["config"]["n_embd"] == 32 and e["config"]["log_dir"] == str(log_dir)
        assert {"started", "command", "cuda", "nccl"} <= e.keys()
    assert entries[1]["config"]["max_steps"] == 6 and entries[0]["config"]["max_steps"] == 3


def test_run_json_gathers_every_rank(tmp_path):
    data = random_shards(tmp_path / "data", 0, 2000, [2000])
    r = run_script([*ARGS, f"--data_root={data}", f"--log_dir={tmp_path / 'log'}", "--max_steps=1"], nproc=2)
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads((tmp_path / "log" / "run.json").read_text())
    assert entry["world_size"] == 2 and len(entry["devices"]) == 2


def wandb_records(path):
    """The records of an offline W&B run file (run-*.wandb): a ':W&B' header of 7 bytes, then 32 KiB
    blocks of chunks (crc32 4 bytes, length 2, type 1: 1 whole, 2 first, 3 middle, 4 last), each
    record a wandb_internal_pb2.Record."""
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_logs_what_log_txt_has(tmp_path):
    """wandb_log=True in W&B's offline mode: every number of log.txt, at its step, and the config."""
    import wandb  # noqa: F401 -- requirements-dev.txt installs it: a missing wandb fails, never skips
    data = random_shards(tmp_path / "data", 0, 2000, [2000])
    log_dir = tmp_path / "log"
    env = one_thread(WANDB_MODE="offline", WANDB_SILENT="true")
    r = subprocess.run([sys.executable, "train_gpt2.py", *ARGS, f"--data_root={data}", f"--log_dir={log_dir}",
                        "--max_steps=4", "--wandb_log=True", "--wandb_project=test", "--wandb_run_name=tiny"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (path,) = (log_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged, runs = {}, []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for kind in (k for k in items if not k.startswith("_")):  # W&B's own keys start with _
                logged.setdefault(kind, {})[items["_step"]] = items[kind]
        elif record.WhichOneof("record_type") == "run":
            runs.append(record.run)
    assert logged == read_log(log_dir) and set(logged["train"]) == {0, 1, 2, 3}
    assert runs[0].project == "test" and runs[0].display_name == "tiny"
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["n_embd"] == 32 and config["wandb_log"] is True
    (entry,) = json.loads((log_dir / "run.json").read_text())
    assert entry["wandb_run_id"] and path.name == f"run-{entry['wandb_run_id']}.wandb"  # which W&B run it was


@pytest.mark.quick
def test_wandb_is_not_imported_when_off(tmp_path):
    data = random_shards(tmp_path / "data", 0, 2000, [2000])
    code = ("import runpy, sys; sys.argv[0] = 'train_gpt2.py'; "
            "runpy.run_path('train_gpt2.py', run_name='__main__'); "
            "print('wandb imported:', 'wandb' in sys.modules)")
    args = [*ARGS, f"--data_root={data}", f"--log_dir={tmp_path / 'log'}", "--max_steps=1"]
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)  # a fresh interpreter
    assert r.returncode == 0, r.stderr
    assert "step     0 | loss " in r.stdout and "wandb imported: False" in r.stdout, r.stdout


# --- plot.py ---------------------------------------------------------------------------------------

@shares_runs
def test_plot_one_run(run, tmp_path):
    log_dir, _ = run
    out = tmp_path / "one.png"
    panels = plot.plot([("log", plot.read_log(str(log_dir)))], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert [title for title, _ in panels] == ["loss", "val bits per byte"]  # a run without HellaSwag
    (_, loss_lines), (_, bpb_lines) = panels
    assert {"log train (smoothed)", "log val"} <= set(loss_lines)
    assert bpb_lines == ["log"]


def test_plot_leaves_out_panels_with_nothing_to_show(tmp_path):
    """Issue 22: no HellaSwag lines in any log (the quick start), no HellaSwag panel; no bpb lines
    either (build-nanogpt's logs), the loss panel alone."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "log.txt").write_text("0 val 10.9863\n0 bpb 4.1\n0 train 10.955424\n"
                                            "1 train 10.412341\n")
    panels = plot.plot([("a", plot.read_log(str(tmp_path / "a")))], str(tmp_path / "a.png"))
    assert [title for title, _ in panels] == ["loss", "val bits per byte"]
    (tmp_path / "a" / "log.txt").write_text("0 val 10.9863\n0 train 10.955424\n1 train 10.412341\n")
    panels = plot.plot([("a", plot.read_log(str(tmp_path / "a")))], str(tmp_path / "b.png"))
    assert [title for title, _ in panels] == ["loss"] and (tmp_path / "b.png").stat().st_size > 10_000


@shares_runs
def test_plot_build_nanogpt_log_and_two_runs(run, tmp_path, capsys):
    """build-nanogpt's log.txt (same line format, hella lines) and ours overlaid, each labelled by
    its folder; a line that does not parse is skipped with a warning naming it."""
    ours, _ = run
    theirs = tmp_path / "nanogpt_run"
    theirs.mkdir()
    (theirs / "log.txt").write_text("0 val 10.9863\n0 hella 0.2468\n0 train 10.955424\n1 train 10.412341\n"
                                    "this line is not a log line\n250 val 6.1238\n250 hella 0.2553\n")
    curves = plot.read_log(str(theirs))
    assert "log.txt:5" in capsys.readouterr().err
    assert curves["train"] == ([0, 1], [10.955424, 10.412341])
    assert curves["hella"] == ([0, 250], [0.2468, 0.2553])
    alone = tmp_path / "alone.png"
    (_, loss_lines), (_, hella_lines) = plot.plot([("nanogpt_run", curves)], str(alone))  # no bpb: no panel
    assert alone.stat().st_size > 10_000 and "nanogpt_run val" in loss_lines and "nanogpt_run" in hella_lines
    assert {"GPT-2 124M (OpenAI): 0.2955", "GPT-3 124M (paper): 0.337"} <= set(hella_lines)
    out = tmp_path / "two.png"
    r = tool("plot.py", str(ours), str(theirs), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10_000 and "wrote" in r.stdout and "log, nanogpt_run" in r.stdout
    both = [("log", plot.read_log(str(ours))), ("nanogpt_run", curves)]
    (_, loss_lines), _, (_, hella_lines) = plot.plot(both, str(tmp_path / "again.png"))
    assert {"log val", "nanogpt_run val", "log train (smoothed)", "nanogpt_run train (smoothed)"} <= \
        set(loss_lines)
    assert "nanogpt_run" in hella_lines


def test_plot_passes_over_kinds_it_does_not_draw(tmp_path, capsys):
    """Issue 43.1: a kind of line that plot.py does not draw (one a user's trainer adds, or skip) is
    passed over without a word; the curves it knows are read as without it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "log.txt").write_text("0 val 10.9863\n0 top1 0.25\n0 train 10.955424\n1 skip 1\n")
    curves = plot.read_log(str(tmp_path / "a"))
    assert capsys.readouterr().err == ""
    assert curves["val"] == ([0], [10.9863]) and curves["train"] == ([0], [10.955424])
    assert "top1" not in curves and "skip" not in curves


def test_recipes_md_commands_train_each_recipe_and_overlay_them(tmp_path):
    """Issue 22, docs/recipes.md: the quick start once per recipe, each in a log_dir of its own, then
    plot.py over all four; every command runs as written (the trainer made tiny here, on random
    shards in demo_stdlib/), each run trains the recipe its log_dir names, with val every 10 steps."""
    from test_docs import bash_block, run_command
    commands = bash_block(open(os.path.join(ROOT, "docs", "recipes.md")).read(), "## The figures")
    random_shards(tmp_path / "demo_stdlib", 0, 3000, [20000], vocab=50257)
    (tmp_path / "config").symlink_to(os.path.join(ROOT, "config"))  # as run from the project's folder
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--T=32", "--B=2", "--device=cpu",
            "--total_batch_size=128", "--val_tokens=256", "--dtype=float32", "--max_steps=20",
            "--sample_interval=0"]
    for command in commands[:-1]:
        run_command(command, tmp_path, *tiny)
    names = ["adamw_cosine", "adamw_wsd", "muon_wsd", "muon_cosine"]
    for name in names:
        (entry,) = json.loads((tmp_path / f"log_{name}" / "run.json").read_text())
        assert f"{entry['config']['optimizer']}_{entry['config']['lr_schedule']}" == name
        assert list(read_log(tmp_path / f"log_{name}")["val"]) == [0, 10, 20]
    r = run_command(commands[-1], tmp_path)
    assert r.stdout.strip() == f"wrote recipes.png: {', '.join('log_' + name for name in names)}"


def a_log_dir(folder, run_json=None):
    """folder as a run's log_dir: a short log.txt (val, HellaSwag, train) and, unless None, run_json
    (a list of entries, written as JSON, or the file's text)."""
    folder.mkdir()
    (folder / "log.txt").write_text("0 val 10.9863\n0 hella 0.2468\n0 train 10.955424\n1 train 10.412341\n")
    if run_json is not None:
        (folder / "run.json").write_text(run_json if isinstance(run_json, str) else json.dumps(run_json))
    return str(folder)


def val_references(tmp_path, *log_dirs):
    """The labels of GPT-2's val loss line when plot.py draws log_dirs (none, or one); HellaSwag's
    lines are drawn whatever the data: the same eval."""
    (_, loss_lines), (_, hella_lines) = plot.main([*log_dirs, "--out", str(tmp_path / "plot.png")])
    assert {"GPT-2 124M (OpenAI): 0.2955", "GPT-3 124M (paper): 0.337"} <= set(hella_lines)
    return [label for label in loss_lines if "3.2924" in label]


def test_plot_draws_gpt2_val_loss_only_over_fineweb_edu(tmp_path, capsys):
    """Issue: GPT-2's 3.2924 is FineWeb-Edu's val loss, meaningless over a run on other data (the
    demo's Python standard library): drawn, with its dataset in the label, only when some run is
    FineWeb-Edu's, as its run.json's last entry says (or build-nanogpt's log dir, no run.json)."""
    demo = a_log_dir(tmp_path / "demo", [{"config": {"data_root": "data/fineweb_demo"},  # the dataset counts,
                                          "dataset": "demo: the Python standard library"}])  # not the name
    edu = a_log_dir(tmp_path / "edu", [{"config": {"data_root": "x"},
                                        "dataset": "HuggingFaceFW/fineweb-edu sample-10BT"}])
    nanogpt = a_log_dir(tmp_path / "nanogpt")
    assert val_references(tmp_path, demo) == []
    gpt2 = ["GPT-2 124M (OpenAI), FineWeb-Edu val loss: 3.2924"]
    assert val_references(tmp_path, edu) == gpt2 and val_references(tmp_path, nanogpt) == gpt2
    assert val_references(tmp_path, demo, edu) == gpt2  # some run
    # which runs are FineWeb-Edu's: the last start's dataset; older entries without one, data_root's name
    entry = {"config": {"data_root": "/data/edu_fineweb10B/"}}
    edu_run = lambda name, entries: plot.trained_on_fineweb_edu(a_log_dir(tmp_path / name, entries))
    assert edu_run("old", [entry])
    assert edu_run("no_manifest", [dict(entry, dataset=None)])
    assert not edu_run("local", [dict(entry, dataset="local files")])
    assert not edu_run("old_stdlib", [{"config": {"data_root": "stdlib"}}])
    assert not edu_run("fineweb", [{"config": {"data_root": "fineweb10B"}}])  # not edu
    assert not edu_run("edu_score", [dict(entry, dataset="HuggingFaceFW/fineweb-edu-score-2 default")])
    assert not edu_run("then_demo", [
        {"config": {"data_root": "a"}, "dataset": "HuggingFaceFW/fineweb-edu sample-10BT"},
        {"config": {"data_root": "b"}, "dataset": "demo: the Python standard library"}])
    capsys.readouterr()
    for i, text in enumerate(["{not json", "{}", "[]", "[3]", '[{"dataset": 5}]', '[{"config": {}}]']):
        assert not plot.trained_on_fineweb_edu(a_log_dir(tmp_path / f"bad{i}", text)), text
        assert "run.json: not a run.json list of entries" in capsys.readouterr().err, text


def test_smooth_has_no_lag_on_a_ramp():
    """Issue 31.7: the smoothed train curve lagged the loss by ~10 steps. A local line fit returns a
    straight line as it is, to its ends; a noisy one near the line and nearer than the raw values,
    in the middle and over the last 10 steps (the newest loss, the one read most)."""
    ramp = [10 - 0.05 * i for i in range(100)]
    assert plot.smooth(ramp) == pytest.approx(ramp)
    rng = random.Random(0)
    noisy = [v + rng.gauss(0, 0.3) for v in ramp]
    error = [abs(s - v) for s, v in zip(plot.smooth(noisy), ramp)]
    raw_error = [abs(n - v) for n, v in zip(noisy, ramp)]
    assert max(error[10:-10]) < 0.25 and sum(error[10:-10]) < sum(raw_error[10:-10]) / 3
    assert max(error[-10:]) < 0.25 and sum(error[-10:]) < sum(raw_error[-10:]) / 2


@pytest.mark.quick
def test_smooth_passes_over_nan():
    """A skipped step logs nan: it stays a nan (a gap) and is left out of its neighbours' fits, so a
    straight line stays straight beside it; the other values stay finite."""
    ramp = [10 - 0.05 * i for i in range(100)]
    values = list(ramp)
    for i in (0, 30, 31, 60, 99):
        values[i] = float("nan")
    smoothed = plot.smooth(values)
    assert [i for i, s in enumerate(smoothed) if not math.isfinite(s)] == [0, 30, 31, 60, 99]
    assert [s for s in smoothed if s == s] == pytest.approx([v for v in values if v == v])


def test_plot_errors(tmp_path):
    r = tool("plot.py", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 1 and r.stderr.strip() == f"error: {tmp_path / 'missing'}: no such folder"
    r = tool("plot.py", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 1 and "no log.txt in this folder" in r.stderr
    (tmp_path / "log.txt").write_text("garbage\n")
    r = tool("plot.py", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 1 and "no train, val, bpb or hella lines" in r.stderr
    assert not (tmp_path / "x.png").exists()
    (tmp_path / "log.txt").write_text("0 train 10.9\n")
    r = tool("plot.py", str(tmp_path), "--out", str(tmp_path / "no" / "such" / "x.png"))
    assert r.returncode == 1 and "cannot write --out" in r.stderr
    assert tool("plot.py", "--help").returncode == 0


# --- sample.py -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)).save_pretrained(folder)
    return folder


@shares_runs
def test_sample_is_seeded_for_a_checkpoint(run, tmp_path):
    log_dir, _ = run
    ckpt = str(log_dir / "model_00006.pt")
    args = ["sample.py", "--model", ckpt, "--num_samples", "2", "--max_new_tokens", "12", "--device", "cpu",
            "--dtype", "float32"]
    a, b, c = tool(*args), tool(*args), tool(*args, "--seed", "7")
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout != c.stdout
    samples = a.stdout.split("--- sample ")[1:]
    assert len(samples) == 2
    assert all(s.split("\n", 1)[1].startswith("Hello, I'm a language model,") for s in samples)
    (tmp_path / "prompt.txt").write_text("Once upon a time")
    d = tool(*args, "--prompt", f"FILE:{tmp_path / 'prompt.txt'}", "--num_samples", "1")
    assert d.returncode == 0 and d.stdout.split("\n")[1].startswith("Once upon a time")
    # issue 31.8: a log_dir for --model means its newest checkpoint
    e = tool(*[str(log_dir) if arg == ckpt else arg for arg in args])
    assert e.returncode == 0 and e.stdout == a.stdout and e.stderr.strip().splitlines()[0] == (
        f"{log_dir}: its newest checkpoint, {ckpt}"), e.stderr


@shares_runs
def test_greedy_sample_matches_hf_generate(hf_dir, capsys, enc):
    """--top_k 1 is greedy decoding: the same tokens as HF transformers' generate on the same weights."""
    from transformers import GPT2LMHeadModel
    sample.main(["--model", str(hf_dir), "--num_samples", "1", "--max_new_tokens", "12", "--device", "cpu",
                 "--dtype", "float32", "--top_k", "1"])
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    idx = torch.tensor([enc.encode("Hello, I'm a language model,")])
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    out = hf.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=50256)
    assert printed == enc.decode(out[0].tolist())


@shares_runs
def test_sample_reads_hf_folders_and_openai_names(hf_dir, monkeypatch, capsys):
    sample.main(["--model", str(hf_dir), "--num_samples", "1", "--max_new_tokens", "5", "--device", "cpu"])
    from_folder = capsys.readouterr().out
    assert from_folder.startswith("--- sample 0\nHello, I'm a language model,")
    import transformers
    asked = []
    load = transformers.GPT2LMHeadModel.from_pretrained  # the download, here: the local folder
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained",
                        lambda name: asked.append(name) or load(hf_dir))
    sample.main(["--model", "gpt2", "--num_samples", "1", "--max_new_tokens", "5", "--device", "cpu"])
    assert asked == ["gpt2"] and capsys.readouterr().out == from_folder  # the same weights, the same text


@pytest.mark.quick
def test_training_samples_are_returned_seeded_by_the_step(tmp_path):
    """The trainer's samples: at each sampled step, 4 lines in samples.txt, "step {step} sample {i}:
    {text!r}", each a continuation of sample_prompt, and the same lines on the console. They are seeded
    by the step: with the weights held still (max_lr=0) another step samples other text, and a resumed
    run writes what a run straight through writes. A model whose vocabulary is not GPT-2's gets one
    line on the console and no samples."""
    import ast
    data = random_shards(tmp_path / "data", 0, 2000, [2000])
    args = [*ARGS, f"--data_root={data}", "--sample_interval=2", "--sample_length=6", "--eval_interval=2",
            "--checkpoint_interval=2", "--max_lr=0", "--min_lr=0"]
    r = run_script([*args, f"--log_dir={tmp_path / 'straight'}", "--max_steps=4"])
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "straight" / "samples.txt").read_text().splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"step {s} sample {i}" for s in (2, 4)
                                                          for i in range(4)]
    texts = [ast.literal_eval(line.split(": ", 1)[1]) for line in lines]
    assert all(text.startswith("Hello, I'm a language model,") for text in texts)
    assert len(set(texts)) > 1 and texts[:4] != texts[4:]  # the same weights at steps 2 and 4
    assert all(r.stdout.splitlines().count(line) == 1 for line in lines), r.stdout
    for max_steps in (2, 4):
        r = run_script([*args, f"--log_dir={tmp_path / 'resumed'}", f"--max_steps={max_steps}"])
        assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stdout
    assert (tmp_path / "resumed" / "samples.txt").read_text().splitlines() == lines
    r = run_script([*args, f"--log_dir={tmp_path / 'small'}", "--max_steps=2", "--vocab_size=512"])
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "small" / "samples.txt").exists() and " sample 0: " not in r.stdout
    assert ("step 2: no samples: the model's vocab_size=512 is smaller than GPT-2's 50257: its tokens are "
            "not GPT-2's\n") in r.stdout, r.stdout


def nanogpt_checkpoint(path):
    """A checkpoint as build-nanogpt saves it: its config as a pickled dataclass, which
    weights_only loading refuses."""
    from model import GPTConfig
    torch.save({"model": {}, "config": GPTConfig(), "step": 0}, path)
    return path


def test_sample_errors(tmp_path):
    r = tool("sample.py", "--model", str(tmp_path / "none.pt"))
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "none.pt" in r.stderr
    assert "Traceback" not in r.stderr
    r = tool("sample.py", "--model", str(nanogpt_checkpoint(tmp_path / "nanogpt.pt")))
    assert r.returncode == 1
    assert "nanogpt.pt: not a readable train_gpt2.py checkpoint (UnpicklingError" in r.stderr
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    r = tool("sample.py", "--model", "gpt2", "--prompt", f"FILE:{tmp_path / 'latin1.txt'}")
    assert r.returncode == 1 and "latin1.txt: cannot read it" in r.stderr
    r = tool("sample.py", "--model", "gpt2", "--prompt", f"FILE:{tmp_path / 'nope.txt'}")
    assert r.returncode == 1 and f"--prompt FILE:{tmp_path / 'nope.txt'}: cannot read it" in r.stderr
    assert tool("sample.py", "--help").returncode == 0
    (tmp_path / "empty").mkdir()  # neither a HF folder nor a log_dir
    r = tool("sample.py", "--model", str(tmp_path / "empty"))
    assert r.returncode == 1 and r.stderr.strip() == (f"error: {tmp_path / 'empty'}: neither a HF model "
                                                      "folder (no config.json) nor a run's log_dir "
                                                      "(no model_NNNNN.pt)")
    gpu = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU here: a missing device is one line
    r = tool("sample.py", "--model", "gpt2", "--device", gpu)
    assert r.returncode == 1 and r.stderr.startswith(f"error: device='{gpu}' is not on this machine") and \
        len(r.stderr.strip().splitlines()) == 1, r.stderr


# --- export_hf.py ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    log_dir, _ = run
    out = tmp_path_factory.mktemp("export") / "gpt2-tiny"
    r = tool("export_hf.py", str(log_dir / "model_00006.pt"), str(out))
    assert r.returncode == 0, r.stderr
    return log_dir / "model_00006.pt", out


@shares_runs
def test_export_loads_in_transformers_with_the_same_logits(exported):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel
    ckpt, out = exported
    files = {"config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"}
    assert files <= set(os.listdir(out))
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # readable by others as any folder made here
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(hf, GPT2LMHeadModel) and hf.config.vocab_size == 50257
    from gptkit.loading import load_model
    ours = load_model(str(ckpt), "cpu")
    assert ours.config.vocab_size == 50304
    idx = torch.randint(0, 50257, (2, 24))
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)[0][..., :50257]).abs().max().item() < 1e-4


@shares_runs
def test_export_files_are_readable_as_the_umask_says(exported):
    """Issue 21.10: every file of the export gets the mode a new file gets here (0o666 less the
    umask: readable by others on a shared model folder); model.safetensors was 0600."""
    _, out = exported
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: oct(os.stat(out / name).st_mode & 0o777) for name in os.listdir(out)}
    assert modes == {name: oct(0o666 & ~umask) for name in modes}


@shares_runs
def test_export_racing_another_writer_is_one_line(exported, tmp_path, monkeypatch):
    """Issue 21.8: another writer fills OUT_DIR while the export runs: one UserError naming it, that
    writer's files left alone, no temporary folder left behind."""
    import export_hf
    from gptkit.common import UserError
    ckpt, _ = exported
    out, real = tmp_path / "race", export_hf.save_tokenizer

    def racing(folder, max_length):  # the other writer arrives while this export writes
        out.mkdir()
        (out / "theirs.txt").write_text("x")
        return real(folder, max_length)
    monkeypatch.setattr(export_hf, "save_tokenizer", racing)
    with pytest.raises(UserError, match=f"{out}: another writer filled it while this export ran"):
        export_hf.export(str(ckpt), str(out))
    assert os.listdir(out) == ["theirs.txt"] and os.listdir(tmp_path) == ["race"]


@shares_runs
def test_export_tokenizer_is_tiktokens_gpt2(exported, enc):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(exported[1])
    for text in ["Hello, I'm a language model,", "  two spaces\tand\nnewlines ",
                 "héllo wörld 日本語 🤖", "<|endoftext|>"]:
        assert tok(text)["input_ids"] == enc.encode(text, allowed_special="all"), text
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == 50256


@shares_runs
def test_export_generates_in_a_pipeline_and_round_trips(exported):
    from transformers import pipeline
    ckpt, out = exported
    gen = pipeline("text-generation", model=str(out), device="cpu")
    text = gen("Hello, I'm a language model,", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("Hello, I'm a language model,") and len(text) > len("Hello, I'm a language model,")
    back = GPT.from_pretrained(str(out))  # model.py's own HF loader
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
    for k, v in back.state_dict().items():
        padded = k in ("transformer.wte.weight", "lm_head.weight")  # the checkpoint's vocabulary is padded
        assert torch.equal(v, saved[k][:50257] if padded else saved[k]), k


@shares_runs
def test_export_errors(exported, run, tmp_path):
    ckpt, out = exported
    r = tool("export_hf.py", str(ckpt), str(out))
    assert r.returncode == 1 and "already exists and is not an empty folder" in r.stderr
    log_dir, _ = run
    r = tool("export_hf.py", str(log_dir / "log.txt"), str(tmp_path / "x"))
    assert r.returncode == 1 and "log.txt: not a readable train_gpt2.py checkpoint" in r.stderr
    cut = tmp_path / "cut.pt"  # a copy cut short: what a full disk leaves (torch's own line speaks of mmap)
    cut.write_bytes(ckpt.read_bytes()[:100_000])
    r = tool("export_hf.py", str(cut), str(tmp_path / "x"))
    assert r.returncode == 1 and r.stderr == (f"error: {cut}: not a readable train_gpt2.py checkpoint "
                                              f"(ValueError: not a whole zip archive, as torch.save writes: "
                                              f"cut short, or another kind of file)\n"), r.stderr
    small = tmp_path / "small.pt"
    config = {"vocab_size": 512, "block_size": 32, "n_layer": 1, "n_head": 1, "n_embd": 8}
    torch.save({"config": config, "model": {}}, small)
    r = tool("export_hf.py", str(small), str(tmp_path / "y"))
    assert r.returncode == 1 and "vocab_size=512 is smaller than GPT-2's 50257" in r.stderr
    r = tool("export_hf.py", str(nanogpt_checkpoint(tmp_path / "nanogpt.pt")), str(tmp_path / "z"))
    assert r.returncode == 1
    assert "nanogpt.pt: not a readable train_gpt2.py checkpoint (UnpicklingError" in r.stderr
    assert not any((tmp_path / d).exists() for d in "xyz")
    assert tool("export_hf.py", "--help").returncode == 0
