"""Three test tiers, chosen by marks (declared in pyproject.toml):

- unit (no mark): fast, in-process, no shared data, servers or subprocesses; the whole tier runs in under a
  minute: ``.venv/bin/python -m pytest -m "not integration and not slow"``
- ``integration``: reads the shared data in ../shared/data, starts servers (MLflow, Prefect) or processes
  (``python -m pipeline``, torchrun, ...); with the unit tests it is the default run: ``.venv/bin/python -m pytest``
- ``slow``: end-to-end or benchmark-scale, skipped unless --run-slow; everything, as CI runs it:
  ``.venv/bin/python -m pytest --run-slow -n 2 --dist loadfile`` (two pytest-xdist workers, a file each at a time:
  session fixtures, the servers included, exist once per worker, so a test must not depend on which tests ran
  before it on the same stack)

A test that uses one of INTEGRATION_FIXTURES (or a fixture built on one) without an ``integration`` or ``slow``
mark is refused at collection, so the unit tier stays fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from ops.localstack import prefect_api as api
from pipeline.config import parse_value

pytest.register_assert_rewrite("tests.train_helpers")  # its asserts explain a failure, as a test module's do

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real data lives beside the repo (never copied into it); AIAYN_SHARED_DATA points elsewhere.
SHARED_DATA = Path(os.environ.get("AIAYN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).resolve()


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched (each one a kernel launch on a GPU), allocations aside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.__name__.startswith("empty")  # an allocation launches no kernel
        return func(*args, **(kwargs or {}))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker and every process it starts computes on its share of the cores: two workers
    of 2 threads each on 2 cores ran a training test several times slower than one thread each (OpenMP threads
    wait on each other at every operator while the other worker holds the cores). An explicit AIAYN_CPU_THREADS
    wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get("AIAYN_CPU_THREADS"):
        import torch

        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["AIAYN_CPU_THREADS"] = os.environ["OMP_NUM_THREADS"] = str(threads)  # ours, and any torch
        torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytests_folder(tmp_path_factory: pytest.TempPathFactory):
    """Temporary files of the tests and of every process they start (torchrun's log folders, MLflow's model
    downloads) go into pytest's own temporary folder, which pytest prunes (it keeps the last three sessions'),
    instead of piling up in the system's."""
    tmp = str(tmp_path_factory.mktemp("tmp"))
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", tmp)
    patch.setattr(tempfile, "tempdir", tmp)
    yield tmp
    patch.undo()


# Fixtures that read the shared data or start servers/processes: a test using any of them (directly or through
# another fixture) must be marked integration (or slow).
INTEGRATION_FIXTURES = ("shared_data", "tiny_stack", "mlflow_server", "stack", "chromium", "postgres")


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [f"{item.nodeid} (uses {', '.join(f for f in INTEGRATION_FIXTURES if f in item.fixturenames)})"
                for item in items if any(f in item.fixturenames for f in INTEGRATION_FIXTURES)
                and item.get_closest_marker("integration") is None and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("tests that read the shared data or start servers/processes must be marked "
                                "@pytest.mark.integration (or slow):\n  " + "\n  ".join(unmarked))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "multi30k" / "train.en").is_file():
        pytest.fail(f"shared data not found at {SHARED_DATA}: "
                    "put ../shared/data beside the repo or set AIAYN_SHARED_DATA")
    return SHARED_DATA


# A tiny model on real Multi30k: the integration tests check the machinery, not translation quality.
# Two test sets, one out of the captions' domain (news, long sentences): what per-set scores, guards, lineage and
# shards are tested on (the default itself has test2016 alone).
TWO_TESTS = ("data.test=[{name: test2016, format: text, path: multi30k/test2016}, "
             "{name: newstest2014, format: text, path: wmt14-en-de/newstest2014}]")

TINY = ["model.encoder_layers=1", "model.decoder_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "tokenizer.vocab_size=1000", "train.max_tokens=512", "train.update_tokens=512", "train.warmup_steps=10",
        "train.log_every_steps=2", "train.dev_every_steps=1000", "train.dev_max_sentences=64",
        "train.checkpoint_every_steps=1000", "train.checkpoint_every_minutes=60.0",
        # the fixed-N path (tests of choosing N on dev set choose_from themselves)
        "average.choose_from=[]",
        TWO_TESTS,
        # the config as written on every machine (the compute recipe of a CPU class is tested on its own)
        "recipe=none"]

