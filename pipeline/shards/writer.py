"""Tokenizer stage, part 2: every corpus split encoded into Arrow IPC shards.

Output contract (docs/explanation/formats.md, "Token shards"): ``<work_dir>/shards/<fingerprint[:16]>/`` with
``<split>-<NNNNN>.arrow`` files and ``manifest.json``. The fingerprint hashes the tokenizer model, every split's
content hash, the shard layout and this stage's code; a re-run on unchanged inputs returns the existing folder.

Encoding streams: the main process reads the Parquet split in chunks of :data:`CHUNK_ROWS` rows, worker processes
(each with its own sentencepiece model) encode them, and the main process writes the results in order, one
record batch per chunk. At most ``2 * num_workers`` chunks are in flight, so memory does not grow with the
corpus, and the output does not depend on the number of workers.

Resuming: each finished shard file is renamed into a partial folder beside the output (``.<fingerprint>.partial``)
with its entry (rows, bytes, sha256, token statistics) in a JSON file beside it. A run killed at any point
resumes with the first shard of each split not finished there (its files checked against their entries), reading
the corpus from that shard's first row; at WMT scale a kill costs at most one shard's encoding. The output folder
appears only complete, and the partial folder is removed then.

Sampled copies (``tokenizer.sampling_alpha`` > 0, BPE-dropout): the training split is encoded again
``sampled_copies`` times with sentencepiece's sampling, as splits ``train.sampled1``... They are a random draw,
not a function of the inputs: sentencepiece's sampling generator cannot be seeded reproducibly across processes
(``set_random_generator_seed(5)`` gives other pieces in another process). The folder is still named by its inputs
and never drawn again once written, and a run records the shards' fingerprint, so a resume reads the same copies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import TokenizerConfig
from pipeline.data import read_manifest
from pipeline.support.fsutil import (MANIFEST, atomic_dir, atomic_file, code_hash, exclusive, names_full_disk,
                                     needs_space, remove_stale_temps, sha256_file, stage_folder, write_json)
from pipeline.support.proc import exit_with_parent
from pipeline.tokenize import Tokenizer, verify_file

from .format import CHUNK_ROWS, SHARDS_FORMAT, ShardError, sampled_split, shard_schema

log = logging.getLogger("aiayn.shards")

_IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: enough to keep it busy, few enough to bound memory


@names_full_disk
def build_shards(corpus_dir: Path, tokenizer_dir: Path, cfg: TokenizerConfig, work_dir: Path,
                 progress: Callable[[int, int], None] | None = None) -> Path:
    """Encode every split of the corpus with the tokenizer into Arrow IPC shards; return the shard folder.

    Uses ``cfg.num_workers`` worker processes and ``cfg.shard_rows`` rows per shard file. Output appears only
    complete, under ``work_dir/shards/<fingerprint>``; the same inputs give byte-identical files whatever the
    number of workers, and a re-run returns the existing folder without writing. Raises :class:`ShardError`
    (or :class:`~pipeline.tokenize.TokenizerError` for a damaged tokenizer folder) naming the file. ``progress``
    hears (pairs encoded, pairs in every split) as chunks are written. A killed run resumes with the first shard
    not finished (see the module's docstring).
    """
    corpus_dir = Path(corpus_dir)
    tok = Tokenizer(tokenizer_dir)
    if cfg.special != tok.special:
        raise ShardError(f"tokenizer.special {cfg.special.model_dump()} differs from the ids fixed in {tok.model_path} "
                         f"({tok.special.model_dump()}); the model code reads tokenizer.special, so re-run "
                         "train_tokenizer with this config")
    corpus = read_manifest(corpus_dir)
    splits = dict(sorted(corpus["splits"].items()))
    sampling = {"alpha": cfg.sampling_alpha, "copies": cfg.sampled_copies} if cfg.sampling_alpha else None
    identity = {"format": SHARDS_FORMAT, "code": _code_hash(),
                "chunk_rows": CHUNK_ROWS, "shard_rows": cfg.shard_rows, "tokenizer_sha256": tok.sha256,
                "corpus": {key: s["sha256"] for key, s in splits.items()}, "sampling": sampling}
    out, fingerprint, done = stage_folder(work_dir, "shards", identity)
    if done:
        return out
    for s in splits.values():
        verify_file(corpus_dir / s["file"], s["sha256"], corpus_dir / "manifest.json",
                    "re-run the data stage (prepare_corpus)", ShardError)

    started = time.perf_counter()
    schema = shard_schema(tok.dtype)
    is_byte = np.array([tok.sp.is_byte(i) for i in range(tok.vocab_size)])  # bool [vocab]
    entries = {}
    # (split key, corpus split key, sampling alpha): every corpus split once, then the sampled copies of "train"
    jobs = [(key, key, 0.0) for key in splits]
    if sampling:
        jobs += [(sampled_split(k), "train", cfg.sampling_alpha) for k in range(1, sampling["copies"] + 1)]
    total_rows = sum(splits[source]["rows"] for _, source, _ in jobs)
    partial = out.parent / f".{fingerprint[:16]}.partial"
    # The lock is the stage's, not the partial folder's: that folder goes once the output is written.
    with exclusive(out.parent, "shard writing"):
        if (out / MANIFEST).is_file():  # another run finished it while this one waited
            return out
        partial.mkdir(exist_ok=True)
        remove_stale_temps(partial)  # a shard whose write was killed
        finished = {key: _finished(partial, key, _plan(splits[source]["rows"], cfg.shard_rows))
                    for key, source, _ in jobs}
        encoded_rows = sum(e["rows"] for written in finished.values() for e in written)
        if encoded_rows:
            log.info("resuming the shard writing in %s: %d shards (%d of %d pairs) already written", partial,
                     sum(map(len, finished.values())), encoded_rows, total_rows)
        ctx = multiprocessing.get_context("spawn")  # no fork: callers (Prefect, torch) may hold threads and locks
        init = (str(tok.dir), tok.dtype.str, os.getpid())
        with ProcessPoolExecutor(cfg.num_workers, mp_context=ctx, initializer=_init_worker, initargs=init) as pool:
            for key, source, alpha in jobs:
                s = splits[source]
                written = finished[key]
                plan = [c for c in _plan(s["rows"], cfg.shard_rows) if c[0] >= len(written)]
                skip = plan[0][1] if plan else s["rows"]
                chunks = _read_chunks(corpus_dir / s["file"], [stop - start for _, start, stop in plan], skip)
                results = _ordered(pool, _encode_chunk, ((c, alpha) for c in chunks),
                                   _IN_FLIGHT_PER_WORKER * cfg.num_workers)
                shard: _ShardFile | None = None
                for (index, start, stop), encoded in zip(plan, results):
                    if shard is None or shard.index != index:
                        if shard is not None:
                            written.append(shard.finish())
                        shard = _ShardFile(partial, key, index, schema, tok.is_unknown, is_byte)
                    shard.write(start, *encoded)
                    encoded_rows += stop - start
                    if progress is not None:
                        progress(encoded_rows, total_rows)
                if shard is not None:
                    written.append(shard.finish())
                entries[key] = {"corpus_file": s["file"], "corpus_sha256": s["sha256"], **_split_entry(written)}
                log.info("%s: %d pairs encoded into %d shard(s)", key, s["rows"], len(written))
        with atomic_dir(out) as tmp:
            for entry in entries.values():
                for f in entry["shards"]:
                    os.replace(partial / f["file"], tmp / f["file"])
            write_json(tmp / MANIFEST, {
                "format": SHARDS_FORMAT,
                "fingerprint": fingerprint,
                "code": identity["code"],
                "chunk_rows": CHUNK_ROWS,
                "shard_rows": cfg.shard_rows,
                "dtype": tok.dtype.name,
                "tokenizer": {"sha256": tok.sha256, "fingerprint": tok.manifest["fingerprint"],
                              "vocab_size": tok.vocab_size, "model_type": tok.manifest["model_type"],
                              "special": tok.special.model_dump()},
                "corpus": {"fingerprint": corpus["fingerprint"], "src_lang": corpus["src_lang"],
                           "tgt_lang": corpus["tgt_lang"]},
                "splits": entries,
                **({"sampling": sampling} if sampling else {}),
            })
        shutil.rmtree(partial)
    rows = sum(e["rows"] for e in entries.values())
    elapsed = time.perf_counter() - started
    log.info("shards written to %s: %d pairs in %.1f s (%.0f pairs/s)", out, rows, elapsed, rows / max(elapsed, 1e-9))
    return out


def _code_hash() -> str:
    """Hash of this stage's code: every module of this package (the reader's checks are part of what a shard
    folder promises) and the tokenizer wrapper that encodes."""
    package = Path(__file__).resolve().parent
    return code_hash(*sorted(package.glob("*.py")), package.parent / "tokenize.py")


def _plan(rows: int, shard_rows: int) -> list[tuple[int, int, int]]:
    """(shard, start, stop) of every chunk, in order: CHUNK_ROWS rows each, never straddling two shards."""
    return [(first // shard_rows, start, min(start + CHUNK_ROWS, first + shard_rows, rows))
            for first in range(0, rows, shard_rows)
            for start in range(first, min(first + shard_rows, rows), CHUNK_ROWS)]


def _read_chunks(path: Path, sizes: list[int], skip: int = 0) -> Iterator[pa.Buffer]:
    """The (src, tgt) columns of consecutive row ranges of ``sizes`` rows from row ``skip`` on, each as an Arrow
    IPC stream. Row groups before ``skip`` are not read."""
    # pre_buffer off: with it, the reader keeps every row group it has read until the end (the whole file)
    parquet = pq.ParquetFile(path, pre_buffer=False)
    first, group = 0, 0  # the first row group that holds row `skip`, and its first row
    while group < parquet.num_row_groups and first + parquet.metadata.row_group(group).num_rows <= skip:
        first += parquet.metadata.row_group(group).num_rows
        group += 1
    batches = parquet.iter_batches(batch_size=CHUNK_ROWS, columns=["src", "tgt"],
                                   row_groups=range(group, parquet.num_row_groups))
    pending: list[pa.RecordBatch] = []
    have, start, drop = 0, skip, skip - first  # drop: rows of the first group before `skip`
    while drop:
        batch = next(batches, None)
        if batch is None:
            raise ShardError(f"{path}: fewer rows than its corpus manifest records; re-run the data stage "
                             "(prepare_corpus)")
        if batch.num_rows > drop:
            pending, have = [batch.slice(drop)], batch.num_rows - drop
        drop = max(0, drop - batch.num_rows)
    for size in sizes:
        while have < size:
            batch = next(batches, None)
            if batch is None:
                raise ShardError(f"{path}: fewer rows than its corpus manifest records ({skip + sum(sizes)}); "
                                 "re-run the data stage (prepare_corpus)")
            pending.append(batch)
            have += batch.num_rows
        table = pa.Table.from_batches(pending)
        chunk = table.slice(0, size)
        if chunk.column("src").null_count or chunk.column("tgt").null_count:
            raise ShardError(f"{path}: null src/tgt in rows {start}-{start + size - 1}; the corpus contract has none, "
                             "re-run the data stage (prepare_corpus)")
        pending, have, start = table.slice(size).to_batches(), have - size, start + size
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, chunk.schema) as w:
            w.write_table(chunk)
        yield sink.getvalue()
    if have or next(batches, None) is not None:
        raise ShardError(f"{path}: more rows than its corpus manifest records ({skip + sum(sizes)}); "
                         "re-run the data stage (prepare_corpus)")


def _ordered(pool: ProcessPoolExecutor, fn: Callable, items: Iterable, window: int) -> Iterator:
    """``map(fn, items)`` on the pool, results in input order, at most ``window`` items submitted at once."""
    pending: deque[Future] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


_worker_tok: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(tokenizer_dir: str, dtype: str, parent: int) -> None:
    """Worker start: die with the parent (pid ``parent``) even if it is killed outright, which a pool worker
    otherwise outlives; load the tokenizer once per process, not once per task."""
    global _worker_tok, _worker_dtype
    exit_with_parent(parent)
    _worker_tok = Tokenizer(Path(tokenizer_dir))
    _worker_dtype = np.dtype(dtype)


def _encode_chunk(job: tuple[pa.Buffer, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Worker: one chunk and its sampling alpha (0: the deterministic segmentation) -> (src offsets int32 [n+1],
    src ids [tokens], tgt offsets, tgt ids)."""
    payload, alpha = job
    table = pa.ipc.open_stream(payload).read_all()
    src, tgt = table.column("src").to_pylist(), table.column("tgt").to_pylist()
    if alpha:
        return (*_layout(_worker_tok.sample_batch(src, alpha)), *_layout(_worker_tok.sample_batch(tgt, alpha)))
    encode = _worker_tok.encode_batch  # one thread: the worker processes are the parallelism
    return (*_layout(encode(src, num_threads=1)), *_layout(encode(tgt, num_threads=1)))


