"""The stack with a login (``AIAYN_STACK_PASSWORD``): Prefect's auth string and MLflow's basic-auth app, both
asking every API call but the health checks for it, and the pipeline running through them: the default deployment
registers and promotes as without a login. The password is in no command line and nothing ``up`` prints or
records."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import QUICK, Prefect, short_multi30k


def _status(url: str, body: dict | None = None, auth: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
@pytest.mark.integration
def test_a_stack_with_a_login_refuses_strangers_and_runs_the_pipeline(shared_data: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from ops.localstack import Stack, free_port

    home, password = tmp_path / "stack", "s3cret-" + os.urandom(4).hex()
    data = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, "PREFECT_WORKER_QUERY_SECONDS": "1",
           "AIAYN_STACK_USER": "team", "AIAYN_STACK_PASSWORD": password}
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--prefect-port", str(free_port()),
           "--mlflow-port", str(free_port()), "--data-root", str(data), "--work-dir", str(tmp_path / "work")]
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "login:       user team on both servers" in up.stdout and password not in up.stdout
        services = Stack(home).load()
        assert password not in (home / "stack.json").read_text()
        for service in services.values():
            assert not any(password in arg for arg in psutil.Process(service.pid).cmdline()), service.name
        prefect_api, mlflow = services["prefect-server"].url + "/api", services["mlflow"].url
        # health checks need no login; everything else does
        assert _status(f"{prefect_api}/health") == 200 and _status(f"{mlflow}/health") == 200
        search = f"{mlflow}/api/2.0/mlflow/experiments/search"
        assert _status(f"{prefect_api}/flows/filter", {}) == 401
        assert _status(f"{prefect_api}/flows/filter", {}, "team:wrong") == 401
        assert _status(f"{prefect_api}/flows/filter", {}, f"team:{password}") == 200
        assert _status(search, {"max_results": 1}) == 401
        assert _status(search, {"max_results": 1}, f"team:{password}") == 200

        prefect = Prefect(prefect_api, {**env, "PREFECT_API_URL": prefect_api,
                                        "PREFECT_API_AUTH_STRING": f"team:{password}"})
        params = {"data_root": str(data), "max_steps": 10,
                  "overrides": {**QUICK, "tracking.registered_model": "transformer-en-de-login"}}
        status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu", params)
        assert status == 0, out[-4000:]
        os.environ.update(MLFLOW_TRACKING_USERNAME="team", MLFLOW_TRACKING_PASSWORD=password)
        try:
            client = MlflowClient(mlflow)
            exp = client.get_experiment_by_name("aiayn")
            (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
        finally:
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                os.environ.pop(key)
        assert parent.data.tags["promotion.decision"] == "promoted"
        assert not any(password in value for value in parent.data.params.values())
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr
