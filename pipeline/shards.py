"""Tokenizer stage, part 2: every corpus split encoded into Arrow IPC shards, and their memory-mapped reader.

Output contract (docs/formats.md, "Token shards"): ``<work_dir>/shards/<fingerprint[:16]>/`` with
``<split>-<NNNNN>.arrow`` files and ``manifest.json``. The fingerprint hashes the tokenizer model, every split's
content hash, the shard layout and this stage's code; a re-run on unchanged inputs returns the existing folder.

Encoding streams: the main process reads the Parquet split in chunks of :data:`CHUNK_ROWS` rows, worker processes
(each with its own sentencepiece model) encode them, and the main process writes the results in order, one
record batch per chunk. At most ``2 * num_workers`` chunks are in flight, so memory does not grow with the
corpus, and the output does not depend on the number of workers.

Reading maps each shard into memory and addresses tokens in place: an example's ids are a numpy view into the
file, found in O(1) from its index (every shard but the last holds ``shard_rows`` rows, every record batch but a
shard's last holds ``CHUNK_ROWS``). Only the per-example lengths are copied into memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm

from pipeline.config import SpecialIds, TokenizerConfig
from pipeline.data import read_manifest
from pipeline.fsutil import (MANIFEST, atomic_dir, code_hash, read_stage_manifest, sha256_file, stage_folder,
                             write_json)
from pipeline.proc import exit_with_parent
from pipeline.tokenize import Tokenizer, verify_file

log = logging.getLogger("aiayn.shards")

SHARDS_FORMAT = "aiayn-shards/1"
CHUNK_ROWS = 16_384  # rows per record batch and per task sent to a worker (part of the format)
_IN_FLIGHT_PER_WORKER = 2  # chunks queued per worker: enough to keep it busy, few enough to bound memory

Side = Literal["src", "tgt"]


class ShardError(ValueError):
    """Shards that cannot be written or trusted; the message names the file and what to do."""


def shard_schema(dtype: np.dtype) -> pa.Schema:
    """Columns of every shard; ``dtype`` is the token storage type (uint16 or int32)."""
    token = pa.from_numpy_dtype(dtype)
    return pa.schema(
        [
            pa.field("row", pa.int64(), nullable=False),  # 0-based row of the pair in the corpus split's file
            pa.field("src", pa.list_(token), nullable=False),  # source piece ids, no bos/eos
            pa.field("tgt", pa.list_(token), nullable=False),  # target piece ids, no bos/eos
            pa.field("src_len", pa.int32(), nullable=False),  # len(src)
            pa.field("tgt_len", pa.int32(), nullable=False),  # len(tgt)
        ],
        metadata={"format": SHARDS_FORMAT},
    )


def read_shard_manifest(shard_dir: Path) -> dict:
    """The manifest of a finished shard folder; a folder without one is not a shard folder."""
    return read_stage_manifest(shard_dir, SHARDS_FORMAT, "shard", "re-run build_shards", ShardError)


# ------------------------------------------------------------------------------------------------- writing


def build_shards(corpus_dir: Path, tokenizer_dir: Path, cfg: TokenizerConfig, work_dir: Path) -> Path:
    """Encode every split of the corpus with the tokenizer into Arrow IPC shards; return the shard folder.

    Uses ``cfg.num_workers`` worker processes and ``cfg.shard_rows`` rows per shard file. Output appears only
    complete, under ``work_dir/shards/<fingerprint>``; the same inputs give byte-identical files whatever the
    number of workers, and a re-run returns the existing folder without writing. Raises :class:`ShardError`
    (or :class:`~pipeline.tokenize.TokenizerError` for a damaged tokenizer folder) naming the file.
    """
    corpus_dir = Path(corpus_dir)
    tok = Tokenizer(tokenizer_dir)
    if cfg.special != tok.special:
        raise ShardError(f"tokenizer.special {cfg.special.model_dump()} differs from the ids fixed in {tok.model_path} "
                         f"({tok.special.model_dump()}); the model code reads tokenizer.special, so re-run "
                         "train_tokenizer with this config")
    corpus = read_manifest(corpus_dir)
    splits = dict(sorted(corpus["splits"].items()))
    here = Path(__file__)
    identity = {"format": SHARDS_FORMAT, "code": code_hash(here, here.with_name("tokenize.py")),
                "chunk_rows": CHUNK_ROWS, "shard_rows": cfg.shard_rows, "tokenizer_sha256": tok.sha256,
                "corpus": {key: s["sha256"] for key, s in splits.items()}}
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
    ctx = multiprocessing.get_context("spawn")  # no fork: callers (Prefect, torch) may hold threads and locks
    init = (str(tok.model_path), tok.dtype.str, os.getpid())
    with atomic_dir(out) as tmp, ProcessPoolExecutor(cfg.num_workers, mp_context=ctx, initializer=_init_worker,
                                                     initargs=init) as pool:
        for key, s in splits.items():
            writer = _SplitWriter(tmp, key, schema, tok.unk_id, is_byte)
            plan = _plan(s["rows"], cfg.shard_rows)
            chunks = _read_chunks(corpus_dir / s["file"], [stop - start for _, start, stop in plan])
            results = _ordered(pool, _encode_chunk, chunks, _IN_FLIGHT_PER_WORKER * cfg.num_workers)
            for (shard, start, _), encoded in zip(plan, results):
                writer.write(shard, start, *encoded)
            entries[key] = {"corpus_file": s["file"], "corpus_sha256": s["sha256"], **writer.close()}
            log.info("%s: %d pairs encoded into %d shard(s)", key, s["rows"], len(entries[key]["shards"]))
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
        })
    rows = sum(e["rows"] for e in entries.values())
    elapsed = time.perf_counter() - started
    log.info("shards written to %s: %d pairs in %.1f s (%.0f pairs/s)", out, rows, elapsed, rows / max(elapsed, 1e-9))
    return out


def _plan(rows: int, shard_rows: int) -> list[tuple[int, int, int]]:
    """(shard, start, stop) of every chunk, in order: CHUNK_ROWS rows each, never straddling two shards."""
    return [(first // shard_rows, start, min(start + CHUNK_ROWS, first + shard_rows, rows))
            for first in range(0, rows, shard_rows)
            for start in range(first, min(first + shard_rows, rows), CHUNK_ROWS)]


def _read_chunks(path: Path, sizes: list[int]) -> Iterator[pa.Buffer]:
    """The (src, tgt) columns of consecutive row ranges of ``sizes`` rows, each as an Arrow IPC stream."""
    # pre_buffer off: with it, the reader keeps every row group it has read until the end (the whole file)
    batches = pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=CHUNK_ROWS, columns=["src", "tgt"])
    pending: list[pa.RecordBatch] = []
    have = start = 0
    for size in sizes:
        while have < size:
            batch = next(batches, None)
            if batch is None:
                raise ShardError(f"{path}: fewer rows than its corpus manifest records ({sum(sizes)}); "
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
        raise ShardError(f"{path}: more rows than its corpus manifest records ({sum(sizes)}); "
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


_worker_sp: spm.SentencePieceProcessor | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(model_path: str, dtype: str, parent: int) -> None:
    """Worker start: die with the parent (pid ``parent``) even if it is killed outright, which a pool worker
    otherwise outlives; load the model once per process, not once per task."""
    global _worker_sp, _worker_dtype
    exit_with_parent(parent)
    _worker_sp = spm.SentencePieceProcessor(model_file=model_path)
    _worker_dtype = np.dtype(dtype)


def _encode_chunk(payload: pa.Buffer) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Worker: one chunk -> (src offsets int32 [n+1], src ids [tokens], tgt offsets, tgt ids)."""
    table = pa.ipc.open_stream(payload).read_all()
    return (*_encode_texts(table.column("src").to_pylist()), *_encode_texts(table.column("tgt").to_pylist()))


