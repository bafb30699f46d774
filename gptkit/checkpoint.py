"""
Fault tolerance for train_gpt2.py: finding, checking and writing checkpoints, RNG state, trimming the
log lines a crashed run wrote after its last checkpoint, preemption (SIGTERM, Ctrl-C), one run per
log_dir (run.lock). docs/resume.md tells the whole story.

A checkpoint, log_dir/model_{step:05d}.pt, is the state after `step` optimizer updates: build-
nanogpt's model, config, step and val_loss, plus everything needed to continue exactly (RESUME_KEYS):
the optimizer, the global data position, torch's RNG states, whether the step's evals are done, the
count of bad steps in a row and a checksum of its tensors. train_gpt2.py builds it (save_checkpoint)
and puts each piece back where it resumes; rank 0 writes it and validates it (read_checkpoint); the
other ranks read the file it chose.
"""
import atexit
import copy
import os
import re
import signal
import sys
import time

import torch

from gptkit import distributed
from gptkit.common import UserError, atomic_write

RESUME_KEYS = ('model', 'optimizer', 'config', 'train_config', 'step', 'evaluated', 'loader', 'rng',
               'bad_steps', 'checksum')
EXIT_PREEMPTED = 75  # SIGTERM or Ctrl-C: checkpoint written, run the same command again (EX_TEMPFAIL)


# -----------------------------------------------------------------------------
# preemption: SIGTERM or Ctrl-C only sets a flag; the ranks agree on it at step boundaries (distributed.agree)

stop_requested = ''  # the signal that asked the run to stop: 'SIGTERM' or 'Ctrl-C' ('' for none)


def on_stop_signal(signum, frame):
    global stop_requested  # the trainer finishes the step, then saves
    stop_requested = stop_requested or ('Ctrl-C' if signum == signal.SIGINT else 'SIGTERM')
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once


def listen_for_stop_signals():
    """From now on SIGTERM and the first Ctrl-C stop the run at the next step boundary, with a
    checkpoint (exit 75); a second Ctrl-C raises KeyboardInterrupt at once, as Python does."""
    signal.signal(signal.SIGTERM, on_stop_signal)
    signal.signal(signal.SIGINT, on_stop_signal)


# -----------------------------------------------------------------------------
# the end of a run, however it comes: one line for an error, the process group and log_dir released

_failed = False  # an error ends this run: leave the process group without waiting for the others


def error_line(error, B):
    """The one line that ends the run for error, or None for an error that keeps its traceback: a
    UserError, a wait for the other ranks that gave up (a collective, or wait_for_all in the store),
    or the device out of memory at micro-batch B."""
    if isinstance(error, UserError):
        return f"error: {error}"
    if torch.distributed.is_initialized() and re.search(r'[Tt]imed? ?out', str(error)):
        limit = distributed.waiting
        if isinstance(error, torch.distributed.DistStoreError):  # wait_for_all's
            limit = f'WAIT_FOR_ALL_TIMEOUT={distributed.WAIT_FOR_ALL_TIMEOUT}'
        return (f"error: rank {distributed.rank()} waited more than {limit} s for the other ranks: one of them "
                f"is stuck or gone; the last checkpoint stands: run the same command again to resume")
    if isinstance(error, torch.OutOfMemoryError) or re.search(r'out of memory|can.t allocate', str(error)):
        from gptkit.memory import out_of_memory  # with B="auto"'s count, when the start made one
        return out_of_memory(B)
    return None


def one_line_errors(micro_batch):
    """From here on, an error that ends the run prints one line on stderr and exits with code 1, no
    traceback (error_line; micro_batch() is B as the run has it then); once the process group exists,
    rank 0 alone says a UserError, which every rank meets alike. And however the run ends, this process
    leaves the process group at exit: a finished run waits for the others first (rank 0 may still be
    writing), a failed one does not."""
    def excepthook(kind, error, tb):
        global _failed
        _failed = True
        line = error_line(error, micro_batch())
        if line is None:
            sys.__excepthook__(kind, error, tb)
        elif not (isinstance(error, UserError) and torch.distributed.is_initialized() and distributed.rank()):
            # before the teardown, which a gone rank can hold up; to sys.__stderr__, as the hook that
            # init_process_group puts around this one writes "[rankN]: " before what goes to sys.stderr
            print(line, file=sys.__stderr__, flush=True)
    sys.excepthook = excepthook
    atexit.register(lambda: distributed.end_process_group(finished=not _failed))


