"""The database password stays where it is needed: a stack on PostgreSQL whose role's password holds every ASCII
punctuation character, a space and a letter beyond ASCII (percent-encoded in the URL, as ``up`` requires) runs the
default deployment, and the password, as it is or encoded, is in no process's command line, in no environment but
the two servers', in nothing printed, in no log, state message or MLflow parameter, and in no file under the
stack's home (the databases' own files are the PostgreSQL server's, elsewhere)."""

from __future__ import annotations

import os
import string
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import psutil
import pytest

from tests.conftest import QUICK, Prefect, short_multi30k

PASSWORD = "A" + string.punctuation + " \u00e9z"
ENDED = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
FORMS = (PASSWORD, urllib.parse.quote(PASSWORD, safe=""))  # as it is, and as URLs carry it


def _holds(text: str) -> bool:
    return any(form in text for form in FORMS)


@pytest.mark.parametrize("form", FORMS, ids=["as-is", "encoded"])
@pytest.mark.parametrize("url, shown, link", [
    ("http://team:{pw}@mlflow.team:5000", "http://***@mlflow.team:5000", "http://mlflow.team:5000"),
    ("postgresql://team:{pw}@db.team:5432/mlflow?sslmode=require", "postgresql://***@db.team:5432/mlflow?...",
     "postgresql://db.team:5432/mlflow"),
    ("https://mlflow.team/api?token={pw}", "https://mlflow.team/api?...", "https://mlflow.team/api"),
])
def test_a_url_is_shown_without_its_credentials_whatever_they_hold(url: str, shown: str, link: str,
                                                                   form: str) -> None:
    """Every punctuation character in a password or token, percent-encoded or not (``/``, ``?``, ``#`` and ``@``
    split a parsed URL in the wrong place): the message form marks what it hides, the link form leaves it out, and
    no run of the secret's characters is left in either."""
    from pipeline.support.urls import shown_url

    url = url.format(pw=form)
    got = (shown_url(url), shown_url(url, link=True))
    assert not any(form[i:i + 3] in g for g in got for i in range(len(form) - 2)), got
    if form == FORMS[1]:  # unambiguous: the server is named (as it is, a "?" in the secret could start a query)
        assert got == (shown, link)


@pytest.mark.parametrize("url", ["http://127.0.0.1:5000", "sqlite:///srv/mlflow.db", "file:///srv/mlruns"])
def test_a_url_without_credentials_is_shown_as_it_is(url: str) -> None:
    from pipeline.support.urls import shown_url

    assert shown_url(url) == shown_url(url, link=True) == url


def test_the_tracking_server_s_messages_show_no_credentials() -> None:
    """An unreachable tracking server whose URL carries a user and password: the fail-fast error and the lines
    of the wait name the server without them."""
    import mlflow

    from ops.localstack import free_port
    from pipeline import tracking

    uri, said = f"http://team:{FORMS[1]}@127.0.0.1:{free_port()}", []
    with pytest.raises(tracking.TrackingError) as refused:
        tracking.check_reachable(uri, timeout_s=2)
    before = mlflow.get_tracking_uri()
    try:
        mlflow.set_tracking_uri(uri)
        with pytest.raises(tracking.TrackingError) as waited:
            tracking.wait_until_reachable(said.append, patience_s=0.5, every_s=0.2)
    finally:
        mlflow.set_tracking_uri(before)
    for text in (str(refused.value), str(waited.value), *said):
        assert not _holds(text) and "http://***@127.0.0.1:" in text, text


def _role_with_the_password(postgres: str) -> str:
    """A role of the ``postgres`` fixture's server (which has none of the stack's databases) with PASSWORD and
    CREATEDB; its URL, percent-encoded."""
    import psycopg2

    from ops.database import PostgreSQL

    db = PostgreSQL.parse(postgres)
    conn = psycopg2.connect(dbname="postgres", user=db.user, password=db.password, host=db.host, port=db.port)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("DROP ROLE IF EXISTS special")
            cur.execute("CREATE ROLE special LOGIN CREATEDB PASSWORD %s", (PASSWORD,))
    finally:
        conn.close()
    return f"postgresql://special:{FORMS[1]}@{db.host}:{db.port}"


