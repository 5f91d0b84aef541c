"""Micro-batches: token-budget batches of a split's examples, collated for teacher forcing on the device; what a
training run reads."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.config import RunConfig
from pipeline.support.fsutil import MANIFEST, sha256_file
from pipeline.shards import ShardDataset, token_batches, train_splits

from .distributed import DistInfo
from .errors import TrainConfigError


class Batch(NamedTuple):
    """One padded micro-batch on the device, with its real (non-padding) token counts."""

    src: Tensor  # int64 [B, S]: source ids + eos
    tgt_in: Tensor  # int64 [B, T]: bos + target ids (decoder input)
    tgt_out: Tensor  # int64 [B, T]: target ids + eos (what each position predicts)
    n_src: int
    n_tgt: int


def make_batch(ds: ShardDataset, indices: np.ndarray, device: torch.device) -> Batch:
    """Collate examples ``indices`` for teacher forcing: ``tgt_in[:, t]`` is the token before ``tgt_out[:, t]``."""
    src = ds.collate(indices, "src", eos=True)  # [B, S]
    tgt_in = ds.collate(indices, "tgt", bos=True)  # [B, T]: bos y1 .. yn pad..
    tgt_out = ds.collate(indices, "tgt", eos=True)  # [B, T]: y1 .. yn eos pad..
    n = len(indices)
    return Batch(torch.from_numpy(src).to(device, non_blocking=True),
                 torch.from_numpy(tgt_in).to(device, non_blocking=True),
                 torch.from_numpy(tgt_out).to(device, non_blocking=True),
                 int(ds.src_len[indices].sum()) + n, int(ds.tgt_len[indices].sum()) + n)


def usable_batches(ds: ShardDataset, max_tokens: int, max_positions: int, seed: int, epoch: int,
                   limit: int | None = None) -> list[np.ndarray]:
    """Token-budget batches of the examples (the first ``limit``, if given) that fit both ``max_tokens`` and the
    model's ``max_positions``."""
    sizes = ds.sizes[:limit]  # [N]: max(src, tgt) + 1
    keep = np.flatnonzero(sizes <= min(max_tokens, max_positions))  # [K]
    return [keep[b] for b in token_batches(sizes[keep], max_tokens, seed, epoch)]


def accumulation_steps(update_tokens: int, max_tokens: int, world_size: int) -> int:
    """Micro-batches per rank per update so that one update holds about ``update_tokens`` target tokens."""
    return max(1, round(update_tokens / (max_tokens * world_size)))


class TrainData:
    """What a training run reads: each epoch's split and batches (:meth:`epoch`; the data order is the trainer's
    module docstring's), the dev batches, and the records a checkpoint keeps of the shards (``shards``: fingerprint
    and manifest hash; ``tokenizer_sha256``). One update takes a group of :attr:`group` batches."""

    def __init__(self, cfg: RunConfig, train_ds: ShardDataset, shard_dir: Path, info: DistInfo):
        t = cfg.train
        splits = train_splits(train_ds.manifest)
        self.epoch_sets = [train_ds] if splits == ["train"] else [ShardDataset(shard_dir, k, verify=info.is_main)
                                                                  for k in splits]
        self.dev = ShardDataset(shard_dir, "dev", verify=info.is_main)
        self.shards = {"fingerprint": train_ds.manifest["fingerprint"],
                       "manifest_sha256": sha256_file(Path(shard_dir) / MANIFEST)}
        self.tokenizer_sha256 = train_ds.manifest["tokenizer"]["sha256"]
        self.micro_tokens = t.micro_batch_tokens(info.world_size)  # train.max_tokens for this many processes
        self.accum = accumulation_steps(t.update_tokens, self.micro_tokens, info.world_size)
        self.world_size, self.group = info.world_size, self.accum * info.world_size
        self.max_positions, self.seed = cfg.model.max_positions, t.seed
        self.dev_batches = usable_batches(self.dev, self.micro_tokens, self.max_positions, seed=0, epoch=0,
                                          limit=t.dev_max_sentences)

    def epoch(self, epoch: int) -> tuple[ShardDataset, list[np.ndarray]]:
        """The split epoch ``epoch`` reads and its batches; refused when they are too few for one update."""
        ds = self.epoch_sets[epoch % len(self.epoch_sets)]
        batches = usable_batches(ds, self.micro_tokens, self.max_positions, self.seed, epoch)
        if len(batches) < self.group:
            raise TrainConfigError(f"the train split has {len(batches)} batches of max_tokens={self.micro_tokens}, "
                                   f"fewer than one update needs ({self.accum} per rank x {self.world_size} ranks); "
                                   "lower train.update_tokens")
        return ds, batches
