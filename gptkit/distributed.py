"""
What talks across processes beside what train_gpt2.py does in the open: decisions every rank takes
together, the store a torchrun restart meets in, the timeouts. Stateless; docs/ddp.md tells why.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gptkit.common import cpu_cores

# hours that no healthy first compile or checkpoint write takes, and a hang does
FIRST_STEP_TIMEOUT = 3600  # seconds every collective waits until the first step and evals are done
WAIT_FOR_ALL_TIMEOUT = 2 * 3600  # seconds the others wait for rank 0's work alone (wait_for_all)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def _reduce(value, op):
    if world_size() == 1:
        return value
    t = torch.tensor(int(value), device='cuda' if dist.get_backend() == 'nccl' else 'cpu')  # NCCL: GPUs only
    dist.all_reduce(t, op=op)
    return type(value)(t.item())


def max_over_ranks(value):
    """A flag True on any rank is True on all (a bool or an int: the largest)."""
    return _reduce(value, dist.ReduceOp.MAX)


def min_over_ranks(value):
    """A flag True only if True on every rank (a bool or an int: the smallest)."""
    return _reduce(value, dist.ReduceOp.MIN)


def sum_over_ranks(t):
    if world_size() > 1:
        dist.all_reduce(t)


def barrier():
    if world_size() > 1:
        dist.barrier()


def gather_objects(obj):
    """[obj of rank 0, of rank 1, ...] on every rank (small picklable objects: names, hosts)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def restart_store():
    """None (torchrun's store), or on one node a key space per restart attempt: torchrun's store
    outlives a worker group, and a restarted group would read the dead one's keys (a hang)."""
    env = os.environ
    if env.get('TORCHELASTIC_USE_AGENT_STORE') == 'True' and int(env.get('GROUP_WORLD_SIZE', 1)) == 1:
        # one node's agent counts the attempts: its store, seen through this attempt's prefix
        store = dist.TCPStore(env['MASTER_ADDR'], int(env['MASTER_PORT']), int(env['WORLD_SIZE']),
                              is_master=False, timeout=timedelta(minutes=10))
        return dist.PrefixStore(f"train_gpt2/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
    if (env.get('TORCHELASTIC_USE_AGENT_STORE') == 'True' and int(env['RANK']) == 0
            and int(env.get('TORCHELASTIC_MAX_RESTARTS', 0)) > 0):  # several nodes count apart
        print("warning: restarts on several nodes: a restarted worker group can read the dead group's keys "
              "in torchrun's shared store; launch torchrun with --rdzv-backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each group meets in a new store "
              "(see docs/resume.md)")
    return None


def set_rank_environment(log_dir):
    """What torch does not choose for a run, unless the user did: where NCCL's flight recorder dumps
    when a collective times out, log_dir/nccl_trace_rank_N beside the run's log (torch records and dumps
    by default, but into each node's ~/.cache/torch), and inductor's compile workers, this node's CPUs
    shared among its ranks."""
    cpus = cpu_cores()
    # keyed by the names the user may have set each under: torch still reads the older one (second)
    defaults = {('TORCH_FR_DUMP_TEMP_FILE', 'TORCH_NCCL_DEBUG_INFO_TEMP_FILE'):
                    os.path.join(os.path.abspath(log_dir), 'nccl_trace_rank_'),
                ('TORCHINDUCTOR_COMPILE_THREADS',):
                    str(max(1, cpus // int(os.environ.get('LOCAL_WORLD_SIZE', 1))))}
    os.environ.update({names[0]: value for names, value in defaults.items()
                       if not any(name in os.environ for name in names)})


def set_collective_timeout(seconds):
    """From here every collective gives up after seconds; the ranks meet first, under the long one."""
    if dist.is_initialized():
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def wait_for_all():
    """A barrier after rank 0 has worked alone (a checkpoint write), for up to WAIT_FOR_ALL_TIMEOUT,
    however short collective_timeout is: in the store, which counts each rank's calls."""
    if world_size() == 1:
        return
    # the group's own store, whose counts start at zero: a restart on one node meets in a key space of its
    # own (restart_store), one on several nodes in a new store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).
    # Not keyed by torchrun's attempt: each node's agent counts its own, and a node restarted for
    # another's failure counts none (a hang, seen with 2 nodes)
    store = dist.distributed_c10d._get_default_store()
    n = store.add(f'wait_for_all/calls/{rank()}', 1)
    store.set(f'wait_for_all/{n}/{rank()}', '')
    keys = [f'wait_for_all/{n}/{r}' for r in range(world_size())]
    store.wait(keys, timedelta(seconds=WAIT_FOR_ALL_TIMEOUT))


def end_process_group(finished):
    """At exit. A run that finished (or stopped on a signal) waits for rank 0's last writes first."""
    if not dist.is_initialized():
        return
    try:
        if finished:
            wait_for_all()
    finally:
        import gc
        gc.collect()  # FSDP's sharded tensors hold gloo work: free them while Python is whole
        dist.destroy_process_group()