# -----------------------------------------------------------------------------
# reading: the newest checkpoint that loads, checked before anything is built from it


def checksum(obj):
    """The sum of every tensor in obj (through nested dicts, lists and tuples), its bytes read as
    integers (int32 words, else bytes). A byte of a checkpoint flipped or zeroed on disk changes it;
    torch.load checks no CRC, so such a file loads without complaint. Each tensor is summed on its own
    device, in int64 (which wraps around alike everywhere), and each device is read once: a GPU is
    waited for once, not per tensor."""
    sums = {}
    for t in filter(torch.is_tensor, torch.utils._pytree.tree_leaves(obj)):
        words = t.detach().contiguous().view(-1).view(torch.int32 if t.element_size() == 4 else torch.uint8)
        sums.setdefault(t.device, []).append(words.sum(dtype=torch.int64))
    return sum(sum(torch.stack(s).tolist()) for s in sums.values()) % 2 ** 62


def list_checkpoints(log_dir):
    """[(step, path)] of the model_NNNNN.pt files in log_dir, newest first."""
    names = os.listdir(log_dir) if os.path.isdir(log_dir) else []
    return sorted([(int(m[1]), os.path.join(log_dir, n)) for n in names
                   if (m := re.fullmatch(r'model_(\d+)\.pt', n))], reverse=True)


def read_checkpoint(path):
    """The checkpoint at path, checked for what resuming needs; ValueError says what is wrong with
    it, OSError that it could not be read.
    Tensors stay memory-mapped (read once for the checksum); their shapes are checked against a
    model and an optimizer built on the meta device (no memory) from the checkpoint's own config."""
    import pickle  # here, not at the top: only a resume needs them (and the model)
    import warnings

    from model import GPT, GPTConfig
    # Every byte is read first: a read error (I/O, permissions) shows here, and proves nothing about the file.
    with open(path, 'rb') as f:
        while f.read(1 << 24):
            pass
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)  # no pickled code runs
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise ValueError(f"no {', '.join(missing)}: not a checkpoint this trainer can resume from")
        if checksum(dict(ckpt, checksum=None)) != ckpt['checksum']:  # of all but itself, as it was written
            raise ValueError("the tensors do not match the checksum written with them: the file is corrupt")
        # Copying into a model on the meta device does nothing, and torch warns that it does nothing:
        # only the names and shapes are checked. A weight missing or of another shape raises.
        with torch.device('meta'), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            model = GPT(GPTConfig.from_dict(ckpt['config']))
            model.load_state_dict(ckpt['model'])
        kind = ckpt['train_config'].get('optimizer', 'adamw')
        optimizer = model.configure_optimizers(0.0, 1.0, 'cpu', kind, 1.0)
        optimizer.load_state_dict(ckpt['optimizer'])  # group and parameter counts
        for p, state in optimizer.state.items():  # AdamW's moments, Muon's momentum: the parameter's shape
            for v in state.values():
                if v.dim() > 0 and v.shape != p.shape:
                    raise ValueError(f"'optimizer' state of shape {tuple(v.shape)} for a parameter of shape "
                                     f"{tuple(p.shape)}")
        return ckpt
    except pickle.UnpicklingError as e:  # torch's advice (weights_only=False) is the one not to take
        why = re.search('.*(GLOBAL|Unsupported).*', str(e))  # the line that names what it would call
        raise ValueError(f"it holds pickled objects that a weights-only load refuses "
                         f"({why[0] if why else e})") from None
    except (ValueError, MemoryError):
        raise  # MemoryError: the file may well be fine
    except Exception as e:  # truncated (torch.load: OSError for some cuts), not a zip, wrong keys or shapes
        raise ValueError(f"{type(e).__name__}: {' '.join(str(e).split()[:40])}") from None  # its gist, 1 line


def pick_checkpoint(log_dir):
    """Rank 0: (step, path, checkpoint) of the newest checkpoint that loads, or (-1, None, None)
    when log_dir holds none. Newer ones that do not load are reported and renamed aside (*.bad),
    out of the way of the next resume and of keep_checkpoints."""
    bad = []
    for step, path in list_checkpoints(log_dir):
        try:
            ckpt = read_checkpoint(path)
        except ValueError as e:
            print(f"warning: cannot resume from {path}: {e}")
            bad.append(path)
            continue
        except (OSError, MemoryError) as e:
            raise UserError(f"cannot read {path} ({type(e).__name__}: {e}); that is no proof the checkpoint "
                            f"is bad, so nothing falls back: fix the cause and run again") from None
        for p in bad:  # replacing an earlier .bad of this step, if any (the same state: resuming is exact)
            os.replace(p, f"{p}.bad")
            print(f"warning: renamed {p} to {p}.bad; resuming from the previous checkpoint, {path}")
        return step, path, ckpt
    if bad:
        raise UserError(f"{log_dir!r} holds checkpoints but none can be resumed from (see above): move them "
                        f"away to start afresh, or point log_dir elsewhere")
    return -1, None, None