def _leaks(proc: psutil.Process, servers: set[int]) -> list[str]:
    """Where ``proc`` holds the password: its command line, or its environment unless it is one of the servers'
    processes (each has its own database's URL there, and only there)."""
    try:
        found = [f"command line of {proc.pid} {proc.cmdline()[:3]}"] if _holds("\0".join(proc.cmdline())) else []
        if proc.pid not in servers and _holds("\0".join(f"{k}={v}" for k, v in proc.environ().items())):
            found.append(f"environment of {proc.pid} {proc.cmdline()[:3]}")
        return found
    except psutil.Error:  # ended meanwhile
        return []


@pytest.mark.slow
@pytest.mark.integration
def test_the_database_password_is_nowhere_but_in_the_servers_environment(postgres: str, shared_data: Path,
                                                                          tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from ops.localstack import Stack, free_port

    home = tmp_path / "stack"
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, "PREFECT_WORKER_QUERY_SECONDS": "1",
           "AIAYN_DATABASE_URL": _role_with_the_password(postgres)}
    data = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--prefect-port", str(free_port()),
           "--mlflow-port", str(free_port()), "--data-root", str(data), "--work-dir", str(home / "work")]
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    printed, leaks = [up.stdout, up.stderr], set()
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        services = Stack(home).load()
        assert services["prefect-server"].database.startswith("postgresql://special@")
        trees = {name: [psutil.Process(s.pid), *psutil.Process(s.pid).children(recursive=True)]
                 for name, s in services.items()}
        servers = {p.pid for name in ("prefect-server", "mlflow") for p in trees[name]}
        for proc in (p for tree in trees.values() for p in tree):
            leaks.update(_leaks(proc, servers))

        api_url = services["prefect-server"].url + "/api"
        prefect = Prefect(api_url, {**env, "PREFECT_API_URL": api_url})
        params = {"data_root": str(data), "max_steps": 10,
                  "overrides": {**QUICK, "tracking.registered_model": "transformer-en-de-secrets"}}
        run_id = prefect.start_deployment("train-en-de/multi30k-cpu", params)
        worker = psutil.Process(services["prefect-worker"].pid)
        done = threading.Event()

        def sample() -> None:  # the flow run's processes (the worker's children) while they live
            while not done.wait(0.5):
                for proc in worker.children(recursive=True):
                    leaks.update(_leaks(proc, servers))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = time.monotonic() + 900
        while (state := prefect.flow_run(run_id)["state"])["type"] not in ENDED:
            assert time.monotonic() < deadline, "the flow run did not finish"
            time.sleep(2)
        done.set()
        sampler.join()
        assert state["type"] == "COMPLETED", prefect.logs(run_id)[-4000:]
        assert not leaks, leaks

        from ops.localstack import prefect_api

        task_runs = prefect_api(api_url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        assert task_runs
        messages = [state.get("message") or "", prefect.logs(run_id),
                    *(t["state"].get("message") or "" for t in task_runs)]
        assert not any(_holds(m) for m in messages)
        client = MlflowClient(services["mlflow"].url)
        runs = client.search_runs([client.get_experiment_by_name("aiayn").experiment_id])
        assert len(runs) > 1  # the parent and its stages
        assert not any(_holds(str(v)) for r in runs for v in (*r.data.params.values(), *r.data.tags.values()))
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        printed += [down.stdout, down.stderr]
        assert down.returncode == 0, down.stderr
    assert not any(_holds(text) for text in printed)
    files = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "worker.log" for p in files) and any(p.suffix == ".pt" for p in files)
    holding = [str(p) for p in files if any(form.encode() in p.read_bytes() for form in FORMS)]
    assert not holding, holding
