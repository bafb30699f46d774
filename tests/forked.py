"""`python script.py args`, `python -c code args` and `python -m torch.distributed.run args` for the
tests, started from a fork of the test process: drop-in `run` and `Popen` for subprocess's.

Most of a short run's seconds are Python starting and stopping, not training: importing torch
(~1.5 s), torch._dynamo (torch.optim imports it: ~1 s) and the rest, then tearing them down at
exit (~1 s). Here they are imported once per test process (PRELOAD) and every run is a fork of
it: a process of its own, with the command's argv, working folder, environment, signals, exit
code, and stdout/stderr at file descriptors 1 and 2, as the real command has: an uncaught error goes
to sys.excepthook and the command's atexit functions run, as python does. What differs: the rest of
the interpreter's teardown is skipped (os._exit after flushing), and inductor compiles in the
command's own process (no worker pool: the generated code is the same). Two things cannot be had in a fork,
so a command that needs them runs as a real subprocess (and every command does under a CUDA or ROCm
build of torch: gpu_build): variables read when torch is imported
(a command whose environment changes anything but RUNTIME_ENV), and more than one thread (the
command must set OMP_NUM_THREADS=1: OpenMP's pool of threads is not in the fork, and a parallel
region would wait on it forever). torchrun's launcher, forked, has its workers forked in turn (its
`python -u script` commands, whose environment adds only torchrun's variables, TORCHRUN_ENV), by a
copy of itself made before it starts a thread (Zygote): a process each, the launcher's child, in a
session of its own, with its rank's environment, its signals and its exit code, as torchrun's own,
without each worker's ~3 s of starting and stopping an interpreter. What differs there: a worker
dies with its launcher (as every fork here dies with its parent) where a real one would run on, and
it holds the launcher's open files until it ends. A test about what a fresh interpreter imports
(lazy imports) must use subprocess itself: a fork starts with this process's modules, and their
state.
"""
import ctypes
import importlib
import io
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainer's imports (it runs when imported)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "model", "gptkit.hellaswag_eval",
           "gptkit.checkpoint", "gptkit.configurator", "gptkit.run")
# read when a run reads them, never at import: the same in a fork as in a fresh interpreter (the tests'
# faults' own, and a few of the trainer's)
RUNTIME_ENV = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "WANDB_MODE", "WANDB_SILENT", "FREE_0", "FREE_1",
               "FAULT", "STALL_RANK", "STALL_STEP", "SLOW_STEP", "SLOW_WRITE_S", "WAIT_FOR_ALL_S",
               "SLOW_RANK", "SLOW_FIRST_S", "NUDGE_RANK", "NUDGE_STEP", "HF_CACHE", "DOWNLOADS",
               "HELLASWAG_SOURCE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHINDUCTOR_CACHE_DIR"}
# (the last two: torchrun's rendezvous; inductor's cache, set in os.environ by the first compile or reset)
# what torchrun adds to its workers' environment: read when the worker runs, never at import
TORCHRUN_ENV = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "TORCHELASTIC_USE_AGENT_STORE"}
# what a fork can be asked for of subprocess's keyword arguments
FORKABLE_KW = {"cwd", "env", "stdout", "stderr", "text", "start_new_session", "capture_output", "timeout"}
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT
_imported_with = None  # in a fork: the environment of the test process, whose modules it holds


def gpu_build():
    """Whether the installed torch is a CUDA or ROCm build. Its autograd engine starts threads that a
    fork does not have: once this process has run a backward, a forked command's backward stops with
    "Unable to handle autograd's threading in combination with fork-based multiprocessing" (seen with
    torch 2.12.0+cu130 on a machine without a GPU). Such a build runs every command as a subprocess."""
    import torch
    return bool(torch.version.cuda or torch.version.hip)