# The tiny run of a deployment: TINY's model and batch, greedy decoding capped short (with max_steps=10).
QUICK = {**{k: parse_value(v) for k, v in (o.split("=", 1) for o in TINY)}, "train.checkpoint_every_steps": 5,
         "average.last_n": 2, "decode.beam_size": 1, "decode.max_len_a": 0.1, "decode.max_len_b": 2,
         "decode.batch_sentences": 512}


def tiny_config(shared_data: Path, *overrides: str):
    """The multi30k-cpu config shrunk by TINY, reading the shared data, plus ``overrides``."""
    from pipeline.config import load_config

    return load_config("multi30k-cpu", [("data.root", str(shared_data)), *TINY, *overrides])


def resolved_tiny_config(shared_data: Path, folder: Path, *overrides: str) -> Path:
    """:func:`tiny_config` written as a resolved config file in ``folder`` (named by its content), as
    ``python -m pipeline.train --config`` reads it."""
    from pipeline.config import canonical_json, write_resolved

    cfg = tiny_config(shared_data, *overrides)
    name = hashlib.sha256(canonical_json(cfg.model_dump(mode="json")).encode()).hexdigest()[:12]
    return write_resolved(cfg, Path(folder) / f"config-{name}.yaml")


@dataclass(frozen=True)
class Stack:
    """The stage outputs a tiny run trains on: corpus, tokenizer and shard folders (built once per session)."""

    work: Path
    corpus: Path
    tokenizer: Path
    shards: Path


