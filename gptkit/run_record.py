"""
What a run leaves for the people who read it later, on rank 0: log_dir/log.txt and samples.txt
(log, samples); log_dir/run.json, one entry per start or resume (the effective config, the code's
git commit and whether the tree was modified, the versions of Python, torch, CUDA and NCCL, the
devices, hosts and world size, the start time and step); optional Weights & Biases logging
(wandb_log = True).
"""
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

from gptkit import distributed, shards
from gptkit.common import UserError, atomic_write


def device_name(device):
    if device == 'cpu':  # torch's name for the processor, else the platform's
        return torch.cpu.get_capabilities().get('cpu_name') or platform.processor() or platform.machine()
    return torch.cuda.get_device_name(device) if device.startswith('cuda') else device


def write(log_dir, config, start, resumed_from, device):
    """Append this start's entry to log_dir/run.json (rank 0 writes; every rank must call it:
    the hosts and devices are gathered from all)."""
    hosts, devices = zip(*distributed.gather_objects((platform.node(), f"{device}: {device_name(device)}")))
    if distributed.rank() == 0:  # it writes
        # the code's checkout: `git describe` with no tag to name is the commit's hash, with '-dirty' after
        # it when a tracked file differs from it
        try:
            commit, _, dirty = subprocess.run(
                ['git', '--no-optional-locks', '-C', os.path.join(os.path.dirname(__file__), '..'),
                 'describe', '--always', '--dirty', '--abbrev=40', '--exclude=*'],
                capture_output=True, text=True, timeout=10, check=True).stdout.strip().partition('-')
        except (OSError, subprocess.SubprocessError):  # no git installed, not a checkout, or a timeout
            commit = dirty = None
        entry = {
            'started': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
            'start_step': start, 'resumed_from': resumed_from, 'command': sys.argv,
            'git_commit': commit, 'git_modified': None if commit is None else bool(dirty),
            'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,
            'nccl': '.'.join(map(str, torch.cuda.nccl.version())) if device.startswith('cuda') else None,
            'world_size': len(devices), 'hosts': sorted(set(hosts)), 'devices': devices,
            'wandb_run_id': _wandb_run and _wandb_run.id,
            'dataset': shards.dataset_of(config['data_root']), 'config': config,
        }
        path = os.path.join(log_dir, 'run.json')
        entries = []  # the first start's
        if os.path.exists(path):
            with open(path) as f:
                try:
                    entries = json.load(f)
                except ValueError as e:  # never half-written (atomic): edited by hand
                    raise UserError(f"{path} is not JSON ({e}): fix it, or move it away") from None
        atomic_write(path, lambda f: f.write(json.dumps(entries + [entry], indent=1).encode()))


_wandb_run = None


def wandb_start(config, log_dir):
    """Rank 0, when wandb_log: a W&B run with the effective config (files under log_dir/wandb).
    W&B's offline mode (WANDB_MODE=offline) works as online, with `wandb sync` later."""
    global _wandb_run
    import wandb  # configurator.check_config made sure that every rank has it
    try:
        _wandb_run = wandb.init(project=config['wandb_project'], name=config['wandb_run_name'], config=config,
                                dir=log_dir)
    except Exception as e:  # no login, no network (WANDB_MODE=offline needs neither), a bad setting
        raise UserError(f"wandb_log=True: wandb.init failed ({type(e).__name__}: {e}); WANDB_MODE=offline "
                        f"logs without a login or network, for `wandb sync` later") from None


def log(log_dir, line):
    """Rank 0: one line of log_dir/log.txt ("{step} train|val|bpb|hella|skip|overflow|epoch {value}"),
    and its number to W&B, at its step, under its kind."""
    with open(os.path.join(log_dir, 'log.txt'), 'a') as f:
        f.write(line + '\n')
    if _wandb_run is not None:
        step, kind, value = line.split()
        _wandb_run.log({kind: float(value)}, step=int(step))


def samples(log_dir, lines):
    """Rank 0: the trainer's samples, printed and appended to log_dir/samples.txt."""
    print("\n".join(lines))
    with open(os.path.join(log_dir, 'samples.txt'), 'a') as f:
        f.write("\n".join(lines) + "\n")
