import glob
import math
import os

import pytest
import torch

from conftest import ROOT, TINY, random_shards, run_script
from gptkit.common import UserError
from gptkit.configurator import parse_config, trainer_defaults

DEFAULTS = trainer_defaults()  # the constants atop train_gpt2.py, as written (importing it would run it)


@pytest.mark.quick
def test_defaults_are_build_nanogpts_run():
    d = DEFAULTS
    model = (d["n_layer"], d["n_head"], d["n_embd"], d["block_size"], d["vocab_size"])
    assert model == (12, 12, 768, 1024, 50304)
    batch = (d["total_batch_size"], d["B"], d["T"], d["max_steps"], d["warmup_steps"])
    assert batch == (524288, 64, 1024, 19073, 715)
    # build-nanogpt's B=64, one micro-step on its 8 x 80 GB GPUs, is what B="auto" takes there too
    # (compiled, in bf16)
    from gptkit import memory
    from model import GPTConfig
    gpu = dict(d, B="auto", dtype="bfloat16", compile=True)
    assert memory.micro_batch(gpu, GPTConfig.from_dict(d), "cuda", 8, free=80e9)[0] == 64
    optimizer = (d["max_lr"], d["min_lr"], d["weight_decay"], d["grad_clip"], d["seed"])
    assert optimizer == (6e-4, 6e-5, 0.1, 1.0, 1337)
    assert (d["init_from"], d["device"], d["dtype"], d["eval_interval"]) == ("scratch", "auto", "auto", 250)
    assert d["compile"] == "auto"  # on CUDA only
    # a restarted job resumes by itself; a checkpoint is an eval step
    assert (d["resume"], d["checkpoint_interval"] % d["eval_interval"]) == ("auto", 0)


def test_overrides_parse_as_literals_and_keep_types(tmp_path):
    cfg_file = tmp_path / "small.py"
    cfg_file.write_text("import math\nn_layer = 4\nmax_lr = 1e-3\n_private = 3\n")
    c = parse_config([str(cfg_file), "--n_layer=6", "--max_lr=1", "--compile=False", "--init_from=gpt2",
                      "--data_root=123", "--dtype='float32'"], DEFAULTS)
    assert c["n_layer"] == 6 and c["max_lr"] == 1.0 and isinstance(c["max_lr"], float)
    assert c["compile"] is False and c["init_from"] == "gpt2" and c["data_root"] == "123"
    assert c["dtype"] == "float32"
    assert parse_config([str(cfg_file)], DEFAULTS)["max_lr"] == 1e-3
    # a key whose default is "auto" also takes True/False, from a file as from the command line
    cfg_file.write_text("compile = False\n")
    assert parse_config([str(cfg_file)], DEFAULTS)["compile"] is False
    assert parse_config(["--compile=True", "--dtype=float16"], DEFAULTS)["compile"] is True
    # B, a number by default, also takes "auto" (the most that fit: gptkit/memory.py), both ways
    assert parse_config(["--B=auto"], DEFAULTS)["B"] == "auto"
    cfg_file.write_text('B = "auto"\n')
    assert parse_config([str(cfg_file), "--B=8"], DEFAULTS)["B"] == 8
    assert parse_config([str(cfg_file)], DEFAULTS)["B"] == "auto"
    assert DEFAULTS["n_layer"] == 12 and DEFAULTS["B"] == 64  # the defaults are not touched


def test_B_takes_a_number_when_its_default_is_auto(tmp_path):
    """With B = "auto" as the default atop train_gpt2.py, --B=16 is the int 16, not the text "16" that
    a string constant would take; from a config file as well, and "auto" and a bad value as before."""
    auto = dict(DEFAULTS, B="auto")
    B = parse_config(["--B=16"], auto)["B"]
    assert B == 16 and type(B) is int
    cfg_file = tmp_path / "b.py"
    cfg_file.write_text("B = 8\n")
    assert parse_config([str(cfg_file)], auto)["B"] == 8
    assert parse_config([], auto)["B"] == "auto" and parse_config(["--B=auto"], auto)["B"] == "auto"
    for argv, got in ((["--B=big"], "'big'"), (["--B=True"], "True"), (["--B=1.5"], "1.5")):
        with pytest.raises(UserError, match=f"^config key 'B' must be 'auto' or a number of sequences, "
                                            f"got {got}$"):
            parse_config(argv, auto)


