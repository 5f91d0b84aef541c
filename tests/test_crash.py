"""A flow run that dies without cleaning up after itself: its MLflow runs end KILLED, its torchrun goes with it.

Against the real local stack: a deployment run is started, its flow-run process is killed with SIGKILL while
torchrun trains, and the worker's on_crashed hook, the kernel's parent-death signal and the next run's stale-run
sweep have to do what the killed process could not.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import QUICK, REPO_ROOT


def _wait(what: str, check, timeout_s: float, every_s: float = 1.0):
    """Poll ``check`` until it returns something truthy (returned); fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def _start_deployment(env: dict[str, str], name: str, params: dict) -> str:
    """``prefect deployment run NAME --params JSON`` without --watch: returns the new flow run's id at once."""
    res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run", name,
                          "--params", json.dumps(params)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an orphan's zombie may linger where nothing reaps it; it trains no more)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _flow_run_process(worker_pid: int, flow_run_id: str) -> psutil.Process | None:
    """The worker's descendant running ``flow_run_id`` (``python -m prefect.engine``, PREFECT__FLOW_RUN_ID)."""
    for p in psutil.Process(worker_pid).children(recursive=True):
        try:
            if "prefect.engine" in " ".join(p.cmdline()) and \
                    p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id:
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow
@pytest.mark.integration
def test_a_killed_flow_run_ends_its_runs_killed_and_takes_torchrun_down(stack, tmp_path) -> None:
    """SIGKILL of the flow-run process mid-training: torchrun and its ranks exit, Prefect shows the run CRASHED,
    and the worker's on_crashed hook ends the MLflow parent and the open train run KILLED. Then a RUNNING parent
    of the same config whose flow run does not exist (as left by a worker killed with its flow run) is ended
    KILLED by the next run of that config, which itself finishes normally."""
    from mlflow.tracking import MlflowClient

    from pipeline import tracking
    from pipeline.config import load_config

    prefect, mlflow = stack["prefect"], MlflowClient(stack["mlflow"])
    tag = uuid.uuid4().hex[:8]
    # Its own work dir and seed: the stack is shared by every module, and its cached stages must not become
    # another test's cache hits.
    overrides = {**QUICK, "tracking.experiment": f"crash-{tag}", "tracking.registered_model": f"crash-{tag}",
                 "work_dir": str(tmp_path / "work"), "train.seed": 97}

    run_id = _start_deployment(prefect.env, "train-en-de/multi30k-cpu", {"overrides": overrides, "max_steps": 100000})

    def training_parent():
        exp = mlflow.get_experiment_by_name(overrides["tracking.experiment"])
        parents = exp and mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
        if not parents:
            return None
        trains = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}' "
                                                         "and tags.stage = 'train'")
        return (parents[0], trains[0]) if trains and "loss" in trains[0].data.metrics else None

    parent, train = _wait("the train run's first loss in MLflow", training_parent, 150, every_s=2)
    engine = _flow_run_process(stack["services"]["prefect-worker"].pid, run_id)
    assert engine is not None, "no flow-run process under the worker"
    torchrun = [p for p in engine.children(recursive=True) if "torch.distributed.run" in " ".join(p.cmdline())]
    assert torchrun, "torchrun is not running under the flow-run process"
    training = torchrun + [c for p in torchrun for c in p.children(recursive=True)]  # torchrun and its ranks

    engine.send_signal(signal.SIGKILL)
    try:
        _wait("torchrun and its ranks to exit", lambda: not any(_alive(p) for p in training), 60)
    finally:  # should they survive (the failure this checks), they must not train on after the test
        for p in training:
            if _alive(p):
                p.kill()
    _wait("Prefect to mark the flow run CRASHED",
          lambda: prefect.flow_run(run_id)["state"]["type"] == "CRASHED", 60)
    _wait("the on_crashed hook to end the MLflow runs",
          lambda: mlflow.get_run(train.info.run_id).info.status == "KILLED"
          and mlflow.get_run(parent.info.run_id).info.status == "KILLED", 60)
    assert "Prefect flow run" in mlflow.get_run(parent.info.run_id).data.tags["closed_by"]

    # A parent left RUNNING by a flow run that Prefect no longer knows: the next run of the config ends it.
    cfg = load_config("multi30k-cpu-hub", overrides)
    assert cfg.name == parent.data.tags["config_name"]
    tracking.connect(stack["mlflow"], cfg.tracking.experiment)
    gone = str(uuid.uuid4())  # a flow run id the Prefect server never had (as after a deleted flow run)
    stale = tracking.start_pipeline_run(cfg, run_name="stale", tags={"prefect.flow_run_id": gone})
    stale_train = tracking.start_stage_run(stale, "train")  # its open stage run goes with it
    outside = tracking.start_pipeline_run(cfg, run_name="outside-prefect", tags={})  # no flow run: not touched

    status, out, second = prefect.run_deployment("train-en-de/multi30k-cpu", {"overrides": overrides, "max_steps": 10})
    assert status == 0, out[-4000:]
    assert mlflow.get_run(stale).info.status == "KILLED"
    assert mlflow.get_run(stale_train).info.status == "KILLED"
    assert mlflow.get_run(stale).data.tags["closed_by"].startswith(f"stale: Prefect flow run {gone} is deleted")
    assert mlflow.get_run(outside).info.status == "RUNNING"
    exp = mlflow.get_experiment_by_name(cfg.tracking.experiment)
    (new,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{second}'")
    assert new.info.status == "FINISHED"
    assert "stale MLflow run(s)" in prefect.logs(second)
    tracking.finish_run(outside)
