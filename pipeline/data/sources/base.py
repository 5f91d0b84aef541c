"""What every corpus reader shares: :class:`DataError`, :class:`SourceInfo` (a source's provenance), the checks
every local path passes (resolved inside ``data.root``, globs matched in sorted order) and the :class:`Source`
interface each reader implements."""

from __future__ import annotations

import abc
import glob
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from pipeline.config import SourceSpec
from pipeline.support.errors import UserError
from pipeline.support.fsutil import sha256_file

Pair = tuple[int, str, str]  # (1-based line in the source, source sentence, target sentence)
# pairs at a time: (their 1-based lines in the source, int64 [n]; source sentences [n]; target sentences [n])
Batch = tuple[np.ndarray, pa.StringArray, pa.StringArray]


class DataError(UserError, ValueError):
    """Bad input for the data stage; the message names the file (and line) and what to do."""


@dataclass
class SourceInfo:
    """Provenance of one source, recorded in the corpus manifest."""

    name: str
    format: str
    location: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    fingerprint: str | None = None  # datasets' fingerprint for hub / hf_disk sources
    rows_read: int = 0
    bom_stripped: list[str] = field(default_factory=list)  # files whose leading UTF-8 byte order mark was dropped


# ------------------------------------------------------------------------------------------------ paths


def resolve_root(root: str | Path) -> Path:
    """The data root as an absolute path; it must exist."""
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise DataError(
            f"data.root {str(root)!r} resolves to {path}, which is not a folder; "
            "set data.root (CLI --data-root, or AIAYN_DATA_ROOT) to the folder that holds your corpora"
        )
    return path


def resolve_inside(root: Path, rel: str, where: str) -> Path:
    """Resolve ``rel`` under ``root`` and refuse anything that escapes it (``..``, absolute paths, symlinks)."""
    path = (root / Path(rel).expanduser()).resolve()
    if not path.is_relative_to(root):
        raise DataError(
            f"{where} = {rel!r} resolves to {path}, outside data.root ({root}); "
            "move the files under data.root or point data.root at the folder that holds them"
        )
    return path


_GLOB_CHARS = re.compile(r"[*?\[]")


def is_glob(path: str) -> bool:
    """Whether a source's ``path`` is a glob pattern (``*``, ``?``, ``[...]``) rather than one path."""
    return bool(_GLOB_CHARS.search(path))


def glob_matches(root: Path, pattern: str) -> list[str]:
    """What ``pattern`` matches under ``root``, as matched (relative to ``root``, symlinks not yet resolved).

    Sorted, because the file system lists folders in no fixed order and the corpus (and its fingerprint) must not
    depend on it. The caller checks each match with :meth:`Source._inside`.
    """
    return sorted(glob.glob(pattern, root_dir=root))


def pattern_field(pattern: str) -> str:
    """How an error about one match of a glob names it: the source's field and the pattern that matched."""
    return f"path (pattern {pattern!r})"


def existing_file(path: Path, where: str) -> Path:
    """``path``, checked to be a non-empty file; a :class:`DataError` naming ``where`` otherwise."""
    if path.is_dir():
        raise DataError(f"{where}: {path} is a folder, not a file; name the file itself")
    if not path.is_file():
        raise DataError(f"{where}: file not found: {path}")
    if path.stat().st_size == 0:
        raise DataError(f"{where}: file is empty: {path}; remove the source from the config or supply the data")
    return path


def sum_known(counts: Iterator[int | None]) -> int | None:
    """The sum, or None if any count is unknown."""
    total = 0
    for n in counts:
        if n is None:
            return None
        total += n
    return total


# ----------------------------------------------------------------------------------------------- readers


class Source(abc.ABC):
    """A resolved, checked source: ``info`` for the manifest, ``pairs()`` to stream its sentence pairs."""

    def __init__(self, spec: SourceSpec, root: Path, src_lang: str, tgt_lang: str, where: str):
        self.spec, self.root, self.src_lang, self.tgt_lang, self.where = spec, root, src_lang, tgt_lang, where
        self.info = SourceInfo(name=spec.name, format=spec.format, location={})

    def _rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    def _inside(self, path: str | Path, field: str) -> Path:
        """The one gate for every file and folder this source reads: ``path`` (as configured, relative to
        data.root, or found under a checked folder) with its symlinks resolved; a :class:`DataError` naming
        ``<where>.<field>`` and the file if that leads outside data.root. Readers open only what it returns, the
        resolved path, not the link."""
        if isinstance(path, Path) and path.is_relative_to(self.root):  # name it as the user sees it in data.root
            path = path.relative_to(self.root)
        return resolve_inside(self.root, str(path), f"{self.where}.{field}")

    def _bom(self, path: Path) -> None:
        """Record that ``path`` began with a UTF-8 byte order mark, dropped from its first line (data report)."""
        self.info.bom_stripped.append(self._rel(path))

    def _folder_files(self, folder: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
        """The entries under ``folder`` (walked without following links; with ``suffixes``, only names ending in
        one of them), in sorted name order, each passed through :meth:`_inside`: a checked folder may still hold a
        link that leads outside data.root."""
        field = f"path (folder {self._rel(folder)!r})"
        found = sorted(p for p in folder.rglob("*") if suffixes is None or p.suffix in suffixes)
        return [self._inside(p, field) for p in found]

    def _record_files(self, paths: list[Path]) -> None:
        self.info.files = {self._rel(p): sha256_file(p) for p in paths}

    @abc.abstractmethod
    def pairs(self) -> Iterator[Pair]:
        """Stream ``(line, src, tgt)``; sets ``info.rows_read`` when exhausted."""

    def pair_batches(self, rows: int) -> Iterator[Batch]:
        """:meth:`pairs` up to ``rows`` at a time (a reader that can read a batch at once overrides it)."""
        pairs = self.pairs()
        while batch := list(itertools.islice(pairs, rows)):
            lines, srcs, tgts = zip(*batch)
            yield np.array(lines, dtype=np.int64), pa.array(srcs, pa.string()), pa.array(tgts, pa.string())

    def expected_rows(self) -> int | None:
        """How many pairs :meth:`pairs` will yield, counted ahead cheaply (for progress); None when unknown."""
        return None

    def model_target(self, tgt: str, tree_leaves: str) -> str:
        """What the model learns to produce from ``tgt`` as read (kept as ``tgt_raw`` for scoring): ``tgt`` itself
        (a treebank source linearises the tree, writing preterminals as ``tree_leaves``: ``data.tree_leaves``)."""
        return tgt

    def model_targets(self, tgts: pa.StringArray, tree_leaves: str) -> pa.StringArray:
        """:meth:`model_target` of each of ``tgts`` (``tgts`` itself where the reader learns the text as read)."""
        if type(self).model_target is Source.model_target:
            return tgts
        return pa.array([self.model_target(t, tree_leaves) for t in tgts.to_pylist()], pa.string())

    def target_symbols(self, targets: pa.StringArray) -> set[str]:
        """The symbols of a closed target vocabulary in these model targets (a treebank's brackets and labels,
        which the tokenizer must keep whole); none for text."""
        return set()
