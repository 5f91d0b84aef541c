"""The project's image and a Docker work pool, run for real on this machine's Docker daemon (Debian's ``docker.io``,
installed and started here when missing, as .ci/run installs PostgreSQL): ``deploy/build-image.sh`` builds
``deploy/Dockerfile`` on a base made from Debian's packages (no image registry), the image runs the unit tier in a
container without a network and carries its commit, and the default deployment runs end to end in containers that
a Prefect Docker worker starts, on the PostgreSQL-backed stack with MLflow's proxied artifacts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.support.provenance import short_commit
from tests.conftest import QUICK, REPO_ROOT, Prefect, _apt_install, api, short_multi30k

IMAGE = "aiayn-pipeline:test"


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    assert not check or res.returncode == 0, f"docker {' '.join(args)}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """A Docker daemon that answers: the running one, else ``dockerd`` started here (and stopped afterwards)."""
    _apt_install("docker.io", lambda: shutil.which("dockerd"), tmp_path_factory)
    _apt_install("debootstrap", lambda: shutil.which("debootstrap"), tmp_path_factory)
    if docker("info", timeout=60, check=False).returncode == 0:
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("no Docker daemon answers and this user cannot start one: start dockerd")
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while docker("info", timeout=30, check=False).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def image(daemon) -> str:
    """The project's image of this checkout, built as a team without a registry builds it (layers cached)."""
    res = subprocess.run(["bash", str(REPO_ROOT / "deploy" / "build-image.sh"), IMAGE], capture_output=True,
                         text=True, timeout=2400, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return IMAGE


@pytest.mark.slow
@pytest.mark.integration
def test_the_image_runs_the_unit_tier_and_knows_its_commit(image: str) -> None:
    """No .git in the image, yet runs are tagged with the commit it was built from; the unit tier passes inside a
    container with no network at all."""
    probe = "from pipeline.support.provenance import short_commit; print(short_commit())"
    assert docker("run", "--rm", "--network", "none", image, "python", "-c", probe).stdout.strip() == short_commit()
    tier = docker("run", "--rm", "--network", "none", image, "python", "-m", "pytest", "-q", "-n", "2",
                  "-p", "no:cacheprovider", "-m", "not integration and not slow", timeout=1800, check=False)
    assert tier.returncode == 0, tier.stdout[-4000:] + tier.stderr[-2000:]
    assert " passed" in tier.stdout and " failed" not in tier.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_the_default_deployment_runs_in_containers_of_a_docker_pool(image: str, postgres: str, shared_data: Path,
                                                                    tmp_path: Path) -> None:
    """``up --worker docker``: a Docker work pool whose worker starts each flow run in a container of the image,
    with the data mounted read-only and the work dir and cached results on shared folders, on the PostgreSQL-backed
    servers. The default deployment registers a first champion; the second run reuses the data stages from the
    cache, and its weak challenger is refused."""
    from mlflow.tracking import MlflowClient

    from ops.localstack import Stack, free_port

    home = tmp_path / "stack"
    data = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
           "PREFECT_WORKER_QUERY_SECONDS": "1", "AIAYN_DATABASE_URL": postgres}
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--prefect-port", str(free_port()),
           "--mlflow-port", str(free_port()), "--data-root", str(data), "--work-dir", str(tmp_path / "work"),
           "--result-storage", str(tmp_path / "results"), "--worker", "docker", "--image", image]
    ran: list[str] = []
    up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"worker:      pool aiayn-cpu (docker, image {image})" in up.stdout
        services = Stack(home).load()
        api_url = services["prefect-server"].url + "/api"
        prefect = Prefect(api_url, {**env, "PREFECT_API_URL": api_url})
        base = {**QUICK, "tracking.registered_model": "transformer-en-de-docker",
                "train.checkpoint_every_steps": 20, "decode.max_len_a": 1.0, "decode.max_len_b": 5}

        def run(**overrides) -> dict[str, str]:
            params = {"data_root": str(data), "overrides": {**base, **overrides}, "max_steps": 40}
            status, out, run_id = prefect.run_deployment("train-en-de/multi30k-cpu", params)
            ran.append(run_id)
            assert status == 0, prefect.logs(run_id)[-4000:] + out[-2000:]
            client = MlflowClient(services["mlflow"].url)
            exp = client.get_experiment_by_name("aiayn")
            (parent,) = client.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{run_id}'")
            return parent.data.tags

        tags = run()
        assert tags["promotion.decision"] == "promoted" and "first model" in tags["promotion.reason"]
        assert tags["mlflow.source.git.commit"].startswith(short_commit().rstrip("+"))  # the image's own commit
        tags = run(**{"train.lr_scale": 1e-4})  # weights that barely leave their initialisation
        assert tags["promotion.decision"] == "not promoted" and tags["promotion.champion_version"] == "1"
        states = prefect.task_states(ran[1])
        assert [states[s] for s in ("prepare-data", "train-tokenizer", "write-shards")] == ["Cached"] * 3, states
        for run_id in ran:  # each flow run was one container of the image, which exits with status 0
            lines = docker("ps", "-a", "--filter", f"label=io.prefect.flow-run-id={run_id}", "--format",
                           "{{json .}}").stdout.splitlines()
            assert len(lines) == 1, f"containers of flow run {run_id}: {lines}"
            container = json.loads(lines[0])
            assert container["Image"] == image, container
            # the flow run reports its final state from inside the container, which then still has to exit
            assert docker("wait", container["ID"], timeout=120).stdout.strip() == "0", container
    finally:
        down = subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, text=True,
                              timeout=120)
        for run_id in ran:
            left = docker("ps", "-aq", "--filter", f"label=io.prefect.flow-run-id={run_id}", check=False)
            if left.stdout.split():
                docker("rm", "-f", *left.stdout.split(), check=False)
        assert down.returncode == 0, down.stderr


