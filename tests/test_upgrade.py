"""The upgrade page's database commands, as written, on an old stack: a stack home whose Prefect and MLflow
databases have older schemas (Prefect 3.0's, MLflow 2.13's) and something in them is upgraded in place, and the
stack's servers then serve what was there. The commands are read from docs/how-to/upgrade.md, so a path the page
gets wrong (one the stack does not use) fails here."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration  # servers and subprocesses

PREFECT_OLD = "7d6350aea855"  # 2024-09, Prefect 3.0
MLFLOW_OLD = "867495a8f9d4"  # 2024-04, MLflow 2.13


def page_commands() -> list[str]:
    """The shell lines of the page's "Prefect and MLflow databases" block, comments dropped."""
    page = (REPO_ROOT / "docs" / "how-to" / "upgrade.md").read_text(encoding="utf-8")
    section = page.split("## Prefect and MLflow databases", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def old_prefect(home: Path) -> str:
    """Prefect's database at PREFECT_OLD, where the stack keeps it, with one flow; the flow's name."""
    (home / "prefect").mkdir(parents=True)
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect")}
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y",
                          "-r", PREFECT_OLD], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    name = f"flow-before-the-upgrade-{uuid.uuid4().hex[:6]}"
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        db.execute("insert into flow (id, name) values (?, ?)", (str(uuid.uuid4()), name))
    return name


def old_mlflow(home: Path) -> str:
    """MLflow's database at MLFLOW_OLD, where the stack keeps it, with one experiment; its name."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    (home / "mlflow").mkdir(parents=True)
    url = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    engine = sqlalchemy.create_engine(url)
    InitialBase.metadata.create_all(engine)  # MLflow's first tables, then its migrations up to MLFLOW_OLD
    engine.dispose()
    command.upgrade(_get_alembic_config(url), MLFLOW_OLD)
    name = "experiment-before-the-upgrade"
    with sqlite3.connect(home / "mlflow" / "mlflow.db") as db:
        db.execute("insert into experiments (experiment_id, name, artifact_location, lifecycle_stage) "
                   "values (7, ?, ?, 'active')", (name, str(home / "mlflow" / "artifacts" / "7")))
    return name


def test_the_upgrade_page_upgrades_an_old_stack_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from ops.localstack import free_port, prefect_api, start_mlflow, start_prefect_server

    home = tmp_path / "runs" / "stack"  # the page's stack home, runs/stack, under a folder of this test's own
    flow, experiment = old_prefect(home), old_mlflow(home)
    venv_bin = str(Path(sys.executable).parent)
    commands = page_commands()
    assert len(commands) == 2 and all("runs/stack" in c for c in commands), commands
    for cmd in commands:
        res = subprocess.run(["bash", "-c", cmd.replace(".venv/bin/", venv_bin + "/")], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, f"{cmd}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"

    # The stack's own servers on the stack's files, Prefect not allowed to migrate as it starts: each serves the
    # old data only if the page's commands upgraded the very files the stack uses.
    monkeypatch.setenv("PREFECT_API_DATABASE_MIGRATE_ON_START", "false")
    services = []
    try:
        services.append(start_mlflow(home / "mlflow", free_port()))
        assert MlflowClient(services[-1].url).get_experiment_by_name(experiment).experiment_id == "7"
        services.append(start_prefect_server(home / "prefect", free_port()))
        flows = prefect_api(services[-1].url + "/api", "/flows/filter", {"flows": {"name": {"any_": [flow]}}})
        assert [f["name"] for f in flows] == [flow]
    finally:
        for service in services:
            service.stop()
