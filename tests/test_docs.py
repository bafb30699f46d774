"""The docs point at the code as `file.py:name`; every such reference must name something that
file defines, so that the guides cannot drift from the code."""
import ast
import glob
import os
import re
import sys

import pytest

import commands
from conftest import ROOT, one_thread

REF = re.compile(r"`([A-Za-z_][\w/]*\.py):([A-Za-z_][\w.]*)`")


def defines(path, dotted):
    """Whether the Python file at path defines dotted at its top level (a function, class or
    assigned constant), or, for Class.member, in that class's body."""
    if not os.path.isfile(path):
        return False
    scope = ast.parse(open(path).read()).body
    for part in dotted.split('.'):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def references(text):
    return REF.findall(text)


@pytest.mark.quick
def test_resolver_tells_real_names_from_stale_ones():
    trainer, shards = os.path.join(ROOT, "train_gpt2.py"), os.path.join(ROOT, "gptkit", "shards.py")
    assert defines(trainer, "get_lr") and defines(trainer, "total_batch_size")
    assert defines(shards, "DataLoaderLite") and defines(shards, "DataLoaderLite.next_batch")
    assert not defines(trainer, "no_such_function") and not defines(shards, "DataLoaderLite.no_such_method")
    assert not defines(trainer, "train_step") and not defines(trainer, "DataLoaderLite")  # gone, or moved
    assert not defines(trainer, "get_lr.x")  # a function has no members here
    assert not defines(os.path.join(ROOT, "no_such_file.py"), "main")
    found = references("see `model.py:GPT.forward` and `a/b.py:c`, not file.py:x")
    assert found == [("model.py", "GPT.forward"), ("a/b.py", "c")]


@pytest.mark.quick
def test_every_code_reference_in_docs_resolves():
    stale = []
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for file, name in references(open(doc).read()):
            if not defines(os.path.join(ROOT, file), name):
                stale.append(f"{os.path.relpath(doc, ROOT)}: {file}:{name}")
    assert not stale, "references to code that does not exist:\n" + "\n".join(stale)


@pytest.mark.quick
def test_ddp_guide_points_at_the_code():
    refs = set(references(open(os.path.join(ROOT, "docs", "ddp.md")).read()))
    assert len(refs) >= 15, sorted(refs)


@pytest.mark.quick
def test_config_files_are_said_to_run_as_code():
    """Issue 21.8: a config file is Python that the trainer executes: the README and configurator.py
    say so, and to use only files you trust."""
    for path in ("README.md", "gptkit/configurator.py"):
        text = " ".join(open(os.path.join(ROOT, path)).read().split())
        assert "runs as code: use only files you trust" in text, path


def read(*path):
    return open(os.path.join(ROOT, *path)).read()


def bash_lines(block):
    """The lines of a ```bash block's body, continued lines joined, comments and blank lines out."""
    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def bash_block(text, after):
    """The commands of the first ```bash block after the text `after`."""
    return bash_lines(text[text.index(after):].split("```bash\n", 1)[1].split("```", 1)[0])


def run_command(line, cwd, *extra):
    """A `python X.py ...` line of the docs, run with this Python and the project's X.py."""
    import shlex
    import sys
    words = shlex.split(line)
    assert words[0] == "python" and words[1].endswith(".py"), line
    r = commands.run([sys.executable, os.path.join(ROOT, words[1]), *words[2:], *extra], cwd=cwd,
                   capture_output=True, text=True, timeout=300, env=one_thread())
    assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    return r


@pytest.mark.quick
def test_one_gpt2_hellaswag_baseline_with_its_source():
    """Issue 21.11: one figure for GPT-2 124M's HellaSwag acc_norm (0.2955, build-nanogpt's
    hellaswag.py), the same in plot.py's reference line, the README and docs/hellaswag.md; the other
    figures (0.2945, lm-eval's 0.3114) only where the docs explain where they come from."""
    import plot
    assert plot.REFERENCE["hella"][0][0] == 0.2955
    for path in ("README.md", "docs/hellaswag.md", "hellaswag.py"):
        assert "0.2955" in read(path), path
    docs, scripts = glob.glob(os.path.join(ROOT, "docs", "*.md")), glob.glob(os.path.join(ROOT, "*.py"))
    for path in ["README.md", *docs, *scripts]:
        text = read(path)
        if "0.2945" in text:
            assert os.path.basename(path) in ("hellaswag.md", "plot.py"), path
    hella = read("docs", "hellaswag.md")
    assert "0.3114" in hella and "lm_eval --model hf --model_args pretrained=" in hella