def forkable(cmd, kw, allowed=RUNTIME_ENV, imported_with=None):
    """Whether subprocess's cmd and keyword arguments can run as a fork: [sys.executable, then a
    script, -c code or -m torch.distributed.run, ...], in an environment that changes nothing
    read at import, with no more than stdout/stderr (PIPE, STDOUT)/cwd/text/start_new_session/timeout
    asked for."""
    if len(cmd) < 2 or cmd[0] != sys.executable or not set(kw) <= FORKABLE_KW:
        return False
    if cmd[1] == "-u":  # unbuffered stdout and stderr (torchrun starts its workers so): the child's streams
        cmd = [cmd[0], *cmd[2:]]
        if len(cmd) < 2:
            return False
    if gpu_build():  # autograd's device threads: after a backward here, a fork's backward refuses to run
        return False
    if kw.get("stdout") not in (None, PIPE) or kw.get("stderr") not in (None, PIPE, STDOUT):
        return False
    env = kw.get("env") or os.environ
    if cmd[1] == "-m":  # the launcher reads nothing at import; its workers are judged apart (fork_workers)
        return cmd[2:3] == ["torch.distributed.run"]
    folder = os.path.dirname(os.path.abspath(os.path.join(kw.get("cwd") or os.getcwd(), cmd[1])))
    if cmd[1] != "-c" and folder != ROOT and any(os.path.exists(os.path.join(folder, f"{m}.py"))
                                                 for m in [*sys.modules, *PRELOAD]):
        return False  # a script beside modules of its own (another checkout): this process holds ours
    imported_with = os.environ if imported_with is None else imported_with  # this process's modules'
    changed = {k for k in set(env) | set(imported_with) if env.get(k) != imported_with.get(k)}
    if env.get("PYTHONPATH") == ROOT:  # the project's root is on the test process's sys.path already
        changed.discard("PYTHONPATH")
    return (changed <= allowed and (cmd[1] == "-c" or not cmd[1].startswith("-"))
            and env.get("OMP_NUM_THREADS") == "1")


def Popen(cmd, **kw):
    """subprocess.Popen(cmd, **kw), forked when it can be."""
    return Forked(cmd, **kw) if forkable(cmd, kw) else subprocess.Popen(cmd, **kw)


def run(cmd, capture_output=False, timeout=None, **kw):
    """subprocess.run(cmd, ...), forked when it can be: a CompletedProcess, or TimeoutExpired once
    the command and every process it started are gone (kill_job: torchrun's workers too)."""
    if capture_output:
        kw.update(stdout=PIPE, stderr=PIPE)
    return finish(Popen(cmd, **kw), timeout)


def finish(p, timeout=None):
    """The started command p (Popen's) run to its end: a CompletedProcess, or TimeoutExpired once it
    and every process it started are gone (kill_job)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(p)
        for f in (p.stdout, p.stderr):
            if f:
                f.close()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def kill_job(p, timeout=60):
    """kill -9 of the process p and all it started (torchrun: its workers), as a node failure or
    SLURM's scancel does; returns once none of them runs. Killing torchrun's process group is not
    enough: torchrun starts each worker in a session of its own, and the workers ran on (one held
    run.lock when CI ran the same command again). A dying process holds its files until it is gone."""
    tree, todo = [], [p.pid]
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
    while any(state(pid) not in (None, "Z") for pid in tree[1:]):  # gone, or a zombie: its files closed
        assert time.time() - t0 < timeout, f"processes {tree} still run {timeout} s after kill -9"
        time.sleep(0.01)


def children(pid):
    """The pids of pid's children (torchrun's: its workers, not forked.py's Zygote)."""
    return [int(c) for c in os.listdir("/proc") if c.isdigit() and _stat(c)[1:2] == [str(pid)]
            and _comm(c) != Zygote.NAME]


def _comm(pid):
    """The process's name (ps's COMM), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def state(pid):
    """The process's state, as ps shows it ('R', 'S', 'Z' for a zombie, ...), or None once it is gone."""
    return (_stat(pid) or [None])[0]


