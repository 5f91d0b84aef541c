"""Readers of columnar formats: Parquet files, Arrow IPC files and streams, ``datasets`` save_to_disk folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import SourceSpec
from pipeline.data.sources.base import DataError, Pair, Source, existing_file, sum_known


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


def _refuse_nul(texts: pa.Array, first_row: int, what: str, column: str) -> None:
    """A :class:`DataError` naming the first of ``texts`` (rows from ``first_row`` on) that holds a NUL byte: binary
    data, not text, refused as the text readers refuse it (:class:`~pipeline.data.sources.lines.Lines`)."""
    if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
        return
    hits = pc.match_substring(texts, "\x00")
    if pc.any(hits).as_py():
        raise DataError(f"{what}: row {first_row + pc.index(hits, True).as_py()}: column {column!r} holds a NUL byte: "
                        "binary data, not text; remove it from the data, or map the text columns (fields)")


def _pairs_from_batches(batches: Iterator[pa.RecordBatch], cols: tuple[str, str], nested: bool, langs, what: str):
    line = 0
    for batch in batches:
        if nested:
            struct = batch.column(batch.schema.get_field_index("translation"))
            try:
                s_arr, t_arr = (struct.field(lang) for lang in langs)
            except KeyError:
                raise DataError(f"{what}: the 'translation' struct has no field {list(langs)}") from None
            names = [f"translation.{lang}" for lang in langs]
        else:
            s_arr, t_arr = (batch.column(batch.schema.get_field_index(c)) for c in cols)
            names = list(cols)
        for texts, name in zip((s_arr, t_arr), names):
            _refuse_nul(texts, line + 1, what, name)
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
        return sum_known(self._rows(p) for p in self.paths)

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
