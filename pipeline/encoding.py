"""Model input from normalised text: each sentence's token ids with end-of-sentence, cut to the model's positions.

What both decoding engines feed their model (``pipeline.inference`` for PyTorch, ``pipeline.engines`` for
CTranslate2), so that a long sentence is cut, and warned about, and an empty one skipped, the same way whichever
engine serves.
"""

from __future__ import annotations

import logging
from typing import Sequence

from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.inference")


def encode_sources(tokenizer: Tokenizer, sentences: Sequence[str], max_positions: int, source: str = "input",
                   truncated: list[int] | None = None) -> list[list[int]]:
    """Each sentence's token ids with eos, cut to the model's ``max_positions`` (eos included).

    A cut sentence is logged as a warning naming ``source`` and its line (from 1), and its line is appended to
    ``truncated`` when given: the model cannot read past its positions, but the user must know it did not.
    """
    limit = max_positions - 1  # leave room for eos
    rows = []
    for line, ids in enumerate(tokenizer.encode_batch(sentences), start=1):
        if len(ids) > limit:
            log.warning("%s: line %d has %d tokens, more than the model's %d positions hold (%d tokens and "
                        "end-of-sentence); only its first %d tokens are translated", source, line, len(ids),
                        max_positions, limit, limit)
            if truncated is not None:
                truncated.append(line)
        rows.append(ids[:limit] + [tokenizer.eos_id])
    return rows


def to_decode(sentences: Sequence[str]) -> list[int]:
    """The indices of the sentences a model decodes: the non-empty ones. An empty (normalised) sentence translates
    to "" everywhere (CLI, evaluation, either serving engine): given only an end-of-sentence a model still writes a
    fluent, made-up sentence."""
    return [i for i, s in enumerate(sentences) if s]
