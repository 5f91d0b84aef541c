"""The one place that touches Optuna's internals (its private attributes and undocumented conventions).

The sweep's controller (:mod:`.search`) drives a study from outside Optuna's ``optimize`` loop, over runs that
outlive the process that asked for them, and that needs a few things Optuna's public API does not offer:

- :func:`trial_for`: a live :class:`optuna.Trial` for a RUNNING trial a previous controller asked for, to report to
  and tell again after a restart. The public API hands out live trials only from ``study.ask()``, which makes a new
  trial; ``optuna.Trial(study, trial_id)`` is the constructor Optuna calls itself, and the stored trial's id is the
  private ``FrozenTrial._trial_id``.
- :func:`frozen_trial`: what storage holds for a live trial now (its intermediate values so far, its system
  attributes), read by its id through the private ``study._storage.get_trial``: the public
  ``study.get_trials()`` reads every trial of the study for it, at every look at every trial in flight.
- :func:`set_user_attr` and :func:`set_trial_state`: a user attribute and a final state on a WAITING trial (an
  enqueued hunch taken out of the sweep file is withdrawn before it runs). Public ``Trial.set_user_attr`` and
  ``study.tell`` work on a RUNNING trial only, and getting one from a waiting trial means ``study.ask()`` popping
  it (and whichever other waiting trial is first in the queue); the storage calls (``study._storage``, private) do
  it by the trial's id.
- :func:`enqueued_params`: the point a trial was enqueued with. ``study.enqueue_trial`` keeps it in the trial's
  system attribute ``fixed_params``, a name Optuna's own samplers read but does not document.

Each of these is pinned by ``tests/test_sweep.py::test_the_optuna_adapter_holds_on_the_installed_optuna``, which
exercises every function against a real in-memory study and fails loudly when Optuna changes them; pyproject.toml
bounds Optuna to :data:`TESTED` accordingly. A new Optuna: run that test, then widen the bound.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

TESTED = ">=5.0,<5.1"  # the Optuna versions this adapter is tested against (pyproject.toml's bound)


def trial_for(study: optuna.Study, frozen: FrozenTrial) -> optuna.Trial:
    """A live trial of ``frozen``, a RUNNING trial of ``study`` (asked for by an earlier controller): one to report
    its intermediate values to and to ``study.tell`` when it ends."""
    return optuna.Trial(study, frozen._trial_id)


def frozen_trial(study: optuna.Study, trial: optuna.Trial) -> FrozenTrial:
    """What ``study``'s storage holds for the live ``trial`` now (its reports so far, its attributes)."""
    return study._storage.get_trial(trial._trial_id)


def set_user_attr(study: optuna.Study, frozen: FrozenTrial, key: str, value: Any) -> None:
    """Set user attribute ``key`` of the stored trial ``frozen``, whatever its state (WAITING included)."""
    study._storage.set_trial_user_attr(frozen._trial_id, key, value)


def set_trial_state(study: optuna.Study, frozen: FrozenTrial, state: TrialState) -> None:
    """Move the stored trial ``frozen`` to ``state`` without a value (a WAITING trial to FAIL: withdrawn)."""
    study._storage.set_trial_state_values(frozen._trial_id, state)


def enqueued_params(frozen: FrozenTrial) -> dict[str, Any] | None:
    """The params ``frozen`` was enqueued with (``study.enqueue_trial``); None for a trial the sampler drew."""
    return frozen.system_attrs.get("fixed_params")
