"""Issue 35: run.lock names a live run and nothing else. A run that ends (finished, stopped by
SIGTERM with exit 75, or failed) removes the run.lock it holds; a launch that another run refuses
leaves the file as it was; and a launch whose lock lands on a file that an ending run removed
meanwhile takes the lock again on the file that the name gives, so that two runs never each hold
a lock on a different file."""
import fcntl
import os
import signal
import subprocess
import sys
import time

import pytest

import commands
from conftest import ROOT, TINY, one_thread, random_shards, run_script
from gptkit.run import LogDirLock
from test_resume import wrapper

ARGS = [*TINY, "--vocab_size=512", "--B=2", "--T=16", "--total_batch_size=256", "--eval_interval=0",
        "--sample_interval=0", "--checkpoint_interval=5", "--hellaswag=False"]

# another process that takes the lock, prints its pid, and ends its run (release) when its
# stdin closes: a live run, as the trainer holds it
HOLDER = """
import sys
from gptkit.run import LogDirLock
lock = LogDirLock(sys.argv[1])
assert lock.acquire() == ''
print('locked', flush=True)
sys.stdin.read()
lock.release()
print('released', flush=True)
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return random_shards(tmp_path_factory.mktemp("data"), 0, 600, [256 * 40 + 1])


@pytest.fixture
def locks():
    """The locks this test process takes, released whatever the test's end (a fork of this process
    runs the trainer's commands: none must find one held)."""
    taken = []
    yield lambda log_dir: taken.append(LogDirLock(str(log_dir))) or taken[-1]
    for lock in taken:
        lock.release()


def holder(log_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(log_dir)], cwd=ROOT, env=one_thread(), text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == "locked\n"
    return p


