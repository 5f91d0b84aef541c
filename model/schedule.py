"""The paper's learning-rate schedule (section 5.3): linear warm-up, then inverse square root decay; and a
budget cooldown on top of it (not in the paper)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def transformer_lr(step: int, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> float:
    """``lrate = lr_scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``.

    ``step`` counts updates from 1 (the first update is step 1). The peak, at ``step == warmup_steps``, is
    ``lr_scale * (d_model * warmup_steps)^-0.5``. Step 0 (before any update) returns 0, the formula's limit,
    instead of dividing by zero.
    """
    if step <= 0:
        return 0.0
    return lr_scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def cooldown_factor(progress: float, fraction: float) -> float:
    """Multiplier of the learning rate at ``progress`` (0 to 1) through a training budget whose last ``fraction``
    cools down: 1 before it, then linear to 0 at the budget's end; 1 throughout when ``fraction`` is 0."""
    if fraction <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / fraction))


@dataclass
class TransformerLRLambda:
    """``lr_lambda`` for ``LambdaLR``: the learning rate of LambdaLR's step ``s`` is ``transformer_lr(s + 1)``.

    LambdaLR applies ``lr_lambda(0)`` to the first update, the paper calls it step 1: hence the shift. A
    callable object (not a lambda) so that ``LambdaLR.state_dict()`` saves its fields.
    """

    d_model: int
    warmup_steps: int
    lr_scale: float = 1.0

    def __call__(self, scheduler_step: int) -> float:
        return transformer_lr(scheduler_step + 1, self.d_model, self.warmup_steps, self.lr_scale)


def transformer_lr_scheduler(
    optimizer: Optimizer, d_model: int, warmup_steps: int, lr_scale: float = 1.0, last_epoch: int = -1
) -> LambdaLR:
    """LambdaLR following :func:`transformer_lr`; call ``scheduler.step()`` after each ``optimizer.step()``.

    The schedule gives the absolute learning rate, so each parameter group's ``lr`` is set to 1.0 (LambdaLR
    multiplies it by the lambda); ``lr_scale`` is the knob that scales the schedule.
    """
    for group in optimizer.param_groups:
        group["lr"] = 1.0
        group["initial_lr"] = 1.0
    return LambdaLR(optimizer, TransformerLRLambda(d_model, warmup_steps, lr_scale), last_epoch=last_epoch)
