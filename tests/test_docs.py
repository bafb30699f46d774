"""The docs point at the code as `file.py:name`; every such reference must name something that
file defines, so that the guides cannot drift from the code."""
import ast
import glob
import os
import re

import forked
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


def test_resolver_tells_real_names_from_stale_ones():
    trainer = os.path.join(ROOT, "train_gpt2.py")
    assert defines(trainer, "train_step") and defines(trainer, "total_batch_size")
    assert defines(trainer, "DataLoaderLite") and defines(trainer, "DataLoaderLite.next_batch")
    assert not defines(trainer, "no_such_function") and not defines(trainer, "DataLoaderLite.no_such_method")
    assert not defines(trainer, "train_step.x")  # a function has no members here
    assert not defines(os.path.join(ROOT, "no_such_file.py"), "main")
    assert references("see `model.py:GPT.forward` and `a/b.py:c`, not file.py:x") == [("model.py", "GPT.forward"),
                                                                                     ("a/b.py", "c")]


def test_every_code_reference_in_docs_resolves():
    stale = []
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        for file, name in references(open(doc).read()):
            if not defines(os.path.join(ROOT, file), name):
                stale.append(f"{os.path.relpath(doc, ROOT)}: {file}:{name}")
    assert not stale, "references to code that does not exist:\n" + "\n".join(stale)


def test_ddp_guide_points_at_the_code():
    refs = set(references(open(os.path.join(ROOT, "docs", "ddp.md")).read()))
    assert len(refs) >= 15, sorted(refs)


def test_config_files_are_said_to_run_as_code():
    """Issue 21.8: a config file is Python that the trainer executes: the README and configurator.py
    say so, and to use only files you trust."""
    for path in ("README.md", "configurator.py"):
        text = " ".join(open(os.path.join(ROOT, path)).read().split())
        assert "runs as code: use only files you trust" in text, path


def read(*path):
    return open(os.path.join(ROOT, *path)).read()


