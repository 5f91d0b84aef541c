"""What writer and reader agree on: the format tag, the record-batch size, the shard schema and the error type."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline.support.errors import UserError

SHARDS_FORMAT = "aiayn-shards/1"
CHUNK_ROWS = 16_384  # rows per record batch and per task sent to a worker (part of the format)


def sampled_split(copy: int) -> str:
    """Split key of sampled copy ``copy`` (1-based) of the training split (tokenizer.sampling_alpha)."""
    return f"train.sampled{copy}"


def train_splits(manifest: dict) -> list[str]:
    """The training splits that epochs cycle through, in order: the sampled copies when the shards have them
    (epoch e trains on copy e mod len), else the one deterministic ``train``."""
    copies = manifest.get("sampling", {}).get("copies", 0)
    return [sampled_split(k) for k in range(1, copies + 1)] or ["train"]


class ShardError(UserError, ValueError):
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
