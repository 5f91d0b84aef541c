"""The run report: one markdown artifact per flow run (built by :func:`pipeline.report.render_report`) and, when a
promotion decision has evidence, a table artifact of it."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pipeline import tracking
from pipeline.config import RunConfig
from pipeline.report import evidence_rows, render_report


@task(name="report")
def publish_report(cfg: RunConfig, stages: dict[str, tuple[Path, bool]], decision: dict | None,
                   parent_run_id: str) -> str:
    """Publish the markdown report as a Prefect artifact (key ``<config name>-report``); returns its text."""
    text = render_report(cfg, stages, decision, tracking.run_url(parent_run_id))
    key = cfg.name.lower().replace("_", "-")
    create_markdown_artifact(text, key=f"{key}-report", description=f"{cfg.name} pipeline report")
    if decision and evidence_rows(decision):
        create_table_artifact([{"evidence": k, "value": v} for k, v in evidence_rows(decision)],
                              key=f"{key}-promotion", description=f"version {decision['version']}: "
                              f"{decision['decision']}. {decision['reason']}")
    return text
