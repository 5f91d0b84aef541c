"""The sweep's Prefect side: trial runs as flow runs of the pipeline's deployment on the work pool (subflows of the
sweep, started under idempotency keys, cancelled when pruned), read back through MLflow; and the sweep's
artifacts (leaderboard table, report)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling
from prefect.utilities.schema_tools import ValidationError, validate

from pipeline import tracking
from pipeline.config import ConfigError
from pipeline.sweep.search import Outcome


class DeploymentRunner:
    """A :class:`pipeline.sweep.search.Runner` over a pipeline deployment: each run a flow run of ``deployment``
    with ``parameters`` and the run's config overrides, started without waiting (``timeout=0``); outcomes are read
    from the run's MLflow runs and its evaluation downloaded under ``folder``."""

    def __init__(self, deployment: str, parameters: dict[str, Any], folder: Path, tags: list[str]):
        self.deployment, self.parameters, self.folder, self.tags = deployment, parameters, Path(folder), tags

    def check(self, runs: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Refuse, before any run starts, overrides the deployment's parameter schema refuses: ``runs`` are
        (what, overrides) pairs. The server validates each new run against the schema the deployment was applied
        with, built from the code of that day, so a config field added since is refused ("Additional properties
        are not allowed") only when its first trial is created; the same check here fails the sweep at once, with
        the fix."""
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(self.deployment)
        if not deployment.enforce_parameter_schema:  # the server's rule: unset is not enforced
            return
        for what, overrides in runs:
            try:
                validate({**self.parameters, "overrides": overrides}, deployment.parameter_openapi_schema,
                         raise_on_error=True)
            except ValidationError as e:
                raise ConfigError(f"deployment {self.deployment!r} refuses the parameters of {what}: {e}. Its "
                                  f"parameter schema is the code's as of when it was applied: after a config field "
                                  f"was added, apply the deployments again (`.venv/bin/python -m ops.localstack up`, "
                                  f"or `prefect deploy --all`)") from None

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
