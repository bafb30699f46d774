"""
The life of one training run, around what train_gpt2.py does in the open: how it ends (one line for
an error, log_dir and the process group released), one run per log_dir, resume, stop signals and the
bad-step halt, the two timeouts, and what it leaves in log_dir, written on a thread of its own. The
script holds one Run and calls it at set-up, resume, the loop's top, a step's end and a save.
docs/resume.md tells the whole story.
"""
import atexit
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from gptkit import checkpoint, distributed, hardware
from gptkit.common import UserError, atomic_write

EXIT_PREEMPTED = 75  # SIGTERM or Ctrl-C: checkpoint written, run the same command again (EX_TEMPFAIL)
# the write speed a checkpoint is assumed to get at worst (a busy shared file system), in bytes a second,
# for the warning that a stop checkpoint may not fit in the time torchrun gives a stopping worker
SLOW_WRITE_SPEED = 200e6


class Run:

    def __init__(self):
        self.failed = False  # an error ends the run: leave the process group without waiting
        self.memory = None, None  # the micro-batch and B="auto"'s count, for the out-of-memory line
        self.lock = None  # rank 0's LogDirLock
        self.waiting = None  # the timeout collectives wait under now, as the error line names it
        self.short_timeout = None  # collective_timeout, once the first step and evals are done
        self.evals_built = True
        self.stop_signal = ''  # 'SIGTERM' or 'Ctrl-C' once one asked the run to stop
        self.stop_everywhere = False  # some rank's stop signal, as the last step's all-reduce told
        self.bad_steps = 0  # non-finite steps in a row
        self.evaluated = False  # the evals of the current step are done
        self.logs = {}  # the bytes of log.txt and samples.txt a resumed run keeps
        self.wandb = None
        # Rank 0's writes to log_dir (log lines, samples, checkpoints), one after another on a thread of
        # their own: the steps go on meanwhile. Python's exit waits for those given (a crash too).
        self.writer = None  # made by start(), on this process's device
        self.writes = []  # their futures, until each is known to have worked
        self.host_copy = {}  # a checkpoint's tensors in host memory, reused from one save to the next
        # how the process ends: an error as one line, then log_dir and the process group released
        sys.excepthook = self.excepthook
        atexit.register(self.release)

    def error_line(self, error):
        """The one line that ends the run for error, or None for an error that keeps its traceback."""
        if isinstance(error, UserError):
            return f"error: {error}"
        if torch.distributed.is_initialized() and re.search(r'[Tt]imed? ?out', str(error)):
            limit = self.waiting
            if isinstance(error, torch.distributed.DistStoreError):  # wait_for_all's
                limit = f'WAIT_FOR_ALL_TIMEOUT={distributed.WAIT_FOR_ALL_TIMEOUT}'
            return (f"error: rank {distributed.rank()} waited more than {limit} s for the other ranks: one "
                    f"of them is stuck or gone; the last checkpoint stands: run the same command again to "
                    f"resume")
        oom = re.search(r'out of memory|can.t allocate', str(error))
        if isinstance(error, torch.OutOfMemoryError) or oom:
            from gptkit.memory import out_of_memory
            return out_of_memory(*self.memory)
        return None

    def excepthook(self, kind, error, tb):
        self.failed = True
        line = self.error_line(error)
        if line is None:
            sys.__excepthook__(kind, error, tb)
            return
        # a UserError is met alike by every rank (torchrun's RANK, before the group too): rank 0 alone
        # says it. To sys.__stderr__: init_process_group's hook writes "[rankN]: " before sys.stderr's
        if not (isinstance(error, UserError) and int(os.environ.get('RANK', 0))):
            print(line, file=sys.__stderr__, flush=True)
        # torchrun's report gives a worker's error file as its root cause, else "To enable traceback
        # see": the line, in the form torch's @record writes
        if 'TORCHELASTIC_ERROR_FILE' in os.environ:
            said = {'py_callstack': line, 'timestamp': str(int(time.time()))}
            record = json.dumps({'message': {'message': line, 'extraInfo': said}}).encode()
            atomic_write(os.environ['TORCHELASTIC_ERROR_FILE'], lambda f: f.write(record))

    def release(self):
        try:
            distributed.end_process_group(finished=not self.failed)
        finally:
            if self.lock is not None:
                self.lock.release()

    def first_step_timeout(self, collective_timeout, evals):
        """The timeout until the first step and evals are done (each rank compiles at its own pace)."""
        seconds = max(collective_timeout, distributed.FIRST_STEP_TIMEOUT)
        self.waiting = f'FIRST_STEP_TIMEOUT={seconds}'
        self.short_timeout, self.evals_built = collective_timeout, not evals
        return datetime.timedelta(seconds=seconds)

    def start(self, config, device):
        """Rank 0 locks log_dir for the life of the run (a UserError if another run holds it); then
        the checkpoint to resume from, or None (checkpoint.find_checkpoint)."""
        self.config, self.log_dir, self.device = config, config['log_dir'], device
        # the writer thread waits for CUDA's copies on this process's GPU (by default GPU 0: a context there)
        init = (torch.cuda.set_device, (device,)) if device.startswith('cuda') else (None, ())
        self.writer = ThreadPoolExecutor(1, 'log_dir_writer', *init)
        self.memory = config['B'], None
        busy = ''
        if distributed.rank() == 0:
            self.lock = LogDirLock(self.log_dir)
            try:
                busy = self.lock.acquire()
            except OSError as e:  # a file by that name, a read-only file system, no permission
                what = 'a file' if os.path.isfile(self.log_dir) else 'a folder this run cannot write'
                busy = f"log_dir={self.log_dir} is {what} ({e.strerror}: {e.filename}): choose another one"
        if distributed.max_over_ranks(bool(busy)):
            raise UserError(busy or f"log_dir={self.log_dir} is in use by another run, or cannot be written")
        self.checkpoint_path, ckpt = checkpoint.find_checkpoint(self.log_dir, config['resume'])
        return ckpt

    def resume(self, ckpt, state):
        """The step to start from: every entry of state, the RNG and the counters as the checkpoint
        holds them (0 for a fresh run). A run stopped for its bad steps, or done, goes no further."""
        path = self.checkpoint_path
        if ckpt is None:
            return 0
        checkpoint.load_state(state, ckpt, path)
        checkpoint.set_rng_state(ckpt['rng'], self.device)
        step, self.evaluated, self.bad_steps = ckpt['step'], ckpt['evaluated'], ckpt['bad_steps']
        self.logs = ckpt.get('logs')  # None in checkpoints older than the sizes
        max_steps, max_bad_steps = self.config['max_steps'], self.config['max_bad_steps']
        if distributed.rank() == 0:
            at = state['loader'].state_dict()
            print(f"resuming from {path}: step {step}, train data at {at['file']} token {at['pos']:,}")
        if self.bad_steps >= max_bad_steps:  # not for an automatic restart to push on: a person decides
            raise UserError(f"{path} was written after {self.bad_steps} steps in a row with a non-finite "
                            f"loss or gradient norm, and max_bad_steps={max_bad_steps}: to go on (after "
                            f"lowering max_lr, say), raise max_bad_steps above {self.bad_steps}, or point "
                            f"log_dir elsewhere to start afresh")
        if step > max_steps or (step == max_steps and self.evaluated):
            if distributed.rank() == 0:
                print(f"nothing to do: {path} is step {step} and max_steps={max_steps}; raise max_steps to "
                      f"train on, or point log_dir elsewhere to start afresh")
            sys.exit(0)
        return step

    def begin(self, config, start):
        """Rank 0 cuts the logs back to the checkpoint's lines and starts W&B; then run.json."""
        if distributed.rank() == 0:
            checkpoint.trim_logs(self.log_dir, self.logs, start)
            if config['wandb_log']:
                self.start_wandb(config)
        self.write_run_json(config, start)

    def listen_for_stop_signals(self):
        """SIGTERM and a first Ctrl-C set a flag; a second Ctrl-C raises KeyboardInterrupt at once."""
        def on_signal(signum, frame):
            self.stop_signal = self.stop_signal or ('Ctrl-C' if signum == signal.SIGINT else 'SIGTERM')
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def flags(self):
        """This rank's (stop signal, failed write) as 0 or 1, for the step's all-reduce to carry."""
        return float(bool(self.stop_signal)), float(self.failed_write() is not None)

    def must_stop(self):
        """Whether every rank stops here: a stop signal on any rank, or too many bad steps in a row."""
        return self.stop_everywhere or self.bad_steps >= self.config['max_bad_steps']

    def stop(self, step):
        """Its checkpoint written: exit 75 after a signal, else the bad steps' error."""
        path, max_bad_steps = os.path.join(self.log_dir, f'model_{step:05d}.pt'), self.config['max_bad_steps']
        self.finish_writes()
        if self.bad_steps < max_bad_steps:
            # torchrun, signalled too, then prints a traceback of its own and exits 1
            torchrun = "; torchrun's traceback and exit code 1 may follow: the checkpoint is whole" * (
                'TORCHELASTIC_RUN_ID' in os.environ)
            if distributed.rank() == 0:
                print(f"{self.stop_signal or 'SIGTERM'}: stopped at step {step}; wrote {path}; run the same "
                      f"command again to resume (exit code {EXIT_PREEMPTED}){torchrun}")
            sys.exit(EXIT_PREEMPTED)
        raise UserError(f"stopped after {self.bad_steps} steps in a row with a non-finite loss or gradient "
                        f"norm (max_bad_steps={max_bad_steps}); {path} holds the last good weights, with the "
                        f"data position after the skipped batches; lower max_lr or check the data, then "
                        f"raise max_bad_steps to resume from it")

    def evals_done(self, did_eval):
        self.evaluated = True
        self.evals_built = self.evals_built or did_eval

    def end_step(self, good, overflow, stop, failed):
        """good: a finite loss and norm; overflow (float16): neither good nor bad; stop, failed: the
        step's all-reduce of flags(), the same on every rank. Once the first step and evals are done,
        collectives wait collective_timeout: a stuck rank ends the run soon."""
        if failed:  # rank 0 says why; the others end alike, quietly
            raise UserError(self.failed_write() or "rank 0 could not write to log_dir")
        self.bad_steps = 0 if good else self.bad_steps + (not overflow)
        self.stop_everywhere = stop
        self.evaluated = False
        if self.short_timeout and self.evals_built:
            distributed.set_collective_timeout(self.short_timeout)
            self.waiting = f'collective_timeout={self.short_timeout}'
            self.short_timeout = None

    def save(self, step, state, extra):
        """Each entry of state, extra and the run's counters, copied to host memory now; rank 0 writes
        them in the background (checkpoint.write) while the steps go on. It first waits for the write
        before, whose buffers it reuses. A replica that diverged is never saved (FSDP's ranks hold
        shards: nothing to compare)."""
        if isinstance(state['model'], torch.nn.Module) and distributed.world_size() > 1:
            checkpoint.check_replicas(state['model'], step)
        # the write before done first: FSDP gathers the state into host memory, which holds one
        self.finish_writes()
        ckpt = dict(checkpoint.state_dicts(state), **extra, step=step, evaluated=self.evaluated,
                    bad_steps=self.bad_steps, rng=checkpoint.rng_state(self.device), logs={})
        if distributed.rank() == 0:
            host, copied = checkpoint.to_host(ckpt, self.host_copy, self.device)
            self.writes.append(self.writer.submit(checkpoint.write, host, copied, self.log_dir,
                                                  self.config['keep_checkpoints']))

    def failed_write(self):
        """The line of rank 0's first write that failed, or None; it waits for none."""
        while self.writes and self.writes[0].done():
            if error := self.writes[0].exception():  # a UserError's line, or another's (W&B's), on one line
                why = ' '.join(str(error).split())
                return why if isinstance(error, UserError) else f"{type(error).__name__} in a write: {why}"
            self.writes.pop(0)
        return None

    def finish_writes(self):
        """Every rank waits until rank 0's writes are done (however long: wait_for_all), then stops, as
        one, if one failed."""
        wait(self.writes)
        error = self.failed_write()
        distributed.wait_for_all()
        if distributed.max_over_ranks(error is not None):
            raise UserError(error or "rank 0 could not write to log_dir")

    def end(self):
        """The run's end: rank 0's writes done (every rank learns how they went), its writer gone."""
        self.finish_writes()
        self.writer.shutdown()

    def log(self, line):
        """Rank 0: a line of log.txt ("{step} {kind} {value}"), and to W&B, in the background."""
        self.writes.append(self.writer.submit(self.write_log, line))

    def write_log(self, line):
        append(os.path.join(self.log_dir, 'log.txt'), line + '\n')
        if self.wandb is not None:
            step, kind, value = line.split()
            self.wandb.log({kind: float(value)}, step=int(step))

    def samples(self, lines):
        print("\n".join(lines))
        self.writes.append(self.writer.submit(append, os.path.join(self.log_dir, 'samples.txt'),
                                              "\n".join(lines) + "\n"))

    def say_checkpoint_cost(self, nbytes):
        """Rank 0, after the first step: the host memory a checkpoint's copy takes, and a warning when a
        stop (the write in flight, then the stop checkpoint's) at SLOW_WRITE_SPEED would outlast the
        time torchrun gives a stopping worker before it kills it."""
        print(f"checkpoints: each save takes {nbytes / 2 ** 20:,.1f} MiB of host memory for the state, "
              f"written in the background")
        grace = int(os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT', 30))
        stop_s = 2 * nbytes / SLOW_WRITE_SPEED
        if 'TORCHELASTIC_RUN_ID' in os.environ and stop_s > grace:
            print(f"warning: a stop may write two checkpoints (the one in flight, then its own): "
                  f"{stop_s:.0f} s at {SLOW_WRITE_SPEED / 1e6:.0f} MB/s, more than the {grace} s that "
                  f"torchrun waits before it kills a stopping worker; give it more with "
                  f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={round(stop_s * 1.5)} (docs/resume.md)")

    def start_wandb(self, config):
        import wandb  # configurator.check_config made sure that every rank has it
        try:
            self.wandb = wandb.init(project=config['wandb_project'], name=config['wandb_run_name'],
                                    config=config, dir=self.log_dir)
        except Exception as e:  # no login, no network (WANDB_MODE=offline needs neither)
            raise UserError(f"wandb_log=True: wandb.init failed ({type(e).__name__}: {e}); WANDB_MODE="
                            f"offline logs without a login or network, for `wandb sync` later") from None

    def write_run_json(self, config, start):
        """This start's entry: the config, the code's commit, versions, hosts and devices."""
        device = self.device
        mine = platform.node(), f"{device}: {hardware.device_name(device)}"
        hosts, devices = zip(*distributed.gather_objects(mine))
        if distributed.rank() > 0:
            return
        # `git describe` with no tag to name: the commit's hash, then '-dirty' if a tracked file differs
        try:
            commit, _, dirty = subprocess.run(
                ['git', '--no-optional-locks', '-C', os.path.join(os.path.dirname(__file__), '..'),
                 'describe', '--always', '--dirty', '--abbrev=40', '--exclude=*'],
                capture_output=True, text=True, timeout=10, check=True).stdout.strip().partition('-')
        except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or a timeout
            commit = dirty = None
        from gptkit.shards import dataset_of
        entry = {
            'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'start_step': start, 'resumed_from': self.checkpoint_path, 'command': sys.argv,
            'git_commit': commit, 'git_modified': None if commit is None else bool(dirty),
            'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
            'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if device.startswith('cuda') else None,
            'world_size': len(devices), 'hosts': sorted(set(hosts)), 'devices': devices,
            'wandb_run_id': self.wandb and self.wandb.id,
            'dataset': dataset_of(config['data_root']), 'config': config,
        }
        path = os.path.join(self.log_dir, 'run.json')
        entries = []
        if os.path.exists(path):
            with open(path) as f:
                try:
                    entries = json.load(f)
                except ValueError as e:  # never half-written (atomic): edited by hand
                    raise UserError(f"{path} is not JSON ({e}): fix it, or move it away") from None
        atomic_write(path, lambda f: f.write(json.dumps(entries + [entry], indent=1).encode()))


def append(path, text):
    """text at the end of the file at path; an error names the file."""
    try:
        with open(path, 'a') as f:
            f.write(text)
    except OSError as e:
        raise UserError(f"could not write {path} ({e})") from None


class LogDirLock:
    """One run per log_dir: rank 0 holds log_dir/run.lock, which names the run, while the run lasts."""

    def __init__(self, log_dir):
        self.log_dir, self.file, self.made = log_dir, None, []

    def acquire(self):
        """'' once taken, else the line naming the holder. A POSIX lock: it ends with its process."""
        path, folder, made = os.path.join(self.log_dir, 'run.lock'), os.path.abspath(self.log_dir), []
        while not os.path.exists(folder):  # the folders makedirs makes, to remove them if left empty
            made, folder = made + [folder], os.path.dirname(folder)
        os.makedirs(self.log_dir, exist_ok=True)
        if os.name != 'posix':
            return ''
        import fcntl
        while True:
            try:
                f = open(path, 'a+')  # created, or opened as it is: the holder's line stays for others
            except FileNotFoundError:  # a start that failed removed the empty log_dir just now
                os.makedirs(self.log_dir, exist_ok=True)
                continue
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # A run that ends removes run.lock while it holds it: if that came between our open
                # and our lock, no one else will open this file. Lock the one the name gives now.
                if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                    break
            except (BlockingIOError, PermissionError):  # another process holds it
                f.seek(0)
                holder = f.read().strip() or 'a process that has not written its name yet'
                f.close()
                return (f"log_dir={self.log_dir} is in use by a live run ({holder}; {path}); wait for it to "
                        f"end or stop it, or choose another log_dir")
            except FileNotFoundError:  # removed as above, and not made again yet
                pass
            except OSError as e:  # ENOLCK, ENOSYS: a file system without locks
                f.close()
                print(f"warning: cannot lock {path} ({e}): nothing stops a second run from using "
                      f"this log_dir")
                return ''
            f.close()
        f.truncate(0)
        started = time.strftime('%Y-%m-%d %H:%M:%S')
        print(f"pid {os.getpid()} on {os.uname().nodename} since {started}", file=f, flush=True)
        self.file, self.made = f, made
        return ''

    def release(self):
        """run.lock removed while still held (no file names a run that is gone), and the folders that
        acquire made, if empty."""
        if self.file is None:
            return
        try:
            os.remove(self.file.name)
            for folder in self.made:  # log_dir, then the parents it needed: only an empty one goes
                os.rmdir(folder)
        except OSError:
            pass
        self.file.close()
        self.file = None

