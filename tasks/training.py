"""The training task: torchrun in a subprocess, its output streamed into the Prefect logs, a progress artifact
kept up to date; the trainer locks the run folder, so that two runs of one config never train side by side.

A rerun after a crash (of the worker, the machine or torchrun) uses the same run folder (named by the config
hash) and so resumes from its newest intact checkpoint instead of starting over.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from pipeline.config import LaunchConfig, RunConfig, write_resolved
from pipeline.proc import preexec_exit_with_parent
from pipeline.train import trainer
from pipeline.train.launch import torchrun_command
from pipeline.workdir import run_dir
from tasks.caching import stage_cache_key

_PROGRESS_EVERY_S = 10.0


class TrainingFailed(RuntimeError):
    """torchrun exited non-zero; the message carries the end of its output."""


def _last_step(metrics: Path) -> int:
    """The newest step in metrics.jsonl (0 before the first log line)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def _progress(cfg: RunConfig, step: int, started: float) -> float:
    """Percent done: the larger of the step budget and the wall-clock budget used."""
    done = step / cfg.train.max_steps
    if cfg.train.max_minutes:
        done = max(done, (time.monotonic() - started) / (cfg.train.max_minutes * 60))
    return round(100 * min(done, 1.0), 1)


@task(name="train", persist_result=True,
      cache_key_fn=stage_cache_key(trainer.train, ignore=("launch", "tracking_run_id"),
                                   content={"cfg": lambda c: c.section_hash("data", "tokenizer", "model", "train")}))
def train_stage(cfg: RunConfig, shards: Path, launch: LaunchConfig, tracking_run_id: str | None = None,
          init_checkpoint: Path | None = None) -> Path:
    """Train under torchrun until ``max_steps``/``max_minutes``; returns the run folder (checkpoints inside).
    ``init_checkpoint``: start from its weights (``train.init_from``) instead of a random initialisation.

    Only data, tokenizer, model and train settings (budgets included) and the initial weights' content key the
    cache: the launch layout and the tracking run do not change what is trained.
    """
    logger = get_run_logger()
    out = run_dir(cfg, shards, init_checkpoint)
    # No lock here: the trainer's rank 0 holds the run folder's lock (every way in is covered, and its waiting
    # message reaches this log through torchrun's output); this process holding it too would deadlock them.
    out.mkdir(parents=True, exist_ok=True)
    # The one hand-off: the resolved config, written once as the run folder's record, read by every rank as it is.
    config_file = write_resolved(cfg, out / "config.yaml")
    extra = ["--mlflow-run-id", tracking_run_id] if tracking_run_id else []
    cmd = torchrun_command(launch, config_file, shards, out, extra, init_checkpoint=init_checkpoint)
    logger.info("launching: %s", " ".join(cmd))
    progress_id = create_progress_artifact(progress=0.0, key="training-progress",
                                           description=f"training {cfg.name} in {out}")
    started = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    # Its own session, so that a cancellation can signal torchrun's whole process group; and SIGTERM when this
    # process dies outright, which nothing else would deliver to a separate session.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, preexec_fn=preexec_exit_with_parent())
    stop_progress = threading.Event()

    def report_progress() -> None:  # on its own clock: output may be silent for minutes
        while not stop_progress.wait(_PROGRESS_EVERY_S):
            update_progress_artifact(progress_id, _progress(cfg, _last_step(out / "metrics.jsonl"), started))

    reporter = threading.Thread(target=report_progress, daemon=True)
    reporter.start()
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                logger.info(line)
        status = proc.wait()
    finally:
        stop_progress.set()
        if proc.poll() is None:  # the task was cancelled or crashed: take torchrun and its ranks down too
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    reporter.join()
    if status != 0:
        raise TrainingFailed(f"torchrun exited with status {status}; last output:\n" + "\n".join(tail))
    update_progress_artifact(progress_id, 100.0)
    return out