@pytest.mark.quick
def test_slurm_lead_time_is_one_figure():
    """Issue 21.11: the SLURM signal's lead time is the same everywhere it is written (TERM@300 to
    the steps before issue 37, B:USR1@300 to the batch script since)."""
    docs = glob.glob(os.path.join(ROOT, "docs", "*.md"))
    texts = [read("README.md"), read("scripts", "slurm_train.sh")] + [open(p).read() for p in docs]
    assert {m for t in texts for m in re.findall(r"(?:B:)?(?:TERM|USR1)@(\d+)", t)} == {"300"}


def doc_commands(path="README.md"):
    """Every command of a document's ```bash blocks, in order ('a && b' is two; continued lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", read(path), re.S)
    return [c.strip() for block in blocks for line in bash_lines(block) for c in line.split(" && ")]


def left_out(command):
    """Why a README command is not run here, or None: GPUs, SLURM, FineWeb-Edu (20 GB), the tests."""
    if re.search(r"nproc_per_node=8|--nnodes|^sbatch ", command):
        return "GPUs or SLURM"
    if command == "python fineweb.py" or ("train_gpt2.py" in command and "config/demo_cpu.py" not in command):
        return "FineWeb-Edu"  # the trainer's default data_root, edu_fineweb10B
    if "pytest" in command or command.startswith(("pip install", "ruff")):
        return "the tests' own (CI runs them), or an install"
    return None


def test_readme_trainer_lines_run_as_written(tmp_path):
    """Issue 57.1: each README line that launches the trainer here (the quick start's, the 2-process
    CPU line) runs as written on random shards of the demo's size, with only --max_steps=1 appended:
    nothing that changes B, T or total_batch_size, so a line whose shapes cannot run fails here (the
    2-process line did, until it said --B=8: the config's B=16 fills its batch on one process)."""
    import shlex
    from conftest import random_shards
    random_shards(tmp_path / "demo_stdlib", 0, 16384 + 1, [3 * 4096 + 1], vocab=50257)
    (tmp_path / "config").symlink_to(os.path.join(ROOT, "config"))
    lines = [c for c in doc_commands() if "train_gpt2.py" in c and left_out(c) is None]
    assert len(lines) == 2, lines
    for line in lines:
        words = shlex.split(line)
        at = words.index("train_gpt2.py")
        launcher = [sys.executable] + (["-m", "torch.distributed.run", *words[1:at]] if at > 1 else [])
        cmd = [*launcher, os.path.join(ROOT, "train_gpt2.py"), *words[at + 1:], "--max_steps=1"]
        r = commands.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=one_thread())
        assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
        assert re.search(r"^step +0 \| loss ", r.stdout, re.M), (line, r.stdout[-2000:])


def doc_trainer_lines():
    """(file, line) for every line of a ```bash block in the README and docs/ that launches the trainer,
    each loop variable given the first value of its `for` (docs/benchmarks.md's sweeps)."""
    for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        first = dict(re.findall(r"for (\w+) in (\S+)", read(path)))
        for command in doc_commands(path):
            if "train_gpt2.py" in command:
                yield os.path.basename(path), re.sub(r"\$\{?(\w+)\}?", lambda m: first[m[1]], command)


@pytest.mark.quick
def test_every_doc_trainer_line_fits_its_processes(monkeypatch):
    """Issue 57.1: each trainer line of the README and docs, GPU and cluster lines included, names
    keys and values the trainer takes, and its batch fits the processes it launches (B*T*world
    divides total_batch_size): the failure the README's 2-process line had, found without a run."""
    import shlex
    from gptkit.common import UserError
    from gptkit.configurator import parse_config, trainer_defaults
    monkeypatch.chdir(ROOT)  # config/... as the docs' commands name them
    lines = list(doc_trainer_lines())
    assert len(lines) >= 20, lines
    for where, line in lines:
        words = shlex.split(line)
        at = words.index("train_gpt2.py")
        launch = " ".join(words[:at])
        world = int(re.search(r"nproc_per_node=(\d+)", launch)[1]) if "nproc_per_node" in launch else 1
        world *= int(re.search(r"nnodes=(\d+)", launch)[1]) if "nnodes" in launch else 1
        monkeypatch.setenv("WORLD_SIZE", str(world))
        try:
            config = parse_config(words[at + 1:], trainer_defaults())
        except UserError as e:  # the user's one line, with the doc's line that meets it
            pytest.fail(f"{where}: {line}\n{e}")
        assert config["lr_schedule"] in ("cosine", "wsd"), (where, line)


