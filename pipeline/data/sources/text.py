"""Readers of text formats: line-aligned plain text (``text``), tab-separated pairs (``tsv``), WMT SGML (``sgm``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from pipeline.data.sources.base import (
    Batch, DataError, Pair, Source, existing_file, glob_matches, is_glob, pattern_field, sum_known,
)
from pipeline.data.sources.lines import Lines, count_lines

_BATCH_PAIRS = 65_536  # pairs() of a source read in batches


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
        field = pattern_field(pattern)
        prefixes: set[str] = set()
        # Either language's file names a prefix, so a file whose partner is missing is reported, not skipped.
        for suffix in (f".{lang}{gz}" for lang in langs for gz in ("", ".gz")):
            prefixes.update(m[: -len(suffix)] for m in glob_matches(self.root, pattern + suffix))
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
        return sum_known(count_lines(sp) for sp, _ in self.file_pairs)

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
    with Lines(sp, on_bom) as fs, Lines(tp, on_bom) as ft:
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
        field = pattern_field(pattern)
        # Folders that happen to match (weekly/* with a subfolder) hold no rows of their own; skip them.
        paths = [p for p in (self._inside(m, field) for m in glob_matches(self.root, pattern)) if not p.is_dir()]
        if not paths:
            raise DataError(f"{self.where}.path = {pattern!r} matches no file under data.root ({self.root}); "
                            "check the pattern and data.root")
        return [existing_file(p, self.where) for p in paths]

    def expected_rows(self) -> int | None:
        return sum_known(count_lines(p) for p in self.paths)

    def pairs(self) -> Iterator[Pair]:
        n_cols = len(self.spec.columns)
        si, ti = self.idx
        total = 0
        for path in self.paths:
            with Lines(path, self._bom) as lines:
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
    with Lines(path, on_bom) as lines:
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

