"""Streaming readers for every supported corpus source.

Each reader yields ``(line, src, tgt)`` one pair at a time (``line`` is 1-based in its source), so memory does
not grow with the corpus. Every local file a source reads passes :meth:`Source._inside` first: resolved (symlinks
followed) and refused outside ``data.root``.
Every error is a :class:`DataError` naming the file, the line and what to do. A ``text`` or ``tsv`` source's
``path`` may be a glob (``*``, ``?``, ``[...]``): every match, in sorted path order, is read as one source.
"""

from __future__ import annotations

import abc
import codecs
import glob
import gzip
import importlib
import json
import os
import re
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import SourceSpec
from pipeline.errors import UserError
from pipeline.fsutil import sha256_file

Pair = tuple[int, str, str]  # (1-based line in the source, source sentence, target sentence)
# pairs at a time: (their 1-based lines in the source, int64 [n]; source sentences [n]; target sentences [n])
Batch = tuple[np.ndarray, pa.StringArray, pa.StringArray]
_BATCH_PAIRS = 65_536  # pairs() of a source read in batches

# What to tell a user whose hub download cannot work; the shared data README names these folders.
LOCAL_ALTERNATIVE = (
    "use local files instead: a source with 'format: text' and 'path: <prefix>' reads <prefix>.<lang> "
    "(e.g. configs/data/multi30k.yaml reads multi30k/train.en + .de under data.root; see docs/tutorials/own-data.md)"
)


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


def _glob_matches(root: Path, pattern: str) -> list[str]:
    """What ``pattern`` matches under ``root``, as matched (relative to ``root``, symlinks not yet resolved).

    Sorted, because the file system lists folders in no fixed order and the corpus (and its fingerprint) must not
    depend on it. The caller checks each match with :meth:`Source._inside`.
    """
    return sorted(glob.glob(pattern, root_dir=root))


def _pattern_field(pattern: str) -> str:
    """How an error about one match of a glob names it: the source's field and the pattern that matched."""
    return f"path (pattern {pattern!r})"


def existing_file(path: Path, where: str) -> Path:
    """``path``, checked to be a non-empty file; a :class:`DataError` naming ``where`` otherwise."""
    if not path.is_file():
        raise DataError(f"{where}: file not found: {path}")
    if path.stat().st_size == 0:
        raise DataError(f"{where}: file is empty: {path}; remove the source from the config or supply the data")
    return path


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


_BLOCK_BYTES = 1 << 22  # read, decoded and split at a time

# What gzip raises for damaged data: a cut-off stream, a bad header or CRC, an invalid deflate block.
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


class _DamagedGzip(DataError):
    """A .gz input whose compressed data is cut off or corrupt."""


def _damaged_gzip(path: Path, last_line: int, error: Exception) -> _DamagedGzip:
    after = f"after line {last_line}, the last one that read intact" if last_line else "before its first line"
    return _DamagedGzip(
        f"{path}: the compressed file is truncated or corrupt ({type(error).__name__}: {error}); reading stopped "
        f"{after}. Re-download the file, or re-compress it from the original (gzip -t {path.name} checks it)"
    )