def test_readme_commands_run_in_order(tmp_path):
    """Issue 31.1: the README's commands, run in order as written, each do what its comment says:
    the quick start trains into log_demo/ (its config made tiny here, on random shards in
    demo_stdlib/: fineweb.py --demo is test_fineweb.py's), the 2-process CPU line trains the same
    steps into a log_dir of its own (it used to resume the finished demo: 'nothing to do'), and the
    "Looking at a run" lines plot, sample and export it. What is left out is left out by rule."""
    import shlex
    from conftest import random_shards
    lines = doc_commands()
    run_here = [c for c in lines if left_out(c) is None]
    assert len(lines) - len(run_here) == 15, [c for c in lines if left_out(c)]
    assert run_here == ["python fineweb.py --demo", "python train_gpt2.py config/demo_cpu.py",
                        "torchrun --standalone --nproc_per_node=2 train_gpt2.py config/demo_cpu.py --B=8 "
                        "--log_dir=log_demo_ddp",
                        "python plot.py log_demo --out demo.png",
                        'python sample.py --model log_demo --prompt "def" --num_samples 4',
                        "python export_hf.py log_demo/model_00120.pt demo_hf"], run_here
    random_shards(tmp_path / "demo_stdlib", 0, 3000, [20000], vocab=50257)
    (tmp_path / "config").symlink_to(os.path.join(ROOT, "config"))  # commands run from the project's folder
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=32", "--T=16", "--B=2",
            "--total_batch_size=64", "--val_tokens=256", "--sample_length=4", "--device=cpu",
            "--dtype=float32"]
    outs = {}
    for command in run_here[1:]:
        words = shlex.split(command)
        extra = tiny if "train_gpt2.py" in words else []
        if words[0] == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", *words[1:3], os.path.join(ROOT, words[3]),
                   *words[4:], *extra]
            r = commands.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=one_thread())
            assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
        else:
            r = run_command(command, tmp_path, *extra)
        outs[command] = r
    one, two = read_log_lines(tmp_path / "log_demo"), read_log_lines(tmp_path / "log_demo_ddp")
    assert "nothing to do" not in outs[run_here[2]].stdout and "world_size=2 " in outs[run_here[2]].stdout
    assert [s for s, kind, _ in two if kind == "train"] == list(range(120))  # trained from step 0
    for (s1, k1, v1), (s2, k2, v2) in zip(one, two, strict=True):  # the same steps: losses to float32's sums
        assert (s1, k1) == (s2, k2) and abs(v1 - v2) < 2e-4 * max(1, abs(v1)), (s1, k1, v1, v2)
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    sample = outs[run_here[4]]
    assert sample.stdout.count("--- sample ") == 4 and "log_demo/model_00120.pt" in sample.stderr
    assert (tmp_path / "demo_hf" / "model.safetensors").exists()
    assert (tmp_path / "demo_hf" / "tokenizer.json").exists()


def read_log_lines(log_dir):
    return [(int(a), b, float(c)) for a, b, c in (line.split() for line in open(log_dir / "log.txt"))]


