"""Orchestration end to end: a real Prefect server, work pool, worker and MLflow server started by the local-stack
command, the deployments from prefect.yaml, and flow runs started the way users start them
(``prefect deployment run ... --watch``). Also the cache keys and the stack's process bookkeeping, without servers.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import get_args

import psutil
import pytest

from tests.conftest import QUICK, copy_lines, short_multi30k
from tests.conftest import REPO_ROOT as REPO
from tests.conftest import api as _api

STAGES = ["prepare-data", "train-tokenizer", "write-shards", "train", "average-checkpoints", "evaluate",
          "export-ctranslate2"]


@pytest.mark.slow
@pytest.mark.integration
def test_stack_up_is_idempotent_and_binds_localhost(stack) -> None:
    from ops.localstack import Stack

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
def test_deploy_applies_prefect_yaml_to_a_server_and_leaves_the_project_dir_to_the_runs(stack) -> None:
    """`ops.localstack deploy`, as a team runs it against its own server: every deployment and a promotion lock per
    deployed model, and a pull step that each flow run's environment completes (an image's AIAYN_PROJECT_DIR), not
    the path of the checkout it was deployed from."""
    from ops.localstack import deployed_models
    from pipeline.promotion import lock_name

    env = {**stack["env"], "PREFECT_API_URL": stack["prefect"].api, "AIAYN_PROJECT_DIR": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "ops.localstack", "deploy"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(lock_name(m) in res.stdout for m in deployed_models())
    deployment = _api(stack["prefect"].api, "/deployments/name/train-en-de/multi30k-cpu")
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $AIAYN_PROJECT_DIR }}"}}]
    limits = _api(stack["prefect"].api, "/v2/concurrency_limits/filter", {})
    assert {lock_name(m) for m in deployed_models()} <= {c["name"] for c in limits}


@pytest.mark.slow
@pytest.mark.integration
def test_up_after_the_worker_died_marks_its_runs_crashed(stack) -> None:
    """A stack whose worker died with its flow runs (machine restart): the server still shows them Running. The next
    ``up`` marks Crashed the ones whose process is gone, keeps a run whose process lives, and starts a new worker."""
    from ops.localstack import Stack

    api = stack["prefect"].api
    deployment = _api(api, "/deployments/name/train-en-de/multi30k-cpu")["id"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    runs = {}
    for name, pid in (("orphan", gone.pid), ("alive", psutil.Process().pid)):  # this test's process lives on
        run = _api(api, f"/deployments/{deployment}/create_flow_run",
                   {"name": f"{name}-check", "tags": ["orphan-check"], "state": {"type": "RUNNING", "name": "Running"}})
        req = urllib.request.Request(f"{api}/flow_runs/{run['id']}", data=json.dumps({"infrastructure_pid": str(pid)})
                                     .encode(), headers={"Content-Type": "application/json"}, method="PATCH")
        urllib.request.urlopen(req, timeout=30).close()
        runs[name] = run["id"]
    try:
        stack["services"]["prefect-worker"].stop()
        up = subprocess.run([*stack["cmd"][:3], "up", *stack["cmd"][3:]], env=stack["env"], capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stderr
        stack["services"].update(Stack(stack["home"]).load())  # the new worker, for the tests after this one
        assert "flow run orphan-check: its process is gone; marked Crashed" in up.stdout
        assert "alive-check" not in up.stdout
        orphan = _api(api, f"/flow_runs/{runs['orphan']}")["state"]
        assert orphan["type"] == "CRASHED" and f"pid {gone.pid}" in orphan["message"]
        assert _api(api, f"/flow_runs/{runs['alive']}")["state"]["type"] == "RUNNING"
    finally:  # nothing of this test stays Running on the shared stack
        for run_id in runs.values():
            _api(api, f"/flow_runs/{run_id}/set_state", {"force": True, "state": {"type": "CANCELLED",
                                                                                   "name": "Cancelled"}})


@pytest.mark.slow
@pytest.mark.integration
def test_deployment_runs_every_stage_then_reuses_them(stack, shared_data: Path, tmp_path: Path) -> None:
    """First run: every stage runs and logs; same parameters again: every stage is Cached; a changed training
    setting re-runs training (resuming its run folder) and what follows, never data or tokenization."""
    prefect = stack["prefect"]
    # A short corpus no other test uses: data stages of its own, so that the first run prepares its data whichever
    # tests used this stack before (in any order under pytest-xdist), and in seconds.
    root = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    params = {"overrides": QUICK, "max_steps": 10, "data_root": str(root)}
    status, out, first = prefect.run_deployment("train-en-de/multi30k-cpu", params)
    assert status == 0, out[-4000:]
    assert prefect.flow_run(first)["state"]["type"] == "COMPLETED"
    states = prefect.task_states(first)
    assert all(states[s] == "Completed" for s in STAGES), str(states)
    # the graph is the pipeline: its stages and nothing else (tracking is done in plain calls of the flow)
    assert set(states) == {*STAGES, "register-model", "report"}, sorted(states)
    logs = prefect.logs(first)
    assert "launching: " in logs and "torch.distributed.run" in logs
    assert "training stopped (max_steps) at step 10" in logs  # torchrun's own output, streamed into the run logs
    keys = {a["key"]: a for a in prefect.artifacts(first)}
    report = keys["multi30k-cpu-hub-report"]["data"]
    for needle in ("## Data", "| test.test2016 (test2016) | sacrebleu |", "tok_bleu_compound_split", "## Registry",
                   "## Serving export", "| CTranslate2 sacreBLEU |", stack["mlflow"] + "/#/experiments/"):
        assert needle in report, needle
    for stage in ("data", "tokenize", "training", "evaluation"):  # one progress artifact per long stage
        assert keys[f"{stage}-progress"]["type"] == "progress" and keys[f"{stage}-progress"]["data"] == 100.0, stage
    scores = keys["multi30k-cpu-hub-scores"]
    assert scores["type"] == "table" and '"metric": "sacrebleu"' in scores["data"] and "nrefs:1" in scores["data"]
    # link artifacts (Prefect stores them as markdown links)
    assert f"]({stack['mlflow']}/#/experiments/" in keys["multi30k-cpu-hub-mlflow-run"]["data"]
    assert "/#/models/transformer-en-de/versions/" in keys["multi30k-cpu-hub-model-version"]["data"]
    # The MLflow side of the same run: a parent tagged with the flow run, a child per stage, and the trainer's
    # step metrics streamed from the torchrun process into the train child.
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(stack["mlflow"])
    exp = mlflow.get_experiment_by_name("aiayn")
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{first}'")
    assert parent.info.status == "FINISHED" and parent.data.tags["prefect.flow"] == "train-en-de"
    children = {r.data.tags["stage"]: r for r in mlflow.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert sorted(children) == ["average", "data", "evaluate", "export", "register", "tokenize", "train"]
    gate = children["export"].data
    assert gate.params["export.quantization"] == "int8" and {"export.torch_bleu", "export.drop"} <= set(gate.metrics)
    # The registered version serves with CTranslate2 when the gate passed, else with PyTorch, and says which.
    (version,) = mlflow.search_model_versions(f"run_id = '{children['register'].info.run_id}'")
    assert version.tags["serving.engine"] == ("ctranslate2" if gate.params["export.passed"] == "True" else "torch")
    assert version.tags["export.gate"] == ("passed" if gate.params["export.passed"] == "True" else "refused")
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
    choose = {**params, "overrides": {**QUICK, "average.choose_from": [1, 2]}, "max_steps": 14}
    status, out, third = prefect.run_deployment("train-en-de/multi30k-cpu", choose)
    assert status == 0, out[-4000:]
    states = prefect.task_states(third)
    assert [states[s] for s in STAGES] == ["Cached"] * 3 + ["Completed"] * 4, states
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
    for name in ("val.en", "val.de", "test2016.en", "test2016.de", "train.en"):
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
    # one run at a time: a Monday that finds last week's run still going cancels the new one
    assert dep["global_concurrency_limit"]["limit"] == 1
    assert dep["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
    big = _api(prefect.api, "/deployments/name/train-en-de/wmt14-big")
    assert big["global_concurrency_limit"]["limit"] == 1
    assert big["concurrency_options"]["collision_strategy"] == "ENQUEUE"
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

    from pipeline.average import average_run
    from pipeline.config import load_config
    from tasks.caching import stage_cache_key

    def fn(x):
        return x

    def ctx(name):
        return SimpleNamespace(task=SimpleNamespace(name=name, fn=fn))

    folder = tmp_path / "stage"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"a": 1}')
    key = stage_cache_key(average_run, ignore=("run_id",))
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
    from pipeline.train.launch import Rendezvous, rendezvous_for, torchrun_command

    one = torchrun_command(load_config("multi30k-cpu").launch, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o")
    rdzv_id = one[one.index("--rdzv-id") + 1]
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "1", "--nnodes", "1", "--rdzv-backend",
                       "aiayn", "--max-restarts", "0", "--rdzv-id", rdzv_id, "--rdzv-conf",
                       "interface=lo,join_timeout=600", "-m", "pipeline.train", "--config", str(tmp_path / "c.yaml"),
                       "--shards", str(tmp_path / "s"), "--out", str(tmp_path / "o")]
    assert len(rdzv_id) == 32  # a private rendezvous per run, as --standalone makes
    multi = load_config("multi30k-cpu", {"launch.nnodes": 2, "launch.nproc_per_node": 8, "launch.max_restarts": 3,
                                         "launch.rdzv_endpoint": "node0:29500", "launch.interface": "eth0"}).launch
    node1 = Rendezvous("node0:29500", "run-1")
    cmd = " ".join(torchrun_command(multi, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o", node_rank=1,
                                    rendezvous=node1))
    assert ("--nproc-per-node 8 --nnodes 2 --rdzv-backend aiayn --max-restarts 3 --node-rank 1 --rdzv-endpoint "
            "node0:29500 --rdzv-id run-1 --rdzv-conf interface=eth0,join_timeout=600,is_host=false") in cmd
    assert "is_host=true" in " ".join(torchrun_command(multi, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o",
                                                       node_rank=0, rendezvous=node1))
    with pytest.raises(ValueError, match="needs its rendezvous"):
        torchrun_command(multi, tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o")
    # Every node on this machine: the launcher picks a free port on loopback; each attempt names its own.
    local = load_config("multi30k-cpu", {"launch.nnodes": 2}).launch
    first, retry = rendezvous_for(local, "flow-1"), rendezvous_for(local, "flow-2")
    assert first.endpoint.startswith("127.0.0.1:") and (first.run_id, retry.run_id) == ("flow-1", "flow-2")


@pytest.mark.integration
def test_down_never_signals_a_process_it_did_not_start(tmp_path: Path) -> None:
    """A recorded PID now used by another process (other start time) is left alone."""
    from ops.localstack import Service, Stack

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
    from tasks.stages import data_stage

    hub = load_config("multi30k-cpu-hub")  # no internet here (nor in CI): the hub is unreachable
    broken = load_config("multi30k-cpu", data_root=tmp_path)  # no corpora there: bad input, not the network
    quick = data_stage.with_options(retries=2, retry_delay_seconds=0)

    @flow
    def attempt(data) -> str:
        return str(quick(data=data, work_dir=tmp_path / "work", return_state=True).state_details.task_run_id)

    with temporary_settings({PREFECT_API_URL: stack["prefect"].api}):
        for cfg, runs in ((hub, 3), (broken, 1)):
            task_run = _api(stack["prefect"].api, f"/task_runs/{attempt(cfg.data)}")
            assert task_run["state"]["type"] == "FAILED"
            assert task_run["run_count"] == runs, (cfg.name, task_run["run_count"])


@pytest.mark.slow
@pytest.mark.integration
def test_weekly_retraining_decides_on_new_data_with_evidence_and_never_on_old(stack, shared_data: Path,
                                                                              tmp_path: Path) -> None:
    """The weekly deployment on data that grows: v1 becomes champion; a new training file retrains everything
    and v2 faces v1 with a paired test (evidence in tags and the report); a deliberately weak setting is
    refused with its p-value; unchanged data retrains nothing and decides nothing."""
    from mlflow.tracking import MlflowClient

    from ops.localstack import free_port

    root = short_multi30k(shared_data, tmp_path / "data", train=3000, val=300, test2016=200, newstest2014=100)
    model = f"transformer-en-de-weekly-{free_port()}"
    base = {**QUICK, "tracking.registered_model": model, "tracking.experiment": "weekly-test",
            "decode.max_len_a": 1.0, "decode.max_len_b": 5, "train.checkpoint_every_steps": 20}
    prefect, mlflow = stack["prefect"], MlflowClient(stack["mlflow"])

    def run(**overrides) -> tuple[dict, dict]:
        """One weekly run; (its MLflow parent run's tags, the promotion table artifact's rows or {})."""
        params = {"data_root": str(root), "overrides": {**base, **overrides}, "max_steps": 60}
        status, out, run_id = prefect.run_deployment("train-en-de/retrain-weekly", params)
        assert status == 0, prefect.logs(run_id)[-4000:]
        exp = mlflow.get_experiment_by_name("weekly-test")
        (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
        arts = {a["key"]: a for a in prefect.artifacts(run_id)}
        table = arts.get("multi30k-cpu-weekly-promotion")
        rows = {r["evidence"]: r["value"] for r in json.loads(table["data"])} if table else {}
        return parent.data.tags, rows | {"report": arts["multi30k-cpu-weekly-report"]["data"]}

    first, _ = run()
    assert first["promotion.decision"] == "promoted" and "first model" in first["promotion.reason"]

    for lang in ("en", "de"):  # a new week's data
        copy_lines(shared_data / "multi30k" / f"train.{lang}", root / "multi30k" / f"train-extra.{lang}", 6000, 3000)
    second, rows = run()
    assert second["promotion.decision"] in ("promoted", "not promoted")
    assert second["promotion.champion_version"] == "1" and second["promotion.set"] == "multi30k-val"
    p, delta = float(second["promotion.p_value"]), float(second["promotion.delta"])
    ok_guards = "FAILED" not in second.get("promotion.guards", "")
    assert (second["promotion.decision"] == "promoted") == (delta > 0 and p < 0.05 and ok_guards), second
    assert rows["p-value (paired bootstrap)"] == f"{p:.4f}" and "95% CI of delta" in rows
    assert "## Registry" in rows["report"] and "p-value (paired bootstrap)" in rows["report"]
    champion = "2" if second["promotion.decision"] == "promoted" else "1"

    # A deliberately weaker setting on the same data: weights that barely leave their initialisation (at this size
    # a merely lower rate, 0.02, was a coin toss on dev against the 60-step champion).
    weak, _ = run(**{"train.lr_scale": 1e-4})
    assert weak["promotion.decision"] == "not promoted" and weak["promotion.champion_version"] == champion
    assert float(weak["promotion.delta"]) < 0 and "paired bootstrap p = " in weak["promotion.reason"]

    again, _ = run()  # nothing new since the second run: every stage reused, nothing registered or decided
    assert again["promotion.decision"] == "no decision" and "no new data" in again["promotion.reason"]
    versions = mlflow.search_model_versions(f"name = '{model}'")
    assert sorted(int(v.version) for v in versions) == [1, 2, 3]
    assert mlflow.get_model_version_by_alias(model, "champion").version == champion


@pytest.mark.slow
@pytest.mark.integration
def test_two_promotions_at_once_end_with_the_best_champion(stack, shared_data: Path, tiny_stack,
                                                         tmp_path: Path) -> None:
    """Two challengers (better, much better) promoted by two processes at the same moment: the model's Prefect
    concurrency limit makes read-compare-move one step, so the much better one ends as champion and each
    decision's recorded champion is the one it really faced."""
    from mlflow.tracking import MlflowClient

    from ops.localstack import free_port
    from pipeline import tracking
    from pipeline.config import DecodeConfig
    from pipeline.promotion import PromotionSet
    from pipeline.train import train
    from tests.conftest import tiny_config

    ckpt = train(tiny_config(shared_data, "train.max_steps=1"), tiny_stack.shards, tmp_path / "run")
    ckpt = ckpt / "checkpoints" / "ckpt-00000001.pt"
    tracking.connect(stack["mlflow"], "race-test")
    c = MlflowClient(stack["mlflow"])
    exp = c.get_experiment_by_name("race-test").experiment_id
    name = f"transformer-en-de-race-{free_port()}"
    refs = (shared_data / "multi30k" / "val.de").read_text(encoding="utf-8").splitlines()[:300]

    def register(wrong: float) -> str:
        rng = __import__("random").Random(int(wrong * 100))
        hyps = [" ".join(w if rng.random() > wrong else "falsch" for w in line.split()) for line in refs]
        return tracking.register_model(c.create_run(exp).info.run_id, ckpt, tiny_stack.tokenizer, DecodeConfig(), name,
                                       {}, PromotionSet("multi30k-val", "dev", "sacrebleu", hyps, refs))

    first, better, best = register(0.6), register(0.4), register(0.1)
    from pipeline.promotion import Policy

    policy = Policy("multi30k-val", "dev", "sacrebleu", 0.0, 0.05, 1000, "chrf", 1.0, ())
    assert tracking.promote(name, first, policy).promoted
    go = tmp_path / "go"
    script = ("import json, sys, time, pathlib\n"
              "from pipeline import tracking\nfrom pipeline.promotion import Policy\n"
              "from tasks.tracking import promote_locked\n"
              f"tracking.connect({stack['mlflow']!r}, 'race-test')\n"
              f"pathlib.Path({str(tmp_path)!r}, 'ready-' + sys.argv[1]).touch()\n"
              f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
              f"d = promote_locked({name!r}, sys.argv[1], Policy(**json.loads(sys.argv[2])))\n"
              "print(json.dumps({'decision': d.decision, 'champion_version': d.champion_version}))\n")
    env = {**stack["prefect"].env, "MLFLOW_TRACKING_URI": stack["mlflow"]}
    procs = {v: subprocess.Popen([sys.executable, "-c", script, v, json.dumps(policy.__dict__)], cwd=REPO, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for v in (better, best)}
    deadline = time.monotonic() + 180
    while not all((tmp_path / f"ready-{v}").exists() for v in procs):  # both imported and waiting at the barrier
        assert all(p.poll() is None for p in procs.values()) and time.monotonic() < deadline, \
            [p.stderr.read()[-3000:] for p in procs.values() if p.poll() is not None]
        time.sleep(0.1)
    go.touch()
    results = {}
    for v, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        results[v] = json.loads(out.strip().splitlines()[-1])
    assert tracking.champion(name) == best
    if results[better]["decision"] == "promoted":  # better went first: it faced v1, then best faced it
        assert results[better]["champion_version"] == first
        assert results[best] == {"decision": "promoted", "champion_version": better}
    else:  # best went first: better then faced best and lost
        assert results[best] == {"decision": "promoted", "champion_version": first}
        assert results[better] == {"decision": "not promoted", "champion_version": best}
    for v, r in results.items():  # the tags say what happened
        tags = c.get_model_version(name, v).tags
        assert ((tags["promotion.decision"], tags["promotion.champion_version"])
                == (r["decision"], r["champion_version"]))


def test_progress_updates_follow_progress_not_the_clock() -> None:
    """At most one update per percentage point and per minute, and 100 once: a 30-minute run polled every 5 s
    sends ~30 updates instead of 360."""
    from tasks.progress import Throttle

    t = Throttle(min_points=1.0, min_seconds=60.0, now=0.0)
    assert not t.due(0.5, now=120.0)  # not a point yet
    assert not t.due(5.0, now=30.0)  # a point, but not a minute
    assert t.due(5.0, now=61.0) and not t.due(5.5, now=200.0) and not t.due(6.0, now=100.0)
    assert t.due(100.0, now=101.0) and not t.due(100.0, now=500.0)  # the end at once, and once
    run = Throttle(now=0.0)
    sent = [s for s in range(0, 1801, 5) if run.due(100.0 * s / 1800, now=float(s))]
    assert 25 <= len(sent) <= 31 and sent[-1] == 1800


def test_the_browser_reads_what_a_reader_sees() -> None:
    """The page text the browser checks assert on: visible text only (no script or style), image sources."""
    from ops.browser import read_dom

    dom = read_dom('<html><head><style>p {color: red}</style><script>var x = "hidden";</script></head><body>'
                   '<p>Run <b>Completed</b></p><noscript>enable JS</noscript><img src="blob:http://h/1">'
                   '<img alt="no source"><p>test2016  sacrebleu</p></body></html>')
    assert dom.text == "Run Completed test2016  sacrebleu" and dom.images == ["blob:http://h/1"]


def test_result_storage_is_a_folder_or_a_storage_block(tmp_path: Path) -> None:
    from ops.localstack import result_storage_env

    assert result_storage_env(None) == {}
    assert result_storage_env(str(tmp_path / "results")) == {"PREFECT_LOCAL_STORAGE_PATH": str(tmp_path / "results")}
    assert result_storage_env("runs/results") == {"PREFECT_LOCAL_STORAGE_PATH": str(Path("runs/results").resolve())}
    assert result_storage_env("block:s3-bucket/aiayn-results") == {
        "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": "s3-bucket/aiayn-results"}


def test_flow_parameters_are_typed_against_the_config_schema() -> None:
    """The flows' parameter schema (what Prefect renders as the run form and enforces when a deployment run is
    created): shipped config names as choices, every config field under its dotted name with its type and
    bounds, and nothing else."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    from flows.parsing import parse_wsj
    from flows.translation import train_en_de
    from pipeline.config import CONFIG_DIR, ConfigName, FlowOverrides, flow_overrides

    assert sorted(get_args(ConfigName)) == sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    schema = parameter_schema(train_en_de).model_dump_for_openapi()
    assert schema["properties"]["config"]["anyOf"][0]["enum"] == list(get_args(ConfigName))
    assert schema["properties"]["precision"]["anyOf"][0]["enum"] == ["auto", "fp32", "bf16"]
    good = {"overrides": {"train.warmup_steps": 8000, "average.choose_from": [1, 2], "launch.nproc_per_node": "auto"}}
    validate(good, schema, raise_on_error=True, ignore_required=True)
    for bad, says in (({"train.warmup_step": 8000}, "'train.warmup_step' was unexpected"),
                      ({"train.warmup_steps": -3}, "-3 is less than the minimum of 1"),
                      ({"model.norm": "middle"}, "'middle' is not one of ['post', 'pre']"),
                      ({"train": {"warmup_steps": 8000}}, "'train' was unexpected")):
        with pytest.raises(Exception, match=re.escape(says)):
            validate({"overrides": bad}, schema, raise_on_error=True, ignore_required=True)
    assert "overrides" in parameter_schema(parse_wsj).model_dump_for_openapi()["properties"]
    # What the flow then resolves: the fields the caller set, by their dotted names.
    parsed = train_en_de.validate_parameters(good)["overrides"]
    assert isinstance(parsed, FlowOverrides) and flow_overrides(parsed) == good["overrides"]
    assert flow_overrides({"train.max_steps": 5}) == {"train.max_steps": 5} and flow_overrides(None) == {}


def test_the_pair_flows_refuse_another_pair_and_train_translation_takes_any(monkeypatch: pytest.MonkeyPatch) -> None:
    """train-en-de and train-en-fr keep their language pair; train-translation takes a translation config of any
    pair (and still refuses a parsing config). Only the config is resolved: no run, no data read."""
    from flows.common import flow_config
    from flows.translation import EXPECT

    monkeypatch.delenv("AIAYN_DATA_ROOT", raising=False)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)
    with pytest.raises(ValueError, match=re.escape("config 'multi30k-en-fr-cpu' has {'tgt_lang': 'fr'}, but flow "
                                                   "train-en-de needs")) as refused:
        flow_config("multi30k-en-fr-cpu", {}, None, "train-en-de", EXPECT["train-en-de"])
    assert "train-translation runs a translation config of any language pair" in str(refused.value)
    with pytest.raises(ValueError, match=re.escape("has {'tgt_lang': 'de'}, but flow train-en-fr needs")):
        flow_config("multi30k-cpu", {}, None, "train-en-fr", EXPECT["train-en-fr"])
    assert flow_config("multi30k-en-fr-cpu", {}, None, "train-en-fr", EXPECT["train-en-fr"]).data.tgt_lang == "fr"
    for name, tgt in (("multi30k-en-fr-cpu", "fr"), ("multi30k-cpu", "de"), ("wmt14-en-de-base", "de")):
        assert flow_config(name, {}, None, "train-translation", EXPECT["train-translation"]).data.tgt_lang == tgt
    # a pair no shipped config has, through overrides (a config file written for it works the same way)
    de_en = flow_config("multi30k-cpu", {"data.src_lang": "de", "data.tgt_lang": "en"}, None, "train-translation",
                        EXPECT["train-translation"])
    assert (de_en.data.src_lang, de_en.data.tgt_lang, de_en.registered_model_name) == ("de", "en", "transformer-de-en")
    with pytest.raises(ValueError, match=re.escape("has {'task': 'parsing'}, but flow train-translation needs")):
        flow_config("ptb-sample-cpu", {}, None, "train-translation", EXPECT["train-translation"])


def test_every_translation_deployment_names_a_config_its_flow_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """prefect.yaml against flows/translation.py: each translation deployment's entrypoint is a flow of that module
    whose pair its config has; train-translation's deployment leaves the config to the run (a required parameter);
    the local stack creates a promotion lock for each deployed model, En-Fr's included."""
    import importlib

    import yaml
    from prefect.utilities.callables import parameter_schema

    from flows.common import flow_config
    from flows.translation import EXPECT, train_translation
    from ops.localstack import deployed_models

    monkeypatch.delenv("AIAYN_DATA_ROOT", raising=False)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    found = {}
    for d in spec["deployments"]:
        module, _, function = d["entrypoint"].partition(":")
        if module != "flows/translation.py":
            continue
        fl = getattr(importlib.import_module("flows.translation"), function)
        found[f"{fl.name}/{d['name']}"] = d.get("parameters", {}).get("config")
        if "config" in d.get("parameters", {}):
            flow_config(d["parameters"]["config"], {}, None, fl.name, EXPECT[fl.name])  # refuses a wrong pair
    assert found["train-en-fr/multi30k-cpu"] == "multi30k-en-fr-cpu"
    assert found["train-en-de/multi30k-cpu"] == "multi30k-cpu-hub"
    assert found["train-translation/any-pair"] is None
    assert "config" in parameter_schema(train_translation).model_dump_for_openapi()["required"]
    assert {"transformer-en-de", "transformer-en-fr"} <= set(deployed_models())


@pytest.mark.slow
@pytest.mark.integration
def test_a_bad_override_is_refused_when_the_run_is_created(stack) -> None:
    prefect = stack["prefect"]
    before = _api(prefect.api, "/flow_runs/count", {})
    res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run",
                          "train-en-de/multi30k-cpu", "--params", json.dumps({"overrides": {"train.warmup_step": 10}})],
                         cwd=REPO, env=prefect.env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "train.warmup_step" in res.stdout + res.stderr, res.stdout + res.stderr
    assert _api(prefect.api, "/flow_runs/count", {}) == before  # no run was created


