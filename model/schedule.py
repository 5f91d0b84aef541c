"""The paper's learning-rate schedule (section 5.3): linear warm-up, then inverse square root decay; a shorter
warm-up to the same peak for runs that get few updates, and a budget cooldown on top of it (not in the paper)."""

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


def ramped_lr(step: int, d_model: int, warmup_steps: int, ramp_steps: int, lr_scale: float = 1.0,
              ramp_from_step: int = 0, ramp_from: float = 0.0) -> float:
    """The paper's schedule with a shorter warm-up (not in the paper): linear to the paper's peak (that of
    ``warmup_steps``) at update ``ramp_steps``, held there until ``warmup_steps``, then the paper's inverse square
    root decay. A run that will get few updates reaches its peak instead of ending still warming up; the peak and
    the decay stay those the preset was tuned with. The line starts at ``ramp_from`` (a fraction of the peak) at
    update ``ramp_from_step`` (0 and 0: from nothing), so that a warm-up fitted again mid-way goes on from where
    the rate is instead of jumping. ``ramp_steps >= warmup_steps`` from nothing is the paper's schedule
    (:func:`transformer_lr`) exactly."""
    if step <= 0 or (ramp_steps >= warmup_steps and ramp_from_step == 0):
        return transformer_lr(step, d_model, warmup_steps, lr_scale)
    peak = transformer_lr(warmup_steps, d_model, warmup_steps, lr_scale)
    if step < ramp_steps:
        return peak * (ramp_from + (1.0 - ramp_from) * (step - ramp_from_step) / (ramp_steps - ramp_from_step))
    return peak * min(1.0, (warmup_steps / step) ** 0.5)


@dataclass
class TransformerLRLambda:
    """``lr_lambda`` for ``LambdaLR``: the learning rate of LambdaLR's step ``s`` is ``ramped_lr(s + 1)``.

    LambdaLR applies ``lr_lambda(0)`` to the first update, the paper calls it step 1: hence the shift. A
    callable object (not a lambda) so that ``LambdaLR.state_dict()`` saves its fields: the warm-up a budgeted run
    fitted to the updates it will get (``ramp_steps``, from ``ramp_from`` of the peak at ``ramp_from_step``; None:
    ``warmup_steps``, the paper's) is resumed with it.
    """

    d_model: int
    warmup_steps: int
    lr_scale: float = 1.0
    ramp_steps: int | None = None
    ramp_from_step: int = 0
    ramp_from: float = 0.0
    predicted_updates: int | None = None  # what ramp_steps was fitted to (the run's record; not used here)

    def __call__(self, scheduler_step: int) -> float:
        return self.rate(scheduler_step + 1)

    def rate(self, step: int) -> float:
        """The learning rate of update ``step`` (from 1)."""
        if self.ramp_steps is None:
            return transformer_lr(step, self.d_model, self.warmup_steps, self.lr_scale)
        return ramped_lr(step, self.d_model, self.warmup_steps, self.ramp_steps, self.lr_scale, self.ramp_from_step,
                         self.ramp_from)

    def refit(self, step: int, ramp_steps: int, predicted_updates: int | None = None) -> None:
        """Warm up to the peak at update ``ramp_steps`` from here on (fitted to ``predicted_updates``): the line
        goes on from the rate of update ``step`` (the last one trained), so the rate never jumps; the peak is
        reached no sooner than the next update."""
        peak = transformer_lr(self.warmup_steps, self.d_model, self.warmup_steps, self.lr_scale)
        self.ramp_from, self.ramp_from_step = min(1.0, self.rate(step) / peak), step
        self.ramp_steps, self.predicted_updates = max(step + 1, ramp_steps), predicted_updates


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
