"""Training stage: the Transformer on token shards, in one process or under torchrun (DDP), with checkpoints.

Entry points: :func:`train` (library), ``python -m pipeline.train`` (command line, see ``__main__``).
"""

from .checkpoint import CheckpointError, find_latest, load_checkpoint, read_index, save_checkpoint
from .distributed import DistInfo, setup, teardown
from .metrics import ConsoleSink, JsonlSink, MetricsSink
from .trainer import Batch, TrainStep, accumulation_steps, evaluate, make_batch, train, usable_batches

__all__ = [
    "Batch",
    "CheckpointError",
    "ConsoleSink",
    "DistInfo",
    "JsonlSink",
    "MetricsSink",
    "TrainStep",
    "accumulation_steps",
    "evaluate",
    "find_latest",
    "load_checkpoint",
    "make_batch",
    "read_index",
    "save_checkpoint",
    "setup",
    "teardown",
    "train",
    "usable_batches",
]
