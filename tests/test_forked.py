"""tests/forked.py, which starts most of the suite's commands, against subprocess: the same
output, exit code and errors for the same command."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import torch

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
    "torchrun without a script": ["-m", "torch.distributed.run"],
    "an error in a thread": ["-c", "import threading\ndef f(): raise ValueError('boom')\n"
                                   "t = threading.Thread(target=f, name='worker')\n"
                                   "t.start(); t.join(); print('after')"],
}


@pytest.fixture(autouse=True)
def fork_on_any_build(request, monkeypatch):
    """The fork is what these tests test, under a CUDA build of torch too (where the suite runs
    every command as a subprocess: gpu_build). Their commands run no backward, the one thing such a
    build cannot do in a fork; the test of that choice itself keeps it."""
    if request.function is not test_what_a_fork_cannot_have_runs_as_a_subprocess:
        monkeypatch.setattr(forked, "gpu_build", lambda: False)


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


def test_what_a_fork_cannot_have_runs_as_a_subprocess(tmp_path, monkeypatch):
    """More than one thread, a variable read at import, a script beside modules of its own, and any
    command under a GPU build of torch (its autograd threads do not survive a fork)."""
    cmd = [sys.executable, "-c", "print(1)"]
    with monkeypatch.context() as m:
        m.setattr(torch.version, "cuda", "13.0")
        assert forked.gpu_build() and not forked.forkable(cmd, dict(env=one_thread()))
    monkeypatch.setattr(forked, "gpu_build", lambda: False)  # the rest as on a CPU build of torch
    (tmp_path / "script.py").write_text("print(1)")
    assert forked.forkable([sys.executable, str(tmp_path / "script.py")], dict(env=one_thread()))
    (tmp_path / "model.py").write_text("")  # another checkout's: this process holds ours
    assert not forked.forkable([sys.executable, str(tmp_path / "script.py")], dict(env=one_thread()))
    assert forked.forkable(cmd, dict(env=one_thread()))
    assert not forked.forkable(cmd, dict(env=dict(one_thread(), OMP_NUM_THREADS="2")))
    assert not forked.forkable(cmd, dict(env=dict(one_thread(), TORCH_LOGS="recompiles")))
    assert not forked.forkable(cmd, dict(env=one_thread(), preexec_fn=print))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    assert forked.forkable(torchrun, dict(env=dict(one_thread(), TORCH_LOGS="+dynamo")))
    # torchrun's worker, judged in its launcher against the test process's environment (its modules')
    worker, allowed = [sys.executable, "train_gpt2.py"], forked.RUNTIME_ENV | forked.TORCHRUN_ENV
    assert forked.forkable(worker, dict(env=dict(one_thread(), RANK="1")), allowed, one_thread())
    assert not forked.forkable(worker, dict(env=dict(one_thread(), RANK="1", TORCH_LOGS="+dynamo")), allowed,
                               one_thread())
    threads = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    r = forked.run(threads, capture_output=True, text=True, env=dict(one_thread(), OMP_NUM_THREADS="2"))
    assert r.stdout == "2\n"


WORKER = """import os, signal, sys, time
handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)]
name = open('/proc/self/comm').read().strip()
# one write: print writes its arguments and the newline one by one, and unbuffered (python -u) the two
# ranks' pieces could interleave in the pipe they share
said = ['rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], sys.argv[1:], sys.stdout.write_through,
        handlers, name, os.getsid(0) == os.getpid()]
sys.stdout.write(' '.join(map(str, said)) + '\\n')
print('preloaded' if 'torch' in sys.modules else 'fresh', file=sys.stderr)  # a fork starts with torch
if os.environ['RANK'] == '0':
    open('rank0_said', 'w').close()
else:  # rank 1's failure ends the job (torchrun stops rank 0): once rank 0 has said its line
    t0 = time.time()
    while not os.path.exists('rank0_said') and time.time() - t0 < 60:
        time.sleep(0.01)
    sys.exit(3)