class _Lines:
    """``with _Lines(path, on_bom) as lines``: the file's lines as ``(line number, text)``, decoded from UTF-8 with
    the line end dropped (``.gz`` decompressed as read); :meth:`blocks` gives the same lines a block at a time. A
    UTF-8 byte order mark opening the file is no text (editors on Windows write one): it is dropped and told to
    ``on_bom``; bad UTF-8 is a :class:`DataError` naming the line and the byte offset in the file.

    Damaged gzip data is a :class:`DataError` naming the file and the last line read intact, also when it shows
    first as a bad line: a flipped byte often decompresses to garbage (bad UTF-8, a stray tab) well before the CRC
    check at the end of the file catches it, so a DataError raised in the block is checked against the file.
    """

    def __init__(self, path: Path, on_bom: Callable[[Path], None]):
        self.path, self.line, self.on_bom = path, 0, on_bom  # line: the lines given so far

    def __enter__(self) -> _Lines:
        return self

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for first, texts in self.blocks():
            for self.line, text in enumerate(texts.to_pylist(), start=first):  # an error on this line: intact before
                yield self.line, text

    def blocks(self) -> Iterator[tuple[int, pa.StringArray]]:
        """The lines about ``_BLOCK_BYTES`` at a time, as (the first one's line number, the lines): found, checked
        and trimmed by a few whole-block operations, no Python object per line."""
        offset, pending = 0, b""  # the file offset of pending's first byte; a line not yet ended
        with _open_binary(self.path) as f:
            while True:
                try:
                    # read1: what gzip decompressed before a damaged spot comes back in earlier calls, not lost
                    chunk = f.read1(_BLOCK_BYTES)
                except _GZIP_ERRORS as e:
                    raise _damaged_gzip(self.path, self.line, e) from None
                if offset == 0 and not pending and chunk.startswith(codecs.BOM_UTF8):
                    chunk, offset = chunk[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
                    self.on_bom(self.path)
                if not chunk:
                    if pending:  # a last line without its newline
                        yield self._decoded(pending + b"\n", offset)
                    return
                cut = chunk.rfind(b"\n") + 1
                if not cut:  # a line longer than a block: read on
                    pending += chunk
                    continue
                block, pending = pending + chunk[:cut], chunk[cut:]
                yield self._decoded(block, offset)
                offset += len(block)

    def _decoded(self, block: bytes, offset: int) -> tuple[int, pa.StringArray]:
        """``block`` (whole lines, each ending in a newline; it starts at byte ``offset`` of the file) as text."""
        ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 0x0A)  # [k] each line's newline
        offsets = np.zeros(len(ends) + 1, dtype=np.int32)  # [k + 1] where each line starts, the newlines taken out
        offsets[1:] = ends - np.arange(len(ends))
        # not splitlines(): U+2028, U+0085 and friends occur inside sentences
        lines = pa.Array.from_buffers(pa.binary(), len(ends), [
            None, pa.py_buffer(offsets), pa.py_buffer(block.replace(b"\n", b""))])
        try:
            text = lines.cast(pa.string())  # the UTF-8 check
        except pa.ArrowInvalid:  # Python finds the first bad byte, in the first bad line: name both
            try:
                block.decode("utf-8")
            except UnicodeDecodeError as e:
                self.line += block.count(b"\n", 0, e.start) + 1
                raise DataError(
                    f"{self.path}: line {self.line}: invalid UTF-8 at byte offset {offset + e.start} "
                    f"(byte 0x{block[e.start]:02x}); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            raise
        if b"\r" in block:  # CRLF ends (and stray CRs before them: no sentence ends in one)
            text = pc.utf8_rtrim(text, characters="\r")
        first, self.line = self.line + 1, self.line + len(text)
        return first, text

    def __exit__(self, kind, error, tb) -> None:
        if (isinstance(error, DataError) and not isinstance(error, _DamagedGzip) and self.path.suffix == ".gz"
                and (damage := _gzip_error(self.path))):
            raise _damaged_gzip(self.path, max(self.line - 1, 0), damage) from None


def _gzip_error(path: Path) -> Exception | None:
    """What reading ``path`` (a .gz file) to its end raises, or None when its data is intact."""
    try:
        with gzip.open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    except _GZIP_ERRORS as e:
        return e
    return None


def _count_lines(path: Path) -> int | None:
    """The number of lines in ``path`` (decompressed), or None when its gzip data is damaged (reading it says
    where)."""
    lines, last = 0, b"\n"
    try:
        with _open_binary(path) as f:
            while chunk := f.read(1 << 20):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
    except _GZIP_ERRORS:
        return None
    return lines + (last != b"\n")


def _sum_known(counts: Iterator[int | None]) -> int | None:
    """The sum, or None if any count is unknown."""
    total = 0
    for n in counts:
        if n is None:
            return None
        total += n
    return total


def has_bom(path: Path) -> bool:
    """Whether ``path`` opens with a UTF-8 byte order mark."""
    with open(path, "rb") as f:
        return f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8


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
        lines: list[int] = []
        srcs: list[str] = []
        tgts: list[str] = []
        for line, src, tgt in self.pairs():
            lines.append(line)
            srcs.append(src)
            tgts.append(tgt)
            if len(lines) == rows:
                yield np.array(lines, dtype=np.int64), pa.array(srcs, pa.string()), pa.array(tgts, pa.string())
                lines, srcs, tgts = [], [], []
        if lines:
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


class TextSource(Source):
    """Line-aligned plain text: ``<prefix>.<src_lang>`` + ``<prefix>.<tgt_lang>`` (each optionally .gz).

    ``path`` may be a glob over prefixes (``multi30k/train*``): every matched ``<prefix>.<lang>`` with its
    other-language file, the pairs read in sorted prefix order as one source (``line`` counts across them).
    """

    def __init__(self, *args: Any):
        super().__init__(*args)
        spec, langs = self.spec, (self.src_lang, self.tgt_lang)
        if spec.files:
            self.file_pairs = [tuple(self._mapped_file(lang) for lang in langs)]
        elif is_glob(spec.path):
            self.file_pairs = self._globbed_pairs()
        else:
            self._inside(spec.path, "path")  # name the prefix itself if it escapes
            self.file_pairs = [self._prefix_pair(spec.path, f"path (prefix {spec.path!r})")]
        self.paths = [p for pair in self.file_pairs for p in pair]
        self.info.location = {"files": ",".join(self._rel(p) for p in self.paths)}
        if spec.path and is_glob(spec.path):
            self.info.location["pattern"] = spec.path
        self._record_files(self.paths)

    def _mapped_file(self, lang: str) -> Path:
        files = self.spec.files
        if lang not in files:
            raise DataError(f"{self.where}.files has no entry for language {lang!r} (has {sorted(files)})")
        return existing_file(self._inside(files[lang], f"files.{lang}"), self.where)

    def _prefix_file(self, prefix: str, lang: str, field: str) -> Path | None:
        """``<prefix>.<lang>``, else ``<prefix>.<lang>.gz``, resolved inside data.root; None if neither exists."""
        for name in (f"{prefix}.{lang}", f"{prefix}.{lang}.gz"):
            cand = self._inside(name, field)
            if cand.exists():
                return existing_file(cand, self.where)
        return None

    def _prefix_pair(self, prefix: str, field: str) -> tuple[Path, Path]:
        paths = []
        for lang in (self.src_lang, self.tgt_lang):
            path = self._prefix_file(prefix, lang, field)
            if path is None:
                raise DataError(
                    f"{self.where}: file not found: {self.root / prefix}.{lang} (nor {Path(prefix).name}.{lang}.gz); "
                    f"'path' is a prefix: the files must be named <path>.{self.src_lang} and <path>.{self.tgt_lang}"
                )
            paths.append(path)
        return paths[0], paths[1]

    def _globbed_pairs(self) -> list[tuple[Path, Path]]:
        """Every prefix whose ``<prefix>.<lang>`` (plain or .gz, either language) matches the pattern, paired."""
        pattern, langs = self.spec.path, (self.src_lang, self.tgt_lang)
        field = _pattern_field(pattern)
        prefixes: set[str] = set()
        # Either language's file names a prefix, so a file whose partner is missing is reported, not skipped.
        for suffix in (f".{lang}{gz}" for lang in langs for gz in ("", ".gz")):
            prefixes.update(m[: -len(suffix)] for m in _glob_matches(self.root, pattern + suffix))
        if not prefixes:
            raise DataError(
                f"{self.where}.path = {pattern!r} matches no file under data.root ({self.root}): looked for "
                f"{pattern}.{langs[0]} and {pattern}.{langs[1]} (or .gz); 'path' is a prefix pattern, check it "
                "and data.root"
            )
        pairs = []
        for prefix in sorted(prefixes):
            found = {lang: self._prefix_file(prefix, lang, field) for lang in langs}
            missing = [lang for lang in langs if found[lang] is None]
            if missing:
                other = next(lang for lang in langs if lang not in missing)
                raise DataError(
                    f"{self.where}.path = {pattern!r} matches {self._rel(found[other])} but its partner "
                    f"{prefix}.{missing[0]} (or .gz) is missing under data.root ({self.root}); add it, or move the "
                    "unpaired file out of the pattern's reach"
                )
            pairs.append((found[self.src_lang], found[self.tgt_lang]))
        return pairs

    def expected_rows(self) -> int | None:
        return _sum_known(_count_lines(sp) for sp, _ in self.file_pairs)

    def pair_batches(self, rows: int) -> Iterator[Batch]:
        total = 0
        for sp, tp in self.file_pairs:
            for srcs, tgts in _aligned_batches(sp, tp, self._bom, rows):
                yield np.arange(total + 1, total + 1 + len(srcs), dtype=np.int64), srcs, tgts
                total += len(srcs)
        self.info.rows_read = total

    def pairs(self) -> Iterator[Pair]:
        for lines, srcs, tgts in self.pair_batches(_BATCH_PAIRS):
            yield from zip(lines.tolist(), srcs.to_pylist(), tgts.to_pylist())


class _Held:
    """Lines read from one file of a pair and not yet paired: Arrow arrays, taken from the front."""

    def __init__(self, blocks: Iterator[tuple[int, pa.StringArray]]):
        self.blocks, self.arrays, self.rows, self.done = blocks, [], 0, False

    def fill(self, rows: int) -> None:
        """Read blocks until ``rows`` lines are held or the file has ended (``done``)."""
        while self.rows < rows and not self.done:
            block = next(self.blocks, None)
            self.done = block is None
            if block is not None:
                self.arrays.append(block[1])
                self.rows += len(block[1])

    def take(self, n: int) -> pa.StringArray:
        """The first ``n`` lines held (copied only where they span blocks)."""
        taken, need = [], n
        while need:
            head = self.arrays[0]
            if len(head) <= need:
                taken.append(self.arrays.pop(0))
            else:
                taken.append(head.slice(0, need))
                self.arrays[0] = head.slice(need)
            need -= len(taken[-1])
        self.rows -= n
        return taken[0] if len(taken) == 1 else pa.concat_arrays(taken)


def _aligned_batches(sp: Path, tp: Path, on_bom: Callable[[Path], None], rows: int
                     ) -> Iterator[tuple[pa.StringArray, pa.StringArray]]:
    """A line-aligned file pair, up to ``rows`` pairs at a time as (sources, targets); unequal line counts are an
    error naming both files."""
    with _Lines(sp, on_bom) as fs, _Lines(tp, on_bom) as ft:
        held = (_Held(fs.blocks()), _Held(ft.blocks()))
        paired = 0
        while True:
            for side in held:
                side.fill(rows)
            if n := min(held[0].rows, held[1].rows, rows):
                yield held[0].take(n), held[1].take(n)
                paired += n
                continue
            if held[0].rows or held[1].rows:  # one file ran out first
                longer, shorter, rest = (sp, tp, held[0]) if held[0].rows else (tp, sp, held[1])
                total = paired + rest.rows + sum(len(lines) for _, lines in rest.blocks)
                raise DataError(
                    f"{longer} has {total} lines but {shorter} has {paired}: parallel files must be "
                    f"line-aligned (first unmatched line {paired + 1}); fix or re-export the pair"
                )
            return


class TsvSource(Source):
    """Tab-separated text, one pair per line; ``columns`` names the language of each column.

    ``path`` is one file, or a glob (``weekly/*.tsv``): every matching file, in sorted path order, read as one
    source (``line`` counts across them).
    """

    def __init__(self, *args: Any):
        super().__init__(*args)
        cols = self.spec.columns
        missing = [lang for lang in (self.src_lang, self.tgt_lang) if lang not in cols]
        if missing:
            raise DataError(f"{self.where}.columns = {cols} has no column for {missing}; name each column's language")
        self.idx = (cols.index(self.src_lang), cols.index(self.tgt_lang))
        pattern = self.spec.path
        if is_glob(pattern):
            self.paths = self._globbed_files(pattern)
            self.info.location = {"files": ",".join(self._rel(p) for p in self.paths), "pattern": pattern}
        else:
            self.paths = [existing_file(self._inside(pattern, "path"), self.where)]
            self.info.location = {"file": self._rel(self.paths[0])}
        self.info.location["columns"] = ",".join(cols)
        self._record_files(self.paths)

    def _globbed_files(self, pattern: str) -> list[Path]:
        field = _pattern_field(pattern)
        # Folders that happen to match (weekly/* with a subfolder) hold no rows of their own; skip them.
        paths = [p for p in (self._inside(m, field) for m in _glob_matches(self.root, pattern)) if not p.is_dir()]
        if not paths:
            raise DataError(f"{self.where}.path = {pattern!r} matches no file under data.root ({self.root}); "
                            "check the pattern and data.root")
        return [existing_file(p, self.where) for p in paths]

    def expected_rows(self) -> int | None:
        return _sum_known(_count_lines(p) for p in self.paths)

    def pairs(self) -> Iterator[Pair]:
        n_cols = len(self.spec.columns)
        si, ti = self.idx
        total = 0
        for path in self.paths:
            with _Lines(path, self._bom) as lines:
                for line, text in lines:
                    cells = text.split("\t")
                    if len(cells) != n_cols:
                        raise DataError(
                            f"{path}: line {line}: expected {n_cols} tab-separated fields "
                            f"({','.join(self.spec.columns)}), found {len(cells)}; remove stray tabs or fix 'columns'"
                        )
                    total += 1
                    yield total, cells[si], cells[ti]
        self.info.rows_read = total


_DOC = re.compile(r'<doc\b[^>]*\bdocid="([^"]*)"', re.I)
_SEG = re.compile(r'<seg\b[^>]*\bid="?([^">\s]+)"?[^>]*>(.*)</seg>', re.I)


def _read_sgm(path: Path, on_bom: Callable[[Path], None]) -> dict[tuple[str, str], str]:
    """Segments of a WMT SGML file keyed by (docid, seg id), in file order.

    Extraction follows sacreBLEU (strip, collapse whitespace, no HTML unescaping), so the text equals the
    plain-text test sets everyone scores against.
    """
    segs: dict[tuple[str, str], str] = {}
    doc = None
    with _Lines(path, on_bom) as lines:
        for line, text in lines:
            if m := _DOC.search(text):
                doc = m.group(1)
            if m := _SEG.search(text):
                if doc is None:
                    raise DataError(f"{path}: line {line}: <seg> outside any <doc docid=...>; not a WMT SGML file?")
                key = (doc, m.group(1))
                if key in segs:
                    raise DataError(f"{path}: line {line}: duplicate segment docid={doc!r} id={m.group(1)!r}")
                segs[key] = " ".join(m.group(2).split())
    if not segs:
        raise DataError(f"{path}: no <seg> elements found; 'format: sgm' expects a WMT SGML file")
    return segs


class SgmSource(Source):
    """A WMT SGML source/reference pair (``files: {lang: file.sgm}``), aligned by document and segment id."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        files = self.spec.files
        missing = [lang for lang in (self.src_lang, self.tgt_lang) if lang not in files]
        if missing:
            raise DataError(f"{self.where}.files has no SGML file for {missing}; give one per language")
        self.paths = [existing_file(self._inside(files[lang], f"files.{lang}"), self.where)
                      for lang in (self.src_lang, self.tgt_lang)]
        self.info.location = {"files": ",".join(self._rel(p) for p in self.paths)}
        self._record_files(self.paths)

    def pairs(self) -> Iterator[Pair]:
        src, tgt = (_read_sgm(p, self._bom) for p in self.paths)
        if src.keys() != tgt.keys():
            only = sorted(src.keys() ^ tgt.keys())[:3]
            raise DataError(
                f"{self.paths[0]} and {self.paths[1]} hold different segments (e.g. docid/id {only}); "
                "use the source and reference SGML of the same test set"
            )
        for line, (key, s) in enumerate(src.items(), start=1):
            yield line, s, tgt[key]
        self.info.rows_read = len(src)


# --------------------------------------------------------------------------------------- columnar sources


def _column_names(schema_names: list[str], spec: SourceSpec, src_lang: str, tgt_lang: str, where: str, what: str):
    """Pick the source/target columns: ``fields`` mapping, columns named by language, or a ``translation`` struct."""
    if spec.fields:
        missing = [lang for lang in (src_lang, tgt_lang) if lang not in spec.fields]
        if missing:
            raise DataError(f"{where}.fields has no column for {missing}")
        cols = (spec.fields[src_lang], spec.fields[tgt_lang])
        absent = [c for c in cols if c not in schema_names]
        if absent:
            raise DataError(f"{what}: columns {absent} not found (has {schema_names}); fix {where}.fields")
        return cols, False
    if src_lang in schema_names and tgt_lang in schema_names:
        return (src_lang, tgt_lang), False
    if "translation" in schema_names:
        return ("translation", "translation"), True
    raise DataError(
        f"{what}: no columns named {src_lang!r}/{tgt_lang!r} and no 'translation' column (has {schema_names}); "
        f"map them with {where}.fields: {{{src_lang}: <column>, {tgt_lang}: <column>}}"
    )


def _pairs_from_batches(batches: Iterator[pa.RecordBatch], cols: tuple[str, str], nested: bool, langs, what: str):
    line = 0
    for batch in batches:
        if nested:
            struct = batch.column(batch.schema.get_field_index("translation"))
            try:
                s_arr, t_arr = (struct.field(lang) for lang in langs)
            except KeyError:
                raise DataError(f"{what}: the 'translation' struct has no field {list(langs)}") from None
        else:
            s_arr, t_arr = (batch.column(batch.schema.get_field_index(c)) for c in cols)
        for s, t in zip(s_arr.to_pylist(), t_arr.to_pylist()):
            line += 1
            yield line, s or "", t or ""


class ParquetSource(Source):
    """One Parquet file or a folder of them (sorted by name), read in record batches."""

    suffixes = (".parquet",)

    def __init__(self, *args: Any):
        super().__init__(*args)
        path = self._inside(self.spec.path, "path")
        if path.is_dir():
            self.paths = self._folder_files(path, self.suffixes)
            if not self.paths:
                raise DataError(f"{self.where}: folder {path} has no {'/'.join(self.suffixes)} files")
        else:
            self.paths = [existing_file(path, self.where)]
        self.info.location = {"path": self._rel(path)}
        self._record_files(self.paths)

    def _batches(self, path: Path) -> tuple[list[str], Iterator[pa.RecordBatch]]:
        try:
            f = pq.ParquetFile(path, pre_buffer=False)  # pre_buffer keeps every row group read: memory grows
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); check 'format' for this source") from None
        return f.schema_arrow.names, f.iter_batches(batch_size=8192)

    def _rows(self, path: Path) -> int | None:
        """The file's row count from its metadata (None if unreadable: reading it says why)."""
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowInvalid, OSError):
            return None

    def expected_rows(self) -> int | None:
        return _sum_known(self._rows(p) for p in self.paths)

    def pairs(self) -> Iterator[Pair]:
        total = 0
        for path in self.paths:
            names, batches = self._batches(path)
            cols, nested = _column_names(names, self.spec, self.src_lang, self.tgt_lang, self.where, str(path))
            for _, s, t in _pairs_from_batches(batches, cols, nested, (self.src_lang, self.tgt_lang), str(path)):
                total += 1
                yield total, s, t
        self.info.rows_read = total