def _encode_texts(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = _worker_sp.encode(texts, num_threads=1)  # the worker processes are the parallelism
    offsets = np.zeros(len(ids) + 1, np.int32)  # [n+1]
    np.cumsum(np.fromiter(map(len, ids), np.int32, count=len(ids)), out=offsets[1:])
    flat = np.fromiter(chain.from_iterable(ids), _worker_dtype, count=int(offsets[-1]))  # [tokens]
    return offsets, flat


class _SplitWriter:
    """Writes one split's chunks, in order, into shard files and keeps the split's token statistics."""

    def __init__(self, folder: Path, key: str, schema: pa.Schema, unk_id: int, is_byte: np.ndarray):
        self.folder, self.key, self.schema, self.unk_id, self.is_byte = folder, key, schema, unk_id, is_byte
        self.shards: list[dict] = []
        self.writer: pa.ipc.RecordBatchFileWriter | None = None
        self.stats = {side: {"tokens": 0, "max_len": 0, "unk": 0, "byte_fallback": 0} for side in ("src", "tgt")}
        self.rows = 0

    def write(self, shard: int, start: int, src_off: np.ndarray, src_ids: np.ndarray, tgt_off: np.ndarray,
              tgt_ids: np.ndarray) -> None:
        if shard == len(self.shards):
            self._close_shard()
            self.shards.append({"file": f"{self.key}-{shard:05d}.arrow", "rows": 0})
            # No compression: readers address the token buffers in the mapped file directly.
            self.writer = pa.ipc.new_file(self.folder / self.shards[-1]["file"], self.schema)
        n = len(src_off) - 1
        columns = [pa.array(np.arange(start, start + n, dtype=np.int64))]
        for off, ids in ((src_off, src_ids), (tgt_off, tgt_ids)):
            columns.append(pa.ListArray.from_arrays(pa.array(off), pa.array(ids)))
        lengths = [np.diff(src_off), np.diff(tgt_off)]  # int32 [n] each
        columns += [pa.array(length) for length in lengths]
        self.writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=self.schema))
        for side, ids, length in (("src", src_ids, lengths[0]), ("tgt", tgt_ids, lengths[1])):
            st = self.stats[side]
            st["tokens"] += len(ids)
            st["max_len"] = max(st["max_len"], int(length.max(initial=0)))
            st["unk"] += int(np.count_nonzero(ids == self.unk_id))
            st["byte_fallback"] += int(np.count_nonzero(self.is_byte[ids]))
        self.shards[-1]["rows"] += n
        self.rows += n

    def _close_shard(self) -> None:
        if self.writer is None:
            return
        self.writer.close()
        path = self.folder / self.shards[-1]["file"]
        self.shards[-1].update(bytes=path.stat().st_size, sha256=sha256_file(path))
        self.writer = None

    def close(self) -> dict:
        """The split's manifest entry: rows, shards (file, rows, bytes, sha256) and per-side token statistics."""
        self._close_shard()
        for st in self.stats.values():
            st["mean_len"] = round(st["tokens"] / self.rows, 4) if self.rows else 0.0
            st["unk_rate"] = round(st["unk"] / st["tokens"], 8) if st["tokens"] else 0.0
            st["byte_rate"] = round(st["byte_fallback"] / st["tokens"], 8) if st["tokens"] else 0.0
        return {"rows": self.rows, "shards": self.shards, **self.stats}