def _layout(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Worker: piece ids of each text -> (offsets int32 [n+1], concatenated ids [tokens]), the Arrow list layout."""
    offsets = np.zeros(len(ids) + 1, np.int32)  # [n+1]
    np.cumsum(np.fromiter(map(len, ids), np.int32, count=len(ids)), out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(ids), _worker_dtype, count=int(offsets[-1]))  # [tokens]
    return offsets, flat


def _finished(partial: Path, key: str, plan: list[tuple[int, int, int]]) -> list[dict]:
    """The entries of the shards of split ``key`` already finished in ``partial``, in order: the longest run from
    its first shard whose file matches its entry (size and sha256) and holds the rows the plan gives it."""
    rows = {}
    for index, start, stop in plan:
        rows[index] = rows.get(index, 0) + stop - start
    done = []
    for index in sorted(rows):
        meta = partial / _shard_name(key, index, ".json")
        if not meta.is_file():
            break
        entry = json.loads(meta.read_text(encoding="utf-8"))
        path = partial / entry["file"]
        if (entry["rows"] != rows[index] or not path.is_file() or path.stat().st_size != entry["bytes"]
                or sha256_file(path) != entry["sha256"]):
            break
        done.append(entry)
    return done


def _shard_name(key: str, index: int, suffix: str = ".arrow") -> str:
    return f"{key}-{index:05d}{suffix}"


class _ShardFile:
    """One shard file of split ``key``, written chunk by chunk in order into ``partial``; :meth:`finish` renames
    it into place and writes its entry beside it (what a resumed run trusts)."""

    def __init__(self, partial: Path, key: str, index: int, schema: pa.Schema, is_unknown: np.ndarray,
                 is_byte: np.ndarray):
        self.index, self.is_unknown, self.is_byte, self.schema = index, is_unknown, is_byte, schema
        self.path = partial / _shard_name(key, index)
        self._file = contextlib.ExitStack()  # the atomic write of the shard file, open until finish()
        self.tmp = self._file.enter_context(atomic_file(self.path))
        # ours to close (before the atomic write ends), whatever state the writer is left in
        self.sink = self._file.enter_context(pa.OSFile(str(self.tmp), "wb"))
        # No compression: readers address the token buffers in the mapped file directly.
        self.writer = pa.ipc.new_file(self.sink, schema)
        self.stats = {side: {"tokens": 0, "max_len": 0, "unk": 0, "byte_fallback": 0} for side in ("src", "tgt")}
        self.rows = 0

    def write(self, start: int, src_off: np.ndarray, src_ids: np.ndarray, tgt_off: np.ndarray,
              tgt_ids: np.ndarray) -> None:
        """Append one encoded chunk (rows ``start``...) as one record batch."""
        n = len(src_off) - 1
        columns = [pa.array(np.arange(start, start + n, dtype=np.int64))]
        for off, ids in ((src_off, src_ids), (tgt_off, tgt_ids)):
            columns.append(pa.ListArray.from_arrays(pa.array(off), pa.array(ids)))
        lengths = [np.diff(src_off), np.diff(tgt_off)]  # int32 [n] each
        columns += [pa.array(length) for length in lengths]
        batch = pa.RecordBatch.from_arrays(columns, schema=self.schema)
        with self._failing(block=batch.nbytes):
            self.writer.write_batch(batch)
        for side, ids, length in (("src", src_ids, lengths[0]), ("tgt", tgt_ids, lengths[1])):
            st = self.stats[side]
            st["tokens"] += len(ids)
            st["max_len"] = max(st["max_len"], int(length.max(initial=0)))
            st["unk"] += int(np.count_nonzero(self.is_unknown[ids]))
            st["byte_fallback"] += int(np.count_nonzero(self.is_byte[ids]))
        self.rows += n

    def finish(self) -> dict:
        """Close the file, rename it into place and write its entry: file, rows, bytes, sha256, statistics."""
        with self._failing(block=0):
            self.writer.close()
        self._file.close()
        entry = {"file": self.path.name, "rows": self.rows, "bytes": self.path.stat().st_size,
                 "sha256": sha256_file(self.path), "stats": self.stats}
        write_json(self.path.with_suffix(".json"), entry)
        return entry

    @contextlib.contextmanager
    def _failing(self, block: int) -> Iterator[None]:
        """Where a write of the shard fails, its temporary file is closed and removed (so a full disk frees the
        space it held) and a full disk names what the shard needs: at least what it held plus ``block``, the bytes of
        the batch being written (:func:`~pipeline.support.fsutil.needs_space`)."""
        try:
            with needs_space(self.path, written=self.tmp, block=block):
                yield
        except BaseException as e:
            with contextlib.suppress(Exception):  # what failed the write may fail the close too
                self.writer.close()
            if not self._file.__exit__(type(e), e, e.__traceback__):
                raise


def _split_entry(shards: list[dict]) -> dict:
    """A split's manifest entry from its shards' entries: rows, shards (file, rows, bytes, sha256) and per-side
    token statistics."""
    rows = sum(s["rows"] for s in shards)
    out: dict = {"rows": rows, "shards": [{k: s[k] for k in ("file", "rows", "bytes", "sha256")} for s in shards]}
    for side in ("src", "tgt"):
        each = [s["stats"][side] for s in shards]
        st = {"tokens": sum(e["tokens"] for e in each), "max_len": max((e["max_len"] for e in each), default=0),
              "unk": sum(e["unk"] for e in each), "byte_fallback": sum(e["byte_fallback"] for e in each)}
        st["mean_len"] = round(st["tokens"] / rows, 4) if rows else 0.0
        st["unk_rate"] = round(st["unk"] / st["tokens"], 8) if st["tokens"] else 0.0
        st["byte_rate"] = round(st["byte_fallback"] / st["tokens"], 8) if st["tokens"] else 0.0
        out[side] = st
    return out
