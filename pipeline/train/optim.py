"""The optimizer: the paper's Adam (section 5.3), built and restored."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.config import TrainConfig


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Adam:
    """The paper's Adam over every parameter of ``model``, at a rate of 1 that the schedule scales.

    ``train.fused_adam``: one fused kernel for every parameter, else a few grouped (foreach) kernels (torch refuses
    both at once)."""
    return torch.optim.Adam(model.parameters(), lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                            foreach=not t.fused_adam, fused=t.fused_adam)


def load_optimizer(optimizer: torch.optim.Adam, saved: dict) -> None:
    """Load ``saved`` optimizer state (moments, step counts, rates) into ``optimizer``, keeping this run's kernel.

    Adam's saved parameter groups carry the writer's ``foreach``/``fused`` flags, which ``load_state_dict`` would
    restore: a run resumed with ``train.fused_adam`` switched (the same run folder) would silently keep the old
    kernel. The step counts move to where this kernel reads them: the parameter's device for fused Adam, the CPU
    for the grouped one (on a GPU, its bias correction would otherwise read each step back to the host).
    """
    kernel = [{k: g[k] for k in ("foreach", "fused")} for g in optimizer.param_groups]
    optimizer.load_state_dict({**saved, "param_groups": [{**g, **k} for g, k in zip(saved["param_groups"], kernel)]})
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p)
            if entry and torch.is_tensor(entry.get("step")):
                entry["step"] = entry["step"].to(device=p.device if group["fused"] else "cpu", dtype=torch.float32)
