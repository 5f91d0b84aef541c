"""The sweep's controller: Optuna's ask-and-tell over trial runs started elsewhere, Hyperband pruning on their dev
NLL as they train, then the confirmation runs of the best by paired seeds.

Nothing here knows Prefect or MLflow: trials run through a :class:`Runner` (the flows' one starts flow runs of
the sweep's pipeline deployment, ``train-en-de`` or ``parse-wsj``, on the work pool and reads their MLflow runs:
``tasks/sweep.py``). The study lives in Optuna storage
(SQLite or a journal file), and every run is started under an idempotency key derived from the study, so a
controller that stops (crash, cancellation, a new deployment) and starts again re-attaches to the runs it had
started instead of starting them twice (resuming those that were cancelled with it), and goes on where it was.
What it needs of Optuna beyond its public API goes through :mod:`.optuna_adapter`.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import optuna
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

from pipeline.config import ConfigError
from pipeline.sweep import optuna_adapter
from pipeline.sweep.config import SweepConfig

log = logging.getLogger("aiayn.sweep")

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
_UID = "sweep_uid"  # study attribute: this study's identity in idempotency keys (a re-created study gets a new one)
_BASE_POINT = "base_point"  # study attribute: the base config's point of the space as the sweep file has it now
ATTEMPTS = 3  # runs of one trial or confirmation run stopped from outside before the sweep gives up on it
# How a run that was stopped from outside ends: its process died (CRASHED), or it was CANCELLED with its controller
# (the sweep flow's hooks cancel what it started when it fails or crashes; Prefect cancels a cancelled flow run's
# subflows). A controller that finds one when it starts or re-attaches to a run resumes it by a next attempt; one it
# watches end CANCELLED was cancelled on purpose (pruned, or by hand) and is over.
STOPPED = {"CRASHED", "CANCELLED"}


@dataclass(frozen=True)
class Outcome:
    """A finished run: its final state, its evaluation's metrics by name (``multi30k-val.sacrebleu``,
    ``ptb-sample-dev.f1``, ...) and a local folder with its outputs per split (``<split>.hyp`` with ``<split>.ref``,
    or a parser's ``<split>.gold``, as the evaluation wrote them)."""

    state: str
    metrics: dict[str, float] = field(default_factory=dict)
    outputs: Path | None = None
    steps: int | None = None
    message: str = ""


class Runner(Protocol):
    """Where trial runs run. ``start`` is idempotent on ``key``: the same key returns the run it started before."""

    def start(self, key: str, name: str, overrides: dict[str, Any]) -> str: ...

    def state(self, run_id: str) -> str: ...  # SCHEDULED, PENDING, RUNNING, ... or one of FINAL

    def curve(self, run_id: str) -> list[tuple[float, float]]: ...  # (train seconds, dev NLL per sentence)

    def cancel(self, run_id: str, why: str) -> None: ...

    def outcome(self, run_id: str) -> Outcome: ...


def open_storage(sweep: SweepConfig, work_dir: Path) -> optuna.storages.BaseStorage:
    """The study's storage: ``sweep.storage``, or SQLite at ``<work_dir>/sweeps/<name>/optuna.db``. One that cannot
    be opened (a database SQLAlchemy has no dialect or no installed driver for, a file in a folder that is missing or
    not writable, a server that does not answer) is a :class:`ConfigError` naming the sweep file's ``storage`` and
    what to write instead, rather than SQLAlchemy's traceback."""
    try:
        if sweep.storage.startswith("journal:"):
            path = Path(sweep.storage.removeprefix("journal:")).expanduser().resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(str(path)))
        url = sweep.storage
        if not url:
            folder = Path(work_dir) / "sweeps" / sweep.name
            folder.mkdir(parents=True, exist_ok=True)
            url = f"sqlite:///{folder / 'optuna.db'}"
        return optuna.storages.RDBStorage(url)
    # RuntimeError: a database written by another Optuna version (its message says how to upgrade it)
    except (ImportError, OSError, RuntimeError, SQLAlchemyError) as e:
        if isinstance(e, ImportError) and e.__cause__ is not None:
            why = f"its database driver is not installed ({e.__cause__})"
        else:
            why = str(getattr(e, "orig", None) or e).splitlines()[0]  # a DBAPIError: what the database said
        raise ConfigError(f"{sweep.source}: storage = {sweep.storage!r} cannot be opened: {why}. Leave storage "
                          "empty (SQLite in the work dir), or give sqlite:///<file in a writable folder>, a database "
                          "URL whose server answers and whose driver is installed (postgresql://...), or "
                          "journal:<file>") from None


