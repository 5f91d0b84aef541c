"""The training stage's refusals: a config these shards cannot train, and a run whose numbers stopped being finite."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoint import read_index
from pipeline.support.errors import UserError


class TrainConfigError(UserError, ValueError):
    """A config that cannot train on these shards; raised before any training step, saying what to change."""


class NonFiniteError(UserError, FloatingPointError):
    """Training diverged: its loss or weights are no longer finite; the message names the update, the newest
    (finite) checkpoint and what to try."""


def diverged(what: str, ckpt_dir: Path) -> NonFiniteError:
    """:class:`NonFiniteError` saying ``what`` happened, which checkpoint holds the last finite weights and what to
    try instead."""
    entries = read_index(ckpt_dir)
    kept = (f"the newest checkpoint, {ckpt_dir / entries[-1]['file']} (step {entries[-1]['step']}), holds the last "
            "finite weights" if entries else "no checkpoint was written")
    return NonFiniteError(f"{what}; {kept}. Try a lower learning rate (train.lr_scale) or a longer warm-up "
                          "(train.warmup_steps), gradient clipping (train.clip_norm, e.g. 1.0), or check the training "
                          "data for broken pairs")
