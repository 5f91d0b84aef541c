"""The stack on PostgreSQL (``python -m ops.localstack up --database-url``), as a team runs Prefect and MLflow: the
URL's checks without a server, and the default deployment with a promotion decision end to end against a real
PostgreSQL server (the ``postgres`` fixture: Debian's package, a throwaway cluster)."""

from __future__ import annotations

import os
import string
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from ops.database import DATABASES, PostgreSQL, StackError
from tests.conftest import QUICK, Prefect, short_multi30k


@pytest.mark.parametrize(("url", "why"), [
    ("mysql://u:secret@db:3306", "not a PostgreSQL URL"),
    ("u:secret@db:5432", "not a PostgreSQL URL"),
    ("postgresql://db:5432", "names no user or host"),
    ("postgresql://u:secret", "names no user or host"),
    ("postgresql://u:secret@db:5432/prefect", "name the server only"),
    ("postgresql://u@db:5432/?password=secret", "name the server only"),
    ("postgresql://u:secret@db:99999", "Port out of range"),
])
def test_a_bad_database_url_is_refused_without_showing_its_password(url: str, why: str) -> None:
    with pytest.raises(StackError, match=why) as e:
        PostgreSQL.parse(url)
    assert "secret" not in str(e.value)


SPECIAL = string.punctuation + " \t\u00e9"  # every ASCII punctuation character, blanks, a letter beyond ASCII
AS_IS = "!$&'()*+,;=-._~"  # what a URL's password holds unencoded (RFC 3986's userinfo, less ':')


@pytest.mark.parametrize("char", SPECIAL)
def test_a_password_with_any_character_is_taken_percent_encoded_and_refused_ambiguous(char: str) -> None:
    """Percent-encoded, every character is the password's; unencoded, one a URL reads as something else is refused
    naming it and its encoding, the URL shown rebuilt without the password."""
    password = f"Se{char}cr{char}et9"
    db = PostgreSQL.parse(f"postgresql://aiayn:{urllib.parse.quote(password, safe='')}@db.internal:5432")
    assert (db.user, db.password, db.host, db.port) == ("aiayn", password, "db.internal", 5432)
    assert password not in db.shown("aiayn_mlflow")
    assert urllib.parse.unquote(urllib.parse.urlsplit(db.url("aiayn_mlflow")).password) == password
    raw = f"postgresql://aiayn:{password}@db.internal:5432"
    if char in AS_IS:
        assert PostgreSQL.parse(raw).password == password
        return
    with pytest.raises(StackError) as e:
        PostgreSQL.parse(raw)
    message = str(e.value)
    assert "postgresql://aiayn:***@db.internal:5432: the password holds " + repr(char) in message
    assert f"is {urllib.parse.quote(char, safe='')};" in message
    assert not any(piece in message for piece in ("Se" + char, char + "cr", "et9")), message


def test_database_urls_quote_the_credentials_and_show_no_password() -> None:
    db = PostgreSQL.parse("postgresql://team%40ml:p%40ss%2Fw%3Ard@db.internal:6543/")
    assert (db.user, db.password, db.host, db.port) == ("team@ml", "p@ss/w:rd", "db.internal", 6543)
    assert db.url("aiayn_prefect", "asyncpg") == "postgresql+asyncpg://team%40ml:p%40ss%2Fw%3Ard@db.internal:6543/aiayn_prefect"
    assert db.shown("aiayn_mlflow") == "postgresql://team@ml@db.internal:6543/aiayn_mlflow"
    assert PostgreSQL.parse("postgres://u@db").port == 5432


def _query(url: str, database: str, sql: str) -> list[tuple]:
    import psycopg2

    db = PostgreSQL.parse(url)
    with psycopg2.connect(dbname=database, user=db.user, password=db.password, host=db.host, port=db.port) as conn:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchall()


