"""
What talks across processes, beside the DDP story that train_gpt2.py tells in the open (its process
group, DDP wrapper, gradient-sync toggle and all-reduces): how long a rank waits, the one helper by
which all ranks agree on a decision, and leaving the process group. FSDP lives in gptkit/fsdp.py,
imported only by the runs that shard. docs/ddp.md tells the whole story.

How long a rank waits (docs/ddp.md, 10): until the first training step is done, every collective
waits up to FIRST_STEP_TIMEOUT, as each rank compiles its first graphs at its own pace; after it,
collective_timeout (train_gpt2.py), so that a stuck rank (an NFS stall, a GPU fault) ends the run in
minutes. Where rank 0 works alone once training has begun (writing a checkpoint, the end of the
run), the others wait for it in wait_for_all, through the process group's store, up to
WAIT_FOR_ALL_TIMEOUT, however short collective_timeout is.
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

# Hours that no healthy first compile or checkpoint write takes, and a hang does: the run then ends,
# and a requeue can restart it.
FIRST_STEP_TIMEOUT = 3600  # seconds every collective waits until the first training step is done
WAIT_FOR_ALL_TIMEOUT = 2 * 3600  # seconds wait_for_all waits
waiting = 'FIRST_STEP_TIMEOUT'  # the limit a collective waits under now, as the error line names it
_waits = 0  # wait_for_all's calls so far: each one meets on keys of its own


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def restart_store():
    """The store for init_process_group under torchrun: None (torchrun's own), or on one node a
    fresh key space per restart attempt. torchrun's agent store outlives a worker group, and a
    restarted group would read the dead group's keys (its ranks' addresses: a refused connect, or a
    hang; seen 4 times in 10 without it)."""
    env = os.environ
    if env.get('TORCHELASTIC_USE_AGENT_STORE') == 'True' and int(env.get('GROUP_WORLD_SIZE', 1)) == 1:
        # one node's agent counts the attempts, so they key it: its store, seen through this attempt's prefix
        return dist.PrefixStore(f"train_gpt2/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", dist.TCPStore(
            env['MASTER_ADDR'], int(env['MASTER_PORT']), int(env['WORLD_SIZE']), is_master=False,
            timeout=timedelta(minutes=10)))
    if (env.get('TORCHELASTIC_USE_AGENT_STORE') == 'True' and int(env['RANK']) == 0
            and int(env.get('TORCHELASTIC_MAX_RESTARTS', 0)) > 0):  # several nodes count their attempts apart
        print("warning: restarts on several nodes: a restarted worker group can read the dead group's keys "
              "in torchrun's shared store; launch torchrun with --rdzv-backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each group meets in a new store "
              "(see docs/resume.md)")
    return None


def set_rank_environment(log_dir):
    """Under torchrun, before the process group is made, what the user has not set. NCCL's flight
    recorder: the last collectives of each rank, dumped into log_dir/nccl_trace_rank_N when one times
    out (docs/ddp.md, 10, reads them; gloo ignores them). Inductor's compile workers: the CPUs this
    process may use, shared among the ranks of its node (inductor starts up to 32 for each rank)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    # each value keyed by the names the user may have set it under, the one set here first: torch still
    # reads the older names of the buffer (warning that they are) and of the dump's path (second)
    defaults = {('TORCH_NCCL_DUMP_ON_TIMEOUT',): '1',
                ('TORCH_FR_BUFFER_SIZE', 'TORCH_NCCL_TRACE_BUFFER_SIZE'): '2000',
                ('TORCH_FR_DUMP_TEMP_FILE', 'TORCH_NCCL_DEBUG_INFO_TEMP_FILE'):
                    os.path.join(os.path.abspath(log_dir), 'nccl_trace_rank_'),
                ('TORCHINDUCTOR_COMPILE_THREADS',):
                    str(max(1, cpus // int(os.environ.get('LOCAL_WORLD_SIZE', 1))))}
    os.environ.update({names[0]: value for names, value in defaults.items()
                       if not any(name in os.environ for name in names)})


def first_step_timeout(collective_timeout):
    """The process group's timeout from init_process_group to the end of the first training step."""
    global waiting
    seconds = max(collective_timeout, FIRST_STEP_TIMEOUT)
    waiting = f'FIRST_STEP_TIMEOUT={seconds}'
    return timedelta(seconds=seconds)


def set_collective_timeout(collective_timeout):
    """On every rank, once the first training step is done: from here every collective gives up after
    collective_timeout. The ranks meet first, under the longer timeout, so that none waits under the
    shorter one for a rank still in its first step. Later calls do nothing."""
    global waiting
    if waiting.startswith('collective_timeout'):  # set already, by the last line below: no barrier per step
        return
    if dist.is_initialized():
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout))
    waiting = f'collective_timeout={collective_timeout}'


def wait_for_all():
    """A barrier after rank 0 has worked alone (a checkpoint write, the end of the run), for up to
    WAIT_FOR_ALL_TIMEOUT, however short collective_timeout is. It meets in the process group's store
    (restart_store: a torchrun attempt's own keys): each rank sets a key of its own for this call,
    then waits until every rank's is there."""
    global _waits
    if world_size() == 1:
        return
    _waits += 1
    store = dist.distributed_c10d._get_default_store()
    store.set(f'wait_for_all/{_waits}/{rank()}', '')
    store.wait([f'wait_for_all/{_waits}/{r}' for r in range(world_size())],
               timedelta(seconds=WAIT_FOR_ALL_TIMEOUT))


def agree(value, op='max'):
    """value (a bool or an int) combined over all ranks, the same answer on every rank: with 'max',
    a flag is True when it is True on any rank; with 'min', only when it is True on every rank.
    Every decision that all ranks must take together goes through here."""
    if world_size() == 1:
        return value
    t = torch.tensor(int(value), device='cuda' if dist.get_backend() == 'nccl' else 'cpu')  # NCCL: GPUs only
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == 'max' else dist.ReduceOp.MIN)
    return type(value)(t.item())


def sum_over_ranks(t):
    """t summed over all ranks, in place, the same on every rank (one process: t as it is)."""
    if world_size() > 1:
        dist.all_reduce(t)


def gather_objects(obj):
    """[obj of rank 0, of rank 1, ...] on every rank (small picklable objects: names, hosts)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def end_process_group(finished):
    """Leave the process group (at exit). finished: the run got to its end (or stopped on a signal),
    so every rank waits for the others first: none tears down while rank 0 still writes."""
    if not dist.is_initialized():
        return
    try:
        if finished:
            wait_for_all()
    finally:
        import gc
        gc.collect()  # FSDP's sharded tensors hold gloo work: free them while Python is whole
        dist.destroy_process_group()
