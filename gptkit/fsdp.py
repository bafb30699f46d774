"""
parallel="fsdp": PyTorch's FSDP2 (fully_shard), for models whose weights, gradients and AdamW state
do not fit on every GPU whole, as DDP keeps them (docs/fsdp.md). Imported only by the runs that
shard (under torchrun), so a default run reads none of it.

Each transformer block, and the root (embeddings, final norm, the tied output layer), becomes one FSDP
unit: every rank keeps a 1/world_size shard of each parameter, of its gradient and of its AdamW state;
before a unit runs its parameters are all-gathered, after its backward its gradients are
reduce-scattered. Precision stays autocast, as under DDP, so FSDP and DDP compute the same numbers
(FSDP's MixedPrecisionPolicy would all-gather in bf16, half the traffic, but would also run layer norms
and the residual stream in bf16). The rest of the trainer sees full tensors only: checkpoints hold the
full state, in DDP's format (WholeModel, WholeOptimizer), and the evals run on
a plain copy of the whole model.
"""
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's host only


def shard(model):
    """Shard model in place (before the optimizer is built: it must see the sharded parameters)."""
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)  # the rest: wte (= lm_head, one parameter), wpe, ln_f
    return model


def whole_model(model, optimizer):
    """A plain GPT holding the whole weights of the sharded model, gathered, for the evals: 4 bytes per
    parameter on every rank for as long as the caller holds it. The gradients are freed first to make
    room (the next step zeroes them anyway)."""
    optimizer.zero_grad(set_to_none=True)
    copy = type(model).empty(model.config, next(model.parameters()).device)  # no draw from the RNG
    with torch.no_grad():
        targets = dict(copy.named_parameters())
        for name, p in model.named_parameters():
            targets[name].copy_(p.full_tensor())
    return copy


def _names(model, optimizer):
    """The parameters' names in the optimizer's order: DDP's state_dict numbers them so."""
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for group in optimizer.param_groups for p in group['params']]


class WholeModel:
    """The sharded model as a checkpoint holds it: whole tensors on rank 0's host, in DDP's format.
    Every rank calls state_dict(); load_state_dict() keeps this rank's shards of a whole state."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        state = get_model_state_dict(self.model, options=FULL)
        first = {}  # a tied weight (wte = lm_head) is one tensor under both names, as in DDP's
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if first.setdefault(p, name) != name and name in state:
                state[name] = state[first[p]]
        return state

    def load_state_dict(self, state):
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class WholeOptimizer:
    """The sharded optimizer's state as a checkpoint holds it: whole, numbered by position as DDP's
    optimizer numbers it; loaded with this run's settings (param_groups)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        opt = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)  # keyed by name
        names = _names(self.model, self.optimizer)
        state = {i: opt['state'][n] for i, n in enumerate(names) if n in opt.get('state', {})}
        return {'state': state, 'param_groups': self.optimizer.state_dict()['param_groups']}

    def load_state_dict(self, opt_state):
        names = _names(self.model, self.optimizer)
        groups = [dict(g, params=[names[i] for i in g['params']]) for g in opt_state['param_groups']]
        state = {names[i]: s for i, s in opt_state['state'].items()}
        set_optimizer_state_dict(self.model, self.optimizer, {'state': state, 'param_groups': groups},
                                 options=StateDictOptions(full_state_dict=True))


def checkpoint_entries(model, optimizer):
    """The trainer's 'model' and 'optimizer' entries of a checkpoint, for a sharded model."""
    return {'model': WholeModel(model), 'optimizer': WholeOptimizer(model, optimizer)}


def state_mib(model, optimizer):
    """MiB of parameters, gradients and optimizer state that this rank holds: its shards (under DDP
    every rank holds them whole)."""
    # each parameter, its gradient and its optimizer state (the optimizer's state is keyed by parameter)
    tensors = [t for p in model.parameters() for t in (p, p.grad, *optimizer.state.get(p, {}).values())
               if torch.is_tensor(t)]
    return sum((t.to_local() if hasattr(t, 'to_local') else t).nbytes  # a DTensor: its shard
               for t in tensors) / 2 ** 20
