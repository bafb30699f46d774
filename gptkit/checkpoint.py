"""
Checkpoints, log_dir/model_{step:05d}.pt: build-nanogpt's model, config, step and val_loss, plus what
an exact resume needs (RESUME_KEYS). Rank 0 writes them, in the background, and validates them;
gptkit/run.py says when.
"""
import copy
import os
import re
import sys
import zipfile

import torch

from gptkit import distributed
from gptkit.common import UserError, atomic_write

RESUME_KEYS = ('model', 'optimizer', 'config', 'train_config', 'step', 'evaluated', 'loader', 'rng',
               'bad_steps', 'checksum')


def checksum(obj):
    """The sum of every tensor's bytes in obj, as int64 (which wraps alike everywhere), each device read
    once: torch.load checks no CRC, so a byte flipped on disk would load without complaint."""
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


def load(path):
    """torch.load of a checkpoint file, its tensors memory-mapped and no pickled code run. A file that
    is not a whole zip archive is a ValueError that says so: torch's errors speak of miniz and mmap."""
    if os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise ValueError("not a whole zip archive, as torch.save writes: cut short, or another kind of file")
    return torch.load(path, map_location='cpu', weights_only=True, mmap=True)


def read_checkpoint(path):
    """The checkpoint at path, checked against a model and optimizer on the meta device (no memory):
    ValueError says what is wrong with it, OSError that it could not be read."""
    import pickle
    import warnings

    from model import GPT, GPTConfig
    # every byte read first: a read error (I/O, permissions) shows here, and proves nothing about the file
    with open(path, 'rb') as f:
        while f.read(1 << 24):
            pass
    try:
        ckpt = load(path)
        missing = [k for k in RESUME_KEYS if k not in ckpt]
        if missing:
            raise ValueError(f"no {', '.join(missing)}: not a checkpoint this trainer can resume from")
        if checksum(dict(ckpt, checksum=None)) != ckpt['checksum']:  # of all but itself, as it was written
            raise ValueError("the tensors do not match the checksum written with them: the file is corrupt")
        # copying into a meta model checks names and shapes only (torch warns that it does nothing)
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
    """Rank 0: (step, path, checkpoint) of the newest one that loads, or (-1, None, None); newer ones
    that do not are renamed aside (*.bad)."""
    bad = []
    for step, path in list_checkpoints(log_dir):
        try:
            ckpt = read_checkpoint(path)
        except ValueError as e:
            bad.append((path, e))
            continue
        except (OSError, MemoryError) as e:
            raise UserError(f"cannot read {path} ({type(e).__name__}: {e}); that is no proof the checkpoint "
                            f"is bad, so nothing falls back: fix the cause and run again") from None
        for p, why in bad:  # replacing an earlier .bad of this step, if any (the same state: resumes exactly)
            os.replace(p, f"{p}.bad")
            print(f"warning: cannot resume from {p}: {why}; renamed it {os.path.basename(p)}.bad")
        return step, path, ckpt
    if bad:  # one line for them all: with no older one to fall back to, none is renamed
        whys = '; '.join(f"{p}: {why}" for p, why in bad)
        raise UserError(f"{log_dir!r} holds checkpoints but none can be resumed from ({whys}): move them "
                        f"away to start afresh, or point log_dir elsewhere")
    return -1, None, None


def find_checkpoint(log_dir, resume):
    """(path, checkpoint) to resume from, or (None, None): rank 0 chooses, the others read that file."""
    rank, path, ckpt, error = distributed.rank(), None, None, ''
    if rank == 0 and (found := list_checkpoints(log_dir)):
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
            ckpt = load(path)
        except Exception as e:  # not there, or unreadable here: this rank's line, then every rank stops
            error = f"rank {rank} cannot read {path}: {type(e).__name__}: {e}"
            print(f"error: {error}", file=sys.stderr)
    if distributed.max_over_ranks(bool(error)):
        raise UserError(error or f"another rank could not read {path}: log_dir must be on a filesystem "
                                 f"that every node sees")
    return path, ckpt


def rng_state(device):
    """torch's generators, CPU and CUDA (the loader has its own)."""
    if torch.device(device).type == 'cuda':
        return {'torch': torch.get_rng_state(), 'cuda': torch.cuda.get_rng_state(device)}
    return {'torch': torch.get_rng_state()}


def set_rng_state(state, device):
    torch.set_rng_state(state['torch'])  # (older checkpoints also hold Python's and numpy's: unused)
    if torch.device(device).type == 'cuda' and 'cuda' in state:
        torch.cuda.set_rng_state(state['cuda'], device)


def state_dicts(state):
    return {key: obj.state_dict() for key, obj in state.items()}


