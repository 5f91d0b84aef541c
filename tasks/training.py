"""The training stage: torchrun on this machine (one node), or one node flow run per node (several), with the
run folder locked for the whole job, torchrun's output streamed into the Prefect logs and a progress artifact kept
up to date.

Several nodes (``launch.nnodes > 1``): the stage starts one run of the node flow (``flows/nodes.py``, deployment
``launch.node_deployment``) per node, each a torchrun agent, waits for all of them, and fails fast (cancelling
the others) when one fails. Only this flow run locks the run folder and goes on to average, evaluate and
register: once, whatever the number of nodes.

A rerun after a crash (of a node, the worker, the machine or torchrun; ``launch.retries`` does it at once) uses
the same run folder (named by the config hash) and so resumes every node from its newest intact checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator
from uuid import UUID

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, WorkerStatus
from prefect.deployments import run_deployment
from prefect.runtime import flow_run, task_run
from prefect.states import Cancelled, Cancelling

from pipeline.config import FlowRunTrust, LaunchConfig, RunConfig, write_resolved
from pipeline.support.errors import UserError
from pipeline.support.fsutil import exclusive
from pipeline.support.proc import preexec_exit_with_parent
from pipeline.train import trainer
from pipeline.train.launch import Rendezvous, ranks_refusals, rendezvous_for, torchrun_command
from pipeline.workdir import run_dir
from tasks.caching import recorded, stage_cache_key
from tasks.progress import ProgressArtifact

_PROGRESS_POLL_S = 5.0  # how often metrics.jsonl is read; updates are throttled by ProgressArtifact
_POLL_S = 2.0  # how often the stage looks at its node runs
_FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class TrainingFailed(RuntimeError):
    """torchrun (or a node's flow run) failed; the message carries the end of its output."""


class TrainingRefused(TrainingFailed, UserError):
    """The training processes refused the config or input: a retry would fail the same way."""


class NodesNotStarted(TrainingFailed, UserError):
    """A node run did not start within ``launch.node_start_timeout_s``: no worker took it (not retried: a retry
    would wait for the same missing worker)."""


def _retry_unless_refused(task, task_run, state) -> bool:
    """The training task's retry condition: retry a failure (a crash, a lost node), never a refusal."""
    try:
        state.result()
    except UserError:  # TrainingRefused, or a refusal of the launcher's own (e.g. the run folder)
        return False
    except Exception:
        return True
    return False


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


@contextlib.contextmanager
def _progress_artifact(cfg: RunConfig, out: Path) -> Iterator[None]:
    """A ``training-progress`` artifact of this flow run (throttled: :class:`tasks.progress.ProgressArtifact`),
    read from the run folder's metrics.jsonl every few seconds (output may be silent for minutes, and the nodes'
    output is in their own runs); 100 on success."""
    artifact = ProgressArtifact("training-progress", f"training {cfg.name} in {out}")
    started, stop = time.monotonic(), threading.Event()

    def report() -> None:
        while not stop.wait(_PROGRESS_POLL_S):
            artifact.update(_progress(cfg, _last_step(out / "metrics.jsonl"), started))

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        stop.set()
        reporter.join()
    artifact.finish()


def run_torchrun(cmd: list[str], logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Run torchrun, its output streamed into ``logger``; :class:`TrainingFailed` with the end of its output when
    it fails, :class:`TrainingRefused` with the ranks' messages when a rank refused the config or input (torchrun
    itself exits 1 either way: the refusals are read from its ranks' reply files, ``pipeline.train.launch``).
    Torchrun and its ranks go down with this process: when the task is cancelled or crashes, and when it dies
    outright."""
    logger.info("launching: %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with tempfile.TemporaryDirectory(prefix="aiayn-torchrun-") as log_dir:
        # torchrun's --log-dir, given as PET_LOG_DIR (each torchrun option reads PET_<NAME>): where the ranks' reply
        # files go, known to this launcher only
        env = {**os.environ, "PET_LOG_DIR": log_dir}
        # Its own session, so that a cancellation can signal torchrun's whole process group; and SIGTERM when this
        # process dies outright, which nothing else would deliver to a separate session.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=env, start_new_session=True, preexec_fn=preexec_exit_with_parent())
        try:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    logger.info(line)
            status = proc.wait()
        finally:
            if proc.poll() is None:  # the task was cancelled or crashed: take torchrun and its ranks down too
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
        refusals = ranks_refusals(Path(log_dir)) if status != 0 else []
    if refusals:
        # One refusing rank is enough: a refusal is decided by the config and input, so a retry meets it again
        # (the other ranks usually failed because of it: a peer gone from a collective, or stopped by torchrun).
        raise TrainingRefused("training stopped on its config or input and is not retried (a retry would stop the "
                              "same way): " + "\n".join(refusals))
    if status != 0:
        raise TrainingFailed(f"torchrun exited with status {status}; last output:\n" + "\n".join(tail))


@task(name="train", persist_result=True, retry_condition_fn=_retry_unless_refused,
      cache_key_fn=stage_cache_key(trainer.train, ignore=("launch", "tracking_run_id"),
                                   content={"cfg": lambda c: c.section_hash("data", "tokenizer", "model", "train")}))
@recorded
def train_stage(cfg: RunConfig, shards: Path, launch: LaunchConfig, tracking_run_id: str | None = None,
                init_checkpoint: Path | None = None) -> Path:
    """Train under torchrun until ``max_steps``/``max_minutes`` on ``launch.nnodes`` nodes; returns the run folder
    (checkpoints inside). ``init_checkpoint``: start from its weights (``train.init_from``) instead of a random
    initialisation. Retried ``launch.retries`` times (set by the flow), resuming, unless the config was refused.

    Only data, tokenizer, model and train settings (budgets included) and the initial weights' content key the
    cache: the launch layout and the tracking run do not change what is trained.
    """
    logger = get_run_logger()
    out = run_dir(cfg, shards, init_checkpoint)
    # This flow run holds the run folder for the whole job, on every node: a second run of the same config waits
    # here (and says so) instead of starting nodes that would train beside these.
    with exclusive(out, "run folder"):
        # The one hand-off: the resolved config, written once as the run folder's record, read by every rank as it is.
        config_file = write_resolved(cfg, out / "config.yaml")
        extra = ["--launcher-holds-lock", *(["--mlflow-run-id", tracking_run_id] if tracking_run_id else [])]
        with _progress_artifact(cfg, out):
            if launch.nnodes == 1:
                run_torchrun(torchrun_command(launch, config_file, shards, out, extra, init_checkpoint), logger)
            else:
                attempt = f"{flow_run.get_id()}-{task_run.get_run_count()}"
                _run_nodes(launch, rendezvous_for(launch, attempt),
                           {"config_file": str(config_file), "shards": str(shards), "out": str(out), "extra": extra,
                            "init_checkpoint": str(init_checkpoint) if init_checkpoint else None}, logger)
    return out


def _run_nodes(launch: LaunchConfig, rendezvous: Rendezvous, job: dict[str, Any],
               logger: logging.Logger | logging.LoggerAdapter) -> None:
    """One flow run of ``launch.node_deployment`` per node (subflows of this run, tagged with it), each recorded
    with its parameters under the pool's work dir (:meth:`pipeline.config.FlowRunTrust.record_node_run`: a node
    runs only as a run recorded there), watched until all complete; when one fails, the others are cancelled and
    :class:`TrainingFailed` names every node that failed by itself, with its message."""
    parent = str(flow_run.get_id())
    trust = FlowRunTrust.from_environ()
    logger.info("starting %d node runs of %s; rendezvous %s, id %s", launch.nnodes, launch.node_deployment,
                rendezvous.endpoint, rendezvous.run_id)
    runs: list[FlowRun] = []
    why = "the training stage stopped"
    try:
        for rank in range(launch.nnodes):
            parameters = {**job, "launch": launch.model_dump(mode="json"), "node_rank": rank,
                          "rdzv_endpoint": rendezvous.endpoint, "rdzv_id": rendezvous.run_id}
            runs.append(run_deployment(
                launch.node_deployment, timeout=0, as_subflow=True, tags=[f"parent-flow-run:{parent}"],
                flow_run_name=f"{flow_run.get_name()}-node-{rank}-of-{launch.nnodes}",
                idempotency_key=f"{rendezvous.run_id}-node-{rank}",
                job_variables=_node_job_variables(launch, rank), parameters=parameters))
            trust.record_node_run(str(runs[-1].id), parent, parameters)  # the node waits for it as it starts
        failed = _watch(runs, logger, launch)
        if failed is not None:
            why = f"node {failed[0]} ended {failed[1].state.type.value}"
    finally:
        _cancel_unfinished(runs, why)  # a no-op when every node finished
        for run in runs:  # a node that never started leaves its record: no later run may take it
            trust.forget_node_run(str(run.id))
    if failed is not None:
        with get_client(sync_client=True) as client:  # every node that failed by itself, not those cancelled
            ended = [(rank, client.read_flow_run(run.id)) for rank, run in enumerate(runs)]
        failures = [(rank, run) for rank, run in ended if run.state.type.value in ("FAILED", "CRASHED")] or [failed]
        raise _nodes_failed(failures, launch.nnodes)


def _node_job_variables(launch: LaunchConfig, rank: int) -> dict[str, Any]:
    """Node ``rank``'s job variables: the config's own for it (launch.node_job_variables), with its rank among its
    labels (what a Service selecting node 0 matches), whatever other labels they set."""
    own = launch.node_job_variables.get(str(rank), {})
    return {**own, "labels": {**own.get("labels", {}), "aiayn-node-rank": str(rank)}}


def _nodes_failed(failures: list[tuple[int, FlowRun]], nnodes: int) -> TrainingFailed:
    """The stage's error for the node runs that failed by themselves, ``(node rank, run)``, naming each with its
    message: :class:`TrainingRefused` when a node's torchrun was refused (the node's own TrainingRefused, which its
    run's state message names: an exception does not cross flow runs), else :class:`TrainingFailed`."""
    refused = any(f"{TrainingRefused.__name__}: " in (run.state.message or "") for _, run in failures)
    return (TrainingRefused if refused else TrainingFailed)("\n".join(
        f"node {rank} of {nnodes} (flow run {run.name}, {run.id}) ended {run.state.type.value}: {run.state.message}"
        for rank, run in failures))


def _watch(runs: list[FlowRun], logger: logging.Logger | logging.LoggerAdapter,
           launch: LaunchConfig) -> tuple[int, FlowRun] | None:
    """Poll the node runs until all completed (None) or one did not: ``(its rank, the run)``. Raises
    :class:`NodesNotStarted` when one has not started ``launch.node_start_timeout_s`` after they were created."""
    seen: dict[UUID, str] = {}
    deadline = time.monotonic() + launch.node_start_timeout_s
    with get_client(sync_client=True) as client:
        while True:
            current = [client.read_flow_run(r.id) for r in runs]
            for rank, run in enumerate(current):
                state = run.state.type.value if run.state else "SCHEDULED"
                if seen.get(run.id) != state:
                    logger.info("node %d (%s): %s", rank, run.name, state)
                    seen[run.id] = state
            bad = next(((rank, run) for rank, run in enumerate(current)
                        if run.state and run.state.type.value in _FINAL - {"COMPLETED"}), None)
            if bad is not None:
                return bad
            if all(run.state and run.state.type.value == "COMPLETED" for run in current):
                return None
            waiting = [(rank, run) for rank, run in enumerate(current)
                       if run.state is None or run.state.type.value in ("SCHEDULED", "PENDING")]
            if waiting and time.monotonic() > deadline:
                raise NodesNotStarted(_not_started(client, launch, waiting))
            time.sleep(_POLL_S)


def _not_started(client, launch: LaunchConfig, waiting: list[tuple[int, FlowRun]]) -> str:
    """Why node runs still wait: the node deployment's work pool and the workers it has online."""
    pool = client.read_deployment_by_name(launch.node_deployment).work_pool_name
    online = [w for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]
    nodes = ", ".join(f"node {rank} ({run.name})" for rank, run in waiting)
    why = (f"work pool {pool} has no worker online: start one (prefect worker start --pool {pool}) or "
           "point launch.node_deployment at a deployment of a served pool" if not online else
           f"work pool {pool} has {len(online)} worker(s) online, but none started them (is the pool or its "
           "queue paused, or its concurrency limit reached?)")
    return (f"{nodes} did not start within {launch.node_start_timeout_s:g} s (launch.node_start_timeout_s) of "
            f"{launch.node_deployment}: {why}")


def _cancel_unfinished(runs: list[FlowRun], why: str, wait_s: float = 120.0) -> None:
    """Cancel the node runs that are not final and wait (up to ``wait_s``) until they are: their torchrun agents
    must be gone before a retry starts new ones."""
    if not runs:
        return
    with get_client(sync_client=True) as client:
        states = {r.id: client.read_flow_run(r.id).state for r in runs}
        pending = [i for i, state in states.items() if state is None or state.type.value not in _FINAL]
        for run_id in pending:
            # Not started: nothing to stop. Started: the worker stops its process. Not forced: a run that ended
            # meanwhile (failed by itself) keeps its own final state.
            scheduled = states[run_id] is None or states[run_id].type.value == "SCHEDULED"
            client.set_flow_run_state(run_id, Cancelled(message=why) if scheduled else Cancelling(message=why))
        deadline = time.monotonic() + wait_s
        while pending and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            pending = [i for i in pending if client.read_flow_run(i).state.type.value not in _FINAL]


@task(name="torchrun-node")
def train_on_node(config_file: Path, shards: Path, out: Path, launch: LaunchConfig, node_rank: int,
                  rendezvous: Rendezvous, extra: list[str], init_checkpoint: Path | None = None) -> None:
    """One node of a multi-node training run: its torchrun agent, at ``rendezvous`` with node rank
    ``node_rank`` (node 0 hosts the rendezvous and, through rank 0, writes the checkpoints)."""
    run_torchrun(torchrun_command(launch, config_file, shards, out, extra, init_checkpoint, node_rank, rendezvous),
                 get_run_logger())
