"""Where a training run starts: its own newest checkpoint, another run's weights (``train.init_from``), or scratch.

Resuming restores everything the loop carries between updates (model, Adam, schedule, every rank's RNG
streams, the data position, the token totals, the count of skipped updates), so an interrupted run continues
exactly as if it had not stopped. Rank 0 picks the checkpoint; every rank then loads that same file from the
shared run folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch
from torch.optim.lr_scheduler import LRScheduler

from model import Transformer
from pipeline.checkpoint import check_compatible, find_latest, load_checkpoint, load_init_checkpoint
from pipeline.support.fsutil import sha256_file

from .distributed import DistInfo, broadcast_object, seed_everything, set_rng_state
from .optim import load_optimizer

log = logging.getLogger("aiayn.train")


class Start(NamedTuple):
    """The state the training loop starts from (a fresh run: all zero, nothing resumed)."""

    step: int  # updates already done (counted over resumes)
    epoch: int  # epoch of the next update's batches
    batch_pos: int  # position of the next update's first batch in that epoch's batch list
    totals: list[float]  # [3]: target tokens, source tokens, sentences trained on so far
    dev: dict[str, float]  # the last dev metrics recorded (empty: none yet)
    init: dict | None  # the checkpoint the run's weights started from: path, sha256, its step
    resumed: bool  # True when the run continues from its own checkpoint (already saved at ``step``)
    train_seconds: float  # wall-clock seconds trained up to ``step`` (counted over resumes)
    skipped_updates: int  # updates skipped as non-finite up to ``step`` (counted over resumes)


def _fresh(init: dict | None = None) -> Start:
    """A run's first step, its weights new (``init`` None) or from another run's checkpoint ``init``."""
    return Start(step=0, epoch=0, batch_pos=0, totals=[0.0, 0.0, 0.0], dev={}, init=init, resumed=False,
                 train_seconds=0.0, skipped_updates=0)


def resume(ckpt_dir: Path, model: Transformer, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
           seed: int, shards_fingerprint: str, tokenizer_sha256: str, info: DistInfo,
           init_checkpoint: Path | None = None) -> Start:
    """Load the state this run starts from into ``model``, ``optimizer`` and ``scheduler`` (in place) and return it.

    The newest intact checkpoint in ``ckpt_dir`` (rank 0 decides which, every rank loads it) must match the
    model config and ``shards_fingerprint``, else :class:`~.checkpoint.CheckpointError`; it also restores this
    rank's RNG streams, or reseeds them from ``seed`` when the world size changed. Without one,
    ``init_checkpoint`` (when given) supplies the model weights only; otherwise the run starts fresh.
    """
    found = find_latest(ckpt_dir) if info.is_main else None
    name = broadcast_object(found[0] if found else None, info)
    if name is not None:
        path = ckpt_dir / name
        # Rank 0 already holds the state it verified; the other ranks read the file it chose.
        state = found[1] if found else load_checkpoint(path)
        start = _restore(state, path, model, optimizer, scheduler, seed, shards_fingerprint, info)
        if init_checkpoint is not None:
            log.info("--init-checkpoint %s ignored: the run resumes from its own checkpoint", init_checkpoint)
        return start
    if init_checkpoint is not None:
        return _init_from(Path(init_checkpoint).resolve(), model, tokenizer_sha256)
    return _fresh()


def _restore(state: dict, path: Path, model: Transformer, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
             seed: int, shards_fingerprint: str, info: DistInfo) -> Start:
    """Continue from the run's own checkpoint ``state`` (read from ``path``): everything, RNG streams included."""
    check_compatible(state, model.config.to_dict(), shards_fingerprint, path)
    model.load_state_dict(state["model"])
    load_optimizer(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    step = state["step"]
    if state["world_size"] == info.world_size:
        set_rng_state(state["rng"][info.rank])
    else:
        log.warning("checkpoint %s was written by %d ranks, this run has %d: RNG streams restart from the seed",
                    path.name, state["world_size"], info.world_size)
        seed_everything(seed + info.rank + 7919 * step)
    log.info("resuming from %s: step %d, epoch %d, batch %d", path, step, state["epoch"], state["batch_pos"])
    # A resumed run keeps where its weights first came from; its own checkpoint now supersedes that file.
    return Start(step=step, epoch=state["epoch"], batch_pos=state["batch_pos"], totals=list(state["totals"]),
                 dev=state["dev"], init=state.get("init_checkpoint"), resumed=True,
                 train_seconds=float(state.get("train_seconds", 0.0)),  # 0: written before either was recorded
                 skipped_updates=int(state.get("skipped_updates", 0)))


def _init_from(path: Path, model: Transformer, tokenizer_sha256: str) -> Start:
    """Start a new run from another run's weights at ``path``; optimizer, schedule and step count start fresh."""
    state = load_init_checkpoint(path, model.config.to_dict(), tokenizer_sha256)
    model.load_state_dict(state["model"])  # in place: the optimizer and DDP hold these same parameters
    log.info("initialised from %s (step %d of its run)", path, state["step"])
    return _fresh({"path": str(path), "sha256": sha256_file(path), "step": state["step"]})