# Run inside a node's container: each listening TCP socket (IPv4 and IPv6) as "address:port command line"
LISTENING = r"""
import glob, os
def sockets():
    for name in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{name}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                hexaddr, port = f[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if len(raw) == 4:
                    address = ".".join(str(b) for b in raw[::-1])
                else:
                    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                    address = ":".join(b"".join(words).hex()[i:i + 4] for i in range(0, 32, 4))
                yield f[9], f"{address}:{int(port, 16)}"
owners = {}
for fd in glob.glob("/proc/[0-9]*/fd/*"):
    try:
        target = os.readlink(fd)
    except OSError:
        continue
    if target.startswith("socket:["):
        pid = fd.split("/")[2]
        owners[target[8:-1]] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120]
for inode, where in sockets():
    print(where, owners.get(inode, "?"))
"""


def _listening(container: str) -> set[str]:
    """The container's listening TCP sockets, each "address:port command line" (its own /proc)."""
    res = docker("exec", container, "python", "-c", LISTENING, timeout=30, check=False)
    return set(res.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.integration
def test_two_nodes_in_two_containers_train_as_one_node_of_two(image: str, shared_data: Path, tmp_path: Path) -> None:
    """A multi-node training run whose node runs are containers of a Docker pool, each in its own network
    namespace on an internal network this test creates (nothing leaves it but the servers' address on its
    gateway): node 0 is reached by its alias there (launch.node_job_variables), every socket a node listens on is
    bound to eth0's address, and the final checkpoint equals one node with two processes at the same seed."""
    import threading

    from ops import pools
    from ops.localstack import Stack, free_port
    from tests.test_nodes import NODES, _final_weights, _one_node_of_two_processes, _run_folder

    net = f"aiayn-test-{os.getpid()}"
    docker("network", "create", "--internal", net)
    gateway = docker("network", "inspect", net, "-f", "{{(index .IPAM.Config 0).Gateway}}").stdout.strip()
    home, work = tmp_path / "stack", tmp_path / "work"
    data = short_multi30k(shared_data, tmp_path / "data", train=2500, val=300, test2016=200, newstest2014=100)
    threads = os.environ.get("AIAYN_CPU_THREADS") or str(len(os.sched_getaffinity(0)))
    env = {**{k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "AIAYN_PROJECT_DIR")},
           "PREFECT_WORKER_QUERY_SECONDS": "1", "AIAYN_CPU_THREADS": threads}
    cmd = [sys.executable, "-m", "ops.localstack", "--home", str(home), "--host", gateway, "--prefect-port",
           str(free_port()), "--mlflow-port", str(free_port()), "--data-root", str(data), "--work-dir", str(work)]
    worker, seen, addresses = None, {}, {}
    try:
        up = subprocess.run([*cmd[:3], "up", *cmd[3:]], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        services = Stack(home).load()
        api_url = services["prefect-server"].url + "/api"
        env["PREFECT_API_URL"] = api_url
        prefect = Prefect(api_url, env)
        pools.create("aiayn-test-nodes", "docker", pools.template("docker", "aiayn-cpu", {
            "image": image, "image_pull_policy": "Never", "networks": [net], "volumes": [f"{work}:{work}:rw"],
            "env": {"MLFLOW_TRACKING_URI": services["mlflow"].url, "AIAYN_CPU_THREADS": threads,
                    "AIAYN_WORK_DIR": str(work)}}), env)  # the work dir the parent records its node runs in
        cli = str(Path(sys.executable).with_name("prefect"))
        res = subprocess.run([cli, "--no-prompt", "deploy", "flows/nodes.py:train_node", "--name", "docker",
                              "--pool", "aiayn-test-nodes"], cwd=REPO_ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        worker = subprocess.Popen([cli, "worker", "start", "--pool", "aiayn-test-nodes", "--type", "docker"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        alias = {"container_create_kwargs": {"networking_config": {net: {"Aliases": ["aiayn-node0"]}}}}
        params = {"data_root": str(data), "max_steps": 10, "overrides": {
            **NODES, "tracking.registered_model": "transformer-en-de-docker-nodes",
            "launch.node_deployment": "train-node/docker", "launch.rdzv_endpoint": "aiayn-node0:29500",
            "launch.interface": "eth0", "launch.node_job_variables": {"0": alias}}}
        parent = prefect.start_deployment("train-en-de/multi30k-cpu", params)
        done = threading.Event()

        def sample() -> None:  # each running node container's address and listening sockets, while the run lasts
            while not done.wait(1.0):
                for container in docker("ps", "--filter", f"network={net}", "--format", "{{.ID}}",
                                        check=False).stdout.split():
                    if container not in addresses:
                        addresses[container] = docker("inspect", container, "-f", "{{(index .NetworkSettings.Networks"
                                                      f" \"{net}\").IPAddress}}}}", check=False).stdout.strip()
                    seen.setdefault(container, set()).update(_listening(container))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        deadline = time.monotonic() + 900
        while prefect.flow_run(parent)["state"]["type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, "the two-node run did not finish"
            time.sleep(2)
        done.set()
        sampler.join()
        nodes = api(api_url, "/flow_runs/filter", {"flow_runs": {"tags": {"all_": [f"parent-flow-run:{parent}"]}}})
        assert prefect.flow_run(parent)["state"]["type"] == "COMPLETED", prefect.logs(parent)[-4000:] + "".join(
            f"\n--- {n['name']}:\n{prefect.logs(n['id'])[-3000:]}" for n in nodes)
        assert len(nodes) == 2 and {n["state"]["type"] for n in nodes} == {"COMPLETED"}
        # the training job listens on eth0's address only; anything else in a node (Prefect's own flow-run
        # process, Docker's resolver) on loopback only: nothing on 0.0.0.0, ::, or another interface
        for container, listening in seen.items():
            for entry in listening:
                where, command = entry.split(" ", 1)
                address = where.rsplit(":", 1)[0]
                job = "torch.distributed.run" in command or "pipeline.train" in command
                assert address == addresses[container] if job else address.startswith("127."), entry
        assert any(f"{addresses[c]}:29500 " in e and "torch.distributed.run" in e for c in seen for e in seen[c]), \
            seen  # node 0's agent hosts the rendezvous at its alias's port
        run = _run_folder(prefect, parent)
        one = _one_node_of_two_processes(run, tmp_path / "one-node")
        two = _final_weights(run)
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=60)
        subprocess.run([*cmd[:3], "down", "--home", str(home)], env=env, capture_output=True, timeout=120)
        left = docker("ps", "-aq", "--filter", f"network={net}", check=False).stdout.split()
        if left:
            docker("rm", "-f", *left, check=False)
        docker("network", "rm", net, check=False)

