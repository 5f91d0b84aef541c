"""``python -m pipeline.train``: train a model, in one process or under torchrun, without an orchestrator.

``--config`` is a resolved config file, loaded as it is (no presets, environment or overrides: those were applied
once, where it was resolved): a run folder's ``config.yaml``, or one written by ``python -m pipeline config --config
NAME [--set ...] --out FILE``. So every rank, on every node, trains exactly the config its launcher resolved. How
to start it in one process, on one node or on several: docs/tutorials/multi-node.md, "torchrun by hand".

Running the same command again resumes from the newest intact checkpoint in ``--out``. Without ``--shards`` the
shards are built (or reused) from the config, on rank 0 first while the other ranks wait. ``--out`` defaults to the
config's run folder (:func:`pipeline.workdir.run_dir`), the one ``python -m pipeline`` uses too. Prints the output
folder (rank 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pipeline.config import RunConfig, ensure_work_dir, load_resolved
from pipeline.support.errors import UserError
from pipeline.workdir import build_inputs, run_dir

from .distributed import DistInfo, barrier, setup, teardown
from .launch import record_refusal
from .trainer import train


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    p = argparse.ArgumentParser(prog="python -m pipeline.train", description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", type=Path, required=True,
                   help="a resolved config file (python -m pipeline config ... --out FILE, or a run's config.yaml)")
    p.add_argument("--verbose", "-v", action="store_true", help="log at DEBUG level")
    p.add_argument("--shards", type=Path, help="shard folder (default: build or reuse it from the config)")
    p.add_argument("--out", type=Path, help="run folder: checkpoints, metrics.jsonl, train_summary.json")
    p.add_argument("--mlflow-run-id", help="also log into this MLflow run (rank 0; server: MLFLOW_TRACKING_URI)")
    p.add_argument("--launcher-holds-lock", action="store_true",
                   help="the launcher holds the run folder's lock for the whole job (the pipeline's training stage "
                        "does); without it rank 0 takes the lock itself")
    p.add_argument("--init-checkpoint", type=Path, metavar="PATH",
                   help="start from this checkpoint's weights (same model config and tokenizer) unless --out holds "
                        "a checkpoint to resume from; optimizer and step count start fresh")
    return p


def mlflow_sinks(run_id: str | None, info: DistInfo) -> list:
    """An MLflow sink on rank 0 when a run id is given (tracking is imported only then: it pulls in mlflow)."""
    if not run_id or not info.is_main:
        return []
    from pipeline.tracking import MlflowSink, TrackingError

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise TrackingError("--mlflow-run-id needs MLFLOW_TRACKING_URI, the tracking server's address "
                            "(e.g. http://127.0.0.1:5000)")
    return [MlflowSink(run_id, uri)]


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
    sinks: list = []
    try:
        cfg = load_resolved(args.config)
        if info.is_main and args.out:  # before any stage or the trainer writes
            ensure_work_dir(args.out, "--out", "pass --out a writable folder")
        elif info.is_main:
            ensure_work_dir(cfg.work_dir)
        sinks = mlflow_sinks(args.mlflow_run_id, info)  # fails here, before training, if the server is down
        shards = args.shards or ensure_shards(cfg, info)
        out = args.out or run_dir(cfg, shards)
        out = train(cfg, shards, out, sinks=sinks, info=info, init_checkpoint=args.init_checkpoint,
                    lock=not args.launcher_holds_lock)
        for s in sinks:
            s.close()  # raises TrackingError if buffered metrics cannot be sent
    except UserError as e:  # bad input or config (the tracking server down too): one line, exit status 2
        print(f"error: {e}", file=sys.stderr)
        record_refusal(str(e))  # under torchrun, for the launcher: torchrun itself exits 1 whatever its ranks did
        return 2
    finally:
        for s in sinks:
            s.close()  # after a failure, still send what was logged (a no-op once closed)
        teardown(info)
    if info.is_main:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
