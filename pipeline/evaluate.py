"""The evaluation stage: each task's evaluator in one table, and the checkpoint evaluation the pipeline runs.

``EVALUATORS[cfg.task]`` decodes and scores (``pipeline.evalsets.Evaluator``): translation with every BLEU variant
(``pipeline.translation.evaluate``), parsing with EVALB (``pipeline.parsing.evaluate``). Averaging (choosing N on
dev), the CLI and the pipeline reach a task's scoring only through this table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pipeline.config import RunConfig, Task
from pipeline.evalsets import Evaluator, Progress
from pipeline.parsing.evaluate import EVALUATOR as PARSING
from pipeline.translation.evaluate import EVALUATOR as TRANSLATION

EVALUATORS: dict[Task, Evaluator] = {"translation": TRANSLATION, "parsing": PARSING}


def eval_dir(cfg: RunConfig, checkpoint: Path) -> Path:
    """Where :func:`evaluate_checkpoint` writes by default: ``<checkpoint folder>/eval-<checkpoint stem>-<hash of
    task and decoding settings>``."""
    return Path(checkpoint).parent / f"eval-{Path(checkpoint).stem}-{cfg.section_hash('task', 'decode')[:8]}"


def evaluate_checkpoint(cfg: RunConfig, checkpoint: Path, corpus: Path, tokenizer: Path, out_dir: Path | None = None,
                        splits: Sequence[str] | None = None, device: str = "cpu",
                        progress: Progress | None = None) -> Path:
    """Evaluate ``checkpoint`` on ``splits`` (default: every dev/test split) of ``corpus`` as ``cfg.task`` demands;
    returns ``scores.json``. ``out_dir`` defaults to :func:`eval_dir`, so that runs that differ only in how they
    decode never write into the same folder. ``progress`` hears (sentences decoded, sentences in all splits)."""
    if out_dir is None:
        out_dir = eval_dir(cfg, checkpoint)
    return EVALUATORS[cfg.task].evaluate(cfg, checkpoint, tokenizer, corpus, out_dir, splits, device, progress)
