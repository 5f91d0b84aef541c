"""Connecting to the tracking server, the parent run per pipeline run and one child run per stage.

Every call names its run by id through an :class:`mlflow.MlflowClient`: Prefect runs tasks in worker threads,
so nothing here relies on MLflow's fluent "active run", which is per thread.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Iterable
from urllib.parse import quote, urlencode, urlparse

import mlflow
from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from pipeline.config import RunConfig, dump_config
from pipeline.support.errors import UserError
from pipeline.support.provenance import git_commit
from pipeline.support.urls import shown_url

log = logging.getLogger("aiayn.tracking")

# MLflow's limits (mlflow.utils.validation): longer param values are refused, bigger batches too.
MAX_PARAM_VALUE = 6000
BATCH_PARAMS = 100
BATCH_METRICS = 1000


class TrackingError(UserError, RuntimeError):
    """Tracking cannot go on: an unreachable server, a deleted experiment, metrics that could not be sent.
    The message names the server or run and what to do."""


def _unreachable(uri: str, timeout_s: float) -> str | None:
    """Why the http(s) tracking server ``uri`` does not answer ``GET /health`` (its URL and the error), or None
    when it does; database and file URIs need no server: None."""
    if urlparse(uri).scheme not in ("http", "https"):
        return None
    url = shown_url(uri, link=True).rstrip("/") + "/health"  # /health asks no login; urllib takes none in a URL
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            if r.status == 200:
                return None
            why = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        why = str(getattr(e, "reason", e))
    return f"{url}: {why}"


def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Raise :class:`TrackingError` at once unless an http(s) tracking server answers ``GET /health``.

    Database and file URIs need no server and pass. This is the fail-fast check: MLflow's own client retries a
    dead server for minutes before it gives up.
    """
    if why := _unreachable(uri, timeout_s):
        raise TrackingError(f"MLflow tracking server {shown_url(uri)} is not reachable ({why}). Start it "
                            "(python -m ops.localstack up) or point MLFLOW_TRACKING_URI at a running server.")


def wait_until_reachable(say: Callable[[str], None], patience_s: float = 600.0, every_s: float = 15.0) -> None:
    """Return at once when the tracking server answers; else ``say`` one line that it is unreachable and being
    retried, try again every ``every_s`` seconds, ``say`` when it is back, and raise :class:`TrackingError` once
    ``patience_s`` have passed. Called before a stage's results are logged: MLflow's client would retry a
    server that is down for minutes without a word, then fail with a traceback."""
    uri = mlflow.get_tracking_uri()
    if not (why := _unreachable(uri, min(every_s, 10.0))):
        return
    shown = shown_url(uri)
    say(f"MLflow tracking server {shown} is unreachable ({why}); retrying every {every_s:.0f} s for up to "
        f"{patience_s / 60:.0f} min before this run fails")
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
        if not (why := _unreachable(uri, min(every_s, 10.0))):
            say(f"MLflow tracking server {shown} answers again; going on")
            return
    raise TrackingError(f"MLflow tracking server {shown} stayed unreachable for {patience_s / 60:.0f} min ({why}): "
                        "start it again, then rerun: the stages that finished are reused from the cache")


def client() -> MlflowClient:
    """A client for the tracking URI set by :func:`connect` (or ``MLFLOW_TRACKING_URI``)."""
    return MlflowClient()


# The experiment tag by which MLflow's UI picks an experiment's view: the runs table of model training, not the
# GenAI view (traces, judges, prompts) it may guess otherwise.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def _experiment_id(c: MlflowClient, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is None:
        try:
            return c.create_experiment(name, tags=dict([EXPERIMENT_KIND]))
        except MlflowException:  # created meanwhile by a concurrent run: read it back
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(f"MLflow experiment {name!r} ({exp.experiment_id}) is deleted: restore it "
                            f"(mlflow experiments restore --experiment-id {exp.experiment_id}) or set "
                            "tracking.experiment to another name")
    if EXPERIMENT_KIND[0] not in exp.tags:  # made before the tag (or by hand): a kind chosen in the UI stays
        c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def connect(uri: str, experiment: str, timeout_s: float = 10.0) -> str:
    """Check the server answers (fail fast), make ``uri`` this process's tracking URI (also exported as
    ``MLFLOW_TRACKING_URI``, so subprocesses such as torchrun inherit it) and return the id of ``experiment``,
    creating it if needed."""
    check_reachable(uri, timeout_s)
    mlflow.set_tracking_uri(uri)
    return _experiment_id(MlflowClient(uri), experiment)


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts and lists as ``{"a.b.0.c": "value"}``, values as strings cut to MLflow's length limit."""
    out: dict[str, str] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        text = str(tree)
        out[prefix.rstrip(".")] = text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."
        return out
    for k, v in items:
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def log_params(run_id: str, params: dict[str, Any]) -> None:
    """Log params in MLflow-sized batches."""
    c = client()
    for batch in chunked([Param(k, str(v)) for k, v in params.items()], BATCH_PARAMS):
        c.log_batch(run_id, params=batch)