@pytest.mark.quick
@pytest.mark.parametrize("argv,message", [
    (["--max_step=5"], r"unknown config key 'max_step' in --max_step=5; closest valid names: max_steps"),
    (["--n_layer=2.5"],
     r"config key 'n_layer' in --n_layer=2.5 must be int like its default 12, got float 2.5"),
    (["--compile=1"], r"config key 'compile' must be True, False or 'auto', got '1'"),
    (["--dtype=True"], r"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got True"),
    (["--n_layer"], r"expected --key=value, got '--n_layer'"),
    (["config/missing.py"], r"config file 'config/missing.py' not found"),
    (["--B=0"], r"config key 'B' must be positive, got 0"),
    (["--T=-4"], r"config key 'T' must be positive, got -4"),
    (["--collective_timeout=0"], r"config key 'collective_timeout' must be positive, got 0"),
    (["--max_steps=-1"], r"config key 'max_steps' must be >= 0, got -1"),
    (["--n_head=5"], r"n_embd=768 must be a multiple of n_head=5"),
    (["--dtype=float8"],
     r"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got 'float8'"),
    (["--device=gpu"], r"device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    # "auto" takes a bool, but not device's
    (["--device=True"], r"device must be auto, cpu, cuda, cuda:N or mps, got True"),
    (["--resume=yes"], r"config key 'resume' must be 'auto' or 'never', got 'yes'"),
    # issue 35: one check per key, and the line names the key that is wrong
    (["--keep_checkpoints=-1"], r"config key 'keep_checkpoints' must be >= 0, got -1"),
    (["--max_bad_steps=0"], r"config key 'max_bad_steps' must be positive, got 0"),
    (["--decay_frac=2"], r"config key 'decay_frac' must be in \(0, 1\], got 2.0"),
    (["--decay_frac=0"], r"config key 'decay_frac' must be in \(0, 1\], got 0.0"),
    (["--muon_lr=0"], r"config key 'muon_lr' must be positive, got 0.0"),
    (["--muon_momentum=1"], r"config key 'muon_momentum' must be in \[0, 1\), got 1.0"),
    (["--muon_momentum=-0.5"], r"config key 'muon_momentum' must be in \[0, 1\), got -0.5"),
    (["--B=True"], r"config key 'B' must be 'auto' or a number of sequences, got True"),
    (["--B=big"], r"config key 'B' must be 'auto' or a number of sequences, got 'big'"),
    (["--parallel=zero"], r"config key 'parallel' must be 'ddp' or 'fsdp', got 'zero'"),
    (["--optimizer=sgd"], r"config key 'optimizer' must be 'adamw' or 'muon', got 'sgd'"),
    (["--val_tokens=100", "--T=128", "--block_size=128"],
     r"val_tokens=100 is less than one sequence of T=128"),
    (["--optimizer=muon", "--parallel=fsdp"], r"optimizer='muon' orthogonalizes whole weight matrices"),
])
def test_bad_overrides(argv, message):
    with pytest.raises(UserError, match=f"^{message}"):  # the whole line is about that key
        parse_config(argv, DEFAULTS)


@pytest.mark.quick
def test_config_file_sees_the_constants(tmp_path):
    cfg_file = tmp_path / "derived.py"
    cfg_file.write_text("warmup_steps = 100\nmax_steps = 10 * warmup_steps\nT = T // 2\n")
    c = parse_config([str(cfg_file)], DEFAULTS)
    assert (c["warmup_steps"], c["max_steps"], c["T"]) == (100, 1000, 512)


@pytest.mark.quick
def test_broken_config_file(tmp_path):
    cfg_file = tmp_path / "broken.py"
    cfg_file.write_text("n_layer = = 3\n")
    with pytest.raises(UserError, match=r"config file '.*broken.py' failed: SyntaxError"):
        parse_config([str(cfg_file)], DEFAULTS)


@pytest.mark.quick
def test_bad_key_in_config_file(tmp_path):
    cfg_file = tmp_path / "bad.py"
    cfg_file.write_text("learning_rate = 1e-3\n")
    with pytest.raises(UserError, match=r"unknown config key 'learning_rate' in .*bad.py; "
                                        r"closest valid names: max_lr, "):
        parse_config([str(cfg_file)], DEFAULTS)


def test_cli_errors_exit_nonzero_with_one_line():
    r = run_script(["--max_stesp=10"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_stesp" in lines[0] and "max_steps" in lines[0], r.stderr
    r = run_script(["--device=cpu", "--data_root=/nonexistent/shards"])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: data folder '/nonexistent/shards' not found: run `python fineweb.py` to make the token "
        "shards, or point data_root at them")


def test_help_shows_each_constants_comment():
    """Issue 31.3: --help lists every constant once with its default and the comment written beside
    it atop train_gpt2.py (found here by Python's own tokenizer), under its group's heading."""
    import io
    import tokenize
    r = run_script(["--help"])
    assert r.returncode == 0 and not r.stderr, r.stderr
    comments = {}  # constant -> the comment on its line, by tokenize (the help reads the text its own way)
    source = open(os.path.join(ROOT, "train_gpt2.py")).read()
    tokens = list(tokenize.generate_tokens(io.StringIO(source[:source.index("\nDEFAULTS = ")]).readline))
    on_line = {t.start[0]: t.string[1:].strip() for t in tokens if t.type == tokenize.COMMENT}
    for t, after in zip(tokens, tokens[1:]):
        if t.string in DEFAULTS and t.start[1] == 0 and after.string == "=":
            comments[t.string] = on_line.get(t.start[0], "")
    assert set(comments) == set(DEFAULTS), set(comments) ^ set(DEFAULTS)
    assert all(comments.values()), [k for k, c in comments.items() if not c]
    for key, comment in comments.items():
        shown = [line for line in r.stdout.splitlines() if line.strip().startswith(f"--{key}=")]
        assert len(shown) == 1 and shown[0].strip().startswith(f"--{key}={DEFAULTS[key]!r}"), (key, shown)
        assert shown[0].endswith(comment), (key, shown, comment)
    assert "\nsystem:\n" in r.stdout and "\nI/O:\n  --data_root=" in r.stdout


def test_first_answer_imports_only_what_every_run_needs():
    """Issue 31.3: --help and a typo are answered before anything only some runs need is imported
    (FSDP, DTensor, HellaSwag, W&B, HF, the compiler): a fresh interpreter, as a user's."""
    import subprocess
    import sys
    heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "hellaswag", "wandb", "transformers",
             "datasets", "tiktoken", "torch._dynamo", "torch._inductor", "matplotlib")
    for argv in (["--help"], ["--max_step=3"]):
        # the modules imported when the process ends (after the script's own atexit hooks)
        code = ("import atexit, runpy, sys\n"
                f"atexit.register(lambda: print(sorted(m for m in sys.modules if m.startswith({heavy!r}))))\n"
                f"sys.argv = ['train_gpt2.py', *{argv!r}]\n"
                "runpy.run_path('train_gpt2.py', run_name='__main__')\n")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.stdout.strip().splitlines()[-1] == "[]", (argv, r.stdout[-500:], r.stderr[-500:])
        typo = ("error: unknown config key 'max_step' in --max_step=3; closest valid names: max_steps, "
                "max_bad_steps, warmup_steps")
        if argv == ["--help"]:
            assert r.returncode == 0 and not r.stderr, r.stderr
        else:
            assert r.returncode == 1 and r.stderr.strip().splitlines() == [typo], r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_a_device_that_is_not_here_is_one_line(tmp_path, device):
    """Issue 31.5: --device=cuda on a machine without one: one line naming the devices there are,
    and nothing made (no log_dir)."""
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has an Apple GPU")
    r = run_script([f"--device={device}", f"--log_dir={tmp_path / 'log'}"])
    assert r.returncode == 1 and not (tmp_path / "log").exists()
    import re
    here = "cpu, mps" if torch.backends.mps.is_available() else "cpu"
    assert len(r.stderr.strip().splitlines()) == 1 and re.fullmatch(
        rf"error: device={device!r} is not on this machine \((this torch \S+ is built without CUDA|"
        rf"torch sees no CUDA GPU|torch sees no Apple GPU)\); devices here: {here} \(device='auto' picks the "
        rf"best of them\)",
        r.stderr.strip()), r.stderr


def test_gpus_are_checked_as_torchrun_maps_them(monkeypatch):
    """Issue 31.5 on a 2-GPU machine (torch's answers stood in for): cuda is cuda:0, torchrun's rank
    takes cuda:LOCAL_RANK whatever was asked (so device="cuda:1" on a rank that sees one GPU is
    fine), and a GPU that is not there is one line naming the ones that are."""
    from gptkit import hardware
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert hardware.pick_device("cuda") == "cuda:0" and hardware.pick_device("auto") == "cuda:0"
    assert hardware.pick_device("cuda:1", local_rank=0) == "cuda:0"
    assert hardware.pick_device("cuda:1") == "cuda:1"
    assert hardware.pick_device("cpu", local_rank=5) == "cpu"  # CPU processes share the CPU
    with pytest.raises(UserError, match=r"^device='cuda' \(cuda:2 for torchrun's LOCAL_RANK=2\) is not on "
                                        r"this machine \(torch sees 2 CUDA GPUs\); devices here: cpu, "
                                        r"cuda:0, cuda:1"):
        hardware.pick_device("cuda", local_rank=2)  # --nproc_per_node=3 on 2 GPUs
    with pytest.raises(UserError, match=r"^device='cuda:2' is not on this machine "
                                        r"\(torch sees 2 CUDA GPUs\)"):
        hardware.pick_device("cuda:2")
    with pytest.raises(UserError, match=r"^device must be auto, cpu, cuda, cuda:N or mps, got 'gpu'$"):
        hardware.pick_device("gpu")


def test_a_failed_start_leaves_nothing(tmp_path):
    """Issue 31.4: a start that fails, before or after log_dir is locked, leaves no log_dir it made
    and prints no config; a log_dir that was there keeps what it held."""
    from conftest import TINY, random_shards
    data = random_shards(tmp_path / "data", 0, 200, [200])
    log_dir = tmp_path / "runs" / "log_nope"  # and its parent: makedirs makes both
    for args in (["--data_root=nope"],  # found missing before log_dir is made
                 # longer than block_size=32: found once the model is built
                 [f"--data_root={data}", "--T=64"],
                 # no shard holds a step
                 [f"--data_root={data}", "--T=16", "--B=2", "--total_batch_size=256"]):
        r = run_script([*TINY, *args, f"--log_dir={log_dir}"])
        assert r.returncode == 1 and r.stderr.startswith("error: "), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "runs").exists() and "config, where" not in r.stdout, (args, r.stdout)
    log_dir.mkdir(parents=True)
    (log_dir / "notes.txt").write_text("mine")
    r = run_script([*TINY, f"--data_root={data}", "--T=64", f"--log_dir={log_dir}"])
    assert r.returncode == 1 and sorted(os.listdir(log_dir)) == ["notes.txt"]  # run.lock removed (issue 35)


