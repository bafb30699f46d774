"""
What talks across processes, in one place: the torchrun restart store, the end of the process
group, the one helper by which all ranks agree on a decision, the DDP and FSDP wrappings, the
gradient-sync toggle, the global gradient norm, the whole model for the evals, the full state for
checkpoints, and what each rank holds. train_gpt2.py starts the process group (from torchrun's
RANK, LOCAL_RANK, WORLD_SIZE) and all-reduces its losses and HellaSwag counts in the open; every
other collective of the trainer is here. docs/ddp.md and docs/fsdp.md tell the whole story.

How long a rank waits (docs/ddp.md, 10): every collective of the process group gives up after
collective_timeout (train_gpt2.py) once the first training step is done, so a stuck rank (an NFS
stall, a GPU fault) ends the run in minutes; before that, after FIRST_STEP_TIMEOUT, as each rank
compiles its first graphs at its own pace. Where ranks work apart (rank 0 writing a checkpoint or
downloading, every rank reading a checkpoint), they meet first in wait_for_all, through the process
group's store, for up to WAIT_FOR_ALL_TIMEOUT; the collective after it then waits for ordinary work.

parallel="fsdp" is PyTorch's FSDP2 (fully_shard), for models whose weights, gradients and AdamW
state do not fit on every GPU whole, as DDP keeps them (docs/ddp.md, 12). Each transformer block,
and the root (embeddings, final norm, the tied output layer), becomes one FSDP unit: every rank
keeps a 1/world_size shard of each parameter, of its gradient and of its AdamW state; before a
unit runs its parameters are all-gathered, after its backward its gradients are reduce-scattered.
Precision stays autocast, as under DDP, so FSDP and DDP compute the same numbers (FSDP's
MixedPrecisionPolicy would all-gather in bf16, half the traffic, but would also run layer norms
and the residual stream in bf16). The rest of the trainer sees full tensors only: checkpoints hold
the full state, in DDP's format, and the evals run on a plain copy of the whole model.
"""
import gc
import os
import re
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
# FSDP and DTensor are imported by shard_fsdp, when a run shards: 0.75 s of every start otherwise

# -----------------------------------------------------------------------------
# the process group: who this process is, how a torchrun restart meets, how it ends


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def restart_store():
    """The store for init_process_group under torchrun: None (torchrun's own), or on one node a
    fresh key space per restart attempt. torchrun's agent store outlives a worker group, and a
    restarted group would read the dead group's keys (a hang or a failed connect)."""
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    env = os.environ
    if int(env.get('GROUP_WORLD_SIZE', 1)) == 1:  # one node's agent counts the attempts, so they key it
        store = dist.TCPStore(env['MASTER_ADDR'], int(env['MASTER_PORT']), int(env['WORLD_SIZE']),
                              is_master=False, timeout=timedelta(minutes=10))
        return dist.PrefixStore(f"train_gpt2/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)
    if int(env['RANK']) == 0 and int(env.get('TORCHELASTIC_MAX_RESTARTS', 0)) > 0:  # nodes count apart
        print("warning: restarts on several nodes: a restarted worker group can read the dead group's keys "
              "in torchrun's shared store; launch torchrun with --rdzv-backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each group meets in a new store "
              "(see docs/resume.md)")
    return None


# Hours that no healthy first compile (FIRST_STEP_TIMEOUT) or work apart (WAIT_FOR_ALL_TIMEOUT: a
# checkpoint write, a download) takes, and a hang does: the run then ends, and a requeue can restart it.
FIRST_STEP_TIMEOUT = 3600  # seconds every collective waits until the first training step is done
WAIT_FOR_ALL_TIMEOUT = 2 * 3600  # seconds wait_for_all waits
waiting = 'FIRST_STEP_TIMEOUT'  # the limit a collective waits under now, as the error line names it
_waits = 0  # wait_for_all's calls so far: each one meets on keys of its own


def first_step_timeout(collective_timeout):
    """The process group's timeout from init_process_group to the end of the first training step."""
    global waiting
    seconds = max(collective_timeout, FIRST_STEP_TIMEOUT)
    waiting = f'FIRST_STEP_TIMEOUT={seconds}'
    return timedelta(seconds=seconds)


def hold_to(collective_timeout):
    """On every rank, once the first training step is done: from here every collective gives up after
    collective_timeout. The ranks meet first, under the longer timeout, so that none waits under the
    shorter one for a rank still in its first step."""
    global waiting
    if dist.is_initialized():
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout))
    waiting = f'collective_timeout={collective_timeout}'