@pytest.fixture(scope="session")
def tiny_stack(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    from pipeline.data import prepare_corpus
    from pipeline.shards import build_shards
    from pipeline.tokenize import train_tokenizer

    cfg = tiny_config(shared_data)
    work = tmp_path_factory.mktemp("work")
    corpus = prepare_corpus(cfg.data, work)
    tokenizer = train_tokenizer(corpus, cfg.tokenizer, work)
    return Stack(work, corpus, tokenizer, build_shards(corpus, tokenizer, cfg.tokenizer, work))


@pytest.fixture(scope="session")
def shards(tiny_stack: Stack) -> Path:
    """The tiny stack's token shards (the trainer's tests train on them)."""
    return tiny_stack.shards


def kill_when_stuck(child: subprocess.Popen, stuck: Path, what: str, timeout: float = 120) -> None:
    """Wait until ``child`` creates ``stuck`` (it then waits to be killed), then SIGKILL it: nothing of the child
    runs after that. Fails naming ``what`` it never reached, or with its stderr if it exited first."""
    try:
        deadline = time.monotonic() + timeout
        while not stuck.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, f"the child never reached {what}"
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()


def copy_lines(src: Path, dst: Path, stop: int | None, start: int = 0) -> None:
    """Lines ``start`` to ``stop`` of text file ``src`` into ``dst`` (folders made): a short corpus for a test."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    dst.write_text("".join(lines[start:stop]), encoding="utf-8")


def short_multi30k(shared_data: Path, root: Path, train: int, val: int, test2016: int, newstest2014: int) -> Path:
    """A data root laid out as the shared one for the En-De configs: the first lines of Multi30k train, val and
    test2016 and of newstest2014 (the machinery is tested, not translation quality). Returns ``root``."""
    for lang in ("en", "de"):
        for name, rows in (("train", train), ("val", val), ("test2016", test2016)):
            copy_lines(shared_data / "multi30k" / f"{name}.{lang}", root / "multi30k" / f"{name}.{lang}", rows)
        copy_lines(shared_data / "wmt14-en-de" / f"newstest2014.{lang}", root / "wmt14-en-de" / f"newstest2014.{lang}",
                   newstest2014)
    return root


@pytest.fixture(scope="session")
def ptb_stack(shared_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """The treebank sample's corpus and word tokenizer as ``ptb-sample-cpu`` makes them: (config, work dir, corpus,
    tokenizer folder), for the parsing tests."""
    from pipeline.config import load_config
    from pipeline.data import prepare_corpus
    from pipeline.tokenize import train_tokenizer

    cfg = load_config("ptb-sample-cpu", [("data.root", str(shared_data))])
    work = tmp_path_factory.mktemp("ptb")
    corpus = prepare_corpus(cfg.data, work)
    return cfg, work, corpus, train_tokenizer(corpus, cfg.tokenizer, work)


SMALL_TRAIN_PAIRS = 2_000


@pytest.fixture(scope="session")
def small_stack(shared_data: Path, tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """The first SMALL_TRAIN_PAIRS Multi30k pairs (dev: Multi30k val) through the corpus stage, sharded with
    tiny_stack's tokenizer: an epoch of a few updates, for the tests that cross epochs."""
    from pipeline.data import prepare_corpus
    from pipeline.shards import build_shards

    root = tmp_path_factory.mktemp("small-data")
    for split, n in (("train", SMALL_TRAIN_PAIRS), ("val", None)):
        for lang in ("en", "de"):
            copy_lines(shared_data / "multi30k" / f"{split}.{lang}", root / f"{split}.{lang}", n)
    cfg = tiny_config(root, "data.train=[{name: m2000, format: text, path: train}]",
                      "data.dev={name: multi30k-val, format: text, path: val}", "data.test=[]")
    work = tmp_path_factory.mktemp("small-work")
    corpus = prepare_corpus(cfg.data, work)
    return Stack(work, corpus, tiny_stack.tokenizer, build_shards(corpus, tiny_stack.tokenizer, cfg.tokenizer, work))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real MLflow tracking server (SQLite + local artifacts) on a free port; yields its URL."""
    from ops.localstack import free_port, start_mlflow

    service = start_mlflow(tmp_path_factory.mktemp("mlflow"), free_port())
    try:
        yield service.url
    finally:
        service.stop()


# ------------------------------------------------------------------------ the local stack (integration)


class Prefect:
    """The bits of the Prefect REST API the assertions need."""

    def __init__(self, api_url: str, env: dict[str, str]):
        self.api, self.env = api_url, env

    def run_deployment(self, name: str, params: dict, timeout: int = 900,
                       run_name: str | None = None) -> tuple[int, str, str]:
        """``prefect deployment run NAME --params JSON --watch`` (``--flow-run-name``, given ``run_name``): (exit
        status, output, flow run id)."""
        named = ["--flow-run-name", run_name] if run_name else []
        res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run", name,
                              "--params", json.dumps(params), *named, "--watch"], cwd=REPO_ROOT, env=self.env,
                             capture_output=True, text=True, timeout=timeout)
        out = res.stdout + res.stderr
        created = re.search(r"UUID: ([0-9a-f-]{36})", out)
        assert created, f"no flow run created: {out[-3000:]}"
        return res.returncode, out, created.group(1)

    def start_deployment(self, name: str, params: dict) -> str:
        """``prefect deployment run NAME --params JSON`` without waiting: the flow run id."""
        res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "deployment", "run", name,
                              "--params", json.dumps(params)], cwd=REPO_ROOT, env=self.env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        return re.search(r"UUID: ([0-9a-f-]{36})", res.stdout + res.stderr).group(1)

    def flow_run(self, run_id: str) -> dict:
        return api(self.api, f"/flow_runs/{run_id}")

    def task_states(self, run_id: str) -> dict[str, str]:
        runs = api(self.api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        return {r["name"].rsplit("-", 1)[0]: r["state"]["name"] for r in runs}  # "train-f14" -> "train"

    def logs(self, run_id: str) -> str:
        messages: list[str] = []
        while True:  # the API serves at most 200 per request
            page = api(self.api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200,
                                                   "offset": len(messages), "sort": "TIMESTAMP_ASC"})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                return "\n".join(messages)

    def artifacts(self, run_id: str) -> list[dict]:
        return api(self.api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, shared_data: Path):
    """`python -m ops.localstack up` on free ports in a temporary home; `down` afterwards."""
    from ops.localstack import Stack, free_port

    home = tmp_path_factory.mktemp("stack")
    # the tests' own configs and sweep files lie in their temporary folders: the stack's pool allows them; a test
    # that must not share the stack's cached stages (test_crash) names a work dir of its own: the pool opts it in
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
           "AIAYN_CONFIG_DIRS": str(tmp_path_factory.getbasetemp().resolve()),
           "AIAYN_RUNS_MAY_SET": "data_root,work_dir"}
    env.pop("PREFECT_API_URL", None)
    ports = [str(free_port()), str(free_port())]
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--prefect-port", ports[0],
           "--mlflow-port", ports[1], "--data-root", str(shared_data), "--work-dir", str(home / "work")]
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    services = Stack(home).load()
    try:
        api_url = services["prefect-server"].url + "/api"
        yield {"home": home, "cmd": cmd, "env": env, "services": services, "up": up.stdout,
               "prefect": Prefect(api_url, {**env, "PREFECT_API_URL": api_url}), "mlflow": services["mlflow"].url}
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr
        left = [s.name for s in services.values() if psutil.pid_exists(s.pid) and s.alive()]
        assert not left, f"still running after down: {left}"


@pytest.fixture(scope="session")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Headless Chromium for the browser checks: Debian's ``chromium``, installed here when missing (apt-get, as
    root); a test that needs it is skipped, with the reason, when it cannot be installed."""
    from ops.browser import executable

    return _apt_install("chromium", executable, tmp_path_factory)