def log_metrics(run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log metrics at one step in MLflow-sized batches."""
    now = int(time.time() * 1000)
    c = client()
    for batch in chunked([Metric(k, float(v), now, step) for k, v in metrics.items()], BATCH_METRICS):
        c.log_batch(run_id, metrics=batch)


def set_tags(run_id: str, tags: dict[str, Any]) -> None:
    """Set (or overwrite) tags on a run."""
    client().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


# What the parent run repeats of its stage runs, so that the runs table and the compare view compare pipeline runs
# without opening their children: per stage, the child's metrics to copy (None: all of them) and params to log as
# metrics (child param -> parent metric).
HEADLINE: dict[str, tuple[tuple[str, ...] | None, dict[str, str]]] = {
    "train": (("train.steps", "train.wall_seconds", "train.tgt_tokens"), {"num_parameters": "model.parameters"}),
    "average": ((), {"average.n": "average.n"}),
    "evaluate": (None, {}),  # every <set>.<score>
    "export": (("export.model_mb", "export.export_sentences_per_s", "export.drop"), {}),
}


def log_headline(parent_run_id: str, stage: str, run_id: str) -> dict[str, float]:
    """Copy the headline figures of ``stage``'s finished child run ``run_id`` (:data:`HEADLINE`) onto the parent
    run, under the same names, and show them as columns of the experiment's runs view (:func:`runs_view_url`);
    returns them."""
    if stage not in HEADLINE:
        return {}
    names, params = HEADLINE[stage]
    run = client().get_run(run_id)  # a stage run lies in its parent's experiment
    data = run.data
    metrics = {k: v for k, v in data.metrics.items() if names is None or k in names}
    for param, metric in params.items():
        try:
            metrics[metric] = float(data.params[param])
        except (KeyError, ValueError):  # not logged by this stage run (e.g. a reused stage logged before)
            pass
    if metrics:
        log_metrics(parent_run_id, metrics)
        _show_in_runs_view(run.info.experiment_id, stage, list(metrics))
    return metrics


# The runs table that compares pipeline runs. MLflow's table shows run names and dates, with every metric and param
# behind "Show more columns". A shared view (the UI's own mechanism: an experiment tag mlflow.sharedViewState.<key>,
# opened with ?viewStateShareKey=<key>) lists only the pipelines' parent runs (the tag config_name is theirs alone),
# with their headline metrics as columns, scores first, best test score on top. Its columns grow with the metrics.
RUNS_VIEW = "aiayn-pipeline-runs"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW}"
RUNS_VIEW_SHOWN = {"evaluate": ("sacrebleu", "chrf", "f1"), "train": ("train.steps", "train.wall_seconds"),
                   "export": ("export.model_mb", "export.export_sentences_per_s")}


def _show_in_runs_view(experiment_id: str, stage: str, names: list[str]) -> None:
    shown = RUNS_VIEW_SHOWN.get(stage, ())
    wanted = [f"metrics.`{n}`" for n in names if (n.rsplit(".", 1)[-1] if stage == "evaluate" else n) in shown]
    if not wanted:
        return
    c = client()
    try:
        view = json.loads(c.get_experiment(experiment_id).tags.get(RUNS_VIEW_TAG, "{}"))
    except ValueError:  # edited by hand into something else: start again
        view = {}
    columns = view.get("selectedColumns", [])
    new = [w for w in wanted if w not in columns]
    if not new:
        return
    # scores before the cost columns (train, export), whichever stage logged first
    scores = [col for col in columns + new if any(col.endswith(f".{m}`") for m in RUNS_VIEW_SHOWN["evaluate"])]
    columns = scores + [col for col in columns + new if col not in scores]
    tests = [col.removeprefix("metrics.") for col in scores if "test" in col]  # the first test set, by sacreBLEU
    order = next((col for col in tests if col.endswith(".sacrebleu`")), next(iter(tests), None))
    view = {"searchFilter": "tags.config_name != ''", "selectedColumns": columns,
            **({"orderByKey": f"metrics.{order}", "orderByAsc": False} if order else {})}
    c.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, json.dumps(view))


def runs_view_url(experiment: str) -> str | None:
    """The experiment's runs view in the MLflow UI: its pipeline runs, a row each, their scores and costs as columns
    (http(s) tracking servers only; None before a run logged its headline figures)."""
    if (ui := _ui()) is None:
        return None
    exp = client().get_experiment_by_name(experiment)
    return _runs_view(ui, exp) if exp is not None else None


def ui_link(ui: str, route: str, **query: str) -> str:
    """The MLflow UI's page ``route`` (e.g. ``experiments/1/runs/<id>``) in its model-training view: the pinned
    UI opens in its GenAI view unless the address's ``workflowType`` query parameter says otherwise (it reads that
    before the choice it keeps in the browser), so every link the pipeline gives carries it."""
    return f"{ui}/#/{route}?{urlencode({**query, 'workflowType': 'machine_learning'})}"


def _runs_view(ui: str, experiment) -> str | None:
    if RUNS_VIEW_TAG not in experiment.tags:
        return None
    return ui_link(ui, f"experiments/{experiment.experiment_id}/runs", viewStateShareKey=RUNS_VIEW)


# Tags a child run copies from its parent, so that stage runs can be filtered on their own.
INHERITED_TAGS = ("config_hash", "preset", "language_pair", "mlflow.source.git.commit")


def start_pipeline_run(cfg: RunConfig, *, run_name: str, tags: dict[str, str]) -> str:
    """Create the parent run of one pipeline run in ``cfg.tracking.experiment``; returns its id.

    Params: the whole resolved config, flattened (``model.d_model``, ``data.train.0.name``, ...). The config
    holds no credentials by design (those come from the environment), so all of it is logged. Artifact:
    ``config.yaml``. Tags: git commit (and whether the checkout differs from it), config hash, preset,
    language pair, config name, and ``tags`` (the flow passes its Prefect flow run id and UI address).
    """
    c = client()
    experiment_id = _experiment_id(c, cfg.tracking.experiment)
    all_tags = {"config_hash": cfg.section_hash(), "config_name": cfg.name, "preset": cfg.preset,
                "language_pair": f"{cfg.data.src_lang}-{cfg.data.tgt_lang}", "mlflow.source.name": "aiayn-pipeline"}
    git = git_commit()
    if git is not None:
        all_tags.update({"mlflow.source.git.commit": git[0], "git_dirty": str(git[1]).lower()})
    all_tags.update(tags)
    run = c.create_run(experiment_id, run_name=run_name, tags={k: str(v) for k, v in all_tags.items()})
    run_id = run.info.run_id
    log_params(run_id, flatten(cfg.model_dump(mode="json")))
    c.log_text(run_id, dump_config(cfg), "config.yaml")
    return run_id


def start_stage_run(parent_run_id: str, stage: str, *, tags: dict[str, str] | None = None) -> str:
    """Create a child run (tag ``mlflow.parentRunId``) named ``stage`` under the parent; returns its id."""
    c = client()
    parent = c.get_run(parent_run_id)
    inherited = {k: parent.data.tags[k] for k in INHERITED_TAGS if k in parent.data.tags}
    all_tags = {**inherited, "mlflow.parentRunId": parent_run_id, "stage": stage, **(tags or {})}
    run = c.create_run(parent.info.experiment_id, run_name=stage, tags={k: str(v) for k, v in all_tags.items()})
    return run.info.run_id


def finish_run(run_id: str, status: str = "FINISHED") -> None:
    """End a run as FINISHED, FAILED or KILLED."""
    if status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"run status {status!r}: use FINISHED, FAILED or KILLED")
    client().set_terminated(run_id, RunStatus.to_string(RunStatus.from_string(status)))


def _ui() -> str | None:
    """The MLflow UI's address: the tracking server's, for http(s) servers only (a SQLite store has no UI)."""
    uri = mlflow.get_tracking_uri()
    return shown_url(uri, link=True).rstrip("/") if urlparse(uri).scheme in ("http", "https") else None


def run_url(run_id: str) -> str | None:
    """The run's page in the MLflow UI (http(s) tracking servers only), e.g. for the Prefect report."""
    if (ui := _ui()) is None:
        return None
    return ui_link(ui, f"experiments/{client().get_run(run_id).info.experiment_id}/runs/{run_id}")


