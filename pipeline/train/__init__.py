"""Training stage: the Transformer on token shards, in one process or under torchrun (DDP), with checkpoints
(their format: ``pipeline.checkpoint``, shared with averaging, evaluation and serving).

Entry points: :func:`train` (library), ``python -m pipeline.train`` (command line, see ``__main__``).
"""

from .distributed import DistInfo, setup, teardown
from .metrics import ConsoleSink, JsonlSink, MetricsSink
from .batches import Batch, accumulation_steps, make_batch, usable_batches
from .step import TrainStep, dev_loss
from .trainer import train

__all__ = [
    "Batch",
    "ConsoleSink",
    "DistInfo",
    "JsonlSink",
    "MetricsSink",
    "TrainStep",
    "accumulation_steps",
    "dev_loss",
    "make_batch",
    "setup",
    "teardown",
    "train",
    "usable_batches",
]
