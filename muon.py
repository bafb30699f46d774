"""
optimizer="muon": torch.optim.Muon for the transformer blocks' weight matrices (attention and MLP),
torch.optim.AdamW for everything else (token and position embeddings, the tied output layer,
biases, layer norms), as one torch optimizer: one list of param groups (the trainer sets each
group's lr, times its lr_scale), one state indexed as a single optimizer's (so checkpoints, FSDP's
full state and GradScaler see one optimizer), one step. docs/recipes.md says when to use it.

Muon's Newton-Schulz iteration runs in bf16 (PyTorch's implementation): on a CPU without bf16 units
it is emulated, and its cost shows in the step time. Muon needs whole matrices: under FSDP a rank
holds shards, so configurator.py refuses optimizer="muon" with parallel="fsdp".
"""
import torch

OPTIMIZERS = ('adamw', 'muon')  # the trainer's optimizer choices: AdamW alone, or this


class MuonAdamW(torch.optim.Optimizer):
    """muon_groups to torch.optim.Muon(**muon_kw), adamw_groups to torch.optim.AdamW(**adamw_kw);
    param_groups lists AdamW's groups, then Muon's (the same dicts the two optimizers use)."""

    def __init__(self, muon_groups, adamw_groups, muon_kw, adamw_kw):
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kw)
        self.muon = torch.optim.Muon(muon_groups, **muon_kw)
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
        self.adamw.step()
        self.muon.step()
