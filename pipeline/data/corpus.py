"""The data stage: sources -> one canonical, cleaned, versioned parallel corpus on disk.

Contract (docs/explanation/formats.md): ``<work_dir>/corpus/<fingerprint>/`` with ``train.parquet``, ``dev.parquet``,
``test.<name>.parquet`` and ``manifest.json``. The folder name is a hash of the data config, every input's
content hash and this stage's code, so a re-run on unchanged inputs returns the existing folder at once, and a
change anywhere gives a new folder instead of overwriting one that other runs may use.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
import unicodedata
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.support.codegraph import code_closure
from pipeline.config import DataConfig
from pipeline.data.clean import Normalizer, TrainFilter
from pipeline.data.sources import TASK_READERS, Batch, DataError, Source, open_source, resolve_root
from pipeline.support.fsutil import (MANIFEST, atomic_dir, code_hash, identity_fingerprint, names_full_disk,
                                     read_stage_manifest, sha256_file, stage_folder, write_json)

log = logging.getLogger("aiayn.data")

CORPUS_FORMAT = "aiayn-corpus/1"
SCHEMA = pa.schema(
    [
        ("split", pa.string()),  # train | dev | test
        ("origin", pa.string()),  # the source's configured name
        ("line", pa.int64()),  # 1-based line (or row) in that source
        ("src", pa.string()),  # normalised source sentence
        ("tgt", pa.string()),  # normalised target sentence
        ("tgt_raw", pa.string()),  # dev/test: target exactly as distributed (score against it); train: null
    ]
)
_LOG_EVERY = 1_000_000
_REPORT_EVERY = 10_000


def _code_hash() -> str:
    """Hash of the code this stage runs (its modules and their imports, the task readers' included): a change to
    reading, cleaning or writing invalidates cached corpora. The config schema is left out: the config's values
    are in the identity."""
    modules = [__name__, *(spec.partition(":")[0] for spec in TASK_READERS.values())]
    return code_hash(*sorted({f for m in modules for f in code_closure(m, ("pipeline.config",))}))


class CorpusSplitWriter:
    """Streams rows of one split into a Parquet file in this format, in row groups of ``batch_rows`` rows (also the
    writer of a distilled corpus's training split, ``pipeline.distill``). Rows come one at a time (:meth:`add`) or
    a batch at a time (:meth:`add_batch`), in order. As a context manager, it closes its file when the block fails
    (a full disk): the file's space is freed when the caller removes it, not when the process ends."""

    def __init__(self, path: Path, split: str, batch_rows: int):
        self.path, self.split, self.batch_rows = path, split, batch_rows
        # Fixed writer options: the same rows always give the same bytes (no timestamps in Parquet metadata).
        self.sink = open(path, "wb")  # ours to close, whatever state the writer is left in
        self.writer = pq.ParquetWriter(self.sink, SCHEMA, compression="zstd", use_dictionary=["split", "origin"])
        self.cols: tuple[list, ...] = ([], [], [], [], [])  # rows added one at a time, not yet in a batch
        self.held: list[pa.RecordBatch] = []  # batches not yet written
        self.held_rows = 0
        # Compressing and writing a row group releases the GIL: a thread does it while this one reads and cleans.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="corpus-writer")
        self.writing: Future | None = None
        self.rows = 0
        self.origins: Counter = Counter()

    def __enter__(self) -> "CorpusSplitWriter":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error is not None:
            self.thread.shutdown(cancel_futures=True)
            with contextlib.suppress(Exception):  # what failed the block may fail the close too
                self.writer.close()
            self.sink.close()

    def add(self, origin: str, line: int, src: str, tgt: str, tgt_raw: str | None) -> None:
        o, ln, s, t, r = self.cols
        o.append(origin)
        ln.append(line)
        s.append(src)
        t.append(tgt)
        r.append(tgt_raw)
        self.origins[origin] += 1
        if len(o) >= self.batch_rows:
            self._hold_rows()

    def add_batch(self, origin: str, lines: np.ndarray, src: pa.StringArray, tgt: pa.StringArray) -> None:
        """Training rows of one origin (no raw target): lines int64 [n], src and tgt [n]."""
        self._hold_rows()
        n = len(src)
        self._hold(pa.RecordBatch.from_arrays(
            [pa.repeat(self.split, n), pa.repeat(origin, n), pa.array(lines, pa.int64()), src, tgt,
             pa.nulls(n, pa.string())], schema=SCHEMA))
        self.origins[origin] += n

    def _hold_rows(self) -> None:
        if self.cols[0]:
            self._hold(pa.RecordBatch.from_arrays(
                [pa.repeat(self.split, len(self.cols[0]))]
                + [pa.array(col, type=field.type) for col, field in zip(self.cols, list(SCHEMA)[1:])], schema=SCHEMA))
            for col in self.cols:
                col.clear()

    def _hold(self, batch: pa.RecordBatch) -> None:
        """Keep ``batch``; write every whole row group held."""
        self.held.append(batch)
        self.held_rows += batch.num_rows
        if self.held_rows >= self.batch_rows:
            self._write(final=False)

    def _write(self, final: bool) -> None:
        """Write every whole row group held (and, ``final``, the rest) on the writer thread."""
        table = pa.Table.from_batches(self.held, schema=SCHEMA)
        whole = table.num_rows if final else table.num_rows - table.num_rows % self.batch_rows
        if whole:
            if self.writing is not None:  # one write in flight at a time: memory stays bounded
                self.writing.result()
            self.writing = self.thread.submit(self.writer.write_table, table.slice(0, whole),
                                              row_group_size=self.batch_rows)
        rest = table.slice(whole)
        self.held, self.held_rows, self.rows = rest.to_batches(), rest.num_rows, self.rows + whole

    def close(self) -> dict:
        self._hold_rows()
        self._write(final=True)
        self.thread.shutdown()  # after the last write
        if self.writing is not None:
            self.writing.result()
        self.writer.close()
        self.sink.close()
        return {"file": self.path.name, "rows": self.rows, "sha256": sha256_file(self.path),
                "origins": dict(sorted(self.origins.items()))}


def _write_eval_split(source: Source, role: str, out: Path, batch_rows: int, normalize: Normalizer,
                      counts: Counter, tree_leaves: str) -> tuple[dict, list[tuple[str, str]]]:
    """Dev/test: never filtered (that would change what is measured); normalised, raw target kept."""
    pairs = []
    with CorpusSplitWriter(out, role, batch_rows) as writer:
        for line, src, tgt in source.pairs():
            s, t = normalize(src), normalize(source.model_target(tgt, tree_leaves))
            if not s or not t:
                counts["empty_side_kept"] += 1
            writer.add(source.spec.name, line, s, t, tgt)
            pairs.append((s, t))
        entry = writer.close()
    if not entry["rows"]:
        raise DataError(f"{source.where} ({source.spec.name}) has no rows; a {role} set cannot be empty")
    return entry, pairs


class _TrainProgress:
    """Pairs read from the training sources, a batch at a time: logged every ``_LOG_EVERY`` and told to ``report``
    as (pairs read, pairs expected) every ``_REPORT_EVERY`` (at the end of the batch that passes it); without a
    count of every source ahead, as (sources read, sources)."""

    def __init__(self, train: list[Source], report: Callable[[int, int], None] | None):
        self.report, self.sources, self.done = report, len(train), 0
        counts = [s.expected_rows() for s in train] if report else []  # a pass over text files: only when asked
        self.expected = 0 if None in counts else sum(counts)

    def batches(self, source: Source, rows: int) -> Iterator[Batch]:
        start, name, read = time.perf_counter(), source.spec.name, 0
        for batch in source.pair_batches(rows):
            yield batch
            before, read = read, read + len(batch[1])
            if read // _LOG_EVERY > before // _LOG_EVERY:
                log.info("%s: %d pairs read (%.0f pairs/s)", name, read, read / (time.perf_counter() - start))
            if self.report and self.expected and read // _REPORT_EVERY > before // _REPORT_EVERY:
                self.report(min(self.done + read, self.expected), self.expected)
        self.done += source.info.rows_read if self.expected else 1
        if self.report:
            total = self.expected or self.sources
            self.report(min(self.done, total), total)


def _open_sources(data: DataConfig) -> tuple[Source, list[Source], list[Source], dict]:
    """Every source resolved and checked (local files hashed), and the stage identity they give."""
    root = resolve_root(data.root)
    langs = (data.src_lang, data.tgt_lang)
    dev = open_source(data.dev, root, *langs, "data.dev")
    tests = [open_source(s, root, *langs, f"data.test[{i}]") for i, s in enumerate(data.test)]
    train = [open_source(s, root, *langs, f"data.train[{i}]") for i, s in enumerate(data.train)]
    config = data.model_dump(mode="json", exclude={"root"}, exclude_none=True)  # where the data sits is not what it is
    identity = {"format": CORPUS_FORMAT, "code": _code_hash(), "config": config,
                "inputs": _provenance({"dev": [dev], "test": tests, "train": train}, with_rows=False)}
    return dev, tests, train, identity


def corpus_fingerprint(data: DataConfig) -> str:
    """The content address of the corpus ``data`` describes (config, code, every input's hash), without
    building it: what an orchestrator keys its cache on. Hub sources are loaded (or found in the cache)."""
    return identity_fingerprint(_open_sources(data)[3])


@names_full_disk
def prepare_corpus(data: DataConfig, work_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Build (or reuse) the cleaned corpus for ``data`` under ``work_dir/corpus/`` and return its folder.

    Every source is resolved and checked before anything is written; output appears only complete (temporary
    folder renamed at the end). Raises :class:`DataError` naming the file, line and what to do. ``progress``
    hears (training pairs read, pairs in the training sources) as they are read (see :class:`_TrainProgress`).
    """
    dev, tests, train, identity = _open_sources(data)
    out, fingerprint, done = stage_folder(work_dir, "corpus", identity, restarts=(
        "it writes each split as one Parquet file, and a Parquet file cut short cannot be continued"))
    if done:
        return out
    groups = {"dev": [dev], "test": tests, "train": train}

    started = time.perf_counter()
    with atomic_dir(out) as tmp:
        splits: dict[str, dict] = {}
        eval_pairs: list[tuple[str, str]] = []
        eval_counts: Counter = Counter()
        normalize_eval = Normalizer(data.cleaning, eval_counts)
        for key, role, source in [("dev", "dev", dev)] + [(f"test.{s.spec.name}", "test", s) for s in tests]:
            entry, pairs = _write_eval_split(source, role, tmp / f"{key}.parquet", data.write_batch_rows,
                                             normalize_eval, eval_counts, data.tree_leaves)
            splits[key] = {"role": role, "name": source.spec.name, **entry}
            eval_pairs += pairs

        counts: Counter = Counter()
        normalize = Normalizer(data.cleaning, counts)
        keep = TrainFilter(data.cleaning, eval_pairs, counts)
        del eval_pairs
        read: Counter = Counter()
        symbols: set[str] = set()  # parsing: the closed target vocabulary of the kept training trees
        reading = _TrainProgress(train, progress)
        with CorpusSplitWriter(tmp / "train.parquet", "train", data.write_batch_rows) as writer:
            for source in train:
                name = source.spec.name
                # a batch at a time: normalisation, the rules and dedup run over whole columns (clean.py)
                for lines, src, tgt in reading.batches(source, data.write_batch_rows):
                    read[name] += len(lines)
                    src = normalize.array(src)
                    tgt = normalize.array(source.model_targets(tgt, data.tree_leaves))
                    kept = keep.batch(src, tgt)  # bool [n]
                    if kept.any():
                        tgt = tgt.filter(kept)
                        writer.add_batch(name, lines[kept], src.filter(kept), tgt)
                        symbols |= source.target_symbols(tgt)
            entry = writer.close()
        report = _cleaning_report(sum(read.values()), counts, entry["rows"])
        if not entry["rows"]:
            raise DataError(
                f"the training split is empty after cleaning: read {dict(read)} pairs, removed "
                f"{report['removed']}; relax data.cleaning (min_words, max_words, max_ratio, decontaminate) "
                "or check that src_lang/tgt_lang match the files"
            )
        entry["origins"] = {n: {"read": read[n], "kept": entry["origins"].get(n, 0)} for n in read}
        splits["train"] = {"role": "train", **entry, "cleaning": report}

        manifest = {
            "format": CORPUS_FORMAT,
            "fingerprint": fingerprint,
            "code": identity["code"],
            "src_lang": data.src_lang,
            "tgt_lang": data.tgt_lang,
            "config": identity["config"],
            "inputs": _provenance(groups, with_rows=True),
            "splits": splits,
            "eval_normalization": dict(sorted(eval_counts.items())),
            **({"target_symbols": sorted(symbols)} if symbols else {}),
            # NFC depends on the Unicode tables of the Python that ran; record them with the writer's version.
            "versions": {"python": platform.python_version(), "unicode": unicodedata.unidata_version,
                         "pyarrow": pa.__version__},
        }
        write_json(tmp / MANIFEST, manifest)
    elapsed = time.perf_counter() - started
    n = sum(read.values())
    log.info("corpus written to %s: %d training pairs read, %d kept (%.0f pairs/s)", out, n, entry["rows"],
             n / max(elapsed, 1e-9))
    return out


def _provenance(groups: dict[str, list[Source]], with_rows: bool) -> dict[str, list[dict]]:
    """Each source's format, location and content hashes (and rows read, once they have been read)."""
    drop = () if with_rows else ("rows_read", "bom_stripped")  # known once read
    return {g: [{k: v for k, v in vars(s.info).items() if k not in drop} for s in sources]
            for g, sources in groups.items()}


def rule_report(read: int, counts: Counter, rules: Sequence[str], kept: int) -> dict:
    """Per rule, in the order the rules run: pairs it removed (``counts[rule]``) and pairs still standing after
    it; with the pairs read and kept (what the rules left)."""
    standing, steps = read, []
    for rule in rules:
        standing -= counts[rule]
        steps.append({"rule": rule, "removed": counts[rule], "remaining": standing})
    assert standing == kept, (standing, kept)
    return {"read": read, "rules": steps, "kept": kept, "removed": {r["rule"]: r["removed"] for r in steps}}


def _cleaning_report(read: int, counts: Counter, kept: int) -> dict:
    """The training filters' :func:`rule_report`, and how many sentences normalisation changed."""
    return {**rule_report(read, counts, TrainFilter.RULES, kept),
            "normalized": {k: counts[k] for k in ("nfc_changed", "whitespace_changed")}}


def read_manifest(corpus_dir: Path) -> dict:
    """The manifest of a finished corpus folder; a folder without one is not a corpus."""
    return read_stage_manifest(corpus_dir, CORPUS_FORMAT, "corpus", "re-run the data stage", DataError)