class ArrowSource(ParquetSource):
    """Arrow IPC files (file or stream format, e.g. a ``datasets`` cache shard), memory-mapped."""

    suffixes = (".arrow", ".feather", ".ipc")

    def _batches(self, path: Path) -> tuple[list[str], Iterator[pa.RecordBatch]]:
        source = pa.memory_map(str(path))
        for opener in (pa.ipc.open_file, pa.ipc.open_stream):
            try:
                reader = opener(source)
                break
            except pa.ArrowInvalid:
                source.seek(0)
        else:
            raise DataError(f"{path}: not an Arrow IPC file or stream; check 'format' for this source")
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        return reader.schema.names, batches

    def _rows(self, path: Path) -> int | None:
        return None  # a stream has no row count ahead of reading it


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); re-save the dataset with save_to_disk") from None


class DatasetSource(Source):
    """A ``datasets.Dataset``: from ``save_to_disk`` (``hf_disk``) or from the Hugging Face hub (``hub``)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.dataset = self._load()
        self.info.fingerprint = self.dataset._fingerprint

    def _load(self):
        import datasets

        spec = self.spec
        path = self._inside(spec.path, "path")
        if not path.is_dir():
            raise DataError(f"{self.where}: folder not found: {path} (format hf_disk reads a save_to_disk folder)")
        self._folder_files(path)
        self._check_referenced(path)
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DataError(f"{path}: not a datasets save_to_disk folder ({e})") from None
        self.info.location = {"path": self._rel(path)}
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise DataError(f"{path}: has splits {sorted(ds)}; set {self.where}.split to one of them")
            ds = ds[spec.split]
            self.info.location["split"] = spec.split
        return ds

    def _check_referenced(self, folder: Path) -> None:
        """Pass what ``load_from_disk`` will open by name through :meth:`_inside` too: the split folders that
        dataset_dict.json lists and the data files each state.json lists (names such as ``../x`` may escape)."""
        listing = folder / "dataset_dict.json"
        splits = [folder / s for s in _json(listing).get("splits", [])] if listing.is_file() else [folder]
        for split in splits:
            state = self._inside(split, f"path (split named in {self._rel(listing)})") / "state.json"
            if state.is_file():
                for entry in _json(state).get("_data_files", []):
                    self._inside(split / entry["filename"], f"path (data file named in {self._rel(state)})")

    def expected_rows(self) -> int | None:
        return len(self.dataset)

    def pairs(self) -> Iterator[Pair]:
        ds = self.dataset
        what = f"{self.spec.format} source {self.spec.name!r}"
        cols, nested = _column_names(ds.column_names, self.spec, self.src_lang, self.tgt_lang, self.where, what)
        # with_format("arrow") honours an indices mapping (select/shuffle) and yields zero-copy Arrow tables.
        tables = ds.with_format("arrow").iter(batch_size=8192)
        batches = (b for t in tables for b in t.to_batches())
        line = 0
        for line, s, t in _pairs_from_batches(batches, cols, nested, (self.src_lang, self.tgt_lang), what):
            yield line, s, t
        self.info.rows_read = line


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 5.0) -> str | None:
    """None when the hub endpoint answers a TCP connect, else why not (DNS, refused, timeout)."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{url.hostname}:{port}: {e}"