def version_url(name: str, version: str) -> str | None:
    """A registered model version's page in the MLflow UI (http(s) tracking servers only)."""
    if (ui := _ui()) is None:
        return None
    return ui_link(ui, f"models/{quote(name)}/versions/{version}")


def flow_run_pages(flow_run_id: str, uri: str) -> dict[str, str]:
    """The MLflow UI pages of a Prefect flow run's pipeline run on the server ``uri``, by name: ``mlflow-run``
    (the parent run), ``mlflow-runs-view`` (the experiment's runs view, :func:`runs_view_url`), ``mlflow-attention``
    (the evaluate run's first attention heat-map), ``mlflow-model`` (the logged model with its metrics per dataset)
    and ``mlflow-model-version`` (its registered version); a page the run did not produce is left out. Raises
    :class:`TrackingError` without an http(s) server or a run of that flow run."""
    if urlparse(uri).scheme not in ("http", "https"):
        raise TrackingError(f"{shown_url(uri)} is not an MLflow server: it has no UI to show")
    check_reachable(uri)
    ui, c = shown_url(uri, link=True).rstrip("/"), MlflowClient(uri)
    parents = flow_run_runs(c, flow_run_id)
    if not parents:
        raise TrackingError(f"no MLflow run is tagged with the Prefect flow run {flow_run_id}")
    parent = parents[0].info
    base = f"experiments/{parent.experiment_id}"
    pages = {"mlflow-run": ui_link(ui, f"{base}/runs/{parent.run_id}")}
    if view := _runs_view(ui, c.get_experiment(parent.experiment_id)):
        pages["mlflow-runs-view"] = view
    children = {r.data.tags.get("stage"): r.info.run_id for r in child_runs(c, parents[0])}
    if "evaluate" in children:
        figures = sorted(a.path for a in c.list_artifacts(children["evaluate"], "attention") if not a.is_dir)
        if figures:
            pages["mlflow-attention"] = ui_link(ui, f"{base}/runs/{children['evaluate']}/artifacts/{figures[0]}")
    if "register" in children:
        for model in c.search_logged_models([parent.experiment_id],
                                            filter_string=f"source_run_id = '{children['register']}'"):
            pages["mlflow-model"] = ui_link(ui, f"{base}/models/{model.model_id}")
        for version in c.search_model_versions(f"run_id = '{children['register']}'"):
            pages["mlflow-model-version"] = ui_link(ui, f"models/{quote(version.name)}/versions/{version.version}")
    return pages


