"""The budget schedule (``train.schedule``; not in the paper): a run on a clock budget fits its warm-up to the
updates the clock will buy on this machine (``schedule: budget`` asked for explicitly also fits it to a step budget,
``max_steps``: a budget of updates reproduces a slower machine's clock on any machine).

A preset's warm-up is tuned for a number of updates (the tiny preset's for the updates a CPU with bf16 matrix units
trains in 30 minutes, results ledger L24); a machine that buys a small fraction of them would end its run still
warming up, never having trained at the peak rate. So the run predicts its updates from the throughput it measures
(updates so far over the seconds they took, in this invocation) and warms up over ``train.budget_warmup`` of them,
at most ``train.warmup_steps``, to the same peak; the peak and the paper's decay after ``warmup_steps`` stay as
tuned (:func:`model.schedule.ramped_lr`). It predicts again at every log interval while it warms up, so a slow first
minute (another job on the machine, a cold cache) shortens the warm-up only until the machine's real pace shows;
once the warm-up is over, the schedule is fixed. Every rank decides alike: the inputs are the shared step and rank
0's seconds. The chosen warm-up travels in the learning-rate scheduler's state, so a resumed run goes on with it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from model.schedule import TransformerLRLambda

log = logging.getLogger("aiayn.train")


@dataclass(frozen=True)
class Prediction:
    """What the clock budget will buy, as measured at one update."""

    step: int  # the update it was made at
    updates: int  # updates predicted at the budget's end (at most max_steps)
    per_s: float  # updates per second measured
    warmup: int  # the warm-up fitted to ``updates``


def predict(step: int, steps_timed: int, seconds_timed: float, seconds_left: float, max_steps: int,
            warmup_steps: int, share: float, fit_steps: bool = False) -> Prediction | None:
    """The updates the budget buys, and the warm-up of ``share`` of them (at least 1, at most ``warmup_steps``).

    With a clock (``seconds_left`` finite), at the measured pace (``steps_timed`` updates in ``seconds_timed``;
    None before anything was timed). Where ``max_steps`` ends the run before the clock, the run has a step budget:
    its warm-up stays ``warmup_steps``, unless ``fit_steps`` (``train.schedule: budget`` asked for explicitly) fits
    it to ``max_steps`` too; without a clock, that is all there is to predict.
    """
    if math.isinf(seconds_left):
        per_s, updates = 0.0, max_steps
    elif steps_timed <= 0 or seconds_timed <= 0:
        return None
    else:
        per_s = steps_timed / seconds_timed
        updates = step + int(per_s * max(seconds_left, 0.0))
    if updates >= max_steps:
        updates = max_steps
        if not fit_steps:
            return Prediction(step, updates, per_s, warmup_steps)
    return Prediction(step, updates, per_s, max(1, min(warmup_steps, round(share * updates))))


class BudgetWarmup:
    """Refits the warm-up of ``schedule`` (the scheduler's lambda) to the predicted updates while the run warms up,
    at each call of :meth:`update` (the trainer's log intervals). The pace is timed from the first call of this
    invocation: start-up is not training, and a resumed run times itself afresh (the machine may be another)."""

    def __init__(self, schedule: TransformerLRLambda, max_steps: int, budget_s: float, share: float,
                 fit_steps: bool = False):
        self.schedule, self.max_steps, self.budget_s, self.share = schedule, max_steps, budget_s, share
        self.fit_steps = fit_steps
        self.anchor: tuple[int, float] | None = None

    def warming_up(self, step: int) -> bool:
        """Whether the warm-up can still change: before its end (or before one was fitted) and before the paper's
        warm-up would have ended."""
        ramp = self.schedule.ramp_steps
        return step < self.schedule.warmup_steps and (ramp is None or step < ramp)

    def update(self, step: int, seconds: float) -> Prediction | None:
        """Predict at update ``step`` with ``seconds`` trained (over resumes) and refit the warm-up when the
        prediction moves it; returns the prediction when it did."""
        if not self.warming_up(step):
            return None
        if self.anchor is None and not math.isinf(self.budget_s):
            self.anchor = (step, seconds)
            return None
        anchor = self.anchor or (step, seconds)
        p = predict(step, step - anchor[0], seconds - anchor[1], self.budget_s - seconds, self.max_steps,
                    self.schedule.warmup_steps, self.share, self.fit_steps)
        if p is None or p.warmup == (self.schedule.ramp_steps or self.schedule.warmup_steps):
            return None  # unchanged (never refitted where the paper's warm-up fits: its rate, exactly)
        self.schedule.refit(step, p.warmup, p.updates)
        peak = self.schedule.rate(self.schedule.warmup_steps)
        # a step budget has no pace to report: its updates are given, not predicted
        source = (f"a step budget of {p.updates} updates" if math.isinf(self.budget_s) else
                  f"{p.per_s:.3g} updates/s, {p.updates} updates predicted in the budget")
        log.info("budget schedule at update %d: %s; warm-up to the peak %.3g at update %d (train.budget_warmup=%g "
                 "of them, at most train.warmup_steps=%d)", step, source, peak, self.schedule.ramp_steps, self.share,
                 self.schedule.warmup_steps)
        return p

    def at_log(self, step: int, seconds: float, optimizer: torch.optim.Optimizer, last_epoch: int) -> dict:
        """At a log interval: :meth:`update`, and where the warm-up moved, the next update's rate (the scheduler at
        ``last_epoch``) set in ``optimizer``; returns the metrics to log with it (none where nothing moved)."""
        predicted = self.update(step, seconds)
        if not predicted:
            return {}
        for g in optimizer.param_groups:  # the next update's rate, from the refitted warm-up
            g["lr"] = self.schedule(last_epoch)
        return {"schedule_predicted_updates": predicted.updates, "schedule_warmup_steps": self.schedule.ramp_steps}

    def summary(self) -> dict:
        """The schedule the run trained with, for its summary and report: ``budget`` once a warm-up was fitted,
        else ``paper`` (the clock bought enough updates for the paper's warm-up, or max_steps ended the run
        first)."""
        s = self.schedule
        return {"kind": "paper" if s.ramp_steps is None else "budget", "warmup_steps": s.ramp_steps or s.warmup_steps,
                "predicted_updates": s.predicted_updates, "peak_lr": s.rate(s.warmup_steps),
                "decay_from": s.warmup_steps}
