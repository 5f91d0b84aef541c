"""The sweep's Prefect side: trial runs as flow runs of the pipeline's deployment on the work pool (subflows of the
sweep, started under idempotency keys, cancelled when pruned, and with the sweep when it fails or crashes), read
back through MLflow; and the sweep's artifacts (leaderboard table, report)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterParentFlowRunId, FlowRunFilterState,
                                            FlowRunFilterStateType)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.logging.loggers import flow_run_logger
from prefect.states import Cancelling
from prefect.utilities.schema_tools import ValidationError, validate

from pipeline import tracking
from pipeline.config import ConfigError
from pipeline.sweep.search import Outcome

_DEPLOY = "`.venv/bin/python -m ops.localstack up`, or `prefect --no-prompt deploy --all` in the project folder"


class DeploymentRunner:
    """A :class:`pipeline.sweep.search.Runner` over a pipeline deployment: each run a flow run of ``deployment``
    with ``parameters`` and the run's config overrides, started without waiting (``timeout=0``); outcomes are read
    from the run's MLflow runs and its evaluation downloaded under ``folder``. ``source``: where the deployment's
    name comes from (the sweep file), for messages."""

    def __init__(self, deployment: str, parameters: dict[str, Any], folder: Path, tags: list[str], source: str):
        self.deployment, self.parameters, self.folder, self.tags = deployment, parameters, Path(folder), tags
        self.source = source

    def check(self, runs: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Refuse, before any run starts, a deployment that does not exist, and overrides the deployment's
        parameter schema refuses: ``runs`` are (what, overrides) pairs. The server validates each new run against
        the schema the deployment was applied with, built from the code of that day, so a config field added since
        is refused ("Additional properties are not allowed") only when its first trial is created; the same check
        here fails the sweep at once, with the fix."""
        with get_client(sync_client=True) as client:
            try:
                deployment = client.read_deployment_by_name(self.deployment)
            except ObjectNotFound:  # Prefect says only "ObjectNotFound: None"
                raise ConfigError(f"{self.source}: deployment {self.deployment!r} does not exist on the Prefect "
                                  f"server {client.api_url}: apply the project's deployments ({_DEPLOY}), or name "
                                  "an existing one as <flow name>/<deployment name> (`prefect deployment ls` lists "
                                  "them)") from None
        if not deployment.enforce_parameter_schema:  # the server's rule: unset is not enforced
            return
        for what, overrides in runs:
            try:
                validate({**self.parameters, "overrides": overrides}, deployment.parameter_openapi_schema,
                         raise_on_error=True)
            except ValidationError as e:
                raise ConfigError(f"{self.source}: deployment {self.deployment!r} refuses the parameters of {what}: "
                                  f"{e}. Its parameter schema is the code's as of when it was applied: after a config "
                                  f"field was added, apply the deployments again ({_DEPLOY})") from None

    def start(self, key: str, name: str, overrides: dict[str, Any]) -> str:
        run = run_deployment(self.deployment, parameters={**self.parameters, "overrides": overrides}, timeout=0,
                             idempotency_key=key, flow_run_name=name, tags=self.tags, as_subflow=True)
        return str(run.id)

    def state(self, run_id: str) -> str:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(UUID(run_id)).state
        return state.type.value if state is not None else "SCHEDULED"

    def curve(self, run_id: str) -> list[tuple[float, float]]:
        return tracking.dev_curve(run_id)

    def cancel(self, run_id: str, why: str) -> None:
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(run_id), Cancelling(message=why))

    def outcome(self, run_id: str) -> Outcome:
        metrics, outputs, steps = tracking.run_outcome(run_id, self.folder / "runs" / run_id)
        return Outcome("COMPLETED", metrics, outputs, steps)


def publish(key: str, rows: list[dict], report: str) -> None:
    """The leaderboard as a table artifact (``<key>-leaderboard``) and the report as markdown (``<key>-report``)."""
    table = [{"trial": r["trial"], "duplicate_of": r["duplicate_of"], "state": r["state"], "value": r["value"],
              "steps": r["steps"], "dev_sentence_nll": r["dev_sentence_nll"], "train_seconds": r["train_seconds"],
              **{f"param.{k}": v for k, v in r["params"].items()}} for r in rows]
    create_table_artifact(table, key=f"{key}-leaderboard", description="the sweep's trials, best dev score first")
    create_markdown_artifact(report, key=f"{key}-report",
                             description="the sweep's leaderboard, confirmation and winner")


# What the hook leaves as it is: runs that are over, and those already being cancelled (a pruned trial).
_LEAVE = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED, StateType.CANCELLING]


def cancel_started_runs(flow: Any, flow_run: Any, state: Any) -> None:
    """``on_failure`` / ``on_crashed`` hook of the sweep flows: cancel the runs this sweep flow run started (its
    trial and confirmation runs, its subflow runs) that are not over, so that none trains on with no controller to
    read its curve, prune it or count it. The next run of the sweep resumes each by its next attempt
    (:data:`pipeline.sweep.search.STOPPED`). A cancelled sweep needs no hook: Prefect cancels a cancelled flow
    run's subflows itself.

    A flow run whose process was killed never reaches its own ``on_failure``: the process worker runs
    ``on_crashed`` itself once the process is gone. A hook must never raise (Prefect would only log it): failures
    are logged here instead, with what to do.
    """
    logger = flow_run_logger(flow_run, flow)
    why = (f"cancelled with its sweep controller, flow run {flow_run.name!r} ({state.name}); the next run of the "
           "sweep resumes it")
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=_LEAVE))))
            for run in runs:
                client.set_flow_run_state(run.id, Cancelling(message=why))
    except Exception:
        logger.exception("could not cancel the runs flow run %s started: cancel them by hand (`prefect flow-run "
                         "cancel <id>`; they are tagged sweep:<name>)", flow_run.id)
        return
    if runs:
        logger.info("flow run %s: cancelled the %d run(s) it had started that were not over: %s", state.name,
                    len(runs), ", ".join(r.name for r in runs))