def content_digest(obj: Any) -> str:
    """A short stable digest of a JSON-able value (MLflow dataset digests hold at most 36 characters)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


def chunked(items: list, size: int) -> Iterable[list]:
    """``items`` in consecutive lists of at most ``size``."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


# ------------------------------------------------------------------ closing runs whose flow run is over

_RUNNING = "attributes.status = 'RUNNING'"


def _search_all(c: MlflowClient, experiment_ids: list[str], filter_string: str) -> list:
    """Every run matching ``filter_string`` in ``experiment_ids``, all pages."""
    runs: list = []
    for ids in chunked(experiment_ids, 100):  # keep each request small, however many experiments there are
        token = None
        while True:
            page = c.search_runs(ids, filter_string=filter_string, max_results=1000, page_token=token)
            runs += list(page)
            token = page.token
            if not token:
                break
    return runs


def flow_run_runs(c: MlflowClient, flow_run_id: str) -> list:
    """The runs tagged with the Prefect flow run ``flow_run_id``, in any experiment (a flow run's overrides may
    have chosen the experiment)."""
    experiment_ids: list[str] = []
    token = None
    while True:
        page = c.search_experiments(max_results=1000, page_token=token)
        experiment_ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return _search_all(c, experiment_ids, f"tags.`prefect.flow_run_id` = '{flow_run_id}'")


