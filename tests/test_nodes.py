"""Several nodes from one flow run, on the real local stack (loopback): the training stage fans out one node flow
run per node, waits for them, fails fast, and the pipeline continues once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import QUICK, REPO_ROOT, api

pytestmark = pytest.mark.integration  # every test runs deployments on a real Prefect server and worker

# Two nodes of one process each; the global batch (2 x 512 tokens per update) equals that of one node of two.
NODES = {**QUICK, "launch.nnodes": 2, "launch.nproc_per_node": 1, "train.update_tokens": 1024,
         "launch.rdzv_timeout_s": 60}


def _params(**overrides) -> dict:
    name = f"nodes-{uuid.uuid4().hex[:8]}"  # its own registered model: its first version is the champion
    return {"overrides": {**NODES, "tracking.registered_model": name, **overrides}}


def _node_runs(prefect, parent: str) -> list[dict]:
    runs = api(prefect.api, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"parent-flow-run:{parent}"]}}})
    return sorted(runs, key=lambda r: (r["created"], r["name"]))


def _run_folder(prefect, parent: str) -> Path:
    """The run folder, from the training-progress artifact's description ("training <name> in <folder>")."""
    (progress,) = [a for a in prefect.artifacts(parent) if a["key"] == "training-progress"][-1:]
    return Path(re.search(r" in (/\S+)$", progress["description"]).group(1))


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    index = json.loads((run / "checkpoints" / "index.json").read_text())["checkpoints"]
    newest = max(index, key=lambda e: e["step"])
    return torch.load(run / "checkpoints" / newest["file"], weights_only=True)["model"]


def _one_node_of_two_processes(run: Path, out: Path) -> dict[str, torch.Tensor]:
    """The same resolved config trained on one node with 2 processes, launched as the training stage does."""
    from pipeline.config import LaunchConfig, load_resolved
    from pipeline.train.launch import torchrun_command

    cfg = load_resolved(run / "config.yaml")
    shards = next(p for p in (Path(cfg.work_dir) / "shards").iterdir() if (p / "manifest.json").is_file()
                  and run.name.endswith(json.loads((p / "manifest.json").read_text())["fingerprint"][:12]))
    cmd = torchrun_command(LaunchConfig(nproc_per_node=2), run / "config.yaml", shards, out)
    # A node of one process computes on every core (or on AIAYN_CPU_THREADS, as under pytest-xdist); so must
    # these two, for the same arithmetic (one thread more or less changes how a matmul splits its sums).
    threads = os.environ.get("AIAYN_CPU_THREADS") or str(len(psutil.Process().cpu_affinity()))
    res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "AIAYN_CPU_THREADS": threads})
    assert res.returncode == 0, res.stderr[-4000:]
    return _final_weights(out)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_nodes_train_once_register_once_and_equal_one_node_of_two(stack, tmp_path: Path) -> None:
    prefect = stack["prefect"]
    params = _params()
    status, out, parent = prefect.run_deployment("train-en-de/multi30k-cpu", {**params, "max_steps": 10})
    assert status == 0, out[-4000:]
    assert prefect.flow_run(parent)["state"]["type"] == "COMPLETED"
    nodes = _node_runs(prefect, parent)
    assert [n["name"].rsplit("-", 3)[-3:] for n in nodes] == [["0", "of", "2"], ["1", "of", "2"]]
    assert {n["state"]["type"] for n in nodes} == {"COMPLETED"}
    assert all(n["parent_task_run_id"] for n in nodes)  # subflows of the training stage: linked in the UI
    logs = prefect.logs(parent)
    assert "starting 2 node runs of train-node/local" in logs and "node 1 (" in logs
    node_logs = prefect.logs(nodes[1]["id"])
    assert "--node-rank 1" in node_logs and "is_host=false" in node_logs
    # Averaging, evaluation and registration ran once, in the parent: one registered version.
    from mlflow.tracking import MlflowClient

    name = params["overrides"]["tracking.registered_model"]
    assert len(MlflowClient(stack["mlflow"]).search_model_versions(f"name='{name}'")) == 1
    progress = [a for a in prefect.artifacts(parent) if a["key"] == "training-progress"]
    assert progress[-1]["data"] == 100.0  # the nodes' progress, in the parent's artifact
    run = _run_folder(prefect, parent)
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 10
    _assert_same_weights(_final_weights(run), _one_node_of_two_processes(run, tmp_path / "one-node"))


