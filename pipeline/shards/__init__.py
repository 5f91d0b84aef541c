"""Tokenizer stage, part 2: token shards (Arrow IPC), written by :mod:`.writer`, memory-mapped by :mod:`.reader`,
batched by token budget by :mod:`.batching`; :mod:`.format` holds what writer and reader agree on.

The format is documented in docs/explanation/formats.md ("Token shards").
"""

from .batching import token_batches
from .format import CHUNK_ROWS, SHARDS_FORMAT, ShardError, shard_schema, train_splits
from .reader import ShardDataset, read_shard_manifest
from .writer import build_shards

__all__ = [
    "CHUNK_ROWS",
    "SHARDS_FORMAT",
    "ShardDataset",
    "ShardError",
    "build_shards",
    "read_shard_manifest",
    "shard_schema",
    "token_batches",
    "train_splits",
]
