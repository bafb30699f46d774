"""scripts/slurm_train.sh cannot meet SLURM here: bash -n checks its syntax, and fake srun and
scontrol commands on PATH run its logic (the launch line, and requeue after a preemption only)."""
import os
import re
import subprocess

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "slurm_train.sh")


def test_syntax():
    r = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("previous, printed, code, requeued, exit_code", [
    ("", "step 10 | loss 3.2\n", 0, False, 0),  # a run that ends
    ("SIGTERM: stopped at step 5; wrote log/model_00005.pt\n",  # an earlier attempt's line
     "step 10 | loss 3.2\n", 0, False, 0),
    ("", "SIGTERM: stopped at step 12; wrote log/model_00012.pt\n", 1, True, 0),  # preempted, via torchrun
    ("", "", 75, True, 0),  # the trainer's own exit code
    ("", "error: bad config\n", 1, False, 1),  # a failure is not requeued
])
def test_requeue_only_after_a_preemption(tmp_path, previous, printed, code, requeued, exit_code):
    out = tmp_path / "gpt2-77.out"
    out.write_text(previous)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(f'#!/bin/bash\necho "$@" > "{tmp_path}/srun_args"\n'
                               f'env > "{tmp_path}/srun_env"\n'
                               f'printf %s "$FAKE_PRINT" >> "{out}"\nexit $FAKE_CODE\n')
    (fake / "scontrol").write_text(f'#!/bin/bash\nif [ "$1" = show ]; then printf "node-a\\nnode-b\\n"; '
                                   f'else echo "$@" >> "{tmp_path}/scontrol"; fi\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    slurm = dict(SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_NAME="gpt2", SLURM_JOB_ID="77",
                 SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="8",
                 SLURM_CPUS_PER_TASK="64")
    fakes = dict(PATH=f"{fake}:{os.environ['PATH']}", FAKE_PRINT=printed, FAKE_CODE=str(code))
    env = dict(os.environ, **slurm, **fakes)
    r = subprocess.run(["bash", SCRIPT, "config/gpt2_350M.py", "--parallel=fsdp"], cwd=tmp_path, env=env,
                       capture_output=True, text=True)
    assert r.returncode == exit_code, r.stdout + r.stderr
    launch = (tmp_path / "srun_args").read_text().split()
    assert launch[:4] == ["--kill-on-bad-exit=0", "--cpus-per-task=64", "python", "-m"]
    assert "--rdzv_backend=c10d" in launch
    # issue 21.3 and 21.16: torchrun gives the workers most of SIGTERM's 300 s lead (not its default 30 s)
    # to write the checkpoint, and their output is not held in a buffer when they exit
    lines = (tmp_path / "srun_env").read_text().splitlines()
    env_seen = dict(line.split("=", 1) for line in lines if "=" in line)
    lead = int(re.search(r"--signal=TERM@(\d+)", open(SCRIPT).read()).group(1))
    assert 200 <= int(env_seen["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < lead
    assert env_seen["PYTHONUNBUFFERED"] == "1"
    assert {"--nnodes=2", "--nproc_per_node=8", "--rdzv_endpoint=node-a:29500", "--rdzv_id=77"} <= set(launch)
    assert launch[-3:] == ["train_gpt2.py", "config/gpt2_350M.py", "--parallel=fsdp"]
    assert (tmp_path / "scontrol").exists() == requeued
    if requeued:
        assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
