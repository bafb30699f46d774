"""How the suite runs a command: `run` and `Popen`, drop-in for subprocess's.

torchrun, and every command when TESTS_SUBPROCESS=1 is set (CI runs the quick tier so too), is a plain
subprocess: every rank is a fresh interpreter. A lone `python script args` or `python -c code` starts
from multiprocessing's forkserver instead, for speed: a fresh single-threaded interpreter that imported
PRELOAD once and forks a child per command. The child takes the command's argv, folder, environment
and output, seeds `random` and numpy's global generator afresh, runs the command, and ends as python
ends: its exit status, its non-daemon threads joined, then its atexit functions. It shares with its
siblings the hash seed and PRELOAD's modules (a change to a variable read at import: a subprocess)."""
import atexit
import io
import multiprocessing
import multiprocessing.forkserver
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time

PLAIN = os.environ.get("TESTS_SUBPROCESS") == "1"
PRELOAD = ["torch", "torch._dynamo", "numpy", "tiktoken"]
# A command that changes a variable of these prefixes runs as a subprocess: torch, numpy or python read
# them at import (the server's stay), or they make it a rank, whose interpreter is a fresh one
IMPORT_ENV = ("TORCH", "PYTORCH", "ATEN_", "OMP_", "GOMP_", "MKL", "KMP_", "OPENBLAS", "ONEDNN", "DNNL",
              "CUDA", "NCCL", "NPY_", "PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "TMPDIR",
              "COVERAGE_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# ...but these, read when a run reads them (inductor sets its cache's in os.environ at its first compile)
RUNTIME_ENV = {"PYTHONUNBUFFERED", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR"}
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT
SERVER_ENV = {}  # the environment the forkserver started with, once it has


def run(cmd, capture_output=False, timeout=None, **kw):
    """subprocess.run(cmd, ...): a CompletedProcess, or TimeoutExpired once the command and every
    process it started are gone (kill_job: torchrun's workers too)."""
    if capture_output:
        kw.update(stdout=PIPE, stderr=PIPE)
    return finish(Popen(cmd, **kw), timeout)


def Popen(cmd, **kw):
    """subprocess.Popen(cmd, **kw), from the forkserver where the command allows it."""
    return Command(cmd, forkable(cmd, kw), **kw)


def finish(p, timeout=None):
    """The started command p run to its end: a CompletedProcess, or TimeoutExpired once it and every
    process it started are gone."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(p)
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def kill_job(p, timeout=60):
    """kill -9 of p and all it started (torchrun's workers, each in a session of its own): once none runs."""
    tree, todo = [], [p.pid] if p.poll() is None else []  # a pid reaped may be another's now
    while todo:  # the whole tree first: a killed process's children are someone else's at once
        tree.append(todo.pop())
        todo += children(tree[-1])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    t0 = time.time()
    while any(_stat(pid)[:1] not in ([], ["Z"]) for pid in tree[1:]):  # gone, or a zombie: files closed
        assert time.time() - t0 < timeout, f"processes {tree} still run {timeout} s after kill -9"
        time.sleep(0.01)


def children(pid):
    """The pids of pid's children (torchrun's: its workers)."""
    return [int(c) for c in os.listdir("/proc") if c.isdigit() and _stat(c)[1:2] == [str(pid)]]


def _stat(pid):
    """/proc/pid/stat's fields after the command's name: state, ppid, ...; [] once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def forkable(cmd, kw):
    """Whether cmd can start from the forkserver: `python script|-c code ...`, with no more of
    subprocess's options than a fork takes, in an environment that changes nothing read at import."""
    kinds = {"cwd", "env", "stdout", "stderr", "text", "start_new_session"}
    if PLAIN or len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-") and cmd[1] != "-c":
        return False
    if not set(kw) <= kinds or {kw.get("stdout"), kw.get("stderr")} - {None, PIPE, STDOUT}:
        return False
    server, env = server_env(), os.environ if kw.get("env") is None else kw["env"]
    changed = {k for k in set(env) | set(server) if env.get(k) != server.get(k)}
    return not any(k.startswith(IMPORT_ENV) for k in changed - RUNTIME_ENV)


def server_env():
    """The forkserver's environment, started now if it is not yet: this process's, with one thread (no
    thread of OpenMP's pool may run at a fork). At exit, commands left running are killed first."""
    if not SERVER_ENV:
        multiprocessing.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ["OMP_NUM_THREADS"] = "1"
        SERVER_ENV.update(os.environ)
        multiprocessing.forkserver.ensure_running()
        os.environ.clear()
        os.environ.update(saved)
        atexit.register(lambda: [os.kill(p.pid, signal.SIGKILL) for p in multiprocessing.active_children()])
    return SERVER_ENV


class Command:
    """What the tests use of subprocess.Popen (args, pid, returncode, stdout, stderr, poll, wait,
    communicate, send_signal, kill), over a subprocess or a command the server forked. Output asked
    for with PIPE goes to a file: no pipe fills up and blocks a command that nobody reads meanwhile."""

    def __init__(self, cmd, forked, stdout=None, stderr=None, text=False, **kw):
        self.args, self.returncode, self.forked = cmd, None, forked
        made = {fd: tempfile.mkstemp() for fd, to in ((1, stdout), (2, stderr)) if to == PIPE}  # (fd, path)
        if forked:
            ready, told = multiprocessing.get_context("forkserver").Pipe(duplex=False)
            self._p = multiprocessing.get_context("forkserver").Process(target=_child, args=(
                cmd, os.path.abspath(kw.get("cwd") or os.getcwd()), dict(kw.get("env") or os.environ),
                {fd: path for fd, (_, path) in made.items()},
                stderr == STDOUT, kw.get("start_new_session"), told))
            self._p.start()
            told.close()
            ready.poll(None)  # the child has its session and its output (or it ended)
        else:
            out, err = (made[fd][0] if fd in made else to for fd, to in ((1, stdout), (2, stderr)))
            self._p = subprocess.Popen(cmd, stdout=out, stderr=err, **kw)
        self.pid = self._p.pid
        self.stdout, self.stderr = (open(made[fd][1], "r" if text else "rb") if fd in made else None
                                    for fd in (1, 2))
        for fd, path in made.values():
            os.close(fd)
            os.unlink(path)

    def poll(self):
        self.returncode = self._p.exitcode if self.forked else self._p.poll()
        return self.returncode

    def wait(self, timeout=None):
        self._p.join(timeout) if self.forked else self._p.wait(timeout)  # the latter raises TimeoutExpired
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) as subprocess gives them: all that PIPE collected, else None."""
        self.wait(timeout)
        return tuple(f.read() if f else None for f in (self.stdout, self.stderr))

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _child(cmd, cwd, env, paths, merged, new_session, ready):
    """In the forked child: become `python cmd[1:]`, run it and end as python ends (never returns)."""
    status, interrupted = 1, False
    try:
        if new_session:
            os.setsid()
        for fd, path in paths.items():
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
        if merged:
            os.dup2(1, 2)
        raw = bool(env.get("PYTHONUNBUFFERED"))  # as python buffers: stdout by block, stderr by line
        sys.stdout = sys.__stdout__ = _stream(1, raw, line_buffering=os.isatty(1))
        sys.stderr = sys.__stderr__ = _stream(2, raw, line_buffering=True, errors="backslashreplace")
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        random.seed()  # fresh, as a new interpreter's
        sys.modules["numpy"].random.seed()
        code = cmd[2] if cmd[1] == "-c" else None
        sys.argv = ["-c", *cmd[3:]] if code is not None else cmd[1:]
        base = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]  # stdlib, site-packages
        sys.path[:] = ["" if code is not None else os.path.dirname(os.path.abspath(cmd[1])),
                       *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)), *base]
        ready.send(True)
        ready.close()
        if code is None:
            runpy.run_path(os.path.abspath(cmd[1]), run_name="__main__")  # python's __file__: absolute
        else:
            main = sys.modules["__main__"] = type(sys)("__main__")
            exec(compile(code, "<string>", "exec"), main.__dict__)
        status = 0
    except SystemExit as e:
        status = e.code & 0xFF if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # the traceback from the command's own first frame, as python prints it
        tb = e.__traceback__
        while tb and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        interrupted = isinstance(e, KeyboardInterrupt)
    threading._shutdown()  # as python ends: its non-daemon threads joined, then atexit's functions
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        if f is not None and not f.closed:
            f.flush()
    if interrupted:  # python's end after an unhandled Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _stream(fd, raw, **kw):
    """sys.stdout or sys.stderr over fd as python makes it: buffered, or written through (raw)."""
    binary = open(fd, "wb", buffering=0 if raw else -1, closefd=False)
    return io.TextIOWrapper(binary, write_through=raw, **kw)
