"""
What every script shares, with no torch (fineweb.py stays light): the one error class for "the user
gave something wrong", and the one way this project writes a file that matters.
"""
import os


class UserError(Exception):
    """Bad configuration, input or data: a config value, a file, a folder, a download that did not
    come. Every script catches it and prints one line (error: ...) with no traceback: it names the
    key, file or value, what was expected and what to do."""


def atomic_write(path, write):
    """Shards, manifests, checkpoints, logs it rewrites, downloads: whole or absent, never
    half-written. write(f) into a temporary file beside path, fsync, rename: path is whole or absent. The
    temporary name is path + '.tmp' + pid, removed on any failure (what a crash leaves behind
    matches path + '.tmp*')."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, 'wb') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # any failure, Ctrl-C included: the temporary file goes, the error stays
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if os.name == 'posix':  # the rename itself survives a crash (a folder cannot be opened on Windows)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        os.fsync(dir_fd)  # a failure raises, and its caller stops (the descriptor then leaks, once)
        os.close(dir_fd)
