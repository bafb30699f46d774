"""tests/forked.py, which starts most of the suite's commands, against subprocess: the same
output, exit code and errors for the same command."""
import signal
import subprocess
import sys

import pytest

import forked
from conftest import ROOT, one_thread

CASES = {
    "output and exit code": ["-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); "
                                   "print('out again'); sys.exit(3)", "a", "--b=1"],
    "sys.exit with a message": ["-c", "import sys; sys.exit('error: no such thing')"],
    "a traceback": ["-c", "def f():\n    raise ValueError('boom')\nf()"],
    "a warning": ["-c", "import warnings; warnings.warn('careful'); print('after')"],
    "Ctrl-C": ["-c", "raise KeyboardInterrupt"],
    "the trainer's bad key": ["train_gpt2.py", "--n_layr=2"],
    "the trainer's bad device": ["train_gpt2.py", "--device=tpu"],
}


@pytest.mark.parametrize("name", CASES)
def test_a_fork_runs_a_command_as_python_does(name):
    cmd = [sys.executable, *CASES[name]]
    for merged in (False, True):
        kw = dict(cwd=ROOT, env=one_thread(), stdout=subprocess.PIPE, text=True,
                  stderr=subprocess.STDOUT if merged else subprocess.PIPE)
        p = forked.Popen(cmd, **kw)
        assert isinstance(p, forked.Forked)  # the fork path, not the fallback
        got = p.communicate(60), p.returncode
        q = subprocess.Popen(cmd, **kw)
        want = q.communicate(60), q.returncode
        assert got == want
    if name == "Ctrl-C":
        assert got[1] == -signal.SIGINT


def test_what_a_fork_cannot_have_runs_as_a_subprocess(tmp_path):
    """More than one thread, a variable read at import, a script beside modules of its own."""
    cmd = [sys.executable, "-c", "print(1)"]
    (tmp_path / "script.py").write_text("print(1)")
    assert forked.forkable([sys.executable, str(tmp_path / "script.py")], dict(env=one_thread()))
    (tmp_path / "model.py").write_text("")  # another checkout's: this process holds ours
    assert not forked.forkable([sys.executable, str(tmp_path / "script.py")], dict(env=one_thread()))
    assert forked.forkable(cmd, dict(env=one_thread()))
    assert not forked.forkable(cmd, dict(env=dict(one_thread(), OMP_NUM_THREADS="2")))
    assert not forked.forkable(cmd, dict(env=dict(one_thread(), TORCH_LOGS="recompiles")))
    assert not forked.forkable(cmd, dict(env=one_thread(), preexec_fn=print))
    assert forked.forkable([sys.executable, "-m", "torch.distributed.run"], dict(env=dict(one_thread(), TORCH_LOGS="+dynamo")))
    r = forked.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                   text=True, env=dict(one_thread(), OMP_NUM_THREADS="2"))
    assert r.stdout == "2\n"


def test_a_timeout_kills_the_fork():
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", "import time; time.sleep(60)"], env=one_thread(), timeout=0.5)