def test_total_batch_size_must_divide():
    r = run_script(["--device=cpu", "--B=4", "--T=64", "--total_batch_size=1000"])
    assert r.returncode == 1
    assert ("total_batch_size=1000 is not a multiple of B*T*world_size = 4*64*1 = 256; try 768 or 1024"
            in r.stderr)
    r = run_script(["--device=cpu", "--B=4", "--T=64", "--total_batch_size=100"])
    assert ("total_batch_size=100 is not a multiple of B*T*world_size = 4*64*1 = 256; try 256, or change B"
            in r.stderr)


@pytest.mark.quick
def test_16_gpus_are_told_which_B_to_use():
    """Issue 21.17: 2 nodes x 8 GPUs at a fixed B=64 (64 x 1024 x 16 > 2**19) stop with a line that
    names the B that works; B="auto" (issue 29) takes it by itself. The README's two-node command
    (the defaults, B=64 unless it sets one) takes a B that divides at 16 processes."""
    from gptkit.configurator import accumulation_steps
    assert accumulation_steps(524288, 64, 1024, 8) == 1 and accumulation_steps(524288, 8, 1024, 8) == 8
    with pytest.raises(UserError) as e:
        accumulation_steps(524288, 64, 1024, 16)
    assert "with 16 process(es) use B=32 (or lower: 16, 8, ...)" in str(e.value), e.value
    readme = open(os.path.join(ROOT, "README.md")).read()
    two_nodes = readme[readme.index("torchrun --nnodes=2"):].split("\n\n")[0]
    words = two_nodes.replace("\\\n", " ").split()
    argv = words[words.index("train_gpt2.py") + 1:]
    argv = [w if w.startswith("--") else os.path.join(ROOT, w) for w in argv]  # config files: the project's
    assert "--nproc_per_node=8" in words, two_nodes
    c = parse_config(argv, DEFAULTS)  # its config: the defaults, and what it sets
    if c["B"] != "auto":  # "auto" takes a B that divides by itself (below)
        accumulation_steps(c["total_batch_size"], c["B"], c["T"], 16)  # else the line above stops it
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in readme
    from gptkit import memory
    from model import GPTConfig
    c = dict(DEFAULTS, B="auto", dtype="bfloat16", compile=True)  # 124M
    auto = lambda world: memory.micro_batch(c, GPTConfig.from_dict(c), "cuda", world, free=80e9)[0]
    assert (auto(8), auto(16), auto(32)) == (64, 32, 16)
    assert accumulation_steps(524288, 32, 1024, 16) == 1 and accumulation_steps(1048576, 8, 1024, 16) == 8