def distributions(sweep: SweepConfig) -> dict[str, BaseDistribution]:
    """Optuna's distribution of each dimension of the space (a group is a choice among its labels)."""
    out: dict[str, BaseDistribution] = {}
    for key, p in sweep.space.items():
        if p.type == "int":
            out[key] = IntDistribution(int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        elif p.type == "float":
            out[key] = FloatDistribution(p.low, p.high, step=p.step, log=p.log)
        else:
            out[key] = CategoricalDistribution(list(p.options) if p.type == "group" else p.choices)
    return out


def open_study(sweep: SweepConfig, work_dir: Path, base: dict[str, Any], objective: str) -> optuna.Study:
    """Create the study, or load it to go on: maximising ``objective`` (the dev score's metric name), TPE seeded
    with ``sweep.seed`` plus the number of trials already in the study, Hyperband (or no pruning: ``pruner.kind``
    none, or a study of fixed arms, whose every trial is enqueued and trains its whole budget). A new study's
    first trial is the base config itself (``base``, its point of the space), so every sweep measures the
    incumbent under the same conditions as its challengers."""
    pruner = (optuna.pruners.HyperbandPruner(sweep.pruner.min_resource_s, sweep.pruner.max_resource_s,
                                             sweep.pruner.reduction_factor)
              if sweep.pruner.kind == "hyperband" and not sweep.fixed_arms else optuna.pruners.NopPruner())
    study = optuna.create_study(study_name=sweep.name, storage=open_storage(sweep, work_dir), direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=sweep.seed), pruner=pruner,
                                load_if_exists=True)
    # A controller that goes on from stored trials must not replay the draws of the one before it: TPE's first
    # trials are random, and the same seed would draw the same points again.
    study.sampler = optuna.samplers.TPESampler(seed=sweep.seed + len(study.trials))
    study.set_user_attr("objective", objective)
    study.set_user_attr(_BASE_POINT, base)
    if _UID not in study.user_attrs:
        study.set_user_attr(_UID, uuid.uuid4().hex[:12])
        study.enqueue_trial(base, user_attrs={"base": True})
    _sync_hunches(sweep, study)
    return study


