"""
The optimizer behind optimizer="muon" (MuonAdamW). (The learning-rate schedule is train_gpt2.py's get_lr.)

optimizer="adamw" is torch's fused AdamW alone (model.py:GPT.configure_optimizers).
optimizer="muon" gives the transformer blocks' weight matrices (attention and MLP) to Muon and
everything else (token and position embeddings, the tied output layer, biases, layer norms) to
AdamW, as one torch optimizer: one list of param groups (the trainer sets each group's lr, times
its lr_scale), one state indexed as a single optimizer's (so checkpoints, FSDP's full state and
GradScaler see one optimizer), one step. docs/recipes.md says when to use it.

The Muon update is torch.optim.Muon's, bit for bit (a test holds them together), computed here so
that a step the trainer skips changes nothing without the host waiting: like fused AdamW, it reads
found_inf, a 0-dim tensor on the device set by the trainer before step() (1.0: skip), and writes
each matrix and momentum buffer back only where it is 0. Its Newton-Schulz iteration runs in bf16:
on a CPU without bf16 units it is emulated, and its cost shows in the step time. Under DDP the
ranks share that work: each steps every momentum buffer (a checkpoint holds them all, and resumes
on any number of processes) but orthogonalizes only its share of the matrices (deal: about as many
Newton-Schulz FLOPs on every rank), and one all-reduce
in bf16 sums the updates, each one rank's and zeros on the others (as modded-nanogpt's first
distributed Muon did): every rank applies the same bits. Muon needs whole matrices: under FSDP a
rank holds shards, so gptkit/configurator.py refuses optimizer="muon" with parallel="fsdp".
"""
import functools
import math

import torch

from gptkit import distributed


def orthogonalize(g, coefficients, steps, eps):
    """Newton-Schulz's quintic iteration towards the nearest semi-orthogonal matrix to g (2-D), in
    bf16: its singular values are pushed towards 1 (to about 0.7-1.2), their vectors kept."""
    a, b, c = coefficients
    x = g.bfloat16()
    wide = g.size(0) <= g.size(1)
    x = x if wide else x.T  # iterate on the side with fewer rows: X X^T is the smaller product
    x.div_(x.norm().clamp(min=eps))  # singular values now at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return x if wide else x.T


def newton_schulz_flops(shape, steps=5):
    """FLOPs of orthogonalize on a matrix of shape (rows, cols): per step X X^T, A A and (..) X, on
    the side with fewer rows."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


@functools.lru_cache(maxsize=None)  # a step asks again with the same shapes: dealt once per run
def deal(shapes, world):
    """The rank that orthogonalizes each matrix of shapes (a tuple): the largest first, each to the
    rank with the fewest FLOPs so far (the lowest such rank on a tie), so every rank's share is within
    a few percent of the mean; a function of the shapes alone, so every rank deals alike."""
    flops = [newton_schulz_flops(shape) for shape in shapes]
    load, owner = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -flops[i]):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += flops[i]
    return owner


class MuonAdamW(torch.optim.Optimizer):
    """muon_groups to Muon (torch.optim.Muon's settings, muon_kw), adamw_groups to fused
    torch.optim.AdamW(**adamw_kw); param_groups lists AdamW's groups, then Muon's (the same dicts
    the two use)."""

    def __init__(self, muon_groups, adamw_groups, muon_kw, adamw_kw):
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kw)
        self.muon = torch.optim.Muon(muon_groups, **muon_kw)  # its defaults and checks; step() is ours
        super().__init__(self.adamw.param_groups + self.muon.param_groups, {})
        self._share()

    def _share(self):
        """The two optimizers work on this one's group dicts and state (their parameters are disjoint)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # makes new group dicts and a new state: share them again
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW takes no closure"
        found_inf = getattr(self, 'found_inf', None)  # set by the trainer (or GradScaler) for this step
        self.adamw.found_inf = found_inf
        self.adamw.step()
        del self.adamw.found_inf
        device = self.muon.param_groups[0]['params'][0].device
        keep = torch.ones((), dtype=torch.bool, device=device) if found_inf is None else found_inf == 0
        todo = [(p, group) for group in self.muon.param_groups for p in group['params'] if p.grad is not None]
        sizes = [p.numel() for p, _ in todo]
        flat = torch.zeros(sum(sizes), dtype=torch.bfloat16, device=device)
        updates = flat.split(sizes)
        owners = deal(tuple(p.shape for p, _ in todo), distributed.world_size())
        for i, (p, group) in enumerate(todo):
            update = self._momentum(p, group, keep)  # every rank keeps every buffer: checkpoints as before
            if owners[i] == distributed.rank():  # this rank's share of the FLOPs
                update = orthogonalize(update, group['ns_coefficients'], group['ns_steps'], group['eps'])
                updates[i].copy_(update.flatten())
        # each update is one rank's, zeros elsewhere: their sum is it, exactly
        distributed.sum_over_ranks(flat)
        for (p, group), update in zip(todo, updates):
            rows, cols = p.shape[:2]  # how torch.optim.Muon scales lr for a matrix of this shape:
            if group['adjust_lr_fn'] == 'match_rms_adamw':  # the update's RMS as AdamW's, so lr carries over
                lr_ratio = 0.2 * math.sqrt(max(rows, cols))
            else:
                lr_ratio = math.sqrt(max(1, rows / cols))
            new_p = p.mul(1 - group['lr'] * group['weight_decay'])
            new_p.add_(update.view_as(p), alpha=-group['lr'] * lr_ratio)
            torch.where(keep, new_p, p, out=p)  # skipped: the old values, bit for bit, on the device

    def _momentum(self, p, group, keep):
        """torch.optim.Muon's momentum step for the matrix p (its buffer written back only where keep,
        a 0-dim bool, is True), and the update that Muon orthogonalizes."""
        state = self.state[p]
        if 'momentum_buffer' not in state:
            state['momentum_buffer'] = torch.zeros_like(p)
        buf, grad, momentum = state['momentum_buffer'], p.grad, group['momentum']
        new_buf = buf.lerp(grad, 1 - momentum)
        update = grad.lerp(new_buf, momentum) if group['nesterov'] else new_buf
        torch.where(keep, new_buf, buf, out=buf)  # skipped: the old buffer, bit for bit
        return update
