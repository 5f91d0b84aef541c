"""A sweep in MLflow: its parent run (the sweep's config, the leaderboard, the confirmation, the winner), one child
run per trial and per confirmation run (its values, dev curve, score and state, linked to the pipeline run it
started); and reading a trial's pipeline run (its dev curve while it trains, its scores and outputs after)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .runs import _experiment_id, child_runs, client, flatten, flow_run_runs, log_metrics, log_params, set_tags


def start_sweep_run(experiment: str, name: str, config: dict[str, Any], tags: dict[str, str]) -> str:
    """The sweep's parent run in ``experiment`` (params: the sweep config, flattened); returns its id. A sweep that
    goes on after a restart opens a new parent run: the trials' child runs say which trial they are."""
    c = client()
    run = c.create_run(_experiment_id(c, experiment), run_name=f"sweep-{name}",
                       tags={"sweep": name, "mlflow.source.name": "aiayn-pipeline", **tags})
    log_params(run.info.run_id, flatten(config))
    return run.info.run_id


def _pipeline_run(flow_run_id: str):
    # the pipeline's parent run (a sweep's parent run carries its own flow run's id, and no pipeline flow name)
    return next((r for r in flow_run_runs(client(), flow_run_id)
                 if "prefect.flow" in r.data.tags and "mlflow.parentRunId" not in r.data.tags), None)


def _stage_run(parent, stage: str):
    return next(iter(child_runs(client(), parent, f"tags.stage = '{stage}'")), None)


def dev_curve(flow_run_id: str) -> list[tuple[float, float]]:
    """(training seconds, dev NLL per sentence) at every dev evaluation logged so far by the training stage of the
    pipeline flow run ``flow_run_id``; empty before its first one (or before its runs exist)."""
    parent = _pipeline_run(flow_run_id)
    train = parent and _stage_run(parent, "train")
    if train is None:
        return []
    c = client()
    nll = {m.step: m.value for m in c.get_metric_history(train.info.run_id, "dev_sentence_nll")}
    seconds = {m.step: m.value for m in c.get_metric_history(train.info.run_id, "train_seconds")}
    return sorted((seconds[s], nll[s]) for s in nll if s in seconds)


def run_outcome(flow_run_id: str, dst: Path) -> tuple[dict[str, float], Path | None, int | None]:
    """A finished pipeline flow run's evaluation metrics (``<set>.<metric>``), its evaluation folder (hypotheses and
    references per split) downloaded into ``dst``, and its training updates; empty when it has no evaluation."""
    parent = _pipeline_run(flow_run_id)
    evaluate = parent and _stage_run(parent, "evaluate")
    if evaluate is None:
        return {}, None, None
    train = _stage_run(parent, "train")
    steps = train.data.metrics.get("train.steps") if train is not None else None
    dst = Path(dst)
    if not dst.is_dir():  # downloaded before: a finished run's evaluation does not change
        dst.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:  # complete, then renamed: never half a folder
            Path(client().download_artifacts(evaluate.info.run_id, "evaluation", tmp)).rename(dst)
    return dict(evaluate.data.metrics), dst, int(steps) if steps is not None else None


def log_child(sweep_run_id: str, name: str, params: dict[str, Any], metrics: dict[str, float],
              curve: list[tuple[float, float]], tags: dict[str, str]) -> str:
    """A child run of the sweep (a trial or a confirmation run): its values as params, its scores as metrics, the
    dev NLL per sentence at each training second reported, and tags (state; ``trial.flow_run_id``: the pipeline
    flow run, whose own MLflow runs carry ``prefect.flow_run_id``)."""
    c = client()
    parent = c.get_run(sweep_run_id)
    run = c.create_run(parent.info.experiment_id, run_name=name,
                       tags={"mlflow.parentRunId": sweep_run_id, "sweep": parent.data.tags.get("sweep", ""),
                             **{k: str(v) for k, v in tags.items()}})
    run_id = run.info.run_id
    log_params(run_id, {k: str(v) for k, v in params.items()})
    log_metrics(run_id, {k: float(v) for k, v in metrics.items() if v is not None})
    for seconds, nll in curve:
        log_metrics(run_id, {"dev_sentence_nll": nll}, step=int(seconds))
    c.set_terminated(run_id, "FINISHED" if tags.get("state") in ("COMPLETE", "COMPLETED") else "KILLED")
    return run_id


def log_sweep_result(sweep_run_id: str, files: list[Path], metrics: dict[str, float], tags: dict[str, str]) -> None:
    """The sweep's conclusions on its parent run: files (leaderboard, report, winner preset) as artifacts under
    ``sweep/``, the winner's numbers as metrics, the verdict as tags; then the run is finished."""
    c = client()
    for f in files:
        c.log_artifact(sweep_run_id, str(f), "sweep")
    log_metrics(sweep_run_id, metrics)
    set_tags(sweep_run_id, tags)
    c.set_terminated(sweep_run_id, "FINISHED")
