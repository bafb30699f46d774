import glob
import math
import os

import pytest

import train_gpt2
from conftest import ROOT, run_script
from schedule import get_lr
from train_gpt2 import UserError, parse_config

DEFAULTS = dict(train_gpt2.DEFAULTS)


def test_defaults_are_build_nanogpts_run():
    d = DEFAULTS
    assert (d["n_layer"], d["n_head"], d["n_embd"], d["block_size"], d["vocab_size"]) == (12, 12, 768, 1024, 50304)
    assert (d["total_batch_size"], d["B"], d["T"], d["max_steps"], d["warmup_steps"]) == (524288, "auto", 1024, 19073, 715)
    # B="auto" on build-nanogpt's 8 x 80 GB GPUs, compiled, in bf16: its B=64, one micro-step
    import memory
    from model import GPTConfig
    assert memory.micro_batch(dict(d, dtype="bfloat16", compile=True), GPTConfig.from_dict(d), "cuda", 8, free=80e9)[0] == 64
    assert (d["max_lr"], d["min_lr"], d["weight_decay"], d["grad_clip"], d["seed"]) == (6e-4, 6e-5, 0.1, 1.0, 1337)
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
    assert DEFAULTS["n_layer"] == 12  # the defaults are not touched


@pytest.mark.parametrize("argv,message", [
    (["--max_step=5"], r"unknown config key 'max_step' in --max_step=5; closest valid names: max_steps"),
    (["--n_layer=2.5"], r"config key 'n_layer' in --n_layer=2.5 must be int like its default 12, got float 2.5"),
    (["--compile=1"], r"config key 'compile' must be True, False or 'auto', got '1'"),
    (["--dtype=True"], r"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got True"),
    (["--n_layer"], r"expected --key=value, got '--n_layer'"),
    (["config/missing.py"], r"config file 'config/missing.py' not found"),
    (["--B=0"], r"config key 'B' must be positive, got 0"),
    (["--T=-4"], r"config key 'T' must be positive, got -4"),
    (["--collective_timeout=0"], r"config key 'collective_timeout' must be positive, got 0"),
    (["--max_steps=-1"], r"config key 'max_steps' must be >= 0, got -1"),
    (["--n_head=5"], r"n_embd=768 must be a multiple of n_head=5"),
    (["--dtype=float8"], r"config key 'dtype' must be 'auto', 'bfloat16', 'float16' or 'float32', got 'float8'"),
    (["--device=gpu"], r"config key 'device' must be auto, cpu, cuda, cuda:N or mps, got 'gpu'"),
    (["--resume=yes"], r"config key 'resume' must be 'auto' or 'never', got 'yes'"),
    (["--keep_checkpoints=-1"], r"keep_checkpoints must be >= 0 and max_bad_steps >= 1, got -1 and 5"),
    (["--max_bad_steps=0"], r"keep_checkpoints must be >= 0 and max_bad_steps >= 1, got 3 and 0"),
])
def test_bad_overrides(argv, message):
    with pytest.raises(UserError, match=message):
        parse_config(argv, DEFAULTS)


def test_config_file_sees_the_constants(tmp_path):
    cfg_file = tmp_path / "derived.py"
    cfg_file.write_text("warmup_steps = 100\nmax_steps = 10 * warmup_steps\nT = T // 2\n")
    c = parse_config([str(cfg_file)], DEFAULTS)
    assert (c["warmup_steps"], c["max_steps"], c["T"]) == (100, 1000, 512)


def test_broken_config_file(tmp_path):
    cfg_file = tmp_path / "broken.py"
    cfg_file.write_text("n_layer = = 3\n")
    with pytest.raises(UserError, match=r"config file '.*broken.py' failed: SyntaxError"):
        parse_config([str(cfg_file)], DEFAULTS)


def test_bad_key_in_config_file(tmp_path):
    cfg_file = tmp_path / "bad.py"
    cfg_file.write_text("learning_rate = 1e-3\n")
    with pytest.raises(UserError, match=r"unknown config key 'learning_rate' in .*bad.py; closest valid names: max_lr, "):
        parse_config([str(cfg_file)], DEFAULTS)