LR_PROBE = """
import os, runpy, sys, torch
step = torch.optim.AdamW.step
def probe(self, *a, **k):  # every update: the lr the trainer set in the optimizer for it
    print(f"probe lr {{self.param_groups[0]['lr']!r}}", flush=True)
    return step(self, *a, **k)
torch.optim.AdamW.step = probe
sys.argv[0] = os.path.join({root!r}, 'train_gpt2.py')
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_lr_schedule(tmp_path):
    """The default schedule, build-nanogpt's: the lr each of a run's updates takes (read in the
    optimizer as it steps), warmup then cosine down to min_lr at max_steps."""
    data = random_shards(tmp_path / "data", 0, 100, [2000], vocab=512)
    (tmp_path / "probe.py").write_text(LR_PROBE.format(root=ROOT))
    r = run_script([*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=32", "--max_lr=6e-4",
                    "--min_lr=6e-5", "--warmup_steps=10", "--max_steps=110", "--eval_interval=0",
                    "--sample_interval=0", "--hellaswag=False", f"--data_root={data}",
                    f"--log_dir={tmp_path / 'log'}"], script=str(tmp_path / "probe.py"), PYTHONPATH=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lr = [float(line.split()[-1]) for line in r.stdout.splitlines() if line.startswith("probe lr ")]
    assert len(lr) == 110  # one update per step, none at max_steps
    assert lr[0] == pytest.approx(6e-5)  # (0 + 1) / 10 of max_lr
    assert lr[9] == pytest.approx(6e-4)
    assert lr[10] == pytest.approx(6e-4)
    assert lr[60] == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert lr[109] == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi * 0.99)) * 5.4e-4)
    cosine = [6e-5 + 0.5 * (1 + math.cos(math.pi * (s - 10) / 100)) * 5.4e-4 for s in range(10, 110)]
    assert lr == pytest.approx([6e-4 * (s + 1) / 10 for s in range(10)] + cosine)  # every step
    assert min(lr[10:]) > 6e-5  # min_lr is where the decay ends, at max_steps


PRESETS = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))


def test_presets_exist():
    assert [os.path.basename(p) for p in PRESETS] == [
        "demo_cpu.py", "gpt2_124M.py", "gpt2_1558M.py", "gpt2_350M.py", "gpt2_774M.py"]


def test_demo_preset_and_readme_say_its_size():
    """Issue 31.8: the demo's parameter count as the preset and the README write it is the model's
    (counted on the meta device), and so is the embedding's share."""
    import torch
    from model import GPT, GPTConfig
    c = parse_config([os.path.join(ROOT, "config", "demo_cpu.py")], DEFAULTS)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict(c))
    n, emb = sum(p.numel() for p in model.parameters()), model.transformer.wte.weight.numel()
    preset = open(os.path.join(ROOT, "config", "demo_cpu.py")).read()
    assert f"# {n / 1e6:.1f}M parameters, {emb / 1e6:.1f}M of them the GPT-2 token embedding" in preset, n
    assert f"a {n / 1e6:.1f}M-parameter GPT" in open(os.path.join(ROOT, "README.md")).read()


