"""Reading user text a line at a time, the one reader of every text input (the data stage's text, TSV, SGML and
treebank files, and ``translate``'s ``--input`` or stdin): a file (``.gz`` decompressed as read) or a stream, a
block at a time; UTF-8 checked, a NUL byte refused, a byte order mark dropped, damaged gzip data named with the last
line read intact."""

from __future__ import annotations

import codecs
import contextlib
import gzip
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.sources.base import DataError


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


_BLOCK_BYTES = 1 << 22  # read, decoded and split at a time
_GZIP_MAGIC = b"\x1f\x8b"

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


def _first_bad_utf8(block: bytes) -> int | None:
    """Where the first byte that is not UTF-8 lies in ``block``, or None if it is all UTF-8."""
    try:
        block.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return None


class Lines:
    """``with Lines(path, on_bom) as lines``: the file's lines as ``(line number, text)``, decoded from UTF-8 with
    the line end dropped (``.gz`` decompressed as read); :meth:`blocks` gives the same lines a block at a time.
    With ``stream`` (stdin's bytes), that is read instead and ``path`` only names it in messages.

    A UTF-8 byte order mark opening the input is no text (editors on Windows write one): it is dropped and told to
    ``on_bom``. What is not text is a :class:`DataError` naming the input, the line and the byte offset, whichever
    comes first: bad UTF-8, or a NUL byte (binary data; no sentence holds one, and the data stage's pair keys join
    a pair's sides with it).

    Damaged gzip data is a :class:`DataError` naming the file and the last line read intact, also when it shows
    first as a bad line: a flipped byte often decompresses to garbage (bad UTF-8, a stray tab) well before the CRC
    check at the end of the file catches it, so a DataError raised in the block is checked against the file.
    """

    def __init__(self, path: Path, on_bom: Callable[[Path], None] | None = None, stream: BinaryIO | None = None):
        self.path, self.line, self.on_bom, self.stream = Path(path), 0, on_bom, stream  # line: the lines given so far
        self.gzipped = False  # the input opens as gzip data does: what to do when it is no text

    def __enter__(self) -> Lines:
        return self

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for first, texts in self.blocks():
            for self.line, text in enumerate(texts.to_pylist(), start=first):  # an error on this line: intact before
                yield self.line, text

    def _open(self):
        return contextlib.nullcontext(self.stream) if self.stream is not None else _open_binary(self.path)

    def blocks(self) -> Iterator[tuple[int, pa.StringArray]]:
        """The lines about ``_BLOCK_BYTES`` at a time, as (the first one's line number, the lines): found, checked
        and trimmed by a few whole-block operations, no Python object per line."""
        offset, pending = 0, b""  # the file offset of pending's first byte; a line not yet ended
        with self._open() as f:
            while True:
                try:
                    # read1: what gzip decompressed before a damaged spot comes back in earlier calls, not lost
                    chunk = f.read1(_BLOCK_BYTES)
                except _GZIP_ERRORS as e:
                    raise _damaged_gzip(self.path, self.line, e) from None
                if offset == 0 and not pending:
                    self.gzipped = chunk.startswith(_GZIP_MAGIC)
                    if chunk.startswith(codecs.BOM_UTF8):
                        chunk, offset = chunk[len(codecs.BOM_UTF8):], len(codecs.BOM_UTF8)
                        if self.on_bom is not None:
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
            text, bad = lines.cast(pa.string()), None  # the UTF-8 check
        except pa.ArrowInvalid:  # Python finds the first bad byte
            text, bad = None, _first_bad_utf8(block)
            if bad is None:
                raise
        nul = block.find(b"\0")
        if nul >= 0 and (bad is None or nul < bad):
            raise self._not_text(block, offset, nul, "a NUL byte", ": binary data, not text",
                                 "give UTF-8 text, one sentence per line (if the rest is text, delete the NUL bytes: "
                                 "tr -d '\\000')")
        if bad is not None:
            raise self._not_text(block, offset, bad, "invalid UTF-8", f" (byte 0x{block[bad]:02x})",
                                 "re-encode the text as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
        if b"\r" in block:  # CRLF ends (and stray CRs before them: no sentence ends in one)
            text = pc.utf8_rtrim(text, characters="\r")
        first, self.line = self.line + 1, self.line + len(text)
        return first, text

    def _not_text(self, block: bytes, offset: int, at: int, what: str, detail: str, fix: str) -> DataError:
        """The error for ``what`` at byte ``at`` of ``block`` (which starts at byte ``offset`` of the input)."""
        self.line += block.count(b"\n", 0, at) + 1
        fix = "it looks gzip-compressed: gunzip it first" if self.gzipped else fix
        return DataError(f"{self.path}: line {self.line}: {what} at byte offset {offset + at}{detail}; {fix}")

    def __exit__(self, kind, error, tb) -> None:
        if (isinstance(error, DataError) and not isinstance(error, _DamagedGzip) and self.stream is None
                and self.path.suffix == ".gz" and (damage := _gzip_error(self.path))):
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


def count_lines(path: Path) -> int | None:
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