def test_own_documents_commands_of_data_md(tmp_path):
    """Issue 21.11: docs/data.md's two commands for one's own documents run as written (the trainer
    stopped after 2 steps here), and without --shard_size a small corpus gets the warning the
    docs quote (smaller steps here: the commands' work, not the model's)."""
    import json
    lines = bash_block(read("docs", "data.md"), "## Training on your own documents")
    assert len(lines) == 2 and "--shard_size" in lines[0], lines
    (tmp_path / "my_corpus").mkdir()
    words = "the of a model data train token shard loss step learning rate batch value".split()
    for i in range(2):  # the size the docs give the example: a few hundred KB, about 100,000 tokens
        with open(tmp_path / "my_corpus" / f"part{i}.jsonl", "w") as f:
            for d in range(180):
                text = " ".join(words[(i * 7 + d * 3 + k) % len(words)] for k in range(300))
                f.write(json.dumps({"text": text}) + "\n")
    (tmp_path / "config").symlink_to(os.path.join(ROOT, "config"))  # commands run from the project's folder
    size = sum(os.path.getsize(p) for p in glob.glob(str(tmp_path / "my_corpus" / "*")))
    r = run_command(lines[0], tmp_path)
    assert "warning" not in r.stdout + r.stderr
    tokens = int(re.search(r"done: ([\d,]+) tokens", r.stdout).group(1).replace(",", ""))
    assert 200_000 < size < 900_000 and 80_000 < tokens < 150_000, (size, tokens)
    assert len(glob.glob(str(tmp_path / "my_data" / "local_train_*.npy"))) >= 4  # named as local files'
    run_command(lines[1], tmp_path, "--max_steps=2", "--device=cpu", "--dtype=float32",
                "--val_tokens=1024", "--sample_interval=0", "--total_batch_size=1024", "--B=4")
    assert "2 val " in (tmp_path / "log_my_data" / "log.txt").read_text()
    one_shard = lines[0].replace(" --shard_size 20000", "").replace("my_data", "my_data_one_shard")
    r = run_command(one_shard, tmp_path)
    assert "warning: only the val shard was written" in r.stdout + r.stderr
    r = commands.run([sys.executable, os.path.join(ROOT, "train_gpt2.py"), "config/demo_cpu.py",
                    "--data_root=my_data_one_shard", "--log_dir=log_one_shard"], cwd=tmp_path,
                   capture_output=True, text=True, timeout=300, env=one_thread())
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: 'my_data_one_shard' holds a val shard and no train shard"), r.stderr
    assert "smaller --shard_size" in r.stderr, r.stderr
    # nothing made or said
    assert not (tmp_path / "log_one_shard").exists() and "config, where" not in r.stdout


def test_fsdp_memory_table_matches_a_count():
    """Issue 21.11: docs/fsdp.md's activations per preset are what autograd saves for one
    micro-batch at the B that "auto" takes on 8 GPUs of 80 GB (bf16 autocast, the CPU's loss,
    counted on fake tensors by memory.activations: no memory used)."""
    from gptkit.configurator import parse_config, trainer_defaults
    from gptkit import memory
    from model import GPTConfig
    table = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in
             re.finditer(r"\| `(gpt2_\w+)\.py` \| (\d+) \| ([\d.]+) GB \|", read("docs", "fsdp.md"))}
    assert len(table) == 4, table
    for preset, (B, gb) in table.items():
        c = parse_config([os.path.join(ROOT, "config", preset + ".py")], trainer_defaults())
        shape = GPTConfig.from_dict(c)
        on_gpu = dict(c, B="auto", dtype="bfloat16", compile=True)  # the preset's own B aside
        assert memory.micro_batch(on_gpu, shape, "cuda", 8, free=80e9)[0] == B, preset
        fixed, per_seq = memory.activations(shape, c["T"], "bfloat16", "cpu", compiled=False)  # CPU's loss
        total = fixed + B * per_seq  # = the count of the whole forward, to 0.5% (test_memory.py)
        assert abs(total / 1e9 - gb) < 0.05, (preset, total / 1e9, gb)


@pytest.mark.quick
def test_readme_is_a_newcomers_page():
    """At most 12,000 characters: the depth lives in docs/."""
    assert len(read("README.md")) <= 12000, len(read("README.md"))


def flat(text):
    """The text with its line breaks and runs of spaces made single spaces (docs wrap anywhere)."""
    return " ".join(text.split())


def documented_eval_steps(max_steps, eval_interval, checkpoint_interval):
    """The steps the docs say a run evaluates at: every eval_interval steps from step 0, and the last
    (README's table; 0: none), and every checkpoint, which holds its own val loss (resume.md): every
    checkpoint_interval steps after step 0 (0: none) and the last."""
    if eval_interval == 0:
        return []
    checkpoints = range(checkpoint_interval, max_steps, checkpoint_interval) if checkpoint_interval else []
    return sorted({*range(0, max_steps, eval_interval), *checkpoints, max_steps})