def _stat(pid):
    """/proc/pid/stat's fields after the command's name: state, ppid, ...; [] once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


class Forked:
    """What the tests use of subprocess.Popen (pid, poll, wait, communicate, send_signal, kill,
    returncode, stdout), over a child forked from this process. Output asked for with PIPE goes
    to a temporary file, read when asked (no pipe to fill up and block the child)."""

    def __init__(self, cmd, cwd=None, env=None, stdout=None, stderr=None, text=False,
                 start_new_session=False, adopter=None, ignored=None):
        for name in PRELOAD if _imported_with is None else ():  # imported once, in the test process
            __import__(name)
        self.args, self.returncode, self._text = cmd, None, text
        piped = {fd: tempfile.TemporaryFile() for fd, where in ((1, stdout), (2, stderr)) if where == PIPE}
        to = {fd: piped[fd].fileno() if fd in piped else None for fd in (1, 2)}  # None: this process's
        if stderr == STDOUT:
            to[2] = to[1] if to[1] is not None else 1
        sys.stdout.flush()
        sys.stderr.flush()
        parent, (ready, started) = os.getpid(), os.pipe()
        # Signals wait until the child has its own handlers (a launcher's handler must never run in
        # its worker), and Popen returns once the child is in its session (torchrun may killpg it).
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        self.pid = os.fork()
        if self.pid == 0:  # the child: whatever the command does, it never returns to the test's code
            status = 1
            try:
                os.close(ready)
                status = _child(cmd, cwd, dict(os.environ if env is None else env), to, start_new_session,
                                adopter or parent, started, ignored)
            finally:
                os._exit(status)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(started)
        os.read(ready, 1)  # the child's session is made (or it ended)
        os.close(ready)
        self._piped, self._pidfd = piped, os.pidfd_open(self.pid)
        self.stdout = self._open(1) if 1 in piped else None
        self.stderr = self._open(2) if 2 in piped else None

    @classmethod
    def adopted(cls, cmd, pid):
        """A Forked over pid, a child of this process that another process forked (Zygote's)."""
        self = cls.__new__(cls)
        self.args, self.returncode, self._text, self._piped = cmd, None, False, {}
        self.pid, self._pidfd, self.stdout, self.stderr = pid, os.pidfd_open(pid), None, None
        return self

    def _open(self, fd):
        """A reader of what the child writes to fd, from the start, with an offset of its own."""
        f = open(f"/proc/self/fd/{self._piped[fd].fileno()}", "rb")
        return io.TextIOWrapper(f, encoding="utf-8", errors="replace") if self._text else f

    def _ended(self, timeout):
        """Whether the child ended within timeout seconds (None: however long), from its pidfd."""
        waiter = select.poll()  # not select.select: it refuses a file descriptor over 1023
        waiter.register(self._pidfd, select.POLLIN)
        return bool(waiter.poll(None if timeout is None else timeout * 1000))

    def poll(self):
        exited = self.returncode is None and self._ended(0)
        return self.wait(0) if exited else self.returncode

    def wait(self, timeout=None):
        """The exit code, waiting on the child's pidfd (an event, not a polling loop)."""
        if self.returncode is None:
            if not self._ended(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            os.close(self._pidfd)
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


def ignored_signals():
    """The signals this process ignores: a command it starts would ignore them too (exec keeps
    SIG_IGN, and resets the signals it handles)."""
    return {sig for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
            if signal.getsignal(sig) == signal.SIG_IGN}


def _child(cmd, cwd, env, to, new_session, parent, started, ignored=None):
    """In the forked child, its signals blocked: become the command and run it as `python` would; the
    status to exit with, as python's (Ctrl-C not caught: killed by SIGINT, as python ends then)."""
    status, interrupted, forker = 1, False, os.getppid()  # forker: the parent, or a zygote's middle
    unbuffered = cmd[1] == "-u"  # python -u script ...
    if unbuffered:
        cmd = [cmd[0], *cmd[2:]]
    try:
        if new_session:
            os.setsid()
        os.close(started)  # Forked() returns: the session is made
        # as a fresh interpreter starts: signals as exec leaves them (what the parent ignores stays
        # ignored, what it handles is reset: a launcher's TERM, INT, HUP, QUIT...), then as python sets
        # them; and python's hooks, warnings, logging and threads
        ignored = ignored_signals() if ignored is None else ignored
        for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_IGN)
        if signal.SIGINT not in ignored:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.excepthook, sys.unraisablehook = sys.__excepthook__, sys.__unraisablehook__  # pytest's report
        import atexit
        atexit._clear()  # the test process's (a launcher's): the command's own run at its end
        opened = {}  # an open file of its own (append): the parent's reader keeps its own offset
        for fd, src in to.items():
            if src is not None:
                if src not in opened:
                    opened[src] = os.open(f"/proc/self/fd/{src}", os.O_WRONLY | os.O_APPEND)
                os.dup2(opened[src], fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        # killed with the test process: a child stuck here must not hold its pipes (xdist's) open. Its
        # other files stay open: closing them would let a finalizer close a number since reused
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, os.path.basename(sys.executable).encode()[:15])  # PR_SET_NAME: not the parent's name
        t0 = time.time()  # a zygote's worker: until the launcher adopts it (its forking middle ends)
        while forker != parent and os.getppid() == forker and time.time() - t0 < 30:
            time.sleep(0.001)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that: end as the signal would have
            return 128 + signal.SIGKILL
        global _imported_with
        if _imported_with is None:  # the test process's environment, which its modules were imported with
            _imported_with = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        was_stdout = {id(sys.stdout), id(sys.__stdout__)}
        raw = unbuffered or bool(env.get("PYTHONUNBUFFERED"))  # as python buffers: by block, stderr and a
        # terminal by line
        sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
        sys.stdout = sys.__stdout__ = _stream(1, raw, line_buffering=os.isatty(1))
        sys.stderr = sys.__stderr__ = _stream(2, raw, line_buffering=True, errors="backslashreplace")
        signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a signal sent meanwhile arrives now, as python's
        threading.excepthook = threading.__excepthook__  # nothing: an error in a thread went unseen
        import faulthandler
        import logging
        import torch
        faulthandler.disable()
        importlib.reload(warnings)  # pytest's catch_warnings replaced how they are shown
        warnings.resetwarnings()
        for action, category in (("default", DeprecationWarning), ("ignore", DeprecationWarning),
                                 ("ignore", PendingDeprecationWarning), ("ignore", ImportWarning),
                                 ("ignore", ResourceWarning)):
            module = "__main__" if action == "default" else ""
            warnings.filterwarnings(action, category=category, module=module, append=True)
        logging.root.handlers.clear()  # pytest's capture
        logging.root.setLevel(logging.WARNING)
        # torch's loggers: made on the test's streams, closed here
        for logger in logging.Logger.manager.loggerDict.values():
            for h in getattr(logger, "handlers", []):
                if type(h) is logging.StreamHandler:
                    h.stream = sys.stdout if id(h.stream) in was_stdout else sys.stderr  # no flush of the old
        torch.set_num_threads(1)  # OMP_NUM_THREADS=1 (forkable): OpenMP's threads are not in the fork
        # the compiler as a fresh interpreter has it: no graph cached by a test of this process, and
        # inductor compiling in this process. A compile worker pool this process made is not in the
        # fork (its threads), and a compile handed to it would wait forever.
        import torch._inductor.config
        torch._dynamo.reset()
        torch._inductor.config.compile_threads = 1
        if cmd[1] == "-c":
            sys.argv = ["-c", *cmd[3:]]
            sys.path[0:0] = [""]
            main = sys.modules["__main__"] = type(sys)("__main__")
            exec(compile(cmd[2], "<string>", "exec"), main.__dict__)
        elif cmd[1] == "-m":
            import runpy
            fork_workers()
            sys.argv = [cmd[2], *cmd[3:]]
            sys.modules.pop(cmd[2], None)  # run afresh as __main__, as python -m does (runpy warns otherwise)
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        else:
            import runpy
            sys.argv = cmd[1:]
            sys.path[0:0] = [os.path.dirname(os.path.abspath(cmd[1]))]
            runpy.run_path(cmd[1], run_name="__main__")
        status = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            status = exit_status(e.code or 0)
        else:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # the traceback from the command's own first frame, as python prints it
        tb, ours = e.__traceback__, (__file__, getattr(sys.modules.get("runpy"), "__file__", ""))
        while tb and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # as python reports it: the command's own hook
        interrupted = isinstance(e, KeyboardInterrupt)
    try:
        import atexit
        atexit._run_exitfuncs()  # as python does at exit (the trainer leaves its process group, its log_dir)
    except BaseException:  # reported by _run_exitfuncs itself
        pass
    for f in (sys.stdout, sys.stderr):  # as python flushes them at exit: one that fails is reported, 120
        try:
            if f is not None and not getattr(f, "closed", False):
                f.flush()
        except Exception as e:  # reported as sys.__unraisablehook__ does, from the flush's own frame
            print(f"Exception ignored in: {f!r}", file=sys.stderr)
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            status = 120
    if interrupted:  # python's end after an unhandled Ctrl-C: killed by SIGINT, or 130 where it is blocked
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    return status


def fork_workers():
    """In torchrun's launcher, forked, before it starts a thread: each worker forked by a Zygote
    when it can be (forkable), else started as torchrun starts it. torchrun's command for a worker is
    `python -u script args`, in a session of its own, with torchrun's variables added to the
    environment (TORCHRUN_ENV)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    popen, zygote = subprocess_handler.SubprocessHandler._popen, Zygote()

    def _popen(self, args, env):
        cmd = list(args)
        kw = dict(env=env, stdout=self._stdout, stderr=self._stderr, start_new_session=True)
        can = forkable(cmd, kw, RUNTIME_ENV | TORCHRUN_ENV, _imported_with)  # against the test's env
        return (can and zygote.start(cmd, env)) or popen(self, args, env)

    subprocess_handler.SubprocessHandler._popen = _popen


class Zygote:
    """A copy of torchrun's launcher made before the launcher starts a thread, which forks its
    workers: no worker can start with a lock that one of the launcher's threads (its store's server,
    its rendezvous' keep-alive) held at a fork, as a worker forked by the launcher itself could. Each
    worker is forked by a middle process that then ends: the launcher, a child subreaper, adopts it
    and waits for it as torchrun waits for its own. The zygote ends with the launcher; signals sent to
    the launcher's process group stay blocked in it (no process of torchrun's job is signalled
    differently)."""
    NAME = "forked-zygote"  # its /proc/PID/comm: children() passes over it

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the zygote's orphaned workers come to this process
        launcher = os.getpid()
        (asks, ask), (self._tell, tells) = os.pipe(), os.pipe()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(ask)
                os.close(self._tell)
                libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it ends with the launcher
                if os.getppid() == launcher:
                    libc.prctl(15, self.NAME.encode())  # PR_SET_NAME
                    self._serve(os.fdopen(asks, "rb"), tells, launcher)
            finally:
                os._exit(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(asks)
        os.close(tells)
        self._ask = os.fdopen(ask, "wb")

    def _serve(self, asks, tells, launcher):
        """The zygote: for each (cmd, env, ignored) asked, a worker, its pid told (0: none) once it is in
        its session and its middle process is gone, so the launcher's child. Its signals and its middle
        processes' stay blocked: a worker unblocks its own."""
        while True:
            try:
                cmd, env, ignored = pickle.load(asks)
            except EOFError:  # the launcher is gone
                return
            got, put = os.pipe()
            middle = os.fork()
            if middle == 0:
                pid = 0
                try:
                    pid = Forked(cmd, env=env, start_new_session=True, adopter=launcher, ignored=ignored).pid
                finally:
                    os.write(put, pid.to_bytes(4, "little"))
                    os._exit(0)
            os.close(put)
            os.waitpid(middle, 0)  # its worker, orphaned, is the launcher's now (a subreaper's)
            os.write(tells, os.read(got, 4))
            os.close(got)

    def start(self, cmd, env):
        """In the launcher: the worker for cmd and env, forked by the zygote, a Forked once adopted;
        None if the zygote could not make it."""
        try:
            pickle.dump((cmd, env, ignored_signals()), self._ask)  # the launcher's now, not the zygote's
            self._ask.flush()
            pid = int.from_bytes(os.read(self._tell, 4), "little")
        except OSError:  # the zygote is gone
            return None
        return Forked.adopted(cmd, pid) if pid else None


def _stream(fd, raw, **kw):
    """sys.stdout or sys.stderr over fd, as python makes them: buffered (by block unless kw says by
    line), written through with PYTHONUNBUFFERED (raw)."""
    binary = open(fd, "wb", buffering=0 if raw else -1, closefd=False)
    return io.TextIOWrapper(binary, write_through=raw, **kw)


def exit_status(code):
    """The status python exits with after sys.exit(code), code an int: the low byte of a C long, and
    255 (C's -1) for an int too big for one. sys.exit(-9) is 247, not a death by SIGKILL."""
    bits = 8 * ctypes.sizeof(ctypes.c_long)
    return (code if -2 ** (bits - 1) <= code < 2 ** (bits - 1) else -1) & 0xFF