@pytest.mark.slow
@pytest.mark.integration
def test_the_run_pages_show_report_scores_form_and_heat_maps_in_a_browser(stack, chromium) -> None:
    """What a user opens after a run, rendered by headless Chromium through ``python -m ops.screenshots``: the
    Prefect run page, its report and score table, the run form; the MLflow parent run, an attention heat-map, the
    logged model's metrics per dataset and the registered version. Screenshots land under the work dir's
    ``screenshots/<flow run name>/``. Found two bugs: the Prefect UI of a stack on another port called port 4200,
    and the logged model was filed under MLflow's Default experiment."""
    prefect, work = stack["prefect"], stack["home"] / "work"
    # a seed of its own: a new checkpoint, so this run registers a version (a known one is not registered again)
    status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu",
                                                 {"overrides": {**QUICK, "train.seed": 7}, "max_steps": 10})
    assert status == 0, out[-4000:]
    env = {**prefect.env, "MLFLOW_TRACKING_URI": stack["mlflow"], "AIAYN_WORK_DIR": str(work)}
    res = subprocess.run([sys.executable, "-m", "ops.screenshots", run_id], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    name = prefect.flow_run(run_id)["name"]
    folder = work / "screenshots" / name
    pages = json.loads((folder / "pages.json").read_text(encoding="utf-8"))
    assert sorted(pages) == ["mlflow-attention", "mlflow-model", "mlflow-model-version", "mlflow-run",
                             "mlflow-runs-view", "prefect-flow-run", "prefect-report", "prefect-run-form",
                             "prefect-scores"]
    for key, page in pages.items():
        png = Path(page["png"])
        assert png.parent == folder and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", key
        assert png.stat().st_size > 20_000, key  # drawn, not a blank page
        assert "Can't connect" not in page["text"] and "Something went wrong" not in page["text"], (key, page["text"])
    text = {k: p["text"] for k, p in pages.items()}
    assert name in text["prefect-flow-run"] and "Completed" in text["prefect-flow-run"]
    for needle in ("pipeline report", "Stages", "Training", "Serving export", "test2016"):
        assert needle in text["prefect-report"], needle
    assert "sacrebleu" in text["prefect-scores"] and "nrefs:1|case:mixed" in text["prefect-scores"]
    for needle in ("config", "overrides", "precision", "multi30k-cpu-hub"):
        assert needle in text["prefect-run-form"], needle
    assert name in text["mlflow-run"]
    # MLflow in its model-training view, as the links ask (workflowType): its side bar, not the GenAI one
    for key in ("mlflow-runs-view", "mlflow-run", "mlflow-model-version"):
        assert "Model registry" in text[key] and "Judges" not in text[key], (key, text[key][:600])
    # the heat-map: listed, and shown as an image the page loaded from the artifact store
    assert "attention/dev1_encoder_decoder_layer1.png" in text["mlflow-attention"]
    assert any(src.startswith("blob:") for src in pages["mlflow-attention"]["images"])
    # the logged model lists each score with the dataset it was measured on
    assert "test2016.sacrebleu" in text["mlflow-model"] and "corpus/test.test2016" in text["mlflow-model"]
    assert "transformer-en-de" in text["mlflow-model-version"] and "serving.engine" in text["mlflow-model-version"]


@pytest.mark.slow
@pytest.mark.integration
def test_two_runs_compare_in_the_mlflow_runs_view_and_compare_page_in_a_browser(stack, chromium, shared_data: Path,
                                                                                 tmp_path: Path) -> None:
    """Two pipeline runs in an experiment of their own, as a user compares them: the runs view their link artifact
    opens lists the two parent runs alone (no stage runs) with the score columns, and MLflow's compare page of the
    two shows both runs' test2016 scores and updates side by side."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from urllib.parse import quote

    from ops.browser import render
    from ops.localstack import free_port
    from pipeline import tracking

    experiment = f"compare-{free_port()}"
    root = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    prefect, client = stack["prefect"], MlflowClient(stack["mlflow"])
    parents = []
    for seed, steps in ((21, 10), (22, 12)):
        params = {"data_root": str(root), "max_steps": steps, "register_model": False,
                  "overrides": {**QUICK, "tracking.experiment": experiment, "train.seed": seed}}
        status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu", params)
        assert status == 0, out[-4000:]
        exp = client.get_experiment_by_name(experiment)
        (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
        parents.append(parent)
        links = {a["key"]: a for a in prefect.artifacts(run_id)}
        assert "viewStateShareKey=aiayn-pipeline-runs" in links["multi30k-cpu-hub-mlflow-runs"]["data"]
    mlflow.set_tracking_uri(stack["mlflow"])
    view = render(tracking.runs_view_url(experiment), window=(1900, 1100)).text
    for needle in ("multi30k-val.sacrebleu", "test2016.sacrebleu", "test2016.chrf", "train.steps",
                   "2 matching runs", *(p.info.run_name for p in parents)):
        assert needle in view, (needle, view[:3000])
    runs, experiments = quote(json.dumps([p.info.run_id for p in parents])), quote(json.dumps([exp.experiment_id]))
    compare = render(f"{stack['mlflow']}/#/compare-runs?runs={runs}&experiments={experiments}").text
    metrics = compare[compare.index("Metrics"):]
    assert "test2016.sacrebleu" in metrics and all(p.info.run_name in compare for p in parents)
    for parent in parents:  # each run's own figures, as the page prints numbers
        for name in ("test2016.sacrebleu", "train.steps"):
            assert f" {parent.data.metrics[name]:g} " in metrics, (name, metrics[:2000])


def test_the_stack_s_api_calls_wait_out_a_busy_server_and_give_up_on_real_errors() -> None:
    import http.server
    import threading
    import urllib.error

    from ops.localstack import prefect_api

    answers = [503, 429, 200, 404]  # busy, busy, then the answer; then a real error, never retried

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            code = answers.pop(0)
            if code == -1:  # a stalled server: no answer within the client's timeout
                time.sleep(1.0)
                return
            self.send_response(code)
            self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(json.dumps({"ok": code}).encode())

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert prefect_api(base, "/x", {}) == {"ok": 200}
        with pytest.raises(urllib.error.HTTPError, match="404"):
            prefect_api(base, "/x", {})
        assert answers == []
        # an answer that does not come in time is asked again; one that never comes is an error at the last try
        answers.extend([-1, 200, -1, -1])
        assert prefect_api(base, "/x", {}, timeout=0.5) == {"ok": 200}
        with pytest.raises(TimeoutError):
            prefect_api(base, "/x", {}, attempts=2, timeout=0.5)
        assert answers == []
    finally:
        server.shutdown()
