"""
parallel="fsdp" for train_gpt2.py: PyTorch's FSDP2 (fully_shard), for models whose weights,
gradients and AdamW state do not fit on every GPU whole, as DDP keeps them (docs/ddp.md, 12).

Each transformer block, and the root (embeddings, final norm, the tied output layer), becomes one
FSDP unit: every rank keeps a 1/world_size shard of each parameter, of its gradient and of its
AdamW state. Before a unit runs, its parameters are all-gathered; after its backward, its
gradients are reduce-scattered (each rank gets the mean of its own shard). Precision stays
autocast, as under DDP: the sharded parameters are float32 and autocast casts them for the
matmuls, so FSDP and DDP compute the same numbers (FSDP's MixedPrecisionPolicy would all-gather
them in bf16, half the traffic, but would also run layer norms and the residual stream in bf16).

The rest of the trainer sees full tensors only: checkpoints hold the full state (gathered one
tensor at a time, so rank 0 holds at most one full copy of the state, on the CPU), in the same
format as DDP's, and the evals run on a plain copy of the whole model, made for them (eval_copy).
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def shard(model):
    """Shard model in place (before the optimizer is built: it must see the sharded parameters)."""
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)  # the rest: wte (= lm_head, one parameter), wpe, ln_f
    if dist.get_rank() == 0:
        print(f"fsdp: {len(model.transformer.h) + 1} units, each sharded over {dist.get_world_size()} process(es)")
    return model


def unwrapped(model):
    return getattr(model, '_orig_mod', model)  # under torch.compile's wrapper


def is_sharded(model):
    return isinstance(unwrapped(model), FSDPModule)


def eval_copy(model, optimizer, device):
    """The model for this step's evals and samples: model itself, or under FSDP a plain GPT holding
    the whole weights (gathered), which the evals then use as they use DDP's plain module. It costs
    4 bytes per parameter on every rank while it lives; the gradients are freed first to make room
    (the next step zeroes them anyway)."""
    if not is_sharded(model):
        return model
    from model import GPT
    optimizer.zero_grad(set_to_none=True)
    with torch.device('meta'):  # no memory, no random init (the run's RNG stream stays as it was)
        plain = GPT(model.config)
    plain.to_empty(device=device)
    plain.lm_head.weight = plain.transformer.wte.weight  # to_empty unties them
    gather_into(plain, model)
    return plain


def set_grad_sync(model, sync):
    """Whether this micro-step's backward synchronises gradients across ranks: DDP's all-reduce or
    FSDP's reduce-scatter. Off for all micro-steps but the last: the gradients accumulate locally."""
    if is_sharded(model):
        unwrapped(model).set_requires_gradient_sync(sync)
    else:
        model.require_backward_grad_sync = sync  # DDP reads it in forward, for the backward that follows


def full(t):
    """A DTensor gathered whole on every rank (a collective); any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model, optimizer, rank):
    """(model state_dict, optimizer state_dict), full, on rank 0 (None, None elsewhere); every rank
    must call it. Gathered one tensor at a time and moved to the CPU: the same format as DDP's."""
    if not is_sharded(model):
        return (model.state_dict(), optimizer.state_dict()) if rank == 0 else (None, None)
    gathered = {}

    def keep(t):  # the tied wte/lm_head weight is gathered once, and saved once
        if id(t) not in gathered:
            whole = full(t)
            gathered[id(t)] = whole.cpu() if rank == 0 else None
        return gathered[id(t)]
    model_state = {k: keep(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()  # indexed by position in the param groups, as without FSDP
    opt_state = {i: {k: keep(v) if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt['state'].items()}
    return (model_state, {'state': opt_state, 'param_groups': opt['param_groups']}) if rank == 0 else (None, None)


def load_full_state(model, optimizer, model_state, opt_state):
    """Load full state dicts (every rank holds them: the checkpoint is read on every rank) into a
    sharded model and its optimizer: each rank keeps its own shards."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(distribute_tensor(model_state[name].to(p.device), p.device_mesh, p.placements, src_data_rank=None))
    order = [p for group in optimizer.param_groups for p in group['params']]
    state = {i: {k: distribute_tensor(v.to(order[i].device), order[i].device_mesh, order[i].placements,
                                      src_data_rank=None) if torch.is_tensor(v) and v.dim() > 0 else v
                 for k, v in s.items()} for i, s in opt_state['state'].items()}
    optimizer.load_state_dict({'state': state, 'param_groups': opt_state['param_groups']})


@torch.no_grad()
def gather_into(plain, model):
    """Copy a sharded model's parameters, whole, into a plain model of the same shape on every rank
    (for the evals and samples, which then run as under DDP)."""
    targets = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        targets[name].copy_(full(p))


def state_mib(model, optimizer):
    """MiB of parameters, gradients and optimizer state that this rank holds (its shards under
    FSDP; whole tensors under DDP or one process)."""
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2 ** 20
