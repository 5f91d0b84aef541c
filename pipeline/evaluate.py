"""The evaluation stage: each task's evaluator in one table, and the checkpoint evaluation the pipeline runs.

``EVALUATORS[cfg.task]`` decodes and scores (``pipeline.evalsets.Evaluator``): translation with every BLEU variant
(``pipeline.translation.evaluate``), parsing with EVALB (``pipeline.parsing.evaluate``). Averaging (choosing N on
dev), the CLI and the pipeline reach a task's scoring only through this table.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from pipeline.config import RunConfig, Task
from pipeline.evalsets import Checkpoints, Evaluator, Progress, checkpoint_list
from pipeline.parsing.evaluate import EVALUATOR as PARSING
from pipeline.translation.evaluate import EVALUATOR as TRANSLATION

EVALUATORS: dict[Task, Evaluator] = {"translation": TRANSLATION, "parsing": PARSING}


def eval_dir(cfg: RunConfig, checkpoint: Checkpoints) -> Path:
    """Where :func:`evaluate_checkpoint` writes by default: ``<checkpoint folder>/eval-<checkpoint stem>-<hash of
    task and decoding settings>``; for an ensemble, whose members' order does not matter, beside the first of
    their sorted paths, ``eval-ensemble<k>-<hash of those paths>-<hash>``."""
    paths = sorted(p.resolve() for p in checkpoint_list(checkpoint))
    settings = cfg.section_hash("task", "decode")[:8]
    if len(paths) == 1:  # one checkpoint, given alone or as a list of one
        return Path(checkpoint_list(checkpoint)[0]).parent / f"eval-{paths[0].stem}-{settings}"
    members = hashlib.sha256("\n".join(map(str, paths)).encode()).hexdigest()[:8]
    return paths[0].parent / f"eval-ensemble{len(paths)}-{members}-{settings}"


def evaluate_checkpoint(cfg: RunConfig, checkpoint: Checkpoints, corpus: Path, tokenizer: Path,
                        out_dir: Path | None = None, splits: Sequence[str] | None = None, device: str | None = None,
                        progress: Progress | None = None) -> Path:
    """Evaluate ``checkpoint`` (several: their ensemble) on ``splits`` (default: every dev/test split) of
    ``corpus`` as ``cfg.task`` demands; returns ``scores.json``. ``out_dir`` defaults to :func:`eval_dir`, so that
    runs that differ only in how they decode never write into the same folder. ``progress`` hears (sentences
    decoded, sentences in all splits)."""
    if out_dir is None:
        out_dir = eval_dir(cfg, checkpoint)
    return EVALUATORS[cfg.task].evaluate(cfg, checkpoint, tokenizer, corpus, out_dir, splits, device, progress)
