"""Streaming readers for every supported corpus source.

Each reader yields ``(line, src, tgt)`` one pair at a time (``line`` is 1-based in its source), so memory does
not grow with the corpus. Every local file a source reads passes :meth:`Source._inside` first: resolved (symlinks
followed) and refused outside ``data.root``.
Every error is a :class:`DataError` naming the file, the line and what to do. A ``text`` or ``tsv`` source's
``path`` may be a glob (``*``, ``?``, ``[...]``): every match, in sorted path order, is read as one source.

The readers live by format family (``text``: text, tsv, sgm; ``columnar``: parquet, arrow, hf_disk; ``hub``), on
what ``base`` shares (the :class:`Source` interface, path checks) and ``lines`` (reading a text file's lines);
:func:`open_source` picks one by a source's ``format``.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pipeline.config import SourceSpec
from pipeline.data.sources.base import (
    Batch, DataError, Pair, Source, SourceInfo, existing_file, is_glob, resolve_inside, resolve_root,
)
from pipeline.data.sources.columnar import ArrowSource, DatasetSource, ParquetSource
from pipeline.data.sources.hub import LOCAL_ALTERNATIVE, HubSource, HubUnavailable
from pipeline.data.sources.text import SgmSource, TextSource, TsvSource

__all__ = [
    "LOCAL_ALTERNATIVE", "TASK_READERS", "ArrowSource", "Batch", "DataError", "DatasetSource", "HubSource",
    "HubUnavailable", "Pair", "ParquetSource", "SgmSource", "Source", "SourceInfo", "TextSource", "TsvSource",
    "existing_file", "is_glob", "open_source", "reader", "resolve_inside", "resolve_root",
]

_READERS: dict[str, type[Source]] = {
    "text": TextSource,
    "tsv": TsvSource,
    "sgm": SgmSource,
    "parquet": ParquetSource,
    "arrow": ArrowSource,
    "hf_disk": DatasetSource,
    "hub": HubSource,
}
# Formats whose reader lives with the task that needs it, named by module as an entry point would be (the treebank
# reader is parsing's): the data stage reads them through the same Source interface without importing that task.
TASK_READERS = {"ptb": "pipeline.parsing.treebank:PtbSource"}


def reader(fmt: str) -> type[Source]:
    """The :class:`Source` class that reads format ``fmt`` (a task's reader is imported on first use)."""
    if fmt in _READERS:
        return _READERS[fmt]
    module, _, name = TASK_READERS[fmt].partition(":")
    return getattr(importlib.import_module(module), name)


def open_source(spec: SourceSpec, root: Path, src_lang: str, tgt_lang: str, where: str) -> Source:
    """Resolve and check a source (paths, files, columns) before any pair is read."""
    return reader(spec.format)(spec, root, src_lang, tgt_lang, where)
