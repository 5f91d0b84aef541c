"""The run report: one markdown artifact per flow run (built by :func:`pipeline.report.render_report`), the scores
as a table artifact, links to the MLflow parent run and the registered model version, and, when a promotion
decision has evidence, a table artifact of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from prefect import task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from pipeline import tracking
from pipeline.config import RunConfig
from pipeline.report import evidence_rows, render_report, score_rows


@task(name="report")
def publish_report(cfg: RunConfig, stages: dict[str, tuple[Path, bool]], decision: dict | None,
                   parent_run_id: str, teachers: Sequence[str] = ()) -> str:
    """Publish the markdown report (key ``<config name>-report``), the scores table (``<config name>-scores``) and
    links to the MLflow run (``<config name>-mlflow-run``), the experiment's runs view (``<config name>-mlflow-runs``)
    and model version (``<config name>-model-version``) as Prefect artifacts; returns the report's text.
    ``teachers``: the names of a distillation's teachers."""
    run_url = tracking.run_url(parent_run_id)
    text = render_report(cfg, stages, decision, run_url, teachers)
    key = cfg.name.lower().replace("_", "-")
    create_markdown_artifact(text, key=f"{key}-report", description=f"{cfg.name} pipeline report")
    scores = json.loads(stages["evaluate"][0].read_text(encoding="utf-8"))
    create_table_artifact(score_rows(scores), key=f"{key}-scores",
                          description=f"{cfg.name}: every score by set and metric, with its signature")
    if run_url:
        create_link_artifact(run_url, link_text="MLflow run", key=f"{key}-mlflow-run",
                             description="the pipeline's parent run in MLflow (one child run per stage)")
    runs_view = tracking.runs_view_url(cfg.tracking.experiment)
    if runs_view:
        create_link_artifact(runs_view, link_text=f"MLflow: compare the runs of {cfg.tracking.experiment}",
                             key=f"{key}-mlflow-runs", description="every pipeline run of the experiment, a row "
                             "each, with its scores, updates, training time and export as columns")
    version_url = decision and tracking.version_url(cfg.registered_model_name, decision["version"])
    if version_url:
        create_link_artifact(version_url, link_text=f"{cfg.registered_model_name} version {decision['version']}",
                             key=f"{key}-model-version", description=f"the registered model version: "
                             f"{decision['decision']}")
    if decision and evidence_rows(decision):
        create_table_artifact([{"evidence": k, "value": v} for k, v in evidence_rows(decision)],
                              key=f"{key}-promotion", description=f"version {decision['version']}: "
                              f"{decision['decision']}. {decision['reason']}")
    return text