def first_on_node():
    """Whether this process is its node's first (torchrun's LOCAL_RANK 0, or no torchrun): the one that
    downloads into the node's caches while the others wait in wait_for_all, as nodes may not share them."""
    return int(os.environ.get('LOCAL_RANK', 0)) == 0


def wait_for_all():
    """A barrier after a phase where ranks work apart (rank 0 writing a checkpoint, downloading, every
    rank reading a checkpoint), for up to WAIT_FOR_ALL_TIMEOUT, however short collective_timeout is.
    It meets in the process group's store, which every rank reaches already (no second transport)."""
    global _waits
    if world_size() == 1:
        return
    _waits += 1
    key, store = f'wait_for_all/{_waits}', dist.distributed_c10d._get_default_store()
    if store.add(key, 1) == world_size():  # the last rank to come lets them all go
        store.set(f'{key}/all', '')
    store.wait([f'{key}/all'], timedelta(seconds=WAIT_FOR_ALL_TIMEOUT))


def gave_up(error, rank, phase):
    """The one line for error when it is a wait for the other ranks that gave up (a collective, or
    wait_for_all in the store) while the run was in phase (the trainer names it); else None."""
    if not (dist.is_initialized() and re.search(r'[Tt]imed? ?out', str(error))):
        return None
    limit = waiting
    if isinstance(error, dist.DistStoreError):  # wait_for_all's
        limit = f'WAIT_FOR_ALL_TIMEOUT={WAIT_FOR_ALL_TIMEOUT}'
    return (f"error: rank {rank} waited more than {limit} s for the other ranks in {phase}: one of them is "
            f"stuck or gone; the last checkpoint stands: run the same command again to resume")


def end_process_group(finished):
    """Leave the process group. finished: every rank got to the end of the run, so they wait for
    each other first (no rank tears down while rank 0 still writes its last checkpoint)."""
    if not dist.is_initialized():
        return
    try:
        if finished:
            wait_for_all()
    finally:
        gc.collect()  # FSDP's sharded tensors hold gloo work: free them while Python is whole
        dist.destroy_process_group()


def agree(value, op='max'):
    """value (a bool or an int) combined over all ranks, the same answer on every rank: with 'max',
    a flag is True when it is True on any rank; with 'min', only when it is True on every rank.
    Every decision that all ranks must take together goes through here."""
    assert op in ('max', 'min'), op
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

# -----------------------------------------------------------------------------
# training: DDP or FSDP, the gradient-sync toggle, the global gradient norm


def wrap_ddp(model, device):
    """DDP: gradients all-reduced during backward (bucket by bucket); rank 0's weights everywhere at
    start. The gradients are views into the buckets: no second copy of them, and no copy per step.
    DDP makes a gradient that exists at its construction a view at once (one that does not exist
    would be allocated apart by the first micro-steps), and zero_grad keeps them so."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    wait_for_all()  # the ranks read data and checkpoint each at its own pace; DDP's broadcast is bounded
    device_ids = [torch.device(device).index] if device.startswith('cuda') else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)


def zero_grad(model, optimizer):
    """Before a step. Under DDP the gradients are zeroed in place: set to None, the backward of each
    micro-step without sync would allocate new ones beside DDP's buckets (4 bytes per parameter
    more) and the sync would copy them in. Elsewhere they are freed, for the forward's activations."""
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))


def shard_fsdp(model):
    """FSDP: shard model in place (before the optimizer is built: it must see the sharded parameters)."""
    from torch.distributed.fsdp import fully_shard
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)  # the rest: wte (= lm_head, one parameter), wpe, ln_f
    if rank() == 0:
        print(f"fsdp: {len(model.transformer.h) + 1} units, each sharded over {world_size()} process(es)")
    return model


def is_sharded(model):
    fsdp = sys.modules.get('torch.distributed.fsdp')  # not imported: nothing is sharded
    return fsdp is not None and isinstance(getattr(model, '_orig_mod', model), fsdp.FSDPModule)  # compiled