def test_cli_errors_exit_nonzero_with_one_line():
    r = run_script(["--max_stesp=10"])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_stesp" in lines[0] and "max_steps" in lines[0], r.stderr
    r = run_script(["--device=cpu", "--data_root=/nonexistent/shards"])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: data folder '/nonexistent/shards' not found: run `python fineweb.py` to make the token shards, "
        "or point data_root at them")


def test_total_batch_size_must_divide():
    r = run_script(["--device=cpu", "--B=4", "--T=64", "--total_batch_size=1000"])
    assert r.returncode == 1
    assert "total_batch_size=1000 is not a multiple of B*T*world_size = 4*64*1 = 256; try 768 or 1024" in r.stderr
    r = run_script(["--device=cpu", "--B=4", "--T=64", "--total_batch_size=100"])
    assert "total_batch_size=100 is not a multiple of B*T*world_size = 4*64*1 = 256; try 256, or change B" in r.stderr


def test_16_gpus_are_told_which_B_to_use():
    """Issue 21.17: 2 nodes x 8 GPUs at a fixed B=64 (64 x 1024 x 16 > 2**19) stop with a line that
    names the B that works; B="auto" (issue 29) takes it by itself: the README's two-node command
    sets no B."""
    from configurator import accumulation_steps
    assert accumulation_steps(524288, 64, 1024, 8) == 1 and accumulation_steps(524288, 8, 1024, 8) == 8
    with pytest.raises(UserError) as e:
        accumulation_steps(524288, 64, 1024, 16)
    assert "with 16 process(es) use B=32 (or lower: 16, 8, ...)" in str(e.value), e.value
    readme = open(os.path.join(ROOT, "README.md")).read()
    two_nodes = readme[readme.index("torchrun --nnodes=2"):].split("\n\n")[0]
    assert "--nproc_per_node=8" in two_nodes and "--B=" not in two_nodes and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in readme
    import memory
    from model import GPTConfig
    c = dict(DEFAULTS, dtype="bfloat16", compile=True)  # 124M
    auto = lambda world: memory.micro_batch(c, GPTConfig.from_dict(c), "cuda", world, free=80e9)[0]
    assert (auto(8), auto(16), auto(32)) == (64, 32, 16)
    assert accumulation_steps(524288, 32, 1024, 16) == 1 and accumulation_steps(1048576, 8, 1024, 16) == 8


def test_lr_schedule():
    kw = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=110)
    assert get_lr(0, **kw) == pytest.approx(6e-5)  # (0 + 1) / 10 of max_lr
    assert get_lr(9, **kw) == pytest.approx(6e-4)
    assert get_lr(10, **kw) == pytest.approx(6e-4)
    assert get_lr(60, **kw) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert get_lr(109, **kw) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi * 0.99)) * 5.4e-4)
    assert get_lr(110, **kw) == get_lr(500, **kw) == 6e-5


PRESETS = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))


def test_presets_exist():
    assert [os.path.basename(p) for p in PRESETS] == [
        "demo_cpu.py", "gpt2_124M.py", "gpt2_1558M.py", "gpt2_350M.py", "gpt2_774M.py"]


@pytest.mark.parametrize("path", PRESETS)
def test_presets_parse_and_divide(path):
    c = parse_config([path], DEFAULTS)
    assert c["n_embd"] % c["n_head"] == 0 and c["T"] <= c["block_size"]
    if "gpt2_" in path:  # the GPU presets: one node of 8 GPUs, 10B tokens; B="auto" takes what the comment says
        import memory
        from model import GPTConfig
        B = memory.micro_batch(dict(c, dtype="bfloat16", compile=True), GPTConfig.from_dict(c), "cuda", 8, free=80e9)[0]
        assert f'# B = "auto" (the default): {B} per GPU on 80 GB' in open(path).read(), (path, B)
        assert c["total_batch_size"] % (B * c["T"] * 8) == 0
        assert abs(c["max_steps"] * c["total_batch_size"] - 10e9) < 0.01e9
        assert c["dtype"] == "auto" and c["compile"] == "auto"  # bf16 (fp16 before Ampere) and compile on GPUs
    else:
        assert c["total_batch_size"] % c["T"] == 0


def test_124M_preset_is_the_defaults():
    c = parse_config([os.path.join(ROOT, "config", "gpt2_124M.py")], DEFAULTS)
    assert {k: v for k, v in c.items() if k != "log_dir"} == {k: v for k, v in DEFAULTS.items() if k != "log_dir"}