def find_checkpoint(log_dir, resume):
    """(path, checkpoint) to resume from, the same on every rank, or (None, None) for a fresh run.
    Rank 0 lists log_dir, chooses and validates it (pick_checkpoint); the others follow its verdict and
    read the same file (log_dir must be on a filesystem they share). resume="never" refuses a log_dir
    that holds checkpoints."""
    rank, path, ckpt, error = distributed.rank(), None, None, ''
    if rank == 0 and (found := list_checkpoints(log_dir)):  # (a fresh log_dir: nothing to choose)
        if resume == 'never':
            error = (f"{log_dir!r} holds checkpoints of an earlier run ({found[0][1]}) and resume='never': "
                     f"point log_dir elsewhere, or move them away")
        else:
            try:
                _, path, ckpt = pick_checkpoint(log_dir)
            except UserError as e:
                error = str(e)
    path, error = distributed.gather_objects((path, error))[0]  # rank 0's verdict: its file, or its error
    if rank > 0 and path is not None:
        try:
            ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
        except Exception as e:  # not there, or unreadable here: this rank's line, then every rank stops
            error = f"rank {rank} cannot read {path}: {type(e).__name__}: {e}"
            print(f"error: {error}", file=sys.stderr)
    if distributed.agree(bool(error)):
        raise UserError(error or f"another rank could not read {path}: log_dir must be on a filesystem "
                                 f"that every node sees")
    return path, ckpt


def rng_state(device):
    """The states of the generators that training draws from, torch's (CPU) and CUDA's on a GPU: the
    same on every rank, as all are seeded and used alike. Python's and numpy's global ones are not
    kept: nothing draws from them (the loader has generators of its own, seeded by the epoch), and
    the bit-identical resume tests would catch a change that did."""
    if torch.device(device).type == 'cuda':
        return {'torch': torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state(device)}
    return {'torch': torch.get_rng_state()}


def set_rng_state(state, device):
    torch.set_rng_state(state['torch'])  # (older checkpoints also hold Python's and numpy's: unused)
    if torch.device(device).type == 'cuda' and 'cuda' in state:
        torch.cuda.set_rng_state(state['cuda'], device)

# -----------------------------------------------------------------------------
# writing: rank 0, atomically; older checkpoints are deleted only once the new one is whole


def check_replicas(model, step):
    """Under DDP, that every rank's weights are rank 0's, bit for bit, before a checkpoint: DDP sends
    weights only at the start, so replicas stay equal only while every rank computes the same bits
    (not so across GPU models or library versions). One checksum per rank, gathered; a UserError
    names the ranks that differ. (Under FSDP the ranks hold different shards: nothing to compare.)"""
    sums = distributed.gather_objects(checksum(list(model.parameters())))
    if differ := [str(r) for r, s in enumerate(sums) if s != sums[0]]:
        ranks = f"rank{'s' * (len(differ) > 1)} {', '.join(differ)}"
        raise UserError(f"step {step}: the weights of {ranks} differ from rank 0's: DDP keeps replicas "
                        f"equal only while every rank computes the same bits (the same GPU model, driver and "
                        f"library versions); no checkpoint of step {step} was written: resume from the last "
                        f"one on matching hardware")


