"""What every script shares, with no torch (fineweb.py stays light): the error for "the user gave
something wrong", the one way this project writes a file that matters, and the CPU cores it has."""
import os


def cpu_cores():
    """The CPU cores this process may use (its affinity, where the OS keeps one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


class UserError(Exception):
    """Bad configuration, input or data: every script prints it as one line (error: ...), no traceback."""


def atomic_write(path, write):
    """write(f) into path + '.tmp' + pid, fsync, rename: path is whole or absent, never half-written."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C included: the temporary file goes, the error stays
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    # the rename itself survives a crash (a folder cannot be opened on Windows)
    if os.name == 'posix':
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