"""


def test_torchruns_workers_are_forked_and_run_as_its_own(tmp_path):
    """torchrun's launcher, forked, forks its workers too: each with its rank's environment, its
    arguments, unbuffered output (python -u), python's signal handlers (not the launcher's), python's
    process name, a session of its own, and its exit code (rank 1's 3 fails the job: torchrun exits
    1), as the real launcher's fresh interpreters have them."""
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "worker.py",
           "--a=1"]
    kw = dict(cwd=tmp_path, env=one_thread(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p = forked.Popen(cmd, **kw)
    assert isinstance(p, forked.Forked)
    got = p.communicate(120)
    (tmp_path / "rank0_said").unlink()
    want = subprocess.run(cmd, **kw, timeout=120)
    assert p.returncode == want.returncode == 1, (got, want)
    assert sorted(got[0].splitlines()) == sorted(want.stdout.splitlines()), (got, want)
    assert [line.split()[:6] for line in sorted(want.stdout.splitlines())] == [
        ["rank", str(r), "of", "2", "['--a=1']", "True"] for r in (0, 1)], want.stdout
    assert got[1].count("preloaded") == 2 and want.stderr.count("fresh") == 2, (got[1], want.stderr)


def test_torchruns_workers_come_from_a_copy_of_its_launcher_without_threads(tmp_path):
    """The launcher runs threads when it starts its workers (its store's server, its rendezvous'
    keep-alive), and a fork copies none of them but may copy a lock one of them holds: the workers are
    forked by forked.py's zygote, made before those threads, which runs one thread. Each worker is the
    launcher's child, in a session of its own, as torchrun's own workers are."""
    (tmp_path / "wait.py").write_text("import os, time\nwhile not os.path.exists('go'):\n"
                                      "    time.sleep(0.01)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "wait.py"]
    p = forked.Popen(cmd, cwd=tmp_path, env=one_thread(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    threads = lambda pid: len(os.listdir(f"/proc/{pid}/task"))  # noqa: E731
    try:
        t0 = time.time()
        while len(forked.children(p.pid)) < 2 and time.time() - t0 < 60:
            time.sleep(0.01)
        workers = forked.children(p.pid)
        zygote = [c for c in os.listdir("/proc") if c.isdigit() and forked._stat(c)[1:2] == [str(p.pid)]
                  and forked._comm(c) == forked.Zygote.NAME]
        assert len(workers) == 2 and len(zygote) == 1, (workers, zygote)
        assert threads(p.pid) > 1 and threads(zygote[0]) == 1, (threads(p.pid), threads(zygote[0]))
        assert all(os.getsid(w) == w for w in workers)
    finally:
        (tmp_path / "go").touch()
    assert p.wait(60) == 0, p.communicate()


# How a command ends, and so its exit code: sys.exit(n), the low byte of n as a C long (255: too big
# for one); sys.exit of anything else, 1 after printing it; a signal, -signum. sys.exit(-9) once made
# the fork's child skip os._exit and run on as a second copy of the test process.
ENDINGS = {f"sys.exit({n})": f"import sys; sys.exit({n})"
           for n in ["0", "3", "255", "256", "-1", "-2", "-9", "2 ** 40 + 3", "2 ** 64", "True", "None",
                     "'a message'", "3.5"]}
ENDINGS.update({
    "SIGTERM": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "SIGKILL": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "Ctrl-C, SIGINT blocked": "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
                              "raise KeyboardInterrupt",  # python's 130: it cannot die of the signal
    "stdout closed": "import sys; print('lost'); sys.stdout.close()",
    "stdout's flush fails": "import sys\nclass Full:\n    def write(self, s): return len(s)\n"
                            "    def flush(self): raise OSError(28, 'No space left on device')\n"
                            "sys.stdout = Full()\nprint('lost')",  # python's 120
})


@pytest.mark.parametrize("code", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_fork_ends_with_the_exit_code_python_gives(code):
    """The exit code, stdout and stderr of python itself, and never a second test process."""
    cmd, me = [sys.executable, "-c", code], os.getpid()
    assert forked.forkable(cmd, dict(env=one_thread(), capture_output=True))  # a fork, against python
    try:
        got = forked.run(cmd, capture_output=True, text=True, env=one_thread())
    finally:
        if os.getpid() != me:  # the child escaped os._exit: it ends here, with a code no case expects
            os._exit(99)
    want = subprocess.run(cmd, capture_output=True, text=True, env=one_thread())
    address = re.compile(r" at 0x[0-9a-f]+>")  # an object's, in a report: one process's own
    assert (got.returncode, got.stdout, address.sub(">", got.stderr)) == \
        (want.returncode, want.stdout, address.sub(">", want.stderr))


@pytest.mark.parametrize("threads", ["1", "2"], ids=["forked", "subprocess"])
def test_a_timeout_kills_the_whole_job(tmp_path, threads):
    """The command starts 2 processes in sessions of their own, as torchrun starts its workers: a
    timeout kills them too, not the command alone (torchrun's workers ran on, one holding run.lock),
    forked or not."""
    code = ("import subprocess, sys, time\n"
            "sleep = [sys.executable, '-c', 'import time; time.sleep(600)']\n"
            "pids = [subprocess.Popen(sleep, start_new_session=True).pid for _ in range(2)]\n"
            "open(sys.argv[1], 'w').write(' '.join(map(str, pids)))\n"
            "time.sleep(600)")
    env = dict(one_thread(), OMP_NUM_THREADS=threads)  # 2 threads: not forkable
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", code, str(tmp_path / "pids")], env=env, timeout=2)
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    states = [forked.state(pid) for pid in pids]
    for pid in pids:  # left running, they would outlive the test
        if forked.state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)
    assert len(pids) == 2 and set(states) <= {None, "Z"}, states  # gone, or a zombie: its files closed


def test_a_compile_in_a_fork_never_depends_on_this_process():
    """This process compiles first, with inductor's pool of compile threads (two, as on any machine
    with two CPUs); then a forked command compiles. The pool's threads are not in the fork: without a
    compiler of the fork's own (forked.py), the command's compile waited on them forever. Each kernel
    holds a constant of its own, so that no cache on disk answers for the compiler."""
    import torch._inductor.config as inductor
    from torch._inductor.async_compile import AsyncCompile
    a, b = (float(c) for c in np.random.default_rng().integers(1, 2 ** 24, 2))
    with inductor.patch(compile_threads=2):
        assert torch.compile(lambda x: x * a)(torch.ones(2)).tolist() == [a, a]
    assert AsyncCompile.pool.cache_info().currsize == 1  # the pool of threads that this process made
    code = f"import torch; print(torch.compile(lambda x: x * {b})(torch.ones(2)).tolist())"
    cmd = [sys.executable, "-c", code]
    assert forked.forkable(cmd, dict(env=one_thread()))
    done = forked.run(cmd, cwd=ROOT, env=one_thread(), capture_output=True, text=True, timeout=120)
    assert done.stdout == f"{[b, b]}\n", done.stderr
    torch._dynamo.reset()