@pytest.mark.quick
@pytest.mark.parametrize("path", PRESETS)
def test_presets_parse_and_divide(path):
    c = parse_config([path], DEFAULTS)
    assert c["n_embd"] % c["n_head"] == 0 and c["T"] <= c["block_size"]
    if "gpt2_" in path:  # the GPU presets: one node of 8 GPUs, 10B tokens; B is what "auto" takes there
        import re
        from gptkit import memory
        from model import GPTConfig
        gpu = dict(c, B="auto", dtype="bfloat16", compile=True)
        B = memory.micro_batch(gpu, GPTConfig.from_dict(c), "cuda", 8, free=80e9)[0]
        said = r"^B = (\d+)  # per GPU on 80 GB \(8 GPUs: (\d+) micro-steps? a step\)"
        line = re.search(said, open(path).read(), re.M)
        assert line and c["B"] == int(line[1]) == B, (path, B, line)
        assert c["total_batch_size"] % (B * c["T"] * 8) == 0
        assert c["total_batch_size"] // (B * c["T"] * 8) == int(line[2]), (path, line[2])
        assert abs(c["max_steps"] * c["total_batch_size"] - 10e9) < 0.01e9
        assert c["dtype"] == "auto" and c["compile"] == "auto"  # bf16 (fp16 before Ampere), compiled, on GPUs
    else:
        assert c["total_batch_size"] % c["T"] == 0


@pytest.mark.quick
def test_124M_preset_is_the_defaults():
    c = parse_config([os.path.join(ROOT, "config", "gpt2_124M.py")], DEFAULTS)
    assert dict(c, log_dir=None) == dict(DEFAULTS, log_dir=None)


def test_an_error_every_rank_meets_is_one_line_under_torchrun(tmp_path):
    """Issue 57.2: a typo'd key under torchrun with 2 processes: the error is said once at most, by
    rank 0 (it was said by each rank; torchrun may stop rank 0 before it says it, when rank 1 fails
    first), and torchrun's report gives that line as the root cause (each rank's error file) instead
    of "To enable traceback see"."""
    r = run_script([*TINY, "--max_stepz=3", f"--log_dir={tmp_path / 'log'}"], nproc=2)
    out = r.stdout + r.stderr
    line = ("error: unknown config key 'max_stepz' in --max_stepz=3; closest valid names: max_steps, "
            "max_bad_steps, warmup_steps")
    assert r.returncode == 1 and [s for s in out.splitlines() if s.startswith("error: ")] in ([line], []), out
    root_cause = out[out.index("Root Cause (first observed failure):"):]
    assert f"traceback : {line}" in root_cause and "To enable traceback see" not in out, out