# ------------------------------------------------------------------------------------------------- reading


class _Shard:
    """One memory-mapped shard file: where each record batch's offsets and ids lie in the mapping."""

    def __init__(self, path: Path, entry: dict, dtype: np.dtype, chunk_rows: int, verify: bool, fix: str):
        if not path.is_file():
            raise ShardError(f"{path}: missing, but the shard manifest lists it; {fix}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ShardError(f"{path}: {size} bytes, the shard manifest records {entry['bytes']} (truncated or "
                             f"overwritten); {fix}")
        if verify and sha256_file(path) != entry["sha256"]:
            raise ShardError(f"{path}: sha256 differs from the shard manifest (the file is corrupt); {fix}")
        schema = shard_schema(dtype)
        try:
            self.mmap = pa.memory_map(str(path))
            reader = pa.ipc.open_file(self.mmap)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowException, OSError) as e:
            raise ShardError(f"{path}: not a readable Arrow IPC file ({e}); {fix}") from None
        if not reader.schema.equals(schema, check_metadata=True):
            raise ShardError(f"{path}: schema {reader.schema} is not the one its manifest implies ({schema}); {fix}")
        rows = [b.num_rows for b in batches]
        expected = [min(chunk_rows, entry["rows"] - i) for i in range(0, entry["rows"], chunk_rows)]
        if rows != expected:
            raise ShardError(f"{path}: record batches of {rows} rows, expected {expected}; {fix}")
        self.mmap.seek(0)
        whole = self.mmap.read_buffer(size)  # zero-copy: the whole mapping
        self.tokens = np.frombuffer(whole, dtype=dtype, count=size // dtype.itemsize)  # [elements]
        self.int32 = np.frombuffer(whole, dtype=np.int32, count=size // 4)  # [elements]: list offsets live here
        base, itemsize = whole.address, self.tokens.itemsize
        self.offsets_at: dict[str, np.ndarray] = {}  # side -> int64 [batches]: batch's offsets, in int32 elements
        self.ids_at: dict[str, np.ndarray] = {}  # side -> int64 [batches]: batch's ids, in token elements
        for side in ("src", "tgt"):
            offs_at, ids_at = [], []
            for b in batches:
                col = b.column(side)
                offsets, values = col.offsets, col.values
                ob, vb = offsets.buffers()[1], values.buffers()[1]
                for buf, align in ((ob, 4), (vb, itemsize)):
                    inside = base <= buf.address and buf.address + buf.size <= base + size
                    if buf.size and not (inside and (buf.address - base) % align == 0):
                        raise ShardError(f"{path}: {side} buffers are not aligned inside the mapped file; {fix}")
                offs_at.append((ob.address - base) // 4 + offsets.offset)
                ids_at.append((vb.address - base) // itemsize + values.offset)
            self.offsets_at[side] = np.array(offs_at, np.int64)
            self.ids_at[side] = np.array(ids_at, np.int64)
        self.batches = batches  # zero-copy record batches over the mapping

    def starts(self, side: Side, local: np.ndarray, chunk_rows: int) -> np.ndarray:
        """Token-element position in :attr:`tokens` of each example (``local``: int [k] rows in this shard)."""
        batch, j = np.divmod(local, chunk_rows)
        return self.ids_at[side][batch] + self.int32[self.offsets_at[side][batch] + j]  # int64 [k]


class ShardDataset:
    """One split of a shard folder, memory-mapped.

    ``src_len`` / ``tgt_len`` (int32 [N]) are in memory; ``ds[i]`` gives example ``i``'s (src, tgt) ids as
    read-only numpy views into the mapped files (no copy), in O(1). :meth:`batches` forms length-bucketed batches
    by token budget and :meth:`collate` pads them, both vectorised. Opening checks every shard's size (and, with
    ``verify``, its sha256) against the manifest, and ``tokenizer`` (when given) against the one that encoded them.
    """

    def __init__(self, shard_dir: Path, split: str = "train", tokenizer: Tokenizer | None = None,
                 verify: bool = True):
        self.dir, self.split = Path(shard_dir), split
        self.manifest = read_shard_manifest(self.dir)
        manifest_path = self.dir / MANIFEST
        if split not in self.manifest["splits"]:
            raise ShardError(f"{manifest_path}: no split {split!r}; it has {sorted(self.manifest['splits'])}")
        recorded = self.manifest["tokenizer"]["sha256"]
        if tokenizer is not None and tokenizer.sha256 != recorded:
            raise ShardError(f"{tokenizer.model_path} (sha256 {tokenizer.sha256[:16]}...) is not the tokenizer these "
                             f"shards were encoded with ({manifest_path} records {recorded[:16]}..., tokenizer folder "
                             f"{self.manifest['tokenizer']['fingerprint'][:16]}); use that tokenizer, or re-run "
                             "build_shards with this one")
        self.special = SpecialIds.model_validate(self.manifest["tokenizer"]["special"])
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shard_rows: int = self.manifest["shard_rows"]
        self.chunk_rows: int = self.manifest["chunk_rows"]
        entry = self.manifest["splits"][split]
        fix = f"delete {self.dir} and re-run build_shards"
        if any(s["rows"] != self.shard_rows for s in entry["shards"][:-1]):
            raise ShardError(f"{manifest_path}: {split} shards are not {self.shard_rows} rows each; {fix}")
        self._shards = [_Shard(self.dir / e["file"], e, self.dtype, self.chunk_rows, verify, fix)
                        for e in entry["shards"]]
        self.src_len = self._column("src_len")  # int32 [N]
        self.tgt_len = self._column("tgt_len")  # int32 [N]
        if len(self.src_len) != entry["rows"]:
            raise ShardError(f"{manifest_path}: {split} has {len(self.src_len)} rows in its shards, the manifest "
                             f"records {entry['rows']}; {fix}")

    def __reduce__(self):
        # Re-open by path in another process (e.g. a DataLoader worker); this process already verified the files.
        return type(self), (self.dir, self.split, None, False)

    def __len__(self) -> int:
        return len(self.src_len)

    @property
    def sizes(self) -> np.ndarray:
        """int32 [N]: tokens an example occupies in a padded batch, max(src, tgt) + 1 (the added eos or bos)."""
        return np.maximum(self.src_len, self.tgt_len) + 1

    @property
    def rows(self) -> np.ndarray:
        """int64 [N]: each example's row in the corpus split's Parquet file."""
        return self._column("row")

    def _column(self, name: str) -> np.ndarray:
        """A numeric column of the whole split, copied into memory (the only per-example data that is)."""
        parts = [b.column(name).to_numpy() for s in self._shards for b in s.batches]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64 if name == "row" else np.int32)

    def ids(self, i: int, side: Side) -> np.ndarray:
        """Example ``i``'s piece ids on one side: a read-only view into the mapped shard, dtype uint16/int32."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} out of range for {len(self)} examples")
        i %= len(self)
        shard, local = divmod(i, self.shard_rows)
        batch, j = divmod(local, self.chunk_rows)
        s = self._shards[shard]
        start = int(s.ids_at[side][batch]) + int(s.int32[s.offsets_at[side][batch] + j])
        return s.tokens[start : start + int((self.src_len if side == "src" else self.tgt_len)[i])]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(src ids, tgt ids) of example ``i``, views into the mapped shard."""
        return self.ids(i, "src"), self.ids(i, "tgt")

    def batches(self, max_tokens: int, seed: int, epoch: int = 0) -> list[np.ndarray]:
        """:func:`token_batches` over :attr:`sizes`: int64 index arrays, each batch within ``max_tokens``."""
        return token_batches(self.sizes, max_tokens, seed, epoch)

    def collate(self, indices: np.ndarray, side: Side, bos: bool = False, eos: bool = False) -> np.ndarray:
        """int64 [B, max_len + bos + eos]: the examples' ids, optionally framed by bos/eos, right-padded with pad.

        One vectorised gather per shard the batch touches; no Python loop over examples.
        """
        indices = np.asarray(indices, dtype=np.int64)  # [B]
        lengths = (self.src_len if side == "src" else self.tgt_len)[indices]  # [B]
        width = int(lengths.max(initial=0))
        out = np.full((len(indices), width + bos + eos), self.special.pad, dtype=np.int64)
        shard_of, local = np.divmod(indices, self.shard_rows)
        steps = np.arange(width)  # [W]
        for shard in np.unique(shard_of):
            rows = np.flatnonzero(shard_of == shard)  # [b] positions in the batch
            s = self._shards[shard]
            starts = s.starts(side, local[rows], self.chunk_rows)  # [b]
            valid = steps < lengths[rows, None]  # [b, W]
            positions = np.where(valid, starts[:, None] + steps, 0)  # [b, W]; 0 keeps padding reads in bounds
            out[rows, bos : bos + width] = np.where(valid, s.tokens[positions], self.special.pad)
        if bos:
            out[:, 0] = self.special.bos
        if eos:
            out[np.arange(len(indices)), lengths + bos] = self.special.eos
        return out


def token_batches(sizes: np.ndarray, max_tokens: int, seed: int, epoch: int = 0) -> list[np.ndarray]:
    """Length-bucketed batches: int64 index arrays, each with ``len(batch) * max(sizes[batch]) <= max_tokens``.

    ``sizes`` (int [N], each >= 1) is what an example costs in a padded batch (e.g. :attr:`ShardDataset.sizes`).
    Examples are sorted by size (ties in random order), cut greedily into the largest batches that fit, and the
    batch order is shuffled; ``(seed, epoch)`` fixes both, so every process of a distributed run gets the same
    list. Every index appears exactly once. The greedy cut walks distinct sizes, not examples.
    """
    sizes = np.asarray(sizes)
    if len(sizes) and sizes.min() < 1:
        raise ValueError("token_batches: every size must be >= 1")
    too_long = int(np.count_nonzero(sizes > max_tokens))
    if too_long:
        raise ValueError(f"{too_long} examples are longer than max_tokens={max_tokens} (longest {int(sizes.max())}); "
                         "raise max_tokens or leave them out (batch np.flatnonzero(sizes <= max_tokens))")
    if not len(sizes):
        return []
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(sizes))  # int64 [N]
    order = order[np.argsort(sizes[order], kind="stable")]  # ascending size, ties in random order
    values, counts = np.unique(sizes[order], return_counts=True)
    ends: list[int] = []  # exclusive end of each batch in `order`
    pos = fill = 0  # examples placed so far; examples in the open (last) batch
    for size, count in zip(values.tolist(), counts.tolist()):
        cap = max_tokens // size  # most examples a batch whose longest has this size can hold
        if fill >= cap:  # the open batch takes no example of this size: close it
            ends.append(pos)
            fill = 0
        take = min(count, cap - fill)
        pos, fill, count = pos + take, fill + take, count - take
        if count:  # the open batch is full; the rest fill whole batches and open a new one
            full, fill = divmod(count, cap)
            ends.extend(range(pos, pos + full * cap + 1, cap))
            pos += count
    if fill:
        ends.append(pos)
    batches = np.split(order, ends[:-1])
    return [batches[i] for i in rng.permutation(len(batches))]