def hunches(sweep: SweepConfig, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep file's ``enqueue`` as whole points: each hunch is the base with the values it names. Optuna would
    draw the dimensions an enqueued point leaves out, so a hunch "x1.5 rate with a cooldown" would also train with
    whatever else TPE drew (BPE-dropout, say), and measure neither."""
    return [{**base, **hunch} for hunch in sweep.enqueue]


def _sync_hunches(sweep: SweepConfig, study: optuna.Study) -> None:
    """The sweep file's ``enqueue`` is the truth for the hunches not yet started: one added after the study began
    joins it at the next run (once: a point already tried is not queued again), and a waiting one no longer in the
    file is withdrawn (FAIL with user attribute ``withdrawn``; it does not count against ``trials``)."""
    wanted = hunches(sweep, study.user_attrs[_BASE_POINT])
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if not t.user_attrs.get("base") and optuna_adapter.enqueued_params(t) not in wanted:
            optuna_adapter.set_user_attr(study, t, "withdrawn", "taken out of enqueue before it ran")
            optuna_adapter.set_trial_state(study, t, TrialState.FAIL)
    for point in wanted:
        study.enqueue_trial(point, skip_if_exists=True)


def run_key(study: optuna.Study, what: str) -> str:
    """The idempotency key of one run of this study (``trial-3``, ``confirm-trial-3-seed-2``)."""
    return f"sweep-{study.study_name}-{study.user_attrs[_UID]}-{what}"


def search(sweep: SweepConfig, study: optuna.Study, runner: Runner, overrides_of, poll_s: float | None = None,
           logger: logging.Logger | logging.LoggerAdapter = log) -> None:
    """Run trials until ``sweep.trials`` are finished (completed, pruned or failed), at most ``max_in_flight`` at
    once. While a trial trains, every new dev evaluation is reported to Optuna at step = its training seconds, as
    the negative dev NLL per sentence (the study maximises); a trial the pruner stops is cancelled. A completed
    trial's value is its dev score (``objective`` user attribute: the metric name). A point drawn a second time
    is not run again: the trial waits for its twin and records the twin's result. ``overrides_of(params)``: a
    trial's config overrides; ``logger``: where each start, prune and result is said (the flow run's logs)."""
    dists = distributions(sweep)
    active: dict[int, tuple[optuna.Trial, str]] = {}
    waiting: dict[int, tuple[optuna.Trial, int]] = {}  # a twin's trial: its number -> (trial, the twin's number)
    for frozen in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # re-attach after a restart
        trial = optuna_adapter.trial_for(study, frozen)
        if "duplicate_of" in frozen.user_attrs:
            waiting[frozen.number] = (trial, frozen.user_attrs["duplicate_of"])
        else:
            active[frozen.number] = (trial, _start(study, runner, trial, frozen.params, overrides_of, logger))

    def more() -> bool:  # start trials up to the budget; record the twins whose trial has finished
        done = finished(study)
        while len(active) < sweep.max_in_flight and done + len(active) + len(waiting) < sweep.trials:
            trial = study.ask(dists)
            twin = _twin(study, trial)
            if twin is None:
                active[trial.number] = (trial, _start(study, runner, trial, trial.params, overrides_of, logger))
            else:
                trial.set_user_attr("duplicate_of", twin)
                waiting[trial.number] = (trial, twin)
                logger.info("trial %d: the point of trial %d again; it records that trial's result", trial.number,
                            twin)
        for number, (trial, twin) in list(waiting.items()):
            if _copy(study, trial, twin):
                del waiting[number]
        return bool(waiting)

    def look(number: int, entry: tuple[optuna.Trial, str]) -> tuple[int, tuple[optuna.Trial, str]] | None:
        trial, run_id = entry
        now = _step(study, runner, trial, run_id, overrides_of, logger)
        return None if now is None else (number, (trial, now))

    _poll(active, more, look, sweep.poll_s if poll_s is None else poll_s)


def finished(study: optuna.Study) -> int:
    """The trials that count against ``trials``: completed, pruned or failed; a withdrawn hunch is none of them."""
    return sum("withdrawn" not in t.user_attrs for t in study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)))


def point(study: optuna.Study, trial: FrozenTrial | optuna.Trial) -> dict[str, Any]:
    """The whole point a trial ran at. A dimension added to the space after a trial ran is not in its params: its
    run took the base config's value of it (a trial overrides only its own params), so that value fills it in."""
    return {**study.user_attrs.get(_BASE_POINT, {}), **trial.params}


def _twin(study: optuna.Study, trial: optuna.Trial) -> int | None:
    """The first earlier trial of the same point. TPE can draw a point twice, and a second run of it would not be a
    new measurement: its config is the same, so its training folder is too (the pipeline's cache is keyed on the
    config), and it would continue the first run's training from its checkpoints."""
    here = point(study, trial)
    return next((t.number for t in study.get_trials(deepcopy=False)
                 if t.number != trial.number and t.params and point(study, t) == here), None)


def _copy(study: optuna.Study, trial: optuna.Trial, twin: int) -> bool:
    """Record ``trial`` as what trial ``twin`` measured (its dev curve, state, score and run) once that one is
    finished; False while it runs."""
    done = next(t for t in study.get_trials(deepcopy=False) if t.number == twin)
    if not done.state.is_finished():
        return False
    for name in ("run_id", "steps", "run_state"):
        if name in done.user_attrs:
            trial.set_user_attr(name, done.user_attrs[name])
    for step, value in sorted(done.intermediate_values.items()):
        trial.report(value, step)
    study.tell(trial, done.value if done.state == TrialState.COMPLETE else None, state=done.state)
    return True


