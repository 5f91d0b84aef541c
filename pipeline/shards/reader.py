"""The memory-mapped shard reader: one split of a shard folder, its examples addressed in place.

Reading maps each shard into memory and addresses tokens in place: an example's ids are a numpy view into the
file, found in O(1) from its index (every shard but the last holds ``shard_rows`` rows, every record batch but a
shard's last holds ``chunk_rows``). Only the per-example lengths are copied into memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from pipeline.config import SpecialIds
from pipeline.support.fsutil import MANIFEST, read_stage_manifest, sha256_file
from pipeline.tokenize import Tokenizer

from .batching import token_batches
from .format import SHARDS_FORMAT, ShardError, shard_schema

Side = Literal["src", "tgt"]


def read_shard_manifest(shard_dir: Path) -> dict:
    """The manifest of a finished shard folder; a folder without one is not a shard folder."""
    return read_stage_manifest(shard_dir, SHARDS_FORMAT, "shard", "re-run build_shards", ShardError)


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