def bash_block(text, after):
    """The commands of the first ```bash block after the text `after` (continued lines joined)."""
    block = text[text.index(after):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def run_command(line, cwd, *extra):
    """A `python X.py ...` line of the docs, run with this Python and the project's X.py."""
    import shlex
    import sys
    words = shlex.split(line)
    assert words[0] == "python" and words[1].endswith(".py"), line
    r = forked.run([sys.executable, os.path.join(ROOT, words[1]), *words[2:], *extra], cwd=cwd,
                   capture_output=True, text=True, timeout=300, env=one_thread())
    assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
    return r


def test_one_gpt2_hellaswag_baseline_with_its_source():
    """Issue 21.11: one figure for GPT-2 124M's HellaSwag acc_norm (0.2955, build-nanogpt's
    hellaswag.py), the same in plot.py's reference line, the README and docs/hellaswag.md; the other
    figures (0.2945, lm-eval's 0.3114) only where the docs explain where they come from."""
    import plot
    assert plot.REFERENCE["hella"][0][0] == 0.2955
    for path in ("README.md", "docs/hellaswag.md", "hellaswag.py"):
        assert "0.2955" in read(path), path
    for path in ["README.md", *glob.glob(os.path.join(ROOT, "docs", "*.md")), *glob.glob(os.path.join(ROOT, "*.py"))]:
        text = read(path)
        if "0.2945" in text:
            assert os.path.basename(path) in ("hellaswag.md", "plot.py"), path
    hella = read("docs", "hellaswag.md")
    assert "0.3114" in hella and "lm_eval --model hf --model_args pretrained=" in hella


def test_slurm_lead_time_is_one_figure():
    """Issue 21.11: the SLURM signal's lead time is the same everywhere it is written."""
    texts = [read("README.md"), read("scripts", "slurm_train.sh")] + [open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    assert {m for t in texts for m in re.findall(r"TERM@(\d+)", t)} == {"300"}


def test_looking_at_a_run_works_right_after_the_quick_start(tmp_path):
    """Issue 21.11: the README's "Looking at a run" commands use the quick start's own paths
    (log_demo/, its last checkpoint model_00120.pt) and run as written once it has finished. The
    run here is the quick start's config made tiny, on random shards: the same files appear."""
    from conftest import random_shards
    readme = read("README.md")
    commands = bash_block(readme, "## Looking at a run")
    quick = bash_block(readme, "## Quick start")[0]
    assert "config/demo_cpu.py" in quick and all("log/" not in c for c in commands), commands
    data = random_shards(tmp_path / "demo_stdlib", 0, 3000, [20000], vocab=50257)
    run_command(f"python train_gpt2.py {os.path.join(ROOT, 'config', 'demo_cpu.py')}", tmp_path, "--n_layer=1",
                "--n_embd=32", "--n_head=2", "--block_size=32", "--T=32", "--B=2", "--total_batch_size=64",
                "--val_tokens=256", "--sample_length=4", "--device=cpu", "--dtype=float32")
    assert (tmp_path / "log_demo" / "model_00120.pt").exists()
    for command in commands:
        run_command(command, tmp_path)
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "demo_hf" / "model.safetensors").exists() and (tmp_path / "demo_hf" / "tokenizer.json").exists()


def test_own_documents_commands_of_data_md(tmp_path):
    """Issue 21.11: docs/data.md's two commands for one's own documents run as written (the trainer
    stopped after 2 steps here), and without --shard_size a small corpus gets the warning the
    docs quote."""
    import json
    commands = bash_block(read("docs", "data.md"), "## Training on your own documents")
    assert len(commands) == 2 and "--shard_size" in commands[0], commands
    (tmp_path / "my_corpus").mkdir()
    words = "the of a model data train token shard loss step learning rate batch value".split()
    for i in range(2):  # 1.3M tokens: a val shard of 1M tokens and a train shard of the rest
        with open(tmp_path / "my_corpus" / f"part{i}.jsonl", "w") as f:
            for d in range(2150):
                f.write(json.dumps({"text": " ".join(words[(i * 7 + d * 3 + k) % len(words)] for k in range(300))}) + "\n")
    (tmp_path / "config").symlink_to(os.path.join(ROOT, "config"))  # the commands run from the project's folder
    r = run_command(commands[0], tmp_path)
    assert "warning" not in r.stdout + r.stderr
    assert len(glob.glob(str(tmp_path / "my_data" / "*_train_*.npy"))) >= 1
    run_command(commands[1], tmp_path, "--max_steps=2", "--device=cpu", "--dtype=float32", "--val_tokens=1024",
                "--sample_interval=0")
    assert "2 val " in (tmp_path / "log_my_data" / "log.txt").read_text()
    r = run_command(commands[0].replace(" --shard_size 1000000", "").replace("my_data", "my_data_one_shard"), tmp_path)
    assert "warning: only the val shard was written" in r.stdout + r.stderr


def test_fsdp_memory_table_matches_a_count():
    """Issue 21.11: docs/fsdp.md's activations per preset are what autograd saves for one
    micro-batch at the B that "auto" takes on 8 GPUs of 80 GB (bf16 autocast, the CPU's loss,
    counted on fake tensors by memory.activations: no memory used)."""
    from configurator import parse_config
    import memory
    import train_gpt2
    from model import GPTConfig
    table = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in
             re.finditer(r"\| `(gpt2_\w+)\.py` \| (\d+) \| ([\d.]+) GB \|", read("docs", "fsdp.md"))}
    assert len(table) == 4, table
    for preset, (B, gb) in table.items():
        c = parse_config([os.path.join(ROOT, "config", preset + ".py")], train_gpt2.DEFAULTS)
        shape = GPTConfig.from_dict(c)
        assert memory.micro_batch(dict(c, dtype="bfloat16", compile=True), shape, "cuda", 8, free=80e9)[0] == B, preset
        fixed, per_seq = memory.activations(shape, c["T"], "bfloat16", "cpu", compiled=False)  # the CPU's loss
        total = fixed + B * per_seq  # = the count of the whole forward, to 0.5% (test_memory.py)
        assert abs(total / 1e9 - gb) < 0.05, (preset, total / 1e9, gb)


def test_readme_is_a_newcomers_page():
    """At most 12,000 characters: the depth lives in docs/."""
    assert len(read("README.md")) <= 12000, len(read("README.md"))