def _launch(study: optuna.Study, runner: Runner, what: str, overrides: dict[str, Any]) -> str:
    """Start run ``what`` of this study (``trial-3``), or find it started. A run stopped from outside (:data:`STOPPED`:
    its process died when the machine went away under it, or it was cancelled with the controller before this one)
    is followed by a next attempt (``trial-3-attempt-2``, up to :data:`ATTEMPTS`), which resumes its training from
    the checkpoints in the same folder: the training budget, time included, counts over resumes, so the trial
    trains no longer than one that never stopped. Every key is idempotent, so a controller started again walks the
    same chain to the attempt in flight."""
    for attempt in range(1, ATTEMPTS + 1):
        label = what if attempt == 1 else f"{what}-attempt-{attempt}"
        run_id = runner.start(run_key(study, label), f"{study.study_name}-{label}", overrides)
        if attempt == ATTEMPTS or runner.state(run_id) not in STOPPED:
            return run_id
    raise AssertionError("unreachable")


def _start(study: optuna.Study, runner: Runner, trial: optuna.Trial, params: dict[str, Any], overrides_of,
           logger: logging.Logger | logging.LoggerAdapter) -> str:
    run_id = _launch(study, runner, f"trial-{trial.number}", overrides_of(params))
    trial.set_user_attr("run_id", run_id)
    logger.info("trial %d: run %s with %s", trial.number, run_id, params)
    return run_id


def _step(study: optuna.Study, runner: Runner, trial: optuna.Trial, run_id: str, overrides_of,
          logger: logging.Logger | logging.LoggerAdapter) -> str | None:
    """Look at one running trial once: report its new dev points, prune it, resume it when its run crashed, or
    record how it ended. The run to look at next; None when the trial is over."""
    state = runner.state(run_id)
    frozen = optuna_adapter.frozen_trial(study, trial)
    last = max(frozen.intermediate_values, default=-1)  # the last step reported
    for seconds, nll in runner.curve(run_id):
        if int(seconds) > last:
            trial.report(-nll if math.isfinite(nll) else float("nan"), int(seconds))
            last = int(seconds)
            # Asked after every point, also of a run that has ended: the pruner records a trial's value at each rung
            # when it passes it, and later trials are measured against those values. The base and the hunches train
            # their whole budget: a hunch is there because its curve is expected to cross the others' late (a larger
            # shape is behind early by construction), and the base is what every other trial is measured against.
            if trial.should_prune() and state not in FINAL and optuna_adapter.enqueued_params(frozen) is None:
                runner.cancel(run_id, f"pruned by the sweep at {int(seconds)} s of training (dev NLL/sentence "
                                      f"{nll:.3f})")
                study.tell(trial, state=TrialState.PRUNED)
                logger.info("trial %d pruned at %d s (dev NLL/sentence %.3f)", trial.number, int(seconds), nll)
                return None
    if state not in FINAL:
        return run_id
    if state == "CRASHED":
        again = _launch(study, runner, f"trial-{trial.number}", overrides_of(frozen.params))
        if again != run_id:
            trial.set_user_attr("run_id", again)
            logger.warning("trial %d: run %s crashed; run %s resumes its training", trial.number, run_id, again)
            return again
    if state != "COMPLETED":
        trial.set_user_attr("run_state", state)
        study.tell(trial, state=TrialState.FAIL)
        logger.warning("trial %d: its run ended %s", trial.number, state)
        return None
    outcome = runner.outcome(run_id)
    objective = study.user_attrs["objective"]
    if objective not in outcome.metrics:
        trial.set_user_attr("run_state", f"COMPLETED without {objective}")
        study.tell(trial, state=TrialState.FAIL)
        return None
    trial.set_user_attr("steps", outcome.steps)
    study.tell(trial, outcome.metrics[objective])
    logger.info("trial %d: %s %.2f", trial.number, objective, outcome.metrics[objective])
    return None


@dataclass
class Arm:
    """One configuration in the confirmation: the base (``trial`` None) or a search trial, with its runs per seed."""

    label: str
    params: dict[str, Any]
    trial: int | None
    search_value: float | None
    runs: dict[int, str] = field(default_factory=dict)  # seed -> run id
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # seed -> outcome


