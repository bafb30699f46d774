"""tests/commands.py, which starts the suite's commands, against python itself: the same output, exit
code and end for the same command, fresh random state in every command, and torchrun's ranks as
fresh interpreters."""
import os
import signal
import subprocess
import sys
import time

import pytest

import commands
from conftest import ROOT, one_thread

pytestmark = pytest.mark.quick  # every test here: the edit loop's tier

CASES = {
    "output and exit code": ["-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); "
                                   "print('out again'); sys.exit(3)", "a", "--b=1"],
    "a traceback": ["-c", "def f():\n    raise ValueError('boom')\nf()"],
    "a warning": ["-c", "import warnings; warnings.warn('careful'); print('after')"],
    "Ctrl-C": ["-c", "raise KeyboardInterrupt"],
    "an error in a thread": ["-c", "import threading\ndef f(): raise ValueError('boom')\n"
                                   "t = threading.Thread(target=f, name='worker')\n"
                                   "t.start(); t.join(); print('after')"],
    # python's order at its end: the main code, its non-daemon threads run to their end, then atexit
    "a thread outlives the main code": ["-c", "import atexit, threading, time\n"
                                              "atexit.register(print, 'atexit')\n"
                                              "later = lambda: (time.sleep(0.5), print('thread'))\n"
                                              "threading.Thread(target=later).start()\nprint('main')"],
    "the trainer's bad key": ["train_gpt2.py", "--n_layr=2"],
    "the trainer's bad device": ["train_gpt2.py", "--device=tpu"],
}
CASES.update({f"sys.exit({n})": ["-c", f"import sys; sys.exit({n})"]
              for n in ["0", "3", "256", "-1", "True", "None", "'a message'"]})
CASES["SIGTERM"] = ["-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
if commands.PLAIN:  # TESTS_SUBPROCESS=1: nothing is forked, and nothing here to compare
    pytest.skip("every command is a subprocess", allow_module_level=True)


@pytest.mark.parametrize("name", CASES)
def test_a_forked_command_runs_as_python_does(name):
    cmd = [sys.executable, *CASES[name]]
    for merged in (False, True):
        kw = dict(cwd=ROOT, env=one_thread(), stdout=subprocess.PIPE, text=True,
                  stderr=subprocess.STDOUT if merged else subprocess.PIPE)
        p = commands.Popen(cmd, **kw)
        assert p.forked  # the forkserver's, not a subprocess
        got = p.communicate(60), p.returncode
        q = subprocess.Popen(cmd, **kw)
        want = q.communicate(60), q.returncode
        assert got == want
    if name == "Ctrl-C":
        assert got[1] == -signal.SIGINT


def test_a_scripts_traceback_starts_at_its_own_first_frame(tmp_path):
    """...and names the script by its absolute path (python's __file__), though given a relative one."""
    (tmp_path / "boom.py").write_text("print(__file__)\ndef f():\n    raise ValueError('boom')\nf()\n")
    cmd = [sys.executable, "boom.py"]
    got = commands.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=one_thread())
    want = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=one_thread())
    assert got.stdout == want.stdout == f"{tmp_path / 'boom.py'}\n"
    assert (got.returncode, got.stderr) == (want.returncode, want.stderr) and "boom.py" in want.stderr


def test_what_the_forkserver_cannot_have_runs_as_a_subprocess():
    """A variable read at import, another number of threads, a rank's variables, torchrun, an option
    the fork lacks."""
    cmd = [sys.executable, "-c", "print(1)"]
    assert commands.forkable(cmd, dict(env=one_thread(FAULT="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT,
                                                       TORCHINDUCTOR_CACHE_DIR="/tmp/x")))
    for env in (one_thread(TORCH_LOGS="+dynamo"), one_thread(RANK="1")):
        assert not commands.forkable(cmd, dict(env=env))
    assert not commands.forkable(cmd, dict(env=dict(one_thread(), OMP_NUM_THREADS="2")))
    assert not commands.forkable(cmd, dict(env=one_thread(), preexec_fn=print))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "x.py"]
    assert not commands.forkable(torchrun, dict(env=one_thread()))
    threads = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    r = commands.run(threads, capture_output=True, text=True, env=dict(one_thread(), OMP_NUM_THREADS="2"))
    assert r.stdout == "2\n"


DRAWS = "import random, numpy as np, sys; print(random.random(), np.random.rand(), 'torch' in sys.modules)"
# one write of the whole line: the two ranks share a pipe
RANK = ("import random, numpy as np, sys\n"
        "said = [random.random(), np.random.rand(), 'torch' in sys.modules, hash('abc')]\n"
        "sys.stdout.write(' '.join(map(str, said)) + '\\n')\n")


def test_every_command_draws_fresh_random_numbers(tmp_path):
    """Two forked commands draw different numbers from random and numpy's global generator, as two
    interpreters do (a fork alone would repeat the server's). torchrun's two ranks are fresh
    interpreters: nothing imported before their script, and their hash seeds differ."""
    draws = [commands.run([sys.executable, "-c", DRAWS], capture_output=True, text=True, env=one_thread())
             for _ in range(2)]
    assert draws[0].stdout.split()[:2] != draws[1].stdout.split()[:2], draws
    (tmp_path / "rank.py").write_text(RANK)
    r = commands.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "rank.py"], cwd=tmp_path, capture_output=True, text=True, env=one_thread(), timeout=120)
    ranks = [line.split() for line in r.stdout.splitlines()]
    assert len(ranks) == 2 and ranks[0][2] == ranks[1][2] == "False", r
    assert ranks[0][:2] != ranks[1][:2] and ranks[0][3] != ranks[1][3], ranks


@pytest.mark.parametrize("threads", ["1", "2"], ids=["forked", "subprocess"])
def test_a_timeout_kills_the_whole_job(tmp_path, threads):
    """The command starts 2 processes in sessions of their own, as torchrun starts its workers: a
    timeout kills them too, not the command alone (torchrun's workers ran on, one holding run.lock)."""
    code = ("import subprocess, sys, time\n"
            "sleep = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
            "pids = [subprocess.Popen(sleep, start_new_session=True).pid for _ in range(2)]\n"
            "open(sys.argv[1], 'w').write(' '.join(map(str, pids)))\n"
            "time.sleep(600)")
    out = tmp_path / "pids"
    env = dict(one_thread(), OMP_NUM_THREADS=threads)  # 2 threads: a subprocess
    p = commands.Popen([sys.executable, "-c", code, str(out)], env=env)
    t0 = time.time()
    while not (out.exists() and len(out.read_text().split()) == 2):  # both started: now the timeout
        assert time.time() - t0 < 60 and p.poll() is None
        time.sleep(0.01)
    with pytest.raises(subprocess.TimeoutExpired):
        commands.finish(p, timeout=0.1)
    pids = [int(pid) for pid in out.read_text().split()]
    states = [commands._stat(pid)[:1] for pid in pids]
    for pid in pids:  # left running, they would outlive the test
        if commands._stat(pid)[:1] not in ([], ["Z"]):
            os.kill(pid, signal.SIGKILL)
    assert all(s in ([], ["Z"]) for s in states), states  # gone, or a zombie: its files closed


def test_a_signal_reaches_a_command_in_its_own_session():
    """start_new_session: the command leads a process group of its own, at once (os.killpg)."""
    p = commands.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=one_thread(),
                       start_new_session=True)
    assert p.forked and os.getpgid(p.pid) == p.pid
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(60) == -signal.SIGTERM