def test_a_node_killed_mid_training_resumes_on_the_retry(stack, tmp_path: Path) -> None:
    prefect = stack["prefect"]
    params = _params(**{"train.checkpoint_every_steps": 2, "launch.retries": 1})
    parent = prefect.start_deployment("train-en-de/multi30k-cpu", {**params, "max_steps": 40})
    agent = _wait_for_checkpointing_agent(prefect, parent, node_rank=1, step=4)
    agent.kill()  # kill -9 of node 1's torchrun agent (its rank goes with it)
    state = _wait_final(prefect, parent, timeout_s=600)
    nodes = _node_runs(prefect, parent)
    # on failure, every node run's own log too: the parent's shows only the node that failed first
    assert state == "COMPLETED", prefect.logs(parent)[-4000:] + "".join(
        f"\n--- node run {n['name']} ({n['state']['type']}):\n{prefect.logs(n['id'])[-3000:]}" for n in nodes)
    first, second = nodes[:2], nodes[2:]
    assert {n["state"]["type"] for n in first} <= {"FAILED", "CRASHED", "CANCELLED"}
    assert [n["state"]["type"] for n in second] == ["COMPLETED", "COMPLETED"]
    logs = prefect.logs(parent)
    assert re.search(r"node 1 \(\S+\): (FAILED|CRASHED)", logs)
    assert re.search(r"resuming from \S+ckpt-\d+\.pt: step [1-9]", "\n".join(prefect.logs(n["id"]) for n in second))
    run = _run_folder(prefect, parent)
    assert json.loads((run / "train_summary.json").read_text())["steps"] == 40
    _assert_same_weights(_final_weights(run), _one_node_of_two_processes(run, tmp_path / "one-node"))


def test_an_unreachable_rendezvous_fails_every_node_and_the_run_naming_it(stack) -> None:
    prefect = stack["prefect"]
    # 127.0.0.2 is loopback, but node 0 hosts the rendezvous on 127.0.0.1 (its interface's address): the other
    # node would wait for nothing. Node 0 refuses it at once; the stage then cancels the other node.
    endpoint = "127.0.0.2:29511"
    # (A seed of its own: the training stage's cache key ignores the launch settings, so the same training config
    # would be found done by the first test.)
    params = _params(**{"launch.rdzv_endpoint": endpoint, "launch.rdzv_timeout_s": 15, "launch.retries": 0,
                        "train.seed": 7})
    begun = time.monotonic()
    status, out, parent = prefect.run_deployment("train-en-de/multi30k-cpu", {**params, "max_steps": 10})
    elapsed = time.monotonic() - begun
    assert status != 0 and prefect.flow_run(parent)["state"]["type"] == "FAILED"
    assert elapsed < 180, elapsed  # at most the 15 s rendezvous timeout, plus starting the runs
    nodes = _node_runs(prefect, parent)
    states = [n["state"]["type"] for n in nodes]
    assert len(nodes) == 2 and set(states) <= {"FAILED", "CANCELLED"} and "FAILED" in states, states
    message = f"the rendezvous endpoint {endpoint} (launch.rdzv_endpoint)"
    failed = nodes[states.index("FAILED")]
    assert message in prefect.logs(failed["id"])
    assert message in prefect.logs(parent)  # the run's own failure names it too


def test_node_runs_that_no_worker_takes_fail_the_stage_in_time_naming_the_pool(stack) -> None:
    """A node deployment on a pool that no worker serves: the runs stay Scheduled, and the training stage fails
    after launch.node_start_timeout_s (not retried), naming the pool and the missing worker."""
    prefect = stack["prefect"]
    cli = [str(Path(sys.executable).with_name("prefect")), "--no-prompt"]
    for args in (["work-pool", "create", "aiayn-unserved", "--type", "process"],
                 ["deploy", "flows/nodes.py:train_node", "--name", "unserved", "--pool", "aiayn-unserved"]):
        res = subprocess.run([*cli, *args], cwd=REPO_ROOT, env=prefect.env, capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    params = _params(**{"launch.node_deployment": "train-node/unserved", "launch.node_start_timeout_s": 10,
                        "launch.retries": 1, "train.seed": 8})
    begun = time.monotonic()
    status, out, parent = prefect.run_deployment("train-en-de/multi30k-cpu", {**params, "max_steps": 10})
    assert status != 0 and prefect.flow_run(parent)["state"]["type"] == "FAILED"
    assert time.monotonic() - begun < 120
    logs = prefect.logs(parent)
    assert "did not start within 10 s (launch.node_start_timeout_s) of train-node/unserved" in logs
    assert "work pool aiayn-unserved has no worker online" in logs
    assert logs.count("starting 2 node runs") == 1  # refused, not retried
    assert {n["state"]["type"] for n in _node_runs(prefect, parent)} == {"CANCELLED"}


def _wait_for_checkpointing_agent(prefect, parent: str, node_rank: int, step: int,
                                  timeout_s: float = 300) -> psutil.Process:
    """Node ``node_rank``'s torchrun agent of flow run ``parent``, once the run folder holds a checkpoint at or
    past ``step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            run = _run_folder(prefect, parent)
            index = json.loads((run / "checkpoints" / "index.json").read_text())["checkpoints"]
        except (ValueError, FileNotFoundError, AttributeError, json.JSONDecodeError):
            index = []
        if index and max(e["step"] for e in index) >= step:
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info["cmdline"] or []
                if "torch.distributed.run" in cmd and "--node-rank" in cmd and \
                        cmd[cmd.index("--node-rank") + 1] == str(node_rank) and \
                        any(a.startswith(parent) for a in cmd):
                    return proc
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} with node {node_rank} running within {timeout_s} s")


def _wait_final(prefect, run_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = prefect.flow_run(run_id)["state"]["type"]
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return state
        time.sleep(2)
    raise AssertionError(f"flow run {run_id} not final after {timeout_s} s")