def child_runs(c: MlflowClient, parent, condition: str = "") -> list:
    """The child runs of the run ``parent``; with ``condition`` (a filter string), those matching it."""
    return _search_all(c, [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
                       + (f" and {condition}" if condition else ""))


def _close_with_children(c: MlflowClient, parent, status: str, reason: str) -> list[str]:
    """End ``parent`` (if still RUNNING) and its RUNNING child runs with ``status``, tagging each ``closed_by``;
    returns the ids it ended."""
    todo = [r.info.run_id for r in child_runs(c, parent, _RUNNING)]
    if parent.info.status == "RUNNING":
        todo.append(parent.info.run_id)  # children first: a parent never looks done while a child still runs
    for run_id in todo:
        if reason:
            c.set_tag(run_id, "closed_by", reason)
        c.set_terminated(run_id, status)
    return todo


def end_pipeline_run(parent_run_id: str, status: str, reason: str = "") -> list[str]:
    """End a pipeline run that stopped: its stage runs still RUNNING (the ``train`` run a failed training leaves)
    and its parent run, with ``status`` (FAILED or KILLED); returns the ended run ids. Fails at once when the
    server does not answer (the next run of the config ends them: :func:`close_stale_runs`)."""
    check_reachable(mlflow.get_tracking_uri())
    c = client()
    return _close_with_children(c, c.get_run(parent_run_id), status, reason)


def close_flow_run(flow_run_id: str, status: str, *, tracking_uri: str | None = None,
                   reason: str = "") -> list[str]:
    """End the MLflow runs of one Prefect flow run with ``status`` (FAILED or KILLED); returns the ended run ids.

    The parent runs are those tagged ``prefect.flow_run_id`` = ``flow_run_id`` (:func:`flow_run_runs`). Only runs
    still RUNNING are touched: a parent the flow already ended (FAILED by its own exception handler, or an earlier
    attempt of a retried flow run) keeps its outcome, while its children still RUNNING are ended too. This is for
    flow runs that died without running their own cleanup (a killed or crashed process, a cancellation): their runs
    would otherwise stay RUNNING forever. ``tracking_uri`` defaults to the process's tracking URI; ``reason`` is set
    as the ``closed_by`` tag.
    """
    if status not in ("FAILED", "KILLED"):
        raise ValueError(f"run status {status!r}: close with FAILED or KILLED")
    if tracking_uri:
        check_reachable(tracking_uri)  # fail in seconds: MLflow's client would retry a dead server for minutes
    c = MlflowClient(tracking_uri) if tracking_uri else client()
    closed: list[str] = []
    for parent in flow_run_runs(c, flow_run_id):
        if "mlflow.parentRunId" not in parent.data.tags:
            closed += _close_with_children(c, parent, status, reason)
    return closed


def close_stale_runs(experiment: str, config_name: str, is_over: Callable[[str], bool | str]) -> list[str]:
    """End as KILLED the RUNNING parent runs of ``config_name`` in ``experiment`` whose Prefect flow run
    ``is_over`` (final or gone), with their RUNNING children; returns the ended run ids.

    A flow run killed before any hook could run (the worker died too, the machine rebooted) leaves its runs
    RUNNING; the next run of the same config clears them up. Parents without a ``prefect.flow_run_id`` tag
    (started outside Prefect) are never touched: nothing says whether they are over.

    ``is_over(flow_run_id)``: falsy while the flow run may still be going; else True, or better the flow run's
    state (``"CRASHED"``, ``"deleted"``), which the ``closed_by`` tag then names for whoever finds the run.
    """
    c = client()
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return []
    closed: list[str] = []
    for parent in _search_all(c, [exp.experiment_id], f"tags.config_name = '{config_name}' and {_RUNNING}"):
        flow_run_id = parent.data.tags.get("prefect.flow_run_id")
        if "mlflow.parentRunId" in parent.data.tags or not flow_run_id:
            continue
        over = is_over(flow_run_id)
        if not over:
            continue
        state = over if isinstance(over, str) else "over"
        closed += _close_with_children(c, parent, "KILLED",
                                       f"stale: Prefect flow run {flow_run_id} is {state}, its runs were still RUNNING")
    return closed