class HubUnavailable(DataError):
    """The hub could not be reached or did not serve the dataset: worth retrying later (unlike bad input)."""


class HubSource(DatasetSource):
    """A dataset on the Hugging Face hub, cached under ``HF_DATASETS_CACHE``.

    Fails in seconds, naming the local alternative, when the hub cannot be reached: a TCP probe first (the
    ``datasets`` client otherwise retries for minutes), and ``HF_HUB_OFFLINE=1`` is honoured (cache only).
    """

    def _load(self):
        import datasets

        spec = self.spec
        self.info.location = {"dataset": spec.dataset, "subset": spec.subset or "", "split": spec.split,
                              "revision": spec.revision or ""}
        ident = f"{spec.dataset}" + (f" ({spec.subset})" if spec.subset else "") + f" split {spec.split!r}"
        if (local := Path(spec.dataset)).exists():  # load_dataset would read it instead of the hub
            raise DataError(
                f"{self.where}.dataset = {spec.dataset!r} is also a path from the working directory "
                f"({local.resolve()}): the datasets library would read it, outside data.root, instead of the hub. "
                "For a local copy use format hf_disk, parquet or arrow with a path under data.root; for the hub "
                "dataset, run from a working directory without that path")
        if not _hub_offline() and (why := _hub_reachable()):
            raise HubUnavailable(
                f"{self.where}: cannot reach the Hugging Face hub for {ident} ({why}). If the dataset is in your "
                f"cache, set HF_HUB_OFFLINE=1 to use it; otherwise {LOCAL_ALTERNATIVE}"
            )
        try:
            return datasets.load_dataset(spec.dataset, spec.subset, split=spec.split, revision=spec.revision)
        except Exception as e:  # the hub client raises many types (HTTP, offline, missing split); all end here
            if _hub_offline():
                raise DataError(f"{self.where}: could not load {ident}: {type(e).__name__}: {e}. HF_HUB_OFFLINE is "
                                f"set and it is not in the cache; {LOCAL_ALTERNATIVE}") from None
            raise HubUnavailable(f"{self.where}: could not load {ident}: {type(e).__name__}: {e}. "
                                 f"{LOCAL_ALTERNATIVE}") from None


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
