"""Orchestration end to end: a real Prefect server, work pool, worker and MLflow server started by the local-stack
command, the deployments from prefect.yaml, and flow runs started the way users start them
(``prefect deployment run ... --watch``). Also the cache keys and the stack's process bookkeeping, without servers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from pipeline.config import parse_value
from tests.conftest import REPO_ROOT as REPO, TINY

STAGES = ["prepare-data", "train-tokenizer", "write-shards", "train", "average-checkpoints", "evaluate"]
# The tiny run of the deployment: TINY's model and batch, 10 updates, greedy decoding capped short.
QUICK = {**{k: parse_value(v) for k, v in (o.split("=", 1) for o in TINY)}, "train.checkpoint_every_steps": 5,
         "average.last_n": 2, "decode.beam_size": 1, "decode.max_len_a": 0.1, "decode.max_len_b": 2,
         "decode.batch_sentences": 512}


def _api(base: str, path: str, body: dict | None = None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class Prefect:
    """The bits of the Prefect REST API the assertions need."""

    def __init__(self, api_url: str, env: dict[str, str]):
        self.api, self.env = api_url, env

    def run_deployment(self, name: str, params: dict, timeout: int = 900) -> tuple[int, str, str]:
        """``prefect deployment run NAME --params JSON --watch``: (exit status, output, flow run id)."""
        res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run", name,
                              "--params", json.dumps(params), "--watch"], cwd=REPO, env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        out = res.stdout + res.stderr
        run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        return res.returncode, out, run_id

    def flow_run(self, run_id: str) -> dict:
        return _api(self.api, f"/flow_runs/{run_id}")

    def task_states(self, run_id: str) -> dict[str, str]:
        runs = _api(self.api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        return {r["name"].rsplit("-", 1)[0]: r["state"]["name"] for r in runs}  # "train-f14" -> "train"

    def logs(self, run_id: str) -> str:
        messages: list[str] = []
        while True:  # the API serves at most 200 per request
            page = _api(self.api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200,
                                                   "offset": len(messages), "sort": "TIMESTAMP_ASC"})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return "\n".join(messages)

    def artifacts(self, run_id: str) -> list[dict]:
        return _api(self.api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, shared_data: Path):
    """`python -m pipeline.localstack up` on free ports in a temporary home; `down` afterwards."""
    from pipeline.localstack import Stack, free_port

    home = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    env.pop("PREFECT_API_URL", None)
    ports = [str(free_port()), str(free_port())]
    cmd = [sys.executable, "-m", "pipeline.localstack", "--home", str(home), "--prefect-port", ports[0],
           "--mlflow-port", ports[1], "--data-root", str(shared_data), "--work-dir", str(home / "work")]
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    services = Stack(home).load()
    try:
        api = services["prefect-server"].url + "/api"
        yield {"home": home, "cmd": cmd, "env": env, "services": services, "up": up.stdout,
               "prefect": Prefect(api, {**env, "PREFECT_API_URL": api}), "mlflow": services["mlflow"].url}
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr
        left = [s.name for s in services.values() if psutil.pid_exists(s.pid) and s.alive()]
        assert not left, f"still running after down: {left}"


@pytest.mark.slow
@pytest.mark.integration
def test_stack_up_is_idempotent_and_binds_localhost(stack) -> None:
    from pipeline.localstack import Stack

    assert "Prefect UI:  http://127.0.0.1:" in stack["up"] and "MLflow UI:   http://127.0.0.1:" in stack["up"]
    again = subprocess.run([*stack["cmd"][:3], "up", *stack["cmd"][3:]], env=stack["env"], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert {k: s.pid for k, s in Stack(stack["home"]).load().items()} == \
        {k: s.pid for k, s in stack["services"].items()}  # the same processes, nothing started twice
    for service in stack["services"].values():
        for conn in psutil.Process(service.pid).net_connections(kind="tcp") if service.name != "prefect-worker" else []:
            if conn.status == psutil.CONN_LISTEN:
                assert conn.laddr.ip == "127.0.0.1", (service.name, conn.laddr)


@pytest.mark.slow
@pytest.mark.integration
def test_deployment_runs_every_stage_then_reuses_them(stack) -> None:
    """First run: every stage runs and logs; same parameters again: every stage is Cached; a changed training
    setting re-runs training (resuming its run folder) and what follows, never data or tokenization."""
    prefect = stack["prefect"]
    params = {"overrides": QUICK, "max_steps": 10}
    status, out, first = prefect.run_deployment("train-en-de/multi30k-cpu", params)
    assert status == 0, out[-4000:]
    assert prefect.flow_run(first)["state"]["type"] == "COMPLETED"
    states = prefect.task_states(first)
    assert all(states[s] == "Completed" for s in STAGES), states
    logs = prefect.logs(first)
    assert "launching: " in logs and "torch.distributed.run" in logs
    assert "training stopped (max_steps) at step 10" in logs  # torchrun's own output, streamed into the run logs
    keys = {a["key"]: a for a in prefect.artifacts(first)}
    report = keys["multi30k-cpu-hub-report"]["data"]
    for needle in ("## Data", "| test.test2016 (test2016) | sacrebleu |", "tok_bleu_compound_split", "## Registry",
                   stack["mlflow"] + "/#/experiments/"):
        assert needle in report, needle
    assert keys["training-progress"]["type"] == "progress" and keys["training-progress"]["data"] == 100.0
    # The MLflow side of the same run: a parent tagged with the flow run, a child per stage, and the trainer's
    # step metrics streamed from the torchrun process into the train child.
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(stack["mlflow"])
    exp = mlflow.get_experiment_by_name("aiayn")
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{first}'")
    assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow"] == "train-en-de"
    children = {r.data.tags["stage"]: r for r in mlflow.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert sorted(children) == ["average", "data", "evaluate", "register", "tokenize", "train"]
    assert children["average"].data.params["average.steps"] == "5,10"
    assert [m.step for m in mlflow.get_metric_history(children["train"].info.run_id, "loss")] == [2, 4, 6, 8, 10]
    assert "test2016.sacrebleu" in children["evaluate"].data.metrics

    status, out, second = prefect.run_deployment("train-en-de/multi30k-cpu", params)
    assert status == 0, out[-4000:]
    states = prefect.task_states(second)
    assert all(states[s] == "Cached" for s in STAGES), states
    report = {a["key"]: a for a in prefect.artifacts(second)}["multi30k-cpu-hub-report"]["data"]
    assert "| train | " in report and "| reused |" in report and "| ran |" not in report

    # A larger step budget is a changed training config: training re-runs, in the same run folder, so it
    # resumes from the last checkpoint (step 10) instead of starting over. N is now chosen on dev among 1, 2.
    choose = {"overrides": {**QUICK, "average.choose_from": [1, 2]}, "max_steps": 14}
    status, out, third = prefect.run_deployment("train-en-de/multi30k-cpu", choose)
    assert status == 0, out[-4000:]
    states = prefect.task_states(third)
    assert [states[s] for s in STAGES] == ["Cached"] * 3 + ["Completed"] * 3, states
    logs = prefect.logs(third)
    assert re.search(r"resuming from \S+: step 10", logs) and "training stopped (max_steps) at step 14" in logs
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{third}'")
    (average,) = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                         "and tags.stage = 'average'")
    assert {"average.dev.last1", "average.dev.last2"} <= set(average.data.metrics)
    assert average.data.params["average.chosen_n"] in ("1", "2")
    assert "## Averaging" in {a["key"]: a for a in prefect.artifacts(third)}["multi30k-cpu-hub-report"]["data"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_corrupt_corpus_fails_the_run_with_the_data_error_and_loses_nothing(stack, shared_data: Path,
                                                                             tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "multi30k").mkdir(parents=True)
    shutil.copytree(shared_data / "wmt14-en-de", root / "wmt14-en-de")
    for name in ("test2016.en", "test2016.de", "train.en"):
        shutil.copy(shared_data / "multi30k" / name, root / "multi30k" / name)
    lines = (shared_data / "multi30k" / "train.de").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "multi30k" / "train.de").write_text("".join(lines[:-7]), encoding="utf-8")  # 7 lines short
    work = stack["home"] / "work"
    before = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()} if work.exists() else {}

    prefect = stack["prefect"]
    status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu",
                                                 {"overrides": QUICK, "max_steps": 10, "data_root": str(root)})
    assert status == 1, out[-3000:]
    assert prefect.flow_run(run_id)["state"]["type"] == "FAILED"
    assert prefect.task_states(run_id)["prepare-data"] == "Failed"
    logs = prefect.logs(run_id)
    assert "train.de" in logs and "28993" in logs.replace(",", ""), logs[-3000:]  # names the file and the count
    after = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()} if work.exists() else {}
    assert {p: m for p, m in after.items() if p in before} == before  # earlier outputs untouched
    assert not [p for p in work.glob("corpus/*") if p.name.startswith(".")], "a half-written corpus was left"


@pytest.mark.slow
@pytest.mark.integration
def test_the_weekly_schedule_creates_runs(stack) -> None:
    prefect = stack["prefect"]
    dep = _api(prefect.api, "/deployments/name/train-en-de/retrain-weekly")
    assert dep["schedules"][0]["schedule"]["cron"] == "0 3 * * 1"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        runs = _api(prefect.api, "/flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}}})
        if runs:
            break
        time.sleep(2)
    assert runs, "the scheduler created no run for train-en-de/retrain-weekly"
    assert {r["state"]["type"] for r in runs} == {"SCHEDULED"}
    starts = sorted(r["expected_start_time"] for r in runs)
    assert all(time.strptime(s[:19], "%Y-%m-%dT%H:%M:%S").tm_wday == 0 for s in starts)  # Mondays


# ----------------------------------------------------------------------------------- without servers


def test_cache_keys_follow_content_not_names(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pipeline.config import load_config
    from tasks.caching import stage_cache_key

    def fn(x):
        return x

    def ctx(name):
        return SimpleNamespace(task=SimpleNamespace(name=name, fn=fn))

    folder = tmp_path / "stage"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"a": 1}')
    key = stage_cache_key(["pipeline/average.py"], ignore=("run_id",))
    cfg = load_config("multi30k-cpu")
    base = key(ctx("t"), {"folder": folder, "cfg": cfg.average, "run_id": "1"})
    assert key(ctx("t"), {"folder": folder, "cfg": cfg.average, "run_id": "2"}) == base  # ignored parameter
    assert key(ctx("u"), {"folder": folder, "cfg": cfg.average, "run_id": "1"}) != base  # another task
    changed = load_config("multi30k-cpu", ["average.last_n=7"]).average
    assert key(ctx("t"), {"folder": folder, "cfg": changed, "run_id": "1"}) != base  # its config
    (folder / "manifest.json").write_text('{"a": 2}')
    assert key(ctx("t"), {"folder": folder, "cfg": cfg.average, "run_id": "1"}) != base  # its input's content
    shutil.rmtree(folder)
    assert key(ctx("t"), {"folder": folder, "cfg": cfg.average, "run_id": "1"}) != base  # a vanished input


def test_torchrun_command_from_launch_settings(tmp_path: Path) -> None:
    from pipeline.config import load_config
    from pipeline.train.launch import torchrun_command

    one = torchrun_command(load_config("multi30k-cpu").launch, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o")
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone", "-m",
                       "pipeline.train", "--config", str(tmp_path / "c.yaml"), "--shards", str(tmp_path / "s"),
                       "--out", str(tmp_path / "o")]
    multi = load_config("multi30k-cpu", {"launch.nnodes": 2, "launch.node_rank": 1, "launch.nproc_per_node": 8,
                                         "launch.rdzv_endpoint": "node0:29500", "launch.rdzv_id": "job"}).launch
    cmd = " ".join(torchrun_command(multi, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o"))
    assert ("--nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
            "--rdzv-id job") in cmd and "--standalone" not in cmd


def test_down_never_signals_a_process_it_did_not_start(tmp_path: Path) -> None:
    """A recorded PID now used by another process (other start time) is left alone."""
    from pipeline.localstack import Service, Stack

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stack = Stack(tmp_path)
        started = psutil.Process(other.pid).create_time()
        stack.save({"mlflow": Service("mlflow", other.pid, started - 100.0, "http://127.0.0.1:1", "log")})
        assert stack.down() == []
        assert other.poll() is None  # still running
        stack.save({"mlflow": Service("mlflow", other.pid, started, "http://127.0.0.1:1", "log")})
        assert stack.down() == ["mlflow"]
        assert other.wait(timeout=30) is not None
    finally:
        other.kill()


@pytest.mark.slow
@pytest.mark.integration
def test_the_data_task_retries_an_unreachable_hub_but_not_bad_input(stack, shared_data: Path, tmp_path: Path) -> None:
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pipeline.config import load_config
    from tasks.stages import prepare_data

    hub = load_config("multi30k-cpu-hub")  # no internet here (nor in CI): the hub is unreachable
    broken = load_config("multi30k-cpu", data_root=tmp_path)  # no corpora there: bad input, not the network
    quick = prepare_data.with_options(retries=2, retry_delay_seconds=0)

    @flow
    def attempt(data) -> str:
        return str(quick(data=data, work_dir=tmp_path / "work", return_state=True).state_details.task_run_id)

    with temporary_settings({PREFECT_API_URL: stack["prefect"].api}):
        for cfg, runs in ((hub, 3), (broken, 1)):
            task_run = _api(stack["prefect"].api, f"/task_runs/{attempt(cfg.data)}")
            assert task_run["state"]["type"] == "FAILED"
            assert task_run["run_count"] == runs, (cfg.name, task_run["run_count"])