def save(ckpt, log_dir, keep_checkpoints):
    """Rank 0 writes ckpt (a dict: every rank passes its own, rank 0's is the one) to
    log_dir/model_{step:05d}.pt atomically, then deletes the checkpoints beyond the newest
    keep_checkpoints. Every rank calls it and learns whether it worked: a failed write (a full disk)
    stops the run, the earlier checkpoints untouched."""
    error = None
    if distributed.rank() == 0:
        # A copy of ckpt with its tensors on the host. They all start for the host at once, where
        # torch.save would wait for each in turn: from a GPU each copy goes into pinned memory without the
        # host waiting; they are done once the host next reads the device, as its stream runs in order.
        # The same view of the same memory is copied once, so the tied wte/lm_head weight stays one
        # storage under two keys. deepcopy, given the host tensors as its memo, copies the rest as it
        # was: what is shared stays shared, and a state dict keeps its metadata.
        copies, memo = {}, {}
        for t in filter(torch.is_tensor, torch.utils._pytree.tree_leaves(ckpt)):
            key = t.data_ptr(), t.dtype, t.shape, t.stride()
            if key not in copies:
                copies[key] = t.to('cpu', non_blocking=True)  # a CPU tensor is returned as it is
            memo[id(t)] = copies[key].detach()  # a tensor of its own, as torch.save would see t
        # The checksum is summed on the device after those copies, so its one read waits for them too.
        host = dict(copy.deepcopy(ckpt, memo), checksum=checksum(ckpt))
        path = os.path.join(log_dir, f"model_{ckpt['step']:05d}.pt")
        for name in ckpt.get('logs', ()):  # the lines the checkpoint vouches for reach the disk first
            with open(os.path.join(log_dir, name), 'a') as f:
                os.fsync(f.fileno())
        try:  # temporary file, fsync, rename: a checkpoint is whole or absent
            atomic_write(path, lambda f: torch.save(host, f))
        except (OSError, RuntimeError) as e:
            # A write that fails (no space, a quota) makes torch.save raise 'unexpected pos', a RuntimeError
            # whose context is the OSError that says why: that is the line to show.
            error = (f"could not write the checkpoint {path} ({e.__context__ or e}); the earlier "
                     f"checkpoints are untouched: fix that (free some space, say) and run the same command "
                     f"again to resume")
        else:
            for _, old in list_checkpoints(log_dir)[keep_checkpoints:] if keep_checkpoints > 0 else []:
                os.remove(old)  # only now that a newer one is complete
    distributed.wait_for_all()  # however long rank 0 took to write: the next collective is bounded again
    if distributed.agree(error is not None):
        raise UserError(error or "rank 0 could not write a checkpoint")

# -----------------------------------------------------------------------------
# resuming: the model's shape, then every piece of state, then the log files


def resumed_model_config(ckpt, path, config):
    """The checkpoint's model shape, once the config is known not to change it."""
    from model import GPTConfig
    old = dict({'optimizer': 'adamw'}, **ckpt['train_config'])  # written before Muon: AdamW
    for key in ('init_from', 'optimizer'):  # another source of weights, or another optimizer's state
        if old.get(key) != config[key]:
            raise UserError(f"{path} continues a run with {key}={old.get(key)!r}, but the config says "
                            f"{key}={config[key]!r}: set it back, or point log_dir elsewhere to start afresh")
    have = ckpt['config']
    diff = [k for k in have if config['init_from'] == 'scratch' and config[k] != have[k]]
    if diff:
        raise UserError(f"{path} holds a model with {', '.join(f'{k}={have[k]}' for k in diff)}, but the "
                        f"config asks for {', '.join(f'{k}={config[k]}' for k in diff)}: a run resumes only "
                        f"into the same model shape; set them back, or point log_dir elsewhere to start "
                        f"afresh")
    changed = [f"{k} {old[k]!r} -> {v!r}" for k, v in config.items() if old.get(k, v) != v]
    if distributed.rank() == 0 and changed:
        print(f"resuming with changed settings: {', '.join(changed)}")
    return GPTConfig.from_dict(have)


def log_sizes(log_dir):
    """Rank 0: {name: bytes} of log.txt and samples.txt in log_dir (those that exist) as they are now,
    for a checkpoint: rank 0's lines, cut back to a checkpoint's on resume (prepare_log_dir)."""
    return {name: os.path.getsize(path) for name in ('log.txt', 'samples.txt')
            if os.path.exists(path := os.path.join(log_dir, name))}


def prepare_log_dir(log_dir, logs, start):
    """Rank 0, before the first step: remove a checkpoint write that a crash cut short, and cut
    log.txt and samples.txt back to the bytes they held when the checkpoint was written (logs: {name:
    bytes}, log_sizes then; {} for a fresh run): the lines a crashed run wrote after its checkpoint
    go, whatever they hold, and the resumed run writes them again. A checkpoint older than the sizes
    (logs None) keeps the lines of the steps before its own, start. Each file is rewritten atomically.
    log_dir exists: claim_log_dir made it."""
    for tmp in [name for name in os.listdir(log_dir) if re.fullmatch(r'model_.*\.pt\.tmp.*', name)]:
        os.remove(os.path.join(log_dir, tmp))
    for name in log_sizes(log_dir):  # the logs that exist
        path = os.path.join(log_dir, name)
        with open(path, 'rb') as f:
            text = f.read()
        if logs is not None:
            kept = text[:logs.get(name, 0)]
        else:  # each line starts with its step ('12 val ...', 'step 12 sample ...')
            kept = b''.join(line for line in text.splitlines(keepends=True) if line.endswith(b'\n')
                            and (m := re.match(rb'\D*(\d+)', line)) and int(m[1]) < start)
        atomic_write(path, lambda f: f.write(kept))

