"""Prefect tasks over the tracking module: the parent run of a pipeline run, one child run per stage, and the
registry. Never cached: every pipeline run records its own lineage, also for stages reused from the cache."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from pipeline import tracking
from pipeline.config import RunConfig


@task(name="start-tracking")
def start_tracking(cfg: RunConfig, uri: str, run_name: str, tags: dict[str, str]) -> str:
    """Check the tracking server (fail now, not after hours of training) and open the parent run."""
    tracking.connect(uri, cfg.tracking.experiment)
    return tracking.start_pipeline_run(cfg, run_name=run_name, tags=tags)


@task(name="open-stage-run")
def open_stage(parent_run_id: str, stage: str) -> str:
    """A child run for a stage that logs while it runs (training streams its metrics into it)."""
    return tracking.start_stage_run(parent_run_id, stage)


@task(name="log-stage")
def log_stage(parent_run_id: str, stage: str, cached: bool, outputs: dict[str, Path], run_id: str | None = None,
              attention_sentences: int = 3) -> str:
    """Record a finished stage's outputs in its child run (opened here unless ``run_id`` is given)."""
    run_id = run_id or tracking.start_stage_run(parent_run_id, stage)
    tracking.set_tags(run_id, {"cached": str(cached).lower()})
    if stage == "data":
        tracking.log_corpus(run_id, outputs["corpus"])
    elif stage == "tokenize":
        tracking.log_tokenizer(run_id, outputs["tokenizer"], outputs["shards"])
    elif stage == "train":
        tracking.log_training(run_id, outputs["run"])
    elif stage == "average":
        tracking.log_averaging(run_id, outputs["checkpoint"])
    elif stage == "evaluate":
        tracking.log_evaluation(run_id, outputs["checkpoint"], outputs["tokenizer"], outputs["scores"],
                                attention_sentences=attention_sentences)
    tracking.finish_run(run_id)
    return run_id


@task(name="register-model")
def register(cfg: RunConfig, parent_run_id: str, checkpoint: Path, tokenizer_dir: Path, scores: Path) -> dict:
    """Register the averaged model (in a ``register`` child run) with its scores as version tags, and move the
    champion alias if it wins; returns the decision (both scores and the reason)."""
    run_id = tracking.start_stage_run(parent_run_id, "register")
    flat = tracking.flat_scores(json.loads(scores.read_text(encoding="utf-8")))
    name = cfg.registered_model_name
    version = tracking.register_model(run_id, checkpoint, tokenizer_dir, cfg.decode, name, flat)
    decision = tracking.promote(name, version, cfg.tracking.promote_metric, cfg.tracking.promote_margin,
                                run_id=parent_run_id)
    tracking.finish_run(run_id)
    return decision


@task(name="finish-tracking")
def finish_tracking(parent_run_id: str, status: str) -> None:
    tracking.finish_run(parent_run_id, status)