def load_state(state, ckpt, path):
    """Each entry of state from the checkpoint at path, by its load_state_dict. An optimizer keeps its
    own settings (lr, weight decay); an entry the checkpoint lacks starts afresh, and says so."""
    for key, obj in state.items():
        saved = ckpt.get(key)
        if not saved:  # a GradScaler that was off saved {}; an entry added since the checkpoint
            # state_dict() on every rank: under FSDP it is a collective
            if key not in ckpt and obj.state_dict() and distributed.rank() == 0:
                print(f"warning: {path} holds no {key!r}: it starts afresh")
            continue
        optimizer = getattr(obj, 'optimizer', obj)  # FSDP's WholeOptimizer: the optimizer it wraps
        if isinstance(optimizer, torch.optim.Optimizer):
            saved = dict(saved, param_groups=optimizer.state_dict()['param_groups'])
        try:
            obj.load_state_dict(saved)
        except UserError as e:  # the loader's: another data_root or shuffle
            raise UserError(f"{path}: {e}") from None
        # an optimizer's state on a CPU would alias the checkpoint's memory map
        if isinstance(optimizer, torch.optim.Optimizer):
            for s in optimizer.state.values():
                s.update({k: v.clone() for k, v in s.items() if torch.is_tensor(v) and v.is_cpu})


def check_replicas(model, step):
    """Every rank's weights are rank 0's, bit for bit: DDP sends weights only at the start, so
    replicas stay equal only while every rank computes the same bits."""
    sums = distributed.gather_objects(checksum(list(model.parameters())))
    if differ := [str(r) for r, s in enumerate(sums) if s != sums[0]]:
        ranks = f"rank{'s' * (len(differ) > 1)} {', '.join(differ)}"
        raise UserError(f"step {step}: the weights of {ranks} differ from rank 0's: DDP keeps replicas "
                        f"equal only while every rank computes the same bits (the same GPU model, driver and "
                        f"library versions); no checkpoint of step {step} was written: resume from the last "
                        f"one on matching hardware")


def state_bytes(model, optimizer, pinned=False):
    """The bytes of a checkpoint's tensors: the whole weights and optimizer state (FSDP's too); pinned:
    as much host memory as their copies take there (torch's pinned allocator rounds each buffer up to a
    power of two)."""
    tensors = [t for p in model.parameters() for t in (p, *optimizer.state.get(p, {}).values())]
    sizes = [t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)]
    return sum(1 << (n - 1).bit_length() if pinned else n for n in sizes)


def to_host(ckpt, buffers, device):
    """ckpt with the tensors that training goes on changing copied into buffers ({leaf's place:
    tensor}), host memory kept from one save to the next; and None, or, from a GPU, the event that
    marks the copies done (into pinned memory, they run while the host goes on). Those are the
    device's tensors; a GPU run's host tensors are copies already (FSDP's gathered state, the RNG's).
    A tensor met twice (the tied wte/lm_head) is copied once; deepcopy keeps the rest as it is."""
    copies, memo, gpu = {}, {}, False
    for i, t in enumerate(filter(torch.is_tensor, torch.utils._pytree.tree_leaves(ckpt))):
        key = t.data_ptr(), t.dtype, t.shape, t.stride()
        if t.device.type != torch.device(device).type:
            copies[key] = t
        elif key not in copies:
            if i not in buffers or (buffers[i].dtype, buffers[i].shape) != (t.dtype, t.shape):
                buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            # an event waits for CUDA's copies; MPS's block (it has no such event here)
            copies[key] = buffers[i].copy_(t, non_blocking=not t.is_mps)
            gpu = gpu or t.is_cuda
        memo[id(t)] = copies[key].detach()  # a tensor of its own, as torch.save would see t
    copied = None
    if gpu:
        copied = torch.cuda.Event()
        copied.record()
    return copy.deepcopy(ckpt, memo), copied


def write(ckpt, copied, log_dir, keep_checkpoints):
    """Rank 0, on the writer thread, once the event copied (or None) says that ckpt is on the host:
    the checkpoint with its checksum, atomically, then the oldest beyond keep_checkpoints deleted. A
    UserError says why a write failed."""
    if copied is not None:
        copied.synchronize()
    path = os.path.join(log_dir, f"model_{ckpt['step']:05d}.pt")
    ckpt['checksum'] = checksum(ckpt)
    # the checksum is the one check (read_checkpoint's): torch.load would not check torch.save's CRC32
    torch.serialization.set_crc32_options(False)
    try:
        # the lines the checkpoint vouches for, written before it on this thread, reach the disk first
        ckpt['logs'] = log_sizes(log_dir)
        for name in ckpt['logs']:
            with open(os.path.join(log_dir, name), 'a') as f:
                os.fsync(f.fileno())
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:
        # a failed write makes torch.save raise 'unexpected pos', whose context is the OSError that says why
        raise UserError(f"could not write the checkpoint {path} ({e.__context__ or e}); the earlier "
                        f"checkpoints are untouched: fix that (free some space, say) and run the same "
                        f"command again to resume") from None
    for _, old in list_checkpoints(log_dir)[keep_checkpoints:] if keep_checkpoints > 0 else []:
        try:
            os.remove(old)  # only now that a newer one is complete
        except OSError as e:
            print(f"warning: could not delete the old checkpoint {old} ({e})")


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
    """Rank 0: {name: bytes} of log.txt and samples.txt, those that exist."""
    return {name: os.path.getsize(path) for name in ('log.txt', 'samples.txt')
            if os.path.exists(path := os.path.join(log_dir, name))}


def trim_logs(log_dir, logs, start):
    """Rank 0, before the first step: log.txt and samples.txt cut back to their sizes in the checkpoint
    (logs; {} when fresh; None when older than the sizes: the lines of the steps before start), and a
    checkpoint write that a crash cut short removed. The resumed run writes the lines again."""
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