# -----------------------------------------------------------------------------
# one run per log_dir: rank 0 holds a POSIX record lock on log_dir/run.lock while the run lasts

_lock = None  # rank 0's (open and locked run.lock, the folders that taking it made, deepest first)


def claim_log_dir(log_dir):
    """Every rank, before log_dir is read: rank 0 takes log_dir/run.lock (lock_log_dir); a UserError on
    every rank when another run holds it."""
    busy = lock_log_dir(log_dir) if distributed.rank() == 0 else ''
    atexit.register(release_log_dir)  # however the run ends
    if distributed.agree(bool(busy)):
        raise UserError(busy or f"log_dir={log_dir} is in use by another run")


def lock_log_dir(log_dir):
    """Rank 0, before log_dir is read: take log_dir/run.lock for the life of this run. '' once taken;
    else one line naming the run that holds it, and the file is left as it was. A POSIX record lock
    (fcntl.lockf): the kernel drops it when its process ends, however it ends (kill -9 too), so a dead
    run never blocks the next start; a forked child does not inherit it. On NFS the server's lock
    manager holds it for every node; Lustre needs mounting with -o flock (docs/resume.md)."""
    global _lock
    path, folder, made = os.path.join(log_dir, 'run.lock'), os.path.abspath(log_dir), []
    while not os.path.exists(folder):  # the folders makedirs makes: log_dir, and parents it needs
        made, folder = made + [folder], os.path.dirname(folder)
    os.makedirs(log_dir, exist_ok=True)  # on every system: the run writes there
    if os.name != 'posix':
        return ''
    import fcntl
    if _lock is not None:  # an earlier run in this process (tests); closing its file drops its lock
        _lock[0].close()  # (and in a forked child, whose parent holds the lock, closing alone is right)
        _lock = None
    while True:
        try:
            f = open(path, 'a+')  # created, or opened without a change: the holder's line stays for others
        except FileNotFoundError:  # a start that failed removed the empty log_dir it had made, just now
            os.makedirs(log_dir, exist_ok=True)
            continue
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A run that ends removes run.lock while it still holds the lock. If one did so between our
            # open and our lock, this lock is on a file that no one else will open (the next launch
            # would create and lock another one): then lock the file that the name gives now.
            if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: another process holds it
            f.seek(0)
            holder = f.read().strip() or 'a process that has not written its name yet'
            f.close()
            return (f"log_dir={log_dir} is in use by a live run ({holder}; {path}); wait for it to end or "
                    f"stop it, or choose another log_dir")
        except FileNotFoundError:  # os.stat: removed as above, and no other launch made it again yet
            pass
        except OSError as e:  # ENOLCK, ENOSYS: a file system without locks
            f.close()
            print(f"warning: cannot lock {path} ({e}): nothing stops a second run from using this log_dir")
            return ''
        f.close()
    f.truncate(0)
    print(f"pid {os.getpid()} on {os.uname().nodename} since {time.strftime('%Y-%m-%d %H:%M:%S')}", file=f,
          flush=True)
    _lock = f, made
    return ''


def release_log_dir():
    """As the run ends, however it ends (at exit; rank 0 alone holds the lock): rank 0 removes run.lock
    while it still holds the lock, so that no file names a run that is gone (after a kill -9 the file
    stays, unlocked, and the next start takes it over). It also removes the folders that taking the
    lock made if nothing was written in them (a start that failed), so that a corrected command starts
    clean and `ls` shows no empty run."""
    global _lock
    if _lock is None:
        return
    f, made = _lock
    try:
        os.remove(f.name)  # while it is still locked (lock_log_dir says why)
        for folder in made:  # log_dir, then the parents it needed
            os.rmdir(folder)  # fails unless empty: a folder that holds anything stays, and so do its parents
    except OSError:
        pass
    f.close()
    _lock = None
