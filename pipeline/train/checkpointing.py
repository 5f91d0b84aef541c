"""When a training run writes a checkpoint, and what the checkpoint holds (its file format, atomic writes and the
index: :mod:`pipeline.checkpoint`).

A checkpoint is due every ``train.checkpoint_every_steps`` updates, and when ``train.checkpoint_every_minutes`` have
passed since the last one (a decision rank 0 takes and shares, so that every rank writes at the same step); the run's
last update is always checkpointed. It holds what an exact resume needs: weights, Adam and schedule, the position in
the data order, every rank's RNG streams, the seconds trained, and the records a later stage reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from pipeline.checkpoint import save_checkpoint
from pipeline.config import RunConfig

from .distributed import DistInfo, all_gather_object, rng_state
from .errors import diverged
from .step import TrainStep

log = logging.getLogger("aiayn.train")


@dataclass
class Progress:
    """Where a run stands after its last update, as its checkpoints record it."""

    step: int  # updates made
    epoch: int
    batch_pos: int  # the next batch of the epoch's order
    totals: Tensor  # float64 [3]: target tokens, source tokens, sentences trained on
    skipped: int  # updates skipped as non-finite, over resumes
    dev: dict | None  # the latest dev loss


class Checkpointer:
    """Writes the run's checkpoints into ``ckpt_dir``: :meth:`due` says when, :meth:`save` writes one (every rank
    calls it: the RNG streams are gathered; rank 0 writes). ``records``: what every checkpoint carries unchanged
    (the shards, the tokenizer's sha256, the weights the run was initialised from). ``trained_seconds``: the
    run's clock, over resumes. ``saved_step``: the step of the newest checkpoint already written (-1: none of this
    run)."""

    def __init__(self, ckpt_dir: Path, cfg: RunConfig, step_fn: TrainStep, info: DistInfo, records: dict,
                 trained_seconds: Callable[[], float], saved_step: int):
        self.dir, self.cfg, self.step_fn, self.info, self.records = ckpt_dir, cfg, step_fn, info, records
        self.trained_seconds = trained_seconds
        self.every_steps = cfg.train.checkpoint_every_steps
        self.every_s = cfg.train.checkpoint_every_minutes * 60
        self.saved_step = saved_step
        self.last_time = time.monotonic()

    def clock_due(self) -> bool:
        """Whether ``train.checkpoint_every_minutes`` have passed since the last checkpoint (rank 0's to decide)."""
        return time.monotonic() - self.last_time >= self.every_s

    def due(self, step: int, clock_due: bool) -> bool:
        """Whether update ``step`` is checkpointed, given the shared :meth:`clock_due`."""
        return step % self.every_steps == 0 or bool(clock_due)

    def save(self, progress: Progress) -> None:
        """Checkpoint the weights after ``progress.step`` updates, refusing weights that are not finite."""
        model, step_fn, info = self.step_fn.model, self.step_fn, self.info
        # Every rank holds the same weights, so every rank refuses alike. Skipped updates keep them finite; this
        # guards the newest checkpoint's promise (the last finite weights) against whatever else could break them.
        broken = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
        if broken:
            raise diverged(f"the weights after update {progress.step} are not finite ({', '.join(broken[:3])}"
                           f"{', ...' if len(broken) > 3 else ''}), so they are not saved", self.dir)
        rngs = all_gather_object(rng_state(), info)  # every rank's RNG streams, for an exact resume
        if info.is_main:
            r = self.records
            state = {"model": model.state_dict(), "optimizer": step_fn.optimizer.state_dict(),
                     "scheduler": step_fn.scheduler.state_dict(), "step": progress.step, "epoch": progress.epoch,
                     "batch_pos": progress.batch_pos, "totals": progress.totals.tolist(), "rng": rngs,
                     "world_size": info.world_size, "config": self.cfg.model_dump(mode="json"),
                     "model_config": model.config.to_dict(), "shards": r["shards"],
                     "tokenizer_sha256": r["tokenizer_sha256"], "init_checkpoint": r["init_checkpoint"],
                     "dev": progress.dev, "train_seconds": self.trained_seconds(), "skipped_updates": progress.skipped}
            entry = save_checkpoint(self.dir, state, progress.step, self.cfg.train.keep_last_checkpoints)
            log.info("checkpoint %s (sha256 %s...)", self.dir / entry["file"], entry["sha256"][:12])
        self.saved_step, self.last_time = progress.step, time.monotonic()
