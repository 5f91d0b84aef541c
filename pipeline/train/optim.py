"""The optimizer: the paper's Adam (section 5.3), or Muon for the layers' weight matrices with Adam for the rest.

Muon (Jordan et al., 2024; ``torch.optim.Muon``) orthogonalises each 2-D weight's momentum by a Newton-Schulz
iteration before it steps; the nanoGPT speedrun's largest single gain in tokens to a target loss. It is meant for
the hidden layers' matrices only: embeddings (here tied with the pre-softmax projection), biases and layer norms
stay with Adam. Its rate follows the same schedule as Adam's, matched to Adam's update size per matrix
(``adjust_lr_fn="match_rms_adamw"``, Liu et al., 2025), times ``train.muon_lr_scale``. Not in the paper.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

from pipeline.config import TrainConfig


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the encoder and decoder layers' 2-D weight matrices, every other parameter) of ``model``."""
    muon, adam = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and ".layers." in name else adam).append(p)
    return muon, adam


def _adam(params: list[nn.Parameter], t: TrainConfig) -> torch.optim.Adam:
    # fused: one kernel for every parameter; foreach: a few grouped kernels (torch refuses both at once)
    return torch.optim.Adam(params, lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                            foreach=not t.fused_adam, fused=t.fused_adam)


class MuonAdam(Optimizer):
    """Muon over ``muon_params``, Adam over ``adam_params``: one optimizer to the schedule and the checkpoints.

    The parameter groups are the two optimizers' own group dicts (Muon's first), so a learning-rate scheduler
    that sets ``lr`` on every group sets both; Muon steps at ``muon_lr_scale`` times that rate. The state dict
    holds both (``{"muon": ..., "adam": ...}``).
    """

    def __init__(self, muon_params: list[nn.Parameter], adam_params: list[nn.Parameter], t: TrainConfig):
        self.muon = torch.optim.Muon(muon_params, lr=1.0, weight_decay=0.0, momentum=t.muon_momentum,
                                     nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adam = _adam(adam_params, t)
        self.lr_scale = t.muon_lr_scale
        # add_param_group keeps each dict itself: these groups are the inner optimizers' own
        super().__init__([*self.muon.param_groups, *self.adam.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001 (torch's signature)
        """One step of both optimizers (no closure: the trainer computes its gradients itself)."""
        if closure is not None:
            raise ValueError("MuonAdam takes no closure")
        rates = [g["lr"] for g in self.muon.param_groups]
        for g in self.muon.param_groups:
            g["lr"] *= self.lr_scale
        self.muon.step()
        for g, lr in zip(self.muon.param_groups, rates):
            g["lr"] = lr
        self.adam.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adam.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adam": self.adam.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"muon", "adam"}:
            raise ValueError("not a Muon and Adam optimizer state (a checkpoint of a run trained with Adam alone?)")
        self.muon.load_state_dict(state_dict["muon"])
        load_optimizer(self.adam, state_dict["adam"])
        # loading replaces the inner optimizers' group dicts: share the new ones, or the schedule would set stale ones
        self.param_groups = [*self.muon.param_groups, *self.adam.param_groups]


def build_optimizer(model: nn.Module, t: TrainConfig) -> Optimizer:
    """``train.optimizer``'s optimizer over ``model``'s parameters (adam: the paper's; muon: :class:`MuonAdam`)."""
    if t.optimizer == "adam":
        return _adam(list(model.parameters()), t)
    return MuonAdam(*muon_parameters(model), t)


def load_optimizer(optimizer: Optimizer, saved: dict) -> None:
    """Load ``saved`` optimizer state (moments, step counts, rates) into ``optimizer``, keeping this run's kernel.

    Adam's saved parameter groups carry the writer's ``foreach``/``fused`` flags, which ``load_state_dict`` would
    restore: a run resumed with ``train.fused_adam`` switched (the same run folder) would silently keep the old
    kernel. The step counts move to where this kernel reads them: the parameter's device for fused Adam, the CPU
    for the grouped one (on a GPU, its bias correction would otherwise read each step back to the host).
    """
    if not isinstance(optimizer, torch.optim.Adam):
        optimizer.load_state_dict(saved)
        return
    if "param_groups" not in saved:
        raise ValueError("not an Adam optimizer state (a checkpoint of a run trained with Muon?)")
    kernel = [{k: g[k] for k in ("foreach", "fused")} for g in optimizer.param_groups]
    optimizer.load_state_dict({**saved, "param_groups": [{**g, **k} for g, k in zip(saved["param_groups"], kernel)]})
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p)
            if entry and torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].to(device=p.device if group["fused"] else "cpu", dtype=torch.float32)