def test_a_run_that_ends_removes_its_run_lock(data, tmp_path):
    """Finished (exit 0), stopped by SIGTERM (exit 75), failed after writing (exit 1): log_dir keeps
    what the run wrote, and no run.lock that names a process gone."""
    log_dir = tmp_path / "log"
    r = run_script([*ARGS, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=5"])
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(log_dir)) == ["log.txt", "model_00005.pt", "run.json"]

    p = commands.Popen([sys.executable, "train_gpt2.py", *ARGS, f"--data_root={data}", f"--log_dir={log_dir}",
                        "--max_steps=1000"], cwd=ROOT, env=one_thread(PYTHONUNBUFFERED="1"),
                       stdout=commands.PIPE, stderr=commands.STDOUT, text=True, start_new_session=True)
    t0 = time.time()
    while "\n8 train " not in "\n" + (log_dir / "log.txt").read_text():  # training, past its resume
        assert p.poll() is None and time.time() - t0 < 120, p.stdout.read()
        time.sleep(0.01)
    assert "run.lock" in os.listdir(log_dir)  # held while it runs
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 75 and "SIGTERM: stopped at step" in out, out
    assert "run.lock" not in os.listdir(log_dir)

    before = sorted(os.listdir(log_dir))
    r = run_script([*ARGS, f"--data_root={data}", f"--log_dir={log_dir}", "--n_layer=3"])  # another shape
    assert r.returncode == 1 and "a run resumes only into the same model shape" in r.stderr, r.stderr
    assert sorted(os.listdir(log_dir)) == before  # run.lock taken, then removed; nothing else touched


# After the trainer's run, the threads it left running: python waits for each non-daemon one before it
# exits, so a writer or logger thread that hangs would hang every run.
THREADS_LEFT = """import threading
left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
print("threads left:", left, flush=True)
if left:  # now, not once they end
    os._exit(1)
"""


@pytest.mark.quick
def test_a_run_that_ends_leaves_no_thread_running(data, tmp_path):
    """A finished run has ended every thread it started that python would wait for at its exit."""
    script = wrapper(tmp_path, "left.py", "", after=THREADS_LEFT)
    r = run_script([*ARGS, f"--data_root={data}", f"--log_dir={tmp_path / 'log'}", "--max_steps=3",
                    "--checkpoint_interval=2"], script=script, PYTHONPATH=ROOT)
    assert r.returncode == 0 and "threads left: []" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.quick
def test_a_refused_launch_leaves_the_lock_file_as_it_was(tmp_path, locks):
    """The holder's line, bytes, inode and mtime stay; the refusal names the holder; once the holder's
    run ends its run.lock is gone, and the next launch takes a fresh one."""
    log_dir = tmp_path / "log"
    p = holder(log_dir)
    try:
        path = log_dir / "run.lock"
        before = path.read_bytes(), os.stat(path)
        assert before[0].startswith(f"pid {p.pid} on ".encode())
        time.sleep(0.01)  # an mtime that a write would change
        refused = locks(log_dir)
        busy = refused.acquire()
        assert f"log_dir={log_dir} is in use by a live run (pid {p.pid} on " in busy
        after = path.read_bytes(), os.stat(path)
        assert after[0] == before[0] and (after[1].st_ino, after[1].st_mtime_ns) == (before[1].st_ino,
                                                                                  before[1].st_mtime_ns)
        refused.release()  # the refused run ends: it holds nothing
        assert path.read_bytes() == before[0]
    finally:
        out, _ = p.communicate("", timeout=60)
    assert out == "released\n" and not log_dir.exists()  # it made log_dir and wrote nothing there
    assert locks(log_dir).acquire() == ""
    assert (log_dir / "run.lock").read_text().startswith(f"pid {os.getpid()} on ")  # (the lock dropped)


@pytest.mark.quick
def test_a_lock_on_a_file_removed_meanwhile_is_taken_again(tmp_path, monkeypatch, locks):
    """The race of an ending run and a new launch: the launch opens run.lock, the ending run removes
    it (here, between the launch's open and its lock; another launch then makes a new one), and the
    launch's lock lands on a file without a name. It must notice, and lock the file that the name
    gives: then the holder is the one that run.lock names, and a third launch is refused."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    path = log_dir / "run.lock"
    path.write_text("pid 1 on a run that is ending\n")
    lockf, calls = fcntl.lockf, []

    def ending_run_removes_it(f, how):
        if not calls:
            os.remove(path)  # the ending run, while it still holds the lock
            path.write_text("")  # another launch, which made the file again (and holds no lock yet)
        calls.append(os.fstat(f.fileno()).st_ino)
        return lockf(f, how)
    monkeypatch.setattr(fcntl, "lockf", ending_run_removes_it)
    assert locks(log_dir).acquire() == ""
    monkeypatch.undo()
    assert len(calls) == 2 and calls[1] == os.stat(path).st_ino != calls[0]  # the second lock: the named file
    # (reading the file here would drop the lock: a POSIX lock goes with any close of the file by its holder)
    r = subprocess.run([sys.executable, "-c", "import sys; from gptkit.run import LogDirLock; "
                        "print(LogDirLock(sys.argv[1]).acquire())", str(log_dir)],
                       cwd=ROOT, env=one_thread(), capture_output=True, text=True, timeout=60)
    assert f"is in use by a live run (pid {os.getpid()} on " in r.stdout, r.stdout + r.stderr


@pytest.mark.quick
def test_a_start_that_ends_removes_the_lock_and_a_failed_one_the_folders_it_made(tmp_path, locks):
    """The run's end (LogDirLock.release, at exit) removes run.lock, and the folders that taking the lock
    made unless something was written in them (a start that failed leaves nothing behind)."""
    made = tmp_path / "runs" / "log"
    assert (lock := locks(made)).acquire() == ""
    lock.release()
    assert os.listdir(tmp_path) == []  # runs/ and runs/log: both made by taking the lock
    assert (lock := locks(made)).acquire() == ""
    (made / "log.txt").write_text("0 train 10.0\n")
    lock.release()
    assert os.listdir(made) == ["log.txt"]  # something was written: it stays
    assert (lock := locks(made)).acquire() == ""
    lock.release()
    assert os.listdir(made) == ["log.txt"]


@pytest.mark.parametrize("where", ["a file", "unwritable"])
def test_a_log_dir_that_cannot_be_written_is_one_line(data, tmp_path, where):
    """Issue 57.4: a log_dir that is an existing file, or that this process may not make (/sys: not
    even root may), ends the start with one line that names it and why; the file is left as it was."""
    log_dir = tmp_path / "log"
    if where == "a file":
        log_dir.write_text("mine\n")
    else:
        log_dir = "/sys/gpt2_log_dir"
    r = run_script([*ARGS, f"--data_root={data}", f"--log_dir={log_dir}", "--max_steps=3"])
    what = "a file (File exists" if where == "a file" else "a folder this run cannot write (Operation not"
    assert r.returncode == 1 and r.stderr.startswith(f"error: log_dir={log_dir} is {what}"), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    if where == "a file":
        assert log_dir.read_text() == "mine\n"