def test_the_trainer_evaluates_when_the_docs_say(tmp_path):
    """A short run evaluates (val lines in log.txt) at the steps documented_eval_steps gives, with an
    interval that reaches neither a checkpoint nor the last step, so that every part of the rule
    shows; and writes its checkpoints there. The planning figures count the default run's evals
    with the same rule (test_planning_figures_have_one_home_and_agree)."""
    from conftest import TINY, random_shards, read_log, run_script
    steps = documented_eval_steps(7, 3, 5)
    assert steps == [0, 3, 5, 6, 7]
    data, log_dir = random_shards(tmp_path / "data", 0, 600, [4000]), tmp_path / "log"
    r = run_script([*TINY, "--vocab_size=512", f"--data_root={data}", f"--log_dir={log_dir}", "--B=2",
                    "--T=16", "--total_batch_size=32", "--max_steps=7", "--eval_interval=3",
                    "--checkpoint_interval=5", "--val_tokens=64", "--sample_interval=0", "--hellaswag=False"])
    assert r.returncode == 0, r.stderr
    assert sorted(read_log(log_dir)["val"]) == steps
    assert sorted(f for f in os.listdir(log_dir) if f.endswith(".pt")) == ["model_00005.pt", "model_00007.pt"]


def test_planning_figures_have_one_home_and_agree():
    """Issue 37.5: the figures a user plans by, each computed or measured at one home and the same
    wherever it is repeated. MFU has one definition, the console's (the GPU's datasheet peak,
    gptkit/hardware.py): benchmarks.md's MFUs are its measured tok/s over the H200's peak, its ratios
    to a timed matmul are the "matmul fraction", and no doc calls one of those MFU. The default
    run's 8-GPU time (benchmarks.md, computed from the H200's tok/s and llm.c's step) is what the
    README, config/gpt2_124M.py and ddp.md repeat; the raw download (data.md), a checkpoint's bytes
    per parameter (fsdp.md, counted here), compile's start (benchmarks.md) and the default run's
    target (recipes.md) likewise."""
    import torch
    import plot
    from gptkit.configurator import parse_config, trainer_defaults
    from gptkit.hardware import GPU_PEAK_FLOPS
    from model import GPT, GPTConfig, flops_per_token
    bench, readme = flat(read("docs", "benchmarks.md")), read("README.md")
    c = parse_config([os.path.join(ROOT, "config", "gpt2_124M.py")], trainer_defaults())
    fpt, peak = flops_per_token(GPTConfig.from_dict(c), c["T"]), GPU_PEAK_FLOPS["H200"]

    def figure(pattern, text=bench):
        return re.search(pattern, text).groups()

    def num(text):
        return float(text.replace(",", ""))

    # MFU: the console's definition; the ratio to a timed matmul by its own name
    tok = num(figure(r"median of steps 10-29 \| \*\*([\d,]+)\*\*")[0])
    achieved, mfu = map(float, figure(r"\| ([\d.]+) TFLOP/s; \*\*MFU ([\d.]+)\*\* \(computed"))
    assert round(tok * fpt / 1e12, 1) == achieved and round(tok * fpt / peak, 3) == mfu == 0.458
    matmul, fraction = map(float, figure(r"8192\^3 matmul timed at ([\d.]+) TFLOP/s\) \| ([\d.]+) \|"))
    assert round(achieved / matmul, 3) == fraction
    bench_tok, bench_mfu = figure(r"\| ([\d,]+), ([\d.]+) \(computed\), [\d.]+, [\d,]+ MiB allocated")
    fsdp_tok, fsdp_mfu = figure(r"\| ([\d,]+) tok/s \(MFU ([\d.]+), computed; matmul fraction")
    for t, m in ((bench_tok, bench_mfu), (fsdp_tok, fsdp_mfu)):
        assert round(num(t) * fpt / peak, 3) == float(m), (t, m)
    mfus = {f"{mfu:.3f}", bench_mfu, fsdp_mfu}
    for path in ["README.md", *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        for value in re.findall(r"MFU:? (0\.\d+)", read(path)):
            assert value in mfus, (path, value, mfus)  # never a matmul fraction called MFU
    assert "the **matmul fraction**" in bench and "[datasheet peak](docs/benchmarks.md#mfu)" in readme

    # the default run on 8 GPUs: computed in benchmarks.md, repeated in the README, the preset, ddp.md
    steps, tokens = c["max_steps"], c["total_batch_size"]
    step_s = tokens / (8 * tok)
    assert (f"take a {tokens:,}-token step in {step_s:.3f} s and the {steps:,} steps in "
            f"**{steps * step_s / 60:.0f} minutes**") in bench
    llmc_ms = int(figure(r"\((\d+) ms per 0\.5M-token step\); at that rate")[0])
    assert f"take **{steps * llmc_ms / 1000 / 60:.1f} minutes**" in bench
    span = f"{step_s:.2f}-{llmc_ms / 1000:.2f} s"
    assert f"**{span} on 8 GPUs**" in bench
    assert f"a 124M step of {span} on 8 GPUs" in flat(read("docs", "ddp.md"))
    # the evals: when the docs say the trainer does them (test_the_trainer_evaluates_when_the_docs_say)
    evals = len(documented_eval_steps(steps, c["eval_interval"], c["checkpoint_interval"]))
    assert f"The {evals} evals, shared by the 8 ranks" in bench and f"its {evals} evals" in bench
    assert f"its {evals} evals (every {c['eval_interval']} steps and at the last)" in bench

    # compile's start: measured on the H200, repeated in precision.md and in the 8-GPU time
    first = figure(r"\| first step, compilation included \| ([\d.]+) s and ([\d.]+) s")
    precision = flat(read("docs", "precision.md"))
    assert "{} s and {} s on an H200".format(*first) in precision and "the minute it takes" not in precision
    assert "compilation {}-{} s".format(*first) in bench

    # the plan: the steps, the evals over 8 ranks and the first compile, at each end; about: to 5 minutes
    eval_s = list(map(float, figure(r"\(([\d.]+)-([\d.]+) s each on\s+one GPU")))
    ends = [(steps * step, evals * e / 8, float(f)) for step, e, f in
            zip((step_s, llmc_ms / 1000), eval_s, first)]
    low, high = (sum(end) / 60 for end in ends)
    plan = 5 * round(high / 5)
    assert f"Plan on about {plan} minutes for the default run on 8 H100s or H200s** (computed: " \
           f"{low:.0f}-{high:.0f} minutes)" in bench
    assert f"19,073 steps, ~{plan} min (computed)" in readme and f"its ~{plan} min on 8 GPUs are" in readme
    assert f"# About {plan} minutes on 8 H100s or H200s (computed" in read("config", "gpt2_124M.py")

    # the raw FineWeb-Edu download: data.md's computed figure, in the README too
    data = flat(read("docs", "data.md"))
    files, size = figure(r"computed: (\d+) parquet files of about ([\d.]+) GB each", data)
    download = f"{int(files) * float(size):.0f} GB"
    assert f"the download is **about {download}**" in data and f"from a {download} download" in readme
    assert "`$HF_HOME/hub`" in data and "`HF_DATASETS_CACHE`" in data and "`--streaming`" in data

    # a checkpoint holds 12 bytes a parameter (float32 weights, AdamW's two moments), counted here
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    opt = model.configure_optimizers(0.1, 1e-3, "cpu")
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))[1].backward()
    opt.step()
    tensors = [*model.state_dict().values()] + [t for s in opt.state_dict()["state"].values()
                                                 for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    tied = model.transformer.wte.weight  # state_dict names the tied weight twice: one storage
    held = sum(t.numel() * t.element_size() for t in tensors) - tied.numel() * tied.element_size()
    assert held / sum(p.numel() for p in model.parameters()) == 12
    xl = num(figure(r"\| `gpt2_1558M.py` \| ([\d.]+)M \|", read("docs", "fsdp.md"))[0]) * 1e6
    fsdp = flat(read("docs", "fsdp.md"))
    assert "(12 bytes per parameter:" in fsdp and f"{xl * 12 / 1e9:.0f} GB at 1.5B, about 84 GB at 7B" in fsdp
    assert "(1.5 GB each: 12 bytes a parameter" in bench

    # the default run's target: recipes.md, with its sources; the README and the preset repeat it
    target, loss = flat(read("docs", "recipes.md")), plot.REFERENCE["loss"][0][0]
    assert f"**val loss below {loss}**" in target and "**HellaSwag acc_norm about 0.30**" in target
    assert "29.9%" in target and "llm.c" in target
    assert f"should end below {loss} val loss" in readme and "near 0.30 HellaSwag" in readme
    assert f"target: val loss below {loss}, HellaSwag near 0.30" in read("config", "gpt2_124M.py")