def arms(sweep: SweepConfig, study: optuna.Study, base: dict[str, Any]) -> list[Arm]:
    """The base and the ``confirm.top_k`` best completed trials other than the base point (by search dev score);
    in a study of fixed arms, every completed one."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    done = sorted((t for t in complete if point(study, t) != base), key=lambda t: (-t.value, t.number))
    best: list[tuple[dict, FrozenTrial]] = []
    for t in done:  # TPE may draw one point twice: confirm it once
        if point(study, t) not in [p for p, _ in best]:
            best.append((point(study, t), t))
    base_trial = next((t for t in complete if point(study, t) == base), None)
    return [Arm("base", base, None, base_trial.value if base_trial else None),
            *(Arm(f"trial-{t.number}", p, t.number, t.value)
              for p, t in (best if sweep.fixed_arms else best[: sweep.confirm.top_k]))]


def confirm(sweep: SweepConfig, study: optuna.Study, runner: Runner, candidates: list[Arm], overrides_of,
            poll_s: float | None = None, logger: logging.Logger | logging.LoggerAdapter = log) -> list[Arm]:
    """Train every arm with every seed of ``confirm.seeds`` (``train.seed``), at most ``max_in_flight`` at once,
    and wait for all, resuming a crashed run as :func:`_launch` does. A run of the same config and seed as a search
    trial reuses its training (the pipeline's cache is keyed on the config), so seed 1 of a trial costs its
    evaluation only."""
    def launch(arm: Arm, seed: int) -> str:
        return _launch(study, runner, f"confirm-{arm.label}-seed-{seed}",
                       {**overrides_of(arm.params), "train.seed": seed})

    pending = [(arm, seed) for arm in candidates for seed in sweep.confirm.seeds]
    active: dict[str, tuple[Arm, int]] = {}

    def more() -> bool:  # start the next runs up to max_in_flight
        while pending and len(active) < sweep.max_in_flight:
            arm, seed = pending.pop(0)
            run_id = launch(arm, seed)
            arm.runs[seed] = run_id
            active[run_id] = (arm, seed)
        return bool(pending)

    def look(run_id: str, entry: tuple[Arm, int]) -> tuple[str, tuple[Arm, int]] | None:
        arm, seed = entry
        state = runner.state(run_id)
        if state == "CRASHED":  # resumed by its next attempt, if one is left
            again = launch(arm, seed)
            if again != run_id:
                logger.warning("confirmation %s seed %d: run %s crashed; run %s resumes it", arm.label, seed, run_id,
                               again)
                arm.runs[seed] = again
                return again, entry
        if state in FINAL:
            arm.outcomes[seed] = runner.outcome(run_id) if state == "COMPLETED" else Outcome(state)
            logger.info("confirmation %s seed %d: %s", arm.label, seed, state)
            return None
        return run_id, entry

    _poll(active, more, look, sweep.poll_s if poll_s is None else poll_s)
    return candidates


K = TypeVar("K")
V = TypeVar("V")


def _poll(in_flight: dict[K, V], more: Callable[[], bool], look: Callable[[K, V], tuple[K, V] | None],
          poll_s: float) -> None:
    """The controller's loop over the runs in flight, the search's and the confirmation's. Each round ``more()``
    starts what may start now (into ``in_flight``) and says whether anything is left besides the runs in flight;
    with neither, the loop ends. Then every run in flight is looked at once: ``look(key, entry)`` is what it goes on
    as (the same key, or another: the run that resumes a crashed one, looked at from the next round), or None when
    it is over. Between rounds, while any run is in flight, it sleeps ``poll_s``."""
    while True:
        if not more() and not in_flight:
            return
        for key, entry in list(in_flight.items()):
            now = look(key, entry)
            if now is None:
                del in_flight[key]
            elif now[0] == key:
                in_flight[key] = now[1]
            else:  # a new run goes on for it: last in line, as a newly started run
                del in_flight[key]
                in_flight[now[0]] = now[1]
        if in_flight:
            time.sleep(poll_s)
