"""Trainer, budgets: max_minutes counted over resumes, the budget schedule's warm-up fitted to the updates the
clock buys, and the cooldown to zero at the budget's end."""

from __future__ import annotations

import json
import logging
import math

import pytest

from model import transformer_lr
from pipeline.checkpoint import load_checkpoint
from pipeline.config import load_config
from pipeline.train import train
from tests.train_helpers import config, final_state, metrics


@pytest.mark.integration
def test_max_minutes_stops_and_checkpoints_and_counts_over_resumes(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=100000", "train.max_minutes=0.05")
    out = train(cfg, shards, tmp_path / "run")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stopped_by"] == "max_minutes" and 0 < summary["steps"] < 100000
    assert summary["checkpoints"][-1]["step"] == summary["steps"] and summary["train_seconds"] >= 3
    last = load_checkpoint(out / "checkpoints" / summary["checkpoints"][-1]["file"])
    assert last["train_seconds"] >= 3
    # Run again (a crashed run's retry, a re-run): the budget is spent, so not one more update is trained.
    train(cfg, shards, out)
    again = json.loads((out / "train_summary.json").read_text())
    assert (again["stopped_by"], again["steps"]) == ("max_minutes", summary["steps"])
    # A larger budget continues the same run for the difference only.
    train(config(shared_data, "train.max_steps=100000", "train.max_minutes=0.1"), shards, out)
    longer = json.loads((out / "train_summary.json").read_text())
    assert longer["steps"] > summary["steps"] and longer["train_seconds"] >= 6
    assert longer["wall_seconds"] < summary["wall_seconds"] + 1.5  # ~3 s more training, not 6


def test_the_budget_schedule_fits_the_warm_up_to_the_updates_the_clock_buys():
    from model import TransformerLRLambda
    from pipeline.train.budget import BudgetWarmup, predict

    # 30 minutes at 0.4 s per update (bf16 matrix units) and at 2.3 s (AVX2 only): the tiny preset's 1,000 stays
    # where ~4,400 updates come, and a quarter of ~780 where they do not
    fast, slow = predict(20, 20, 8.0, 1792.0, 20000, 1000, 0.25), predict(20, 20, 46.0, 1754.0, 20000, 1000, 0.25)
    assert (fast.updates, fast.warmup) == (4500, 1000) and (slow.updates, slow.warmup) == (782, 196)
    assert predict(20, 0, 0.0, 1800.0, 20000, 1000, 0.25) is None  # nothing timed yet
    capped = predict(20, 20, 8.0, 1792.0, 300, 1000, 0.25)  # max_steps ends the run first: a step budget
    assert (capped.updates, capped.warmup) == (300, 1000)

    schedule = TransformerLRLambda(d_model=256, warmup_steps=1000)
    budget = BudgetWarmup(schedule, 20000, 1800.0, 0.25)
    assert budget.update(20, 60.0) is None and schedule.ramp_steps is None  # the first call times from here
    # a busy first minute (another job on the machine): 20 updates in 60 s predict ~590, so a short warm-up ...
    first = budget.update(40, 120.0)
    assert first.updates == 40 + int(20 / 60 * 1680) and schedule.ramp_steps == round(first.updates / 4)
    # ... that grows once the machine's real pace shows, going on from the rate reached (no jump)
    rate = schedule.rate(60)
    second = budget.update(60, 128.0)
    assert second.updates > first.updates and schedule.ramp_steps == round(second.updates / 4)
    assert schedule.rate(60) == pytest.approx(rate, rel=1e-12) and schedule.rate(schedule.ramp_steps) == \
        pytest.approx(schedule.rate(1000), rel=1e-12)
    assert budget.summary() == {"kind": "budget", "warmup_steps": schedule.ramp_steps,
                                "predicted_updates": second.updates, "peak_lr": schedule.rate(1000),
                                "decay_from": 1000}
    # once the warm-up is over, the schedule is fixed whatever the pace does
    ramp = schedule.ramp_steps
    assert budget.update(ramp, 500.0) is None and budget.update(ramp + 20, 1700.0) is None
    assert schedule.ramp_steps == ramp


def test_auto_fits_a_clock_budget_and_budget_asked_for_fits_a_step_budget_too(caplog):
    from model import TransformerLRLambda
    from pipeline.train.budget import BudgetWarmup

    assert load_config("multi30k-cpu").train.budget_schedule  # the embedded default: 30 minutes
    assert not load_config("multi30k-cpu", ["train.schedule=paper"]).train.budget_schedule
    assert not load_config("multi30k-cpu", ["train.max_minutes=null"]).train.budget_schedule
    assert load_config("multi30k-cpu", ["train.max_minutes=null", "train.schedule=budget"]).train.budget_schedule
    # a budget of 780 updates (an AVX2 machine's 30 minutes) on any machine: fitted at the first call, untimed
    schedule = TransformerLRLambda(d_model=256, warmup_steps=1000)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        steps = BudgetWarmup(schedule, 780, math.inf, 0.25, fit_steps=True).update(20, 9.0)
    assert (steps.updates, steps.warmup, schedule.ramp_steps) == (780, 195, 195)
    # the log names the step budget, not a pace it never measured
    assert "a step budget of 780 updates; warm-up to the peak" in caplog.text and "updates/s" not in caplog.text


@pytest.mark.integration
def test_a_clock_budget_run_warms_up_to_the_peak_and_records_its_schedule(shared_data, shards, tmp_path):
    """A warm-up of 20,000 updates that a 15-second budget cannot reach: the run fits it to its predicted updates,
    trains at the paper's peak before the end, logs the prediction, and a resume goes on with the warm-up it chose;
    a step budget keeps the paper's schedule."""
    # why 20,000: the tiny test model ran 1,118 updates in 15 s on a Zen 4 EPYC, past a warm-up of 1,000
    warmup = 20000
    overrides = ("train.max_steps=100000", f"train.warmup_steps={warmup}", "train.log_every_steps=2")
    # a warm-up of a twentieth of the predicted updates: the run still reaches its peak when another job slows the
    # machine several times over after the last fit (the containers' tests, beside this one under pytest-xdist)
    out = train(config(shared_data, *overrides, "train.max_minutes=0.25", "train.budget_warmup=0.05"), shards,
                tmp_path / "clock")
    summary = json.loads((out / "train_summary.json").read_text())
    sched, rows = summary["schedule"], metrics(out)
    fits = [r for r in rows if "schedule_warmup_steps" in r]
    assert sched["kind"] == "budget" and fits and sched["warmup_steps"] == fits[-1]["schedule_warmup_steps"]
    assert sched["predicted_updates"] == fits[-1]["schedule_predicted_updates"] < warmup
    assert sched["warmup_steps"] < summary["steps"]  # the run reached its peak ...
    peak = transformer_lr(warmup, 32, warmup)
    assert sched["peak_lr"] == pytest.approx(peak) and max(r["lr"] for r in rows if "lr" in r) == pytest.approx(peak)
    state = final_state(out)["scheduler"]["lr_lambdas"][0]  # ... and a resume goes on with the warm-up it chose
    assert (state["ramp_steps"], state["predicted_updates"]) == (sched["warmup_steps"], sched["predicted_updates"])
    steps = train(config(shared_data, *overrides, "train.max_steps=12"), shards, tmp_path / "steps")
    paper = json.loads((steps / "train_summary.json").read_text())["schedule"]
    assert (paper["kind"], paper["warmup_steps"]) == ("paper", warmup)
    assert [r["lr"] for r in metrics(steps) if "lr" in r] == pytest.approx(
        [transformer_lr(s, 32, warmup) for s in range(2, 13, 2)], rel=1e-12)


@pytest.mark.integration
def test_cooldown_takes_the_learning_rate_linearly_to_zero_at_the_end_of_the_budget(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=20", "train.cooldown=0.5")
    rows = [r for r in metrics(train(cfg, shards, tmp_path / "steps")) if "lr" in r]
    d, warmup = cfg.model.d_model, cfg.train.warmup_steps
    # the update numbered s trains at the paper's rate of step s times the cooldown at (s - 1) / 20 of the budget
    assert [r["lr"] for r in rows] == pytest.approx(
        [transformer_lr(r["step"], d, warmup) * min(1.0, (1 - (r["step"] - 1) / 20) / 0.5) for r in rows], rel=1e-9)
    assert rows[-1]["step"] == 20 and rows[-1]["lr"] < 0.11 * transformer_lr(20, d, warmup)
    # on the clock: the factor on the paper's rate falls update by update and the last updates before max_minutes
    # run at a fraction of it (how small depends on how long one update takes: loose on a busy machine)
    timed = config(shared_data, "train.max_steps=100000", "train.max_minutes=0.1", "train.cooldown=1.0")
    rows = [r for r in metrics(train(timed, shards, tmp_path / "minutes")) if "lr" in r]
    factors = [r["lr"] / transformer_lr(r["step"], d, warmup) for r in rows]
    assert factors == sorted(factors, reverse=True) and factors[-1] < 0.5, factors