def _apt_install(package: str, found, tmp_path_factory: pytest.TempPathFactory):
    """What ``found()`` finds, after ``apt-get install package`` (and an index update if the first try fails) when
    it finds nothing; a skip, with the reason, when the package cannot be installed."""
    import fcntl

    if (hit := found()) is not None:
        return hit
    if os.geteuid() != 0:
        pytest.skip(f"{package} is not installed and this user cannot install it: apt-get install {package}")
    # One installer at a time: under pytest-xdist each worker has the fixture, and a second apt-get would fail on
    # dpkg's lock. The lock file lies beside the workers' own temporary folders (their common parent).
    with open(tmp_path_factory.getbasetemp().parent / "apt-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        why = ""
        for attempt in ([], ["apt-get", "update", "-q"], []):  # a stale package index: update, then again
            if (hit := found()) is not None:  # another worker installed it while this one waited
                return hit
            cmd = attempt or ["apt-get", "install", "-y", "-q", package]
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                                     stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as e:
                pytest.skip(f"{package} could not be installed ({' '.join(cmd)}: {e})")
            why = res.stderr.strip()[-500:] or why
        if (hit := found()) is not None:
            return hit
    pytest.skip(f"{package} could not be installed (apt-get install {package}): {why}")


# ------------------------------------------------------------------------ a PostgreSQL server (integration)


@pytest.fixture
def postgres(postgres_server: str) -> str:
    """The session's PostgreSQL server (:func:`postgres_server`) without the stack's databases: each test's stack
    creates its own, as on a fresh server (another test's Prefect work pools and MLflow runs would be found there)."""
    import psycopg2

    from ops.database import DATABASES, PostgreSQL

    db = PostgreSQL.parse(postgres_server)
    conn = psycopg2.connect(dbname="postgres", user=db.user, password=db.password, host=db.host, port=db.port)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            for name in DATABASES.values():
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        conn.close()
    return postgres_server


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway PostgreSQL server on 127.0.0.1 (Debian's ``postgresql``, installed here when missing, as .ci/run
    does): a cluster of its own in a temporary folder, a role with a password and CREATEDB, stopped and removed
    afterwards. Yields its URL, ``postgresql://USER:PASSWORD@127.0.0.1:PORT``. The system's own cluster, if any, is
    never touched."""
    import secrets
    import shutil

    from ops.localstack import free_port

    bindir = _apt_install("postgresql", _postgres_bindir, tmp_path_factory)
    # initdb refuses to run as root: as root the cluster belongs to Debian's postgres user, in a folder under /tmp
    # (pytest's own folders are root's, mode 700)
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="aiayn-pg-", dir="/tmp"))
    password, port = secrets.token_hex(8), free_port()
    (data / "pw").write_text(password + "\n")
    if as_user:
        shutil.chown(data, "postgres")
        shutil.chown(data / "pw", "postgres")
    cluster = data / "cluster"

    def pg(*cmd: str) -> subprocess.CompletedProcess:
        res = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, f"{' '.join(cmd)}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res

    pg(str(bindir / "initdb"), "-D", str(cluster), "-U", "aiayn", f"--pwfile={data / 'pw'}", "--auth=scram-sha-256",
       "-E", "UTF8", "--locale=C.UTF-8")
    pg(str(bindir / "pg_ctl"), "-D", str(cluster), "-l", str(data / "server.log"), "-w", "-o",
       f"-c listen_addresses=127.0.0.1 -p {port} -k {data}", "start")
    try:
        yield f"postgresql://aiayn:{password}@127.0.0.1:{port}"
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(cluster), "-m", "fast", "-w", "stop")
        shutil.rmtree(data, ignore_errors=True)


def _postgres_bindir() -> Path | None:
    """The folder of the newest installed PostgreSQL's initdb and pg_ctl, or None."""
    import glob

    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    return Path(dirs[-1]) if dirs and Path(dirs[-1], "initdb").is_file() else None