@pytest.mark.slow
@pytest.mark.integration
def test_the_default_deployment_and_a_promotion_on_postgresql(postgres: str, shared_data: Path,
                                                               tmp_path: Path) -> None:
    """``up`` with AIAYN_DATABASE_URL creates both databases and starts Prefect and MLflow on them; the default
    deployment runs twice (a first champion, then a weak challenger refused by the paired test); flow runs, MLflow
    runs, versions and the champion alias are rows in PostgreSQL, and no SQLite database exists under the stack's
    home. The password is in no process's command line and in nothing ``up`` prints or records."""
    from mlflow.tracking import MlflowClient

    from ops.localstack import Stack, free_port

    home = tmp_path / "stack"
    env = {"PREFECT_WORKER_QUERY_SECONDS": "1", "AIAYN_DATABASE_URL": postgres}
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, **env}
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--prefect-port", str(free_port()),
           "--mlflow-port", str(free_port()), "--data-root", str(shared_data), "--work-dir", str(home / "work")]
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        password = PostgreSQL.parse(postgres).password
        services = Stack(home).load()
        assert services["prefect-server"].database.endswith("/" + DATABASES["prefect-server"])
        assert services["mlflow"].database.endswith("/" + DATABASES["mlflow"])
        assert "databases:   Prefect postgresql://aiayn@127.0.0.1:" in up.stdout
        assert password not in up.stdout + (home / "stack.json").read_text()
        import psutil

        for service in services.values():
            assert not any(password in arg for arg in psutil.Process(service.pid).cmdline()), service.name

        api_url = services["prefect-server"].url + "/api"
        prefect = Prefect(api_url, {**env, "PREFECT_API_URL": api_url})
        root = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
        base = {**QUICK, "tracking.registered_model": "transformer-en-de-pg", "train.checkpoint_every_steps": 20,
                "decode.max_len_a": 1.0, "decode.max_len_b": 5}

        def run(**overrides) -> dict[str, str]:
            params = {"data_root": str(root), "overrides": {**base, **overrides}, "max_steps": 40}
            status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu", params)
            assert status == 0, prefect.logs(run_id)[-4000:]
            client = MlflowClient(services["mlflow"].url)
            exp = client.get_experiment_by_name("aiayn")
            (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
            return parent.data.tags

        first = run()
        assert first["promotion.decision"] == "promoted" and "first model" in first["promotion.reason"]
        weak = run(**{"train.lr_scale": 1e-4})  # weights that barely leave their initialisation
        assert weak["promotion.decision"] == "not promoted" and weak["promotion.champion_version"] == "1"
        assert "promotion.p_value" in weak

        # the evidence is in PostgreSQL, not in files beside the servers
        flow_runs = _query(postgres, DATABASES["prefect-server"],
                           "select count(*) from flow_run where state_type = 'COMPLETED'")[0][0]
        assert flow_runs >= 2
        assert _query(postgres, DATABASES["mlflow"],
                      "select alias, version from registered_model_aliases "
                      "where name = 'transformer-en-de-pg'") == [("champion", 1)]
        assert _query(postgres, DATABASES["mlflow"], "select count(*) from runs")[0][0] >= 2 * 8  # parents, stages
        assert not [p for p in home.rglob("*.db")], "a SQLite database under the stack's home"
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr


@pytest.mark.integration
def test_up_names_a_database_it_cannot_create(postgres: str, tmp_path: Path) -> None:
    """A role without CREATEDB on a server without the stack's databases: ``up`` stops before starting anything,
    saying which database to create and how, without the password."""
    import psycopg2

    db = PostgreSQL.parse(postgres)
    c = psycopg2.connect(dbname="postgres", user=db.user, password=db.password, host=db.host, port=db.port)
    try:  # the fixture's server has none of the stack's databases
        c.autocommit = True
        with c.cursor() as cur:
            cur.execute("DROP ROLE IF EXISTS reader")
            cur.execute("CREATE ROLE reader LOGIN PASSWORD 'r3ader-pw'")
    finally:
        c.close()
    url = f"postgresql://reader:r3ader-pw@{db.host}:{db.port}"
    from ops.localstack import free_port

    res = subprocess.run([sys.executable, "-m", "ops.localstack", "up", "--home", str(tmp_path / "stack"),
                          "--prefect-port", str(free_port()), "--mlflow-port", str(free_port())],
                         env={**os.environ, "AIAYN_DATABASE_URL": url}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "CREATE DATABASE aiayn_mlflow OWNER reader" in res.stderr and "r3ader-pw" not in res.stderr
    assert not (tmp_path / "stack" / "stack.json").exists()


def test_no_worker_cli_call_or_other_server_inherits_a_database_setting(monkeypatch, tmp_path: Path) -> None:
    """The database settings of the shell that runs ``up`` reach no worker or CLI call of the stack (the
    environment their flow runs inherit); each server gets its own database's URL only, which ``up`` sets."""
    from ops.database import client_environ
    from ops.localstack import prefect_env

    secret = {"AIAYN_DATABASE_URL": "postgresql://u:pw1@db", "MLFLOW_BACKEND_STORE_URI": "postgresql://u:pw2@db/m",
              "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://u:pw3@db/p",
              "PREFECT_SERVER_DATABASE_PASSWORD": "pw4"}
    for name, value in secret.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AIAYN_CPU_THREADS", "3")
    for env in (prefect_env(tmp_path, "http://127.0.0.1:4200/api"), client_environ()):
        assert not set(secret) & set(env) and env["AIAYN_CPU_THREADS"] == "3"
