"""``python -m pipeline.train``: train a model, in one process or under torchrun, without an orchestrator.

One process::

    python -m pipeline.train --config multi30k-cpu --shards runs/shards/<fp> --out runs/train/demo

One node, N processes (DDP; gloo on CPU, NCCL on GPU)::

    torchrun --standalone --nproc_per_node 2 -m pipeline.train --config multi30k-cpu --out runs/train/demo

Two nodes (run on each node, same command but its own ``--node-rank``; HOST0 is reachable from both, and
``--out`` should be a shared folder so that a restart on either node finds the checkpoints)::

    torchrun --nnodes 2 --nproc_per_node 8 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        --rdzv-id my-run -m pipeline.train --config wmt14-en-de-base --out /shared/runs/base
    torchrun --nnodes 2 --nproc_per_node 8 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        --rdzv-id my-run -m pipeline.train --config wmt14-en-de-base --out /shared/runs/base

Running the same command again resumes from the newest intact checkpoint in ``--out``. Without ``--shards``
the shards are built (or reused: every stage is a cached no-op when unchanged) from the config, on rank 0
first while the other ranks wait. ``--out`` defaults to the config's run folder (``pipeline.stages.run_dir``:
``<work_dir>/train/<hash of data, tokenizer, model, train less its budgets>``), the one ``python -m pipeline``
uses too.
Prints the output folder (rank 0).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pipeline.cli import add_config_args, resolve_config, user_errors
from pipeline.config import RunConfig
from pipeline.stages import build_inputs, run_dir

from .distributed import DistInfo, barrier, setup, teardown
from .trainer import train


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (the config ones as in ``python -m pipeline``)."""
    p = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--shards", type=Path, help="shard folder (default: build or reuse it from the config)")
    p.add_argument("--out", type=Path, help="run folder: checkpoints, metrics.jsonl, train_summary.json")
    return p


def ensure_shards(cfg: RunConfig, info: DistInfo) -> Path:
    """Build (or reuse) corpus, tokenizer and shards; rank 0 first, then the others find them cached."""
    shards = build_inputs(cfg).shards if info.is_main else None
    barrier(info)
    return shards if shards is not None else build_inputs(cfg).shards


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, join the job, train; returns the exit status (2 for a refused config or input)."""
    args = build_parser().parse_args(argv)
    info = setup()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank {info.rank}] %(name)s: %(message)s")
    try:
        cfg = resolve_config(args)
        shards = args.shards or ensure_shards(cfg, info)
        out = args.out or run_dir(cfg)
        out = train(cfg, shards, out, info=info)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown(info)
    if info.is_main:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