def is_dtensor(t):
    dtensor = sys.modules.get('torch.distributed.tensor')  # not imported: no DTensor exists
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t):
    """This rank's shard of a DTensor (FSDP's parameters and state); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def require_backward_grad_sync(model, sync):
    """Whether this micro-step's backward synchronises gradients across ranks: DDP's all-reduce or
    FSDP's reduce-scatter. Off for all micro-steps but the last: the gradients accumulate locally.
    A plain module (one process) has nothing to synchronise."""
    if is_sharded(model):
        getattr(model, '_orig_mod', model).set_requires_gradient_sync(sync)  # inside torch.compile's wrapper
    elif isinstance(model, DDP):
        model.require_backward_grad_sync = sync  # DDP reads it in forward, for the backward that follows


def full(t):
    """A DTensor gathered whole on every rank (a collective); any other tensor as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def clip_grad_norm(model, max_norm):
    """Clip the gradients to a global norm of max_norm (0: no clipping) and return that norm, the
    same on every rank: DDP's gradients are already whole; FSDP's shards make it a collective."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float('inf'))
    return full(norm)

# -----------------------------------------------------------------------------
# evals and checkpoints: the whole model, the full state


def whole_models(model, raw_model, optimizer, device):
    """(model, raw_model) for this step's evals and samples: model without DDP's wrapper (compiled,
    if compiled) and the plain raw_model. Under FSDP both are one plain GPT holding the whole
    weights, gathered: 4 bytes per parameter on every rank, for as long as the caller holds it
    (keep it in a function's locals: it goes when the function returns). The gradients are freed
    first to make room (the next step zeroes them anyway)."""
    if not is_sharded(raw_model):  # the evals' ranks run different numbers of batches: no DDP there
        return (model.module if isinstance(model, DDP) else model), raw_model
    from model import GPT
    optimizer.zero_grad(set_to_none=True)
    copy = GPT.empty(raw_model.config, device)  # no random init: the run's RNG stream stays as it was
    with torch.no_grad():
        targets = dict(copy.named_parameters())
        for name, p in raw_model.named_parameters():
            targets[name].copy_(full(p))
    return copy, copy


def full_state(model, optimizer):
    """(model state_dict, optimizer state_dict), full, on rank 0 (None, None elsewhere); every rank
    must call it. Under FSDP gathered one tensor at a time and moved to the CPU: rank 0 holds at
    most one full copy of the state, in the same format as DDP's."""
    if not is_sharded(model):
        return (model.state_dict(), optimizer.state_dict()) if rank() == 0 else (None, None)
    gathered = {}

    def keep(t):  # the tied wte/lm_head weight is gathered once, and saved once (one storage, two keys)
        shard = local(t)  # state_dict() gives a new DTensor per key
        key = (shard.data_ptr(), tuple(shard.shape)) if shard.numel() else id(t)
        if key not in gathered:
            whole = full(t)
            gathered[key] = whole.cpu() if rank() == 0 else None
        return gathered[key]
    model_state = {k: keep(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()  # indexed by position in the param groups, as without FSDP
    opt_state = {i: {k: keep(v) if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in opt['state'].items()}
    if rank() > 0:
        return None, None
    return model_state, {'state': opt_state, 'param_groups': opt['param_groups']}


def load_full_state(model, optimizer, model_state, opt_state):
    """Load full state dicts (every rank holds them: the checkpoint is read on every rank) into the
    model and its optimizer; under FSDP each rank keeps its own shards."""
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(opt_state)
        return
    from torch.distributed.tensor import distribute_tensor

    def shard_like(p, t):  # this rank's shard of the full tensor t, placed as parameter p is
        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_like(p, model_state[name]))
    order = [p for group in optimizer.param_groups for p in group['params']]
    state = {i: {k: shard_like(order[i], v) if torch.is_tensor(v) and v.dim() > 0 else v
                 for k, v in s.items()} for i, s in opt_state['state'].items()}
    optimizer.load_state_dict({'state': state, 'param_groups': opt_state['param_groups']})


def state_mib(model, optimizer):
    """MiB of parameters, gradients and optimizer state that this rank holds (its shards under
    FSDP; whole tensors under DDP or one process)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = [local(t) for t in tensors]
    return sum(t.numel() * t.element_size() for t in tensors) / 2 ** 20
