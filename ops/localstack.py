"""The local stack: everything a user needs on one machine, bound to 127.0.0.1.

    python -m ops.localstack up [--data-root DIR]   # Prefect server + work pool + deployments + worker, MLflow
    python -m ops.localstack status
    python -m ops.localstack down                   # stops exactly the processes ``up`` started
    python -m ops.localstack deploy                 # prefect.yaml and the promotion locks to $PREFECT_API_URL

``up`` starts a Prefect server and an MLflow tracking server (SQLite by default, below; artifacts in a folder), creates
the process work pool, deploys ``prefect.yaml`` and starts a worker; it prints the two UI addresses. It is safe
to run twice: a service whose recorded process is alive and healthy is kept. Before it starts a worker it marks
Crashed the runs of the pool whose process is gone (a machine restart leaves them Running). Every process is recorded in
``<home>/stack.json`` with its PID and start time, so ``down`` never signals a process it did not start, even
after a PID was reused. Ports default to Prefect's 4200 and MLflow's 5000 (``--prefect-port``, ``--mlflow-port``).

With ``--database-url postgresql://USER:PASSWORD@HOST:PORT`` (or ``AIAYN_DATABASE_URL``, which keeps the password
out of the process list and the shell history) both servers keep their data on that PostgreSQL server instead, as
Prefect and MLflow advise for servers with concurrent workers: Prefect in the database ``aiayn_prefect``, MLflow's
runs and registry in ``aiayn_mlflow`` (created when missing, if the role may; else create them first). The
embedded default stays SQLite.

The Prefect CLI finds the server through ``prefect.toml`` in the project root (``api.url``), so after ``up``
``prefect deployment run 'train-en-de/multi30k-cpu' --watch`` works from the project root. With other ports,
export the ``PREFECT_API_URL`` that ``up`` prints.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import psutil
import yaml

from ops import pools
from ops.database import DATABASES, PostgreSQL, StackError, client_environ
from pipeline.config import ENV_RUNS_MAY_SET, load_config
from pipeline.support.urls import shown_url
from pipeline.support.fsutil import write_json
from pipeline.support.proc import free_port  # noqa: F401  (the tests and ops.localstack callers name it here too)
from pipeline.promotion import lock_name

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
WORK_POOL = "aiayn-cpu"  # prefect.yaml's pool of CPU runs: this stack's worker serves it
GPU_POOL = "aiayn-gpu"  # prefect.yaml's pool of the paper-scale runs: served here only where CUDA is


@dataclass
class Service:
    """One started process: enough to find it again (pid + start time) and to reach it (url)."""

    name: str
    pid: int
    create_time: float
    url: str
    log: str
    database: str = "sqlite"  # where the service keeps its data: sqlite, or the PostgreSQL URL without password

    def alive(self) -> bool:
        """True only if the recorded PID still runs the process we started (not a reused PID)."""
        try:
            return abs(psutil.Process(self.pid).create_time() - self.create_time) < 1.0
        except psutil.Error:
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the service's process group (it was started in its own session), then SIGKILL what is left."""
        if not self.alive():
            return
        leader = psutil.Process(self.pid)
        procs = [leader, *leader.children(recursive=True)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
            _, procs = psutil.wait_procs(procs, timeout=timeout_s)
            procs = [p for p in procs if _running(p)]
            if not procs:
                return


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def login() -> tuple[str, str] | None:
    """The stack's login, from the environment only (never a command line): ``AIAYN_STACK_USER`` (default aiayn)
    and ``AIAYN_STACK_PASSWORD``; None without a password: servers that ask for none (loopback only)."""
    password = os.environ.get("AIAYN_STACK_PASSWORD")
    return (os.environ.get("AIAYN_STACK_USER", "aiayn"), password) if password else None


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def start_service(name: str, cmd: list[str], env: dict[str, str], health_url: str | None, url: str, log: Path,
                  timeout_s: float = 120.0, database: str = "sqlite") -> Service:
    """Start ``cmd`` in its own session (so SIGTERM reaches it and its children), wait until ``health_url``
    answers 200, and return it; on failure stop it and raise :class:`StackError` with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, start_new_session=True)
    service = Service(name, proc.pid, psutil.Process(proc.pid).create_time(), url, str(log), database)
    deadline = time.monotonic() + timeout_s
    while health_url is not None and not healthy(health_url):
        if proc.poll() is not None or time.monotonic() > deadline:
            service.stop()
            why = (f"exited with status {proc.returncode}" if proc.poll() is not None
                   else f"not healthy in {timeout_s:.0f} s")
            raise StackError(f"{name} {why}; its log ({log}) ends with:\n{_tail(log)}")
        time.sleep(0.3)
    return service


def start_mlflow(home: Path, port: int, database: PostgreSQL | None = None, host: str = HOST) -> Service:
    """An MLflow tracking server on ``host``:``port`` (127.0.0.1 by default): runs and registry in SQLite (or in
    ``database``), artifacts in a folder, served through it (proxied: clients need no access to the folder). It
    accepts requests addressed to ``host`` (MLflow's --allowed-hosts) and to this machine's loopback."""
    home = home.resolve()
    (home / "artifacts").mkdir(parents=True, exist_ok=True)
    if port_in_use(port, host):
        raise StackError(f"port {port} on {host} is taken; stop what uses it or pass --mlflow-port")
    env = {**client_environ(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # unused job runner (STACK-NOTES)
    auth = []
    if (credentials := login()) is not None:  # MLflow's basic-auth app: the stack's user is its admin
        config = home / "basic_auth.ini"
        config.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{home / 'auth.db'}\n"
                          f"admin_username = {credentials[0]}\n"
                          "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
                          encoding="utf-8")
        env |= {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_AUTH_ADMIN_PASSWORD": credentials[1],
                "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
        auth = ["--app-name", "basic-auth"]
    if database is None:
        env["MLFLOW_BACKEND_STORE_URI"], shown = f"sqlite:///{home / 'mlflow.db'}", "sqlite"
    else:
        database.ensure(DATABASES["mlflow"])
        # by the environment, not --backend-store-uri: a password on the command line is in every `ps`
        env["MLFLOW_BACKEND_STORE_URI"] = database.url(DATABASES["mlflow"])
        shown = database.shown(DATABASES["mlflow"])
    cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", host, "--port", str(port),
           "--workers", "1", "--artifacts-destination", str(home / "artifacts"),
           "--allowed-hosts", ",".join(f"{name}:{port},{name}" for name in dict.fromkeys([host, HOST, "localhost"])),
           *auth]
    url = f"http://{host}:{port}"
    return start_service("mlflow", cmd, env, f"{url}/health", url, home / "mlflow.log", database=shown)


def prefect_env(home: Path, api_url: str | None) -> dict[str, str]:
    """Environment for Prefect processes of this stack: its own PREFECT_HOME (database, result storage), and no
    database settings (the server adds its own)."""
    env = {**client_environ(), "PREFECT_HOME": str(home.resolve()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "AIAYN_PROJECT_DIR": str(REPO)}  # prefect.yaml's pull step runs flows in this checkout
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if (credentials := login()) is not None:  # the clients' side of both servers' login
        env |= {"PREFECT_API_AUTH_STRING": ":".join(credentials), "MLFLOW_TRACKING_USERNAME": credentials[0],
                "MLFLOW_TRACKING_PASSWORD": credentials[1]}
    return env


def start_prefect_server(home: Path, port: int, database: PostgreSQL | None = None, host: str = HOST) -> Service:
    """A Prefect server on ``host``:``port`` (127.0.0.1 by default) with SQLite under ``home`` (or its database on
    ``database``; the server migrates it to its schema as it starts)."""
    if port_in_use(port, host):
        raise StackError(f"port {port} on {host} is taken; stop what uses it or pass --prefect-port")
    env = prefect_env(home, None)
    env.pop("PREFECT_API_URL", None)
    shown = "sqlite"  # the default: SQLite under PREFECT_HOME
    if database is not None:
        database.ensure(DATABASES["prefect-server"])
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database.url(DATABASES["prefect-server"], "asyncpg")
        shown = database.shown(DATABASES["prefect-server"])
    if (credentials := login()) is not None:  # every API call but the health check then needs the login
        env["PREFECT_SERVER_API_AUTH_STRING"] = ":".join(credentials)
    env["PREFECT_SERVER_API_PORT"] = str(port)
    env["PREFECT_SERVER_API_HOST"] = host
    url = f"http://{host}:{port}"
    # The UI calls the API at server.ui.api_url, which defaults to api.url: prefect.toml's port 4200, not this
    # server's (on another port every page would say "Can't connect to Server API").
    env["PREFECT_SERVER_UI_API_URL"] = f"{url}/api"
    cmd = [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", host, "--port", str(port)]
    return start_service("prefect-server", cmd, env, f"{url}/api/health", url, home / "server.log", database=shown)


def prefect_cli(args: list[str], env: dict[str, str]) -> None:
    """Run a Prefect CLI command from the project root; raise :class:`StackError` with its output if it fails."""
    res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise StackError(f"prefect {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def start_worker(home: Path, api_url: str, mlflow_url: str, extra_env: dict[str, str],
                 worker: str = "process", pool: str = WORK_POOL) -> Service:
    """A worker of ``worker`` type on the stack's pool. A process worker's flow runs inherit its environment
    (tracking URI, data root); a Docker worker's get theirs from the pool's template (:meth:`Stack.up`)."""
    env = {**prefect_env(home, api_url), "MLFLOW_TRACKING_URI": mlflow_url, **extra_env}
    cmd = [str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool", pool, "--type", worker]
    # A worker has no health endpoint by default; it is up once its process runs (it polls the server).
    name = "prefect-worker" if pool == WORK_POOL else "prefect-gpu-worker"
    return start_service(name, cmd, env, None, api_url, home / f"{name.removeprefix('prefect-')}.log")


def cuda_devices() -> int:
    """How many CUDA devices this machine's torch sees (0 without CUDA): whether the stack serves the GPU pool."""
    import torch

    return torch.cuda.device_count()


def prefect_api(base: str, path: str, body: dict | None = None, attempts: int = 5, timeout: float = 30.0):
    """One Prefect REST call (GET, or POST with ``body``) to the server at ``base`` with the stack's login, retried
    while the server is busy (:func:`ops.pools.server_call`); the decoded JSON answer. Every call made here is safe
    to repeat: reads, filters, forced state changes, deployment upserts."""
    credentials = login()
    env = {"PREFECT_API_URL": base, **({"PREFECT_API_AUTH_STRING": ":".join(credentials)} if credentials else {})}
    return pools.server_call(env, path, body, attempts=attempts, timeout=timeout)


def crash_orphaned_runs(api_url: str) -> list[str]:
    """Mark Crashed the flow runs of the stack's pool that the server still shows pending, running or cancelling
    although their process is gone, as a machine restart or a killed stack leaves them; returns their names.
    Left alone such a run shows Running for ever, and whatever waits on it (a sweep re-attaching to its trial
    runs) waits for ever too. ``up`` calls it before it starts a worker, when no worker of this stack runs one."""
    runs = prefect_api(api_url, "/flow_runs/filter", {
        "flow_runs": {"state": {"type": {"any_": ["PENDING", "RUNNING", "CANCELLING"]}}},
        "work_pools": {"name": {"any_": [WORK_POOL]}}})
    marked = []
    for run in runs:
        if _run_process_alive(run):
            continue
        prefect_api(api_url, f"/flow_runs/{run['id']}/set_state", {"force": True, "state": {
            "type": "CRASHED", "name": "Crashed",
            "message": f"its process (pid {run.get('infrastructure_pid') or 'never recorded'}) is gone: the stack's "
                       "worker and its runs stopped (machine restart or a killed stack); found by ops.localstack up"}})
        marked.append(run["name"])
    return marked


def _run_process_alive(run: dict) -> bool:
    """The run's recorded process exists and is older than the run (after a restart its PID may be another's)."""
    pid = str(run.get("infrastructure_pid") or "")
    if not pid.isdigit():
        return False
    try:
        created = psutil.Process(int(pid)).create_time()
    except psutil.Error:
        return False
    started = run.get("start_time")
    return started is None or created <= datetime.fromisoformat(started).timestamp() + 1.0


def deployed_pools() -> list[str]:
    """The work pools prefect.yaml's deployments run on."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    return sorted({d["work_pool"]["name"] for d in spec["deployments"]})


def deployed_models() -> list[str]:
    """The registered model of every deployment's config in prefect.yaml (their promotion locks)."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    names = set()
    with warnings.catch_warnings():  # a config's own warnings are for its runs, not for the stack
        warnings.simplefilter("ignore")
        for d in spec["deployments"]:
            if "config" in d.get("parameters", {}):  # the train-node deployments register nothing
                names.add(load_config(d["parameters"]["config"]).registered_model_name)
    return sorted(names)


def result_storage_env(storage: str | None) -> dict[str, str]:
    """Where cached stage results (persisted task results) go, as the worker's Prefect settings:
    ``block:<block type>/<name>`` a storage block (e.g. ``block:s3-bucket/aiayn-results``, created beforehand
    with ``prefect block create``) for workers on other machines; anything else a folder (shared storage for
    several workers); None: Prefect's default, ``<PREFECT_HOME>/storage`` of this stack."""
    if not storage:
        return {}
    if storage.startswith("block:"):
        return {"PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": storage.removeprefix("block:")}
    return {"PREFECT_LOCAL_STORAGE_PATH": str(Path(storage).expanduser().resolve())}


def create_promotion_locks(env: dict[str, str]) -> list[str]:
    """One Prefect global concurrency limit (one slot) per deployed registered model, ``promote-<model>``: the
    flows hold it while they read the champion, compare and move the alias. Existing limits are kept. Made in REST
    calls to ``env``'s PREFECT_API_URL rather than a Prefect CLI process each."""
    names = [lock_name(m) for m in deployed_models()]
    for name in names:
        try:
            pools.server_call(env, "/v2/concurrency_limits/", {"name": name, "limit": 1})
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: a limit of that name exists, kept as it is
                raise StackError(f"promotion lock {name}: the Prefect server at {env['PREFECT_API_URL']} refused "
                                 f"it ({e.code}): {e.read().decode(errors='replace')[-2000:]}") from None
        except (urllib.error.URLError, OSError) as e:
            raise StackError(f"promotion lock {name}: no Prefect server answers at {env['PREFECT_API_URL']} "
                             f"({getattr(e, 'reason', e)})") from None
    return names


class Stack:
    """The recorded services of one stack home (``<home>/stack.json``)."""

    def __init__(self, home: Path):
        self.home = home.resolve()
        self.state = self.home / "stack.json"

    def load(self) -> dict[str, Service]:
        """The recorded services; a StackError naming the record when it is not one ``up`` wrote."""
        if not self.state.is_file():
            return {}
        try:
            return {k: Service(**v) for k, v in json.loads(self.state.read_text(encoding="utf-8")).items()}
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, not UTF-8, or not a map of services
            raise StackError(f"{self.state}: not a stack record ({str(e).splitlines()[0]}); stop the stack's "
                             "processes yourself if any still run (their logs are beside it), then delete the "
                             "file") from None

    def save(self, services: dict[str, Service]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        write_json(self.state, {k: asdict(v) for k, v in services.items()})

    def up(self, prefect_port: int, mlflow_port: int, data_root: Path | None = None,
           work_dir: Path | None = None, result_storage: str | None = None,
           database: PostgreSQL | None = None, worker: str = "process",
           image: str | None = None, host: str = HOST) -> dict[str, Service]:
        """Start what is not running, deploy prefect.yaml, and return the services (safe to call twice).

        ``worker``: ``process`` runs each flow run as a process of this checkout; ``docker`` as a container of
        ``image`` (deploy/Dockerfile), with ``data_root`` mounted read-only and the work dir and result storage
        read-write; ``none`` starts the two servers only (a team's: its pools, deployments and workers are made
        with ``python -m ops.pools apply`` and ``deploy``, and never replaced by this stack's)."""
        if worker == "docker" and login() is not None:
            raise StackError("--worker docker with a login (AIAYN_STACK_PASSWORD): the Docker pool's template would "
                             "carry the MLflow password where every reader of the pool sees it; on a team's servers "
                             "give containers their credentials from the cluster's secrets "
                             "(docs/how-to/team-servers.md)")
        if worker == "docker" and (image is None or data_root is None):
            raise StackError("--worker docker needs --image (deploy/build-image.sh builds one) and --data-root "
                             "(the corpora mounted into each flow run's container)")
        services = {k: s for k, s in self.load().items() if s.alive()}
        for name, db in DATABASES.items():  # a running server keeps its data where it is: never switched
            wanted = "sqlite" if database is None else database.shown(db)
            if name in services and services[name].database != wanted:
                raise StackError(f"{name} of the stack under {self.home} runs on {services[name].database}, not "
                                 f"{wanted}: stop it first (python -m ops.localstack down --home {self.home}) or use "
                                 "another --home")
        if "mlflow" not in services:
            services["mlflow"] = start_mlflow(self.home / "mlflow", mlflow_port, database, host)
            self.save(services)
        if "prefect-server" not in services:
            services["prefect-server"] = start_prefect_server(self.home / "prefect", prefect_port, database, host)
            self.save(services)
        if worker == "none":
            return services
        api_url = services["prefect-server"].url + "/api"
        env = prefect_env(self.home / "prefect", api_url)
        if worker == "docker":
            work_dir = work_dir or self.home / "work"
            result_storage = result_storage or str(self.home / "prefect" / "storage")
        extra = result_storage_env(result_storage)
        # One person's stack: its runs may name their own data root (-p data_root=...); what else they may set is the
        # environment's to say (the trust model, pipeline.config.trust)
        extra[ENV_RUNS_MAY_SET] = os.environ.get(ENV_RUNS_MAY_SET, "data_root")
        if data_root is not None:
            extra["AIAYN_DATA_ROOT"] = str(data_root.resolve())
        if work_dir is not None:
            extra["AIAYN_WORK_DIR"] = str(work_dir.resolve())
        if worker == "docker":
            self._docker_pool(image, data_root, work_dir, {"MLFLOW_TRACKING_URI": services["mlflow"].url, **extra},
                              env)
            # the pull step's {{ $AIAYN_PROJECT_DIR }} stays for each container to fill: the image's project folder
            env.pop("AIAYN_PROJECT_DIR")
        else:
            self._process_pool(WORK_POOL, env)
        self._process_pool(GPU_POOL, env)
        prefect_cli(["deploy", "--all"], env)
        create_promotion_locks(env)
        if "prefect-worker" not in services:
            for name in crash_orphaned_runs(api_url):
                print(f"flow run {name}: its process is gone; marked Crashed")
            services["prefect-worker"] = start_worker(self.home / "prefect", api_url, services["mlflow"].url, extra,
                                                      worker)
            self.save(services)
        if "prefect-gpu-worker" not in services and cuda_devices():
            services["prefect-gpu-worker"] = start_worker(self.home / "prefect", api_url, services["mlflow"].url,
                                                          extra, pool=GPU_POOL)
            self.save(services)
        return services

    @staticmethod
    def _process_pool(pool: str, env: dict[str, str]) -> None:
        """``pool`` as a process pool (ops.pools, deploy/process/pool.json): its flow runs take the worker's
        environment and command, which no deployment or flow run may set."""
        try:
            pools.create(pool, "process", pools.template("process", pool, {}), env)
        except pools.PoolError as e:
            raise StackError(str(e)) from None

    @staticmethod
    def _docker_pool(image: str, data_root: Path, work_dir: Path, run_env: dict[str, str],
                     env: dict[str, str]) -> None:
        """The stack's pool as a Docker pool (ops.pools): ``image``, built here and so never pulled; the data root
        (read-only), the work dir and a result storage folder mounted at their own paths, so that a path a run
        records means the same on the host and in every container; ``run_env`` for each flow run."""
        mounts = {data_root.resolve(): "ro", work_dir.resolve(): "rw"}
        if "PREFECT_LOCAL_STORAGE_PATH" in run_env:
            mounts[Path(run_env["PREFECT_LOCAL_STORAGE_PATH"])] = "rw"
        for folder in mounts:
            folder.mkdir(parents=True, exist_ok=True)
        try:
            pools.create(WORK_POOL, "docker", pools.template("docker", WORK_POOL, {
                "image": image, "image_pull_policy": "Never",
                "volumes": [f"{folder}:{folder}:{mode}" for folder, mode in mounts.items()], "env": run_env}), env)
        except pools.PoolError as e:
            raise StackError(str(e)) from None

    def down(self) -> list[str]:
        """Stop exactly the recorded processes that are still ours; forget the record. Returns their names."""
        services = self.load()
        stopped = []
        for name in ("prefect-worker", "prefect-gpu-worker", "prefect-server", "mlflow"):  # workers first
            if name in services and services[name].alive():
                services[name].stop()
                stopped.append(name)
        self.state.unlink(missing_ok=True)
        return stopped


def _port(text: str) -> int:
    """A TCP port a server may listen on, or argparse's one-line refusal."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give a number from 1 to 65535")
    return int(text)


def _check_home(home: Path) -> None:
    """A StackError unless ``home`` is a folder, or can be made one (no file in its place or above it)."""
    folder = home
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise StackError(f"--home / AIAYN_STACK_HOME {home}: {folder} is a file, not a folder; give the folder "
                         "where the stack keeps its records (made when missing)")


def check_api(url: str) -> None:
    """A StackError naming ``url`` (PREFECT_API_URL) unless a Prefect server's API answers there and has the work
    pools prefect.yaml's deployments name."""
    given, example = f"PREFECT_API_URL {shown_url(url)}", "export PREFECT_API_URL=http://HOST:PORT/api"
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http:// or https:// address")
        parts.port  # noqa: B018  (raises ValueError for a port that is not one)
    except ValueError as e:
        raise StackError(f"{given}: {e}; {example}") from None
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + path, headers=headers),
                                        timeout=15) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise StackError(f"{given}: no server answers there ({getattr(e, 'reason', e)}); {example}, the "
                             "address of the team's Prefect server's API") from None

    if get("/health") != (200, b"true"):
        raise StackError(f"{given}: answers, but not as a Prefect server's API (its /health is not true); the "
                         f"API's address ends in /api: {example}")
    for pool in deployed_pools():
        status, _ = get(f"/work_pools/{pool}")
        if status == 401:
            raise StackError(f"{given}: the server asks for a login; export PREFECT_API_AUTH_STRING=USER:PASSWORD")
        if status != 200:
            raise StackError(f"{given}: the server has no work pool {pool} (answer {status}), which prefect.yaml's "
                             "deployments run on; make the pools first: python -m ops.pools apply "
                             "(docs/how-to/team-servers.md)")


def build_parser() -> argparse.ArgumentParser:
    """The command line (defaults that come from the environment are resolved in main, so the generated
    reference does not depend on the shell it was made in)."""
    p = argparse.ArgumentParser(prog="python -m ops.localstack", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["up", "down", "status", "deploy"],
                   help="deploy: apply prefect.yaml's deployments and a promotion lock per deployed model to the "
                        "Prefect server at PREFECT_API_URL (a team's own; its work pools made beforehand), "
                        "starting nothing")
    p.add_argument("--home", type=Path,
                   help="where the stack keeps its databases, artifacts, logs and PID records (default: env "
                        "AIAYN_STACK_HOME, else runs/stack)")
    p.add_argument("--prefect-port", type=_port, default=4200, help="the Prefect server's port on 127.0.0.1")
    p.add_argument("--mlflow-port", type=_port, default=5000, help="the MLflow server's port on 127.0.0.1")
    p.add_argument("--data-root", type=Path, help="local corpora for flow runs (sets AIAYN_DATA_ROOT for the worker)")
    p.add_argument("--work-dir", type=Path, help="where flow runs write stage outputs (AIAYN_WORK_DIR)")
    p.add_argument("--database-url",
                   help="keep Prefect's and MLflow's data on this PostgreSQL server, "
                        "postgresql://USER:PASSWORD@HOST:PORT, in the databases aiayn_prefect and aiayn_mlflow "
                        "(default: env AIAYN_DATABASE_URL, which keeps the password off the command line; else "
                        "SQLite files under the stack's home)")
    p.add_argument("--result-storage",
                   help="where cached stage results go: a folder, or 'block:<type>/<name>', a Prefect storage block "
                        "for workers on other machines (default: env AIAYN_RESULT_STORAGE, else the stack's "
                        "PREFECT_HOME)")
    p.add_argument("--worker", choices=["process", "docker", "none"], default="process",
                   help="how flow runs run: processes of this checkout, or containers of --image started by a "
                        "Docker worker (a Docker work pool; the data root, work dir and result storage mounted); "
                        "none: the two servers only, no pools, deployments or worker (a team's servers: "
                        "python -m ops.pools apply and deploy make those)")
    p.add_argument("--host", default=HOST,
                   help="the address both servers listen on and are reached at: 127.0.0.1, this machine only, or "
                        "an address of this machine that other machines or containers reach")
    p.add_argument("--image", help="with --worker docker: the project's image (deploy/build-image.sh builds one)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.home = args.home or Path(os.environ.get("AIAYN_STACK_HOME", REPO / "runs" / "stack"))
    args.result_storage = args.result_storage or os.environ.get("AIAYN_RESULT_STORAGE")
    args.database_url = args.database_url or os.environ.get("AIAYN_DATABASE_URL")
    try:
        _check_home(args.home)
        stack = Stack(args.home)
        if args.action == "up":
            database = PostgreSQL.parse(args.database_url) if args.database_url else None
            services = stack.up(args.prefect_port, args.mlflow_port, args.data_root, args.work_dir,
                                args.result_storage, database, args.worker, args.image, args.host)
            print(f"Prefect UI:  {services['prefect-server'].url}")
            from pipeline.tracking import ui_link

            print(f"MLflow UI:   {ui_link(services['mlflow'].url, 'experiments')}")
            print(f"databases:   Prefect {services['prefect-server'].database}, MLflow {services['mlflow'].database}")
            if (credentials := login()) is not None:
                print(f"login:       user {credentials[0]} on both servers (password: AIAYN_STACK_PASSWORD)")
            if args.worker == "none":
                print("workers:     none (--worker none): make the pools and deployments with python -m ops.pools "
                      "apply and python -m ops.localstack deploy (docs/how-to/team-servers.md)")
            else:
                kind = "process" if args.worker == "process" else f"docker, image {args.image}"
                print(f"worker:      pool {WORK_POOL} ({kind}), log {services['prefect-worker'].log}")
                gpu = services.get("prefect-gpu-worker")
                print(f"GPU worker:  pool {GPU_POOL}, log {gpu.log}" if gpu else
                      f"GPU worker:  none (no CUDA device here): runs of the {GPU_POOL} pool's deployments wait")
            print(f"export PREFECT_API_URL={services['prefect-server'].url}/api "
                  f"MLFLOW_TRACKING_URI={services['mlflow'].url}")
        elif args.action == "deploy":
            if not os.environ.get("PREFECT_API_URL"):
                raise StackError("deploy applies prefect.yaml to the server at PREFECT_API_URL, which is not set: "
                                 "export PREFECT_API_URL=http://HOST:PORT/api (the local stack's `up` deploys "
                                 "by itself)")
            check_api(os.environ["PREFECT_API_URL"])
            # prefect deploy fills {{ $AIAYN_PROJECT_DIR }} of the pull step from its own environment when it is
            # set; left unset, the placeholder stays and each flow run's environment (the image's) fills it
            env = {k: v for k, v in client_environ().items() if k != "AIAYN_PROJECT_DIR"}
            prefect_cli(["deploy", "--all"], env)
            locks = create_promotion_locks(env)
            print(f"deployed prefect.yaml to {os.environ['PREFECT_API_URL']}; promotion locks: {', '.join(locks)}")
        elif args.action == "down":
            stopped = stack.down()
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            services = stack.load()
            for name, s in services.items():
                print(f"{name:<15} {'up' if s.alive() else 'down':<5} pid {s.pid:<8} {s.url}  log {s.log}"
                      + (f"  data {s.database}" if name in DATABASES else ""))
            if not services:
                print("no stack recorded under", stack.home)
    except StackError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
