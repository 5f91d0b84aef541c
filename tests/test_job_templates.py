"""The work pools' base job templates a team deploys with (deploy/, docs/how-to/team-servers.md): each passes the
check the Prefect server makes when a pool is created with it, a flow run's job variables validate as the server
validates them (only the bounded, run-settable variables: the pinned ones are the pool creator's), and each renders,
with Prefect's own templating as its worker does, into a job with nothing left unresolved. The image
(deploy/Dockerfile) sets the folder prefect.yaml's pull step runs the flows in."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.schema_tools.validation import ValidationError, is_valid_schema
from prefect.utilities.templating import apply_values, find_placeholders

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
TEMPLATES = ("kubernetes/cpu-pool.json", "kubernetes/gpu-pool.json", "docker/cpu-pool.json", "process/pool.json")
# what a team's platform team sets when it makes the pools (docs/how-to/team-servers.md)
TEAM_POOL = {"image": "registry.internal/ml/aiayn-pipeline:5ec8025",
             "env": {"PREFECT_API_URL": "http://prefect.mlops.svc:4200/api",
                     "MLFLOW_TRACKING_URI": "http://mlflow.mlops.svc:5000",
                     "AIAYN_DATA_ROOT": "/shared/data", "AIAYN_WORK_DIR": "/shared/work"}}
# and on Kubernetes: where the pods go, as whom, how they pull the image, and secrets read from the cluster's own
CLUSTER = {"namespace": "ml", "service_account_name": "aiayn-runs",
           "node_selector": {"nvidia.com/gpu.present": "true"},
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
           "image_pull_secrets": [{"name": "regcred"}],
           "secret_env": [{"name": "MLFLOW_TRACKING_PASSWORD",
                           "valueFrom": {"secretKeyRef": {"name": "aiayn-mlflow", "key": "password"}}}]}
# what a flow run sets: node 0's label (the training stage's node runs)
RUN = {"labels": {"aiayn-node-rank": "0"}}


def load(name: str) -> dict:
    return json.loads((DEPLOY / name).read_text(encoding="utf-8"))


def pool(name: str, **defaults) -> dict:
    """The template of ``name`` as ``ops.pools apply`` sends it, with a team's defaults (its pinned values among
    them) and ``defaults``."""
    from ops.pools import TEMPLATES, template

    kind = name.split("/")[0]
    role = [r for r, f in TEMPLATES[kind].items() if f == name][0]
    team = {"kubernetes": {**TEAM_POOL, **CLUSTER}, "docker": {**TEAM_POOL, "volumes": ["/srv/aiayn:/shared"]},
            "process": {"env": TEAM_POOL["env"]}}[kind]
    return template(kind, role, {**team, **defaults})


def render(template: dict, values: dict) -> dict:
    """The job a worker builds for a flow run: the variables' defaults, overlaid by the deployment's job variables,
    substituted into the job configuration (as prefect.workers.base.BaseJobConfiguration does)."""
    schema = template["variables"]["properties"]
    variables = {k: v["default"] for k, v in schema.items() if v.get("default") is not None} | values
    return apply_values(template["job_configuration"], variables)


def run_check(template: dict, *job_variables: dict) -> None:
    """The check the Prefect server makes when a flow run of a deployment is created (or its job variables are
    updated): the pool's defaults, the deployment's job variables, then the run's, against the variables' schema."""
    from prefect.server.api.validation import _validate_work_pool_job_variables

    asyncio.run(_validate_work_pool_job_variables(None, "pool", template, *job_variables, ignore_required=False,
                                                  ignore_invalid_defaults=True))


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_base_job_template_passes_the_servers_checks_and_renders_whole(name: str) -> None:
    raw = load(name)
    assert validate_base_job_template(raw) is raw  # every placeholder declared as a variable
    template = pool(name)
    assert validate_base_job_template(template) is template  # and so in the pool apply makes
    is_valid_schema(template["variables"])
    run_check(template, {}, RUN)  # a flow run's job variables, as the server checks them
    job = render(template, RUN)
    assert not find_placeholders(json.dumps(job)), name  # nothing left for the worker to trip on
    assert job["env"] == TEAM_POOL["env"] and job["labels"] == RUN["labels"]
    assert "command" not in job  # the worker's own: prefect flow-run execute
    if name.startswith("kubernetes/"):
        pod = job["job_manifest"]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        # the worker puts env's plain values before these (prefect-kubernetes: _populate_env_in_manifest)
        assert container["image"] == TEAM_POOL["image"] and container["env"] == CLUSTER["secret_env"]
        assert "args" not in container  # the worker fills them from its command
        spec = pod["spec"]
        assert (spec["nodeSelector"], spec["tolerations"], spec["imagePullSecrets"]) == (
            CLUSTER["node_selector"], CLUSTER["tolerations"], CLUSTER["image_pull_secrets"])
        assert spec["serviceAccountName"] == CLUSTER["service_account_name"]
        assert job["namespace"] == job["job_manifest"]["metadata"]["namespace"] == CLUSTER["namespace"]
        # the pod carries the job's labels: the headless Service of multi-node training selects node 0 by them
        assert pod["metadata"]["labels"] == RUN["labels"]
        assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
        assert job["job_manifest"]["spec"]["backoffLimit"] == 0  # a failed run is resumed by Prefect, not re-run
        limits = container["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (name == "kubernetes/gpu-pool.json")
    elif name.startswith("docker/"):
        assert job["image"] == TEAM_POOL["image"] and job["volumes"] == ["/srv/aiayn:/shared"]
    else:
        assert "working_dir" not in job  # the worker's temporary folder, then prefect.yaml's pull step


# What a person who may start a flow run tries (each also as a deployment's job variables: the same check): the
# pool creator's settings, unbounded resources, a dotted key (Prefect's worker nests "env.X" into env), null.
REFUSED = [
    ("kubernetes/cpu-pool.json", {"namespace": "kube-system"}, "namespace"),
    ("kubernetes/cpu-pool.json", {"command": "sh -c 'cat /var/run/secrets/*/token'"}, "command"),
    ("kubernetes/cpu-pool.json", {"service_account_name": "admin"}, "service_account_name"),
    ("kubernetes/cpu-pool.json", {"image": "attacker/image:latest"}, "image"),
    ("kubernetes/cpu-pool.json", {"env": {"AIAYN_WORK_DIR": "/shared/other-team"}}, "env"),
    ("kubernetes/cpu-pool.json", {"env.AIAYN_WORK_DIR": "/shared/other-team"}, "env.AIAYN_WORK_DIR"),
    ("kubernetes/cpu-pool.json", {"secret_env": [{"name": "T", "valueFrom": {"secretKeyRef": {
        "name": "any", "key": "token"}}}]}, "secret_env"),
    ("kubernetes/gpu-pool.json", {"tolerations": [{"operator": "Exists"}]}, "tolerations"),
    ("kubernetes/cpu-pool.json", {"shared_claim": "other-team"}, "shared_claim"),
    ("kubernetes/gpu-pool.json", {"gpus": 100}, "gpus"),
    ("kubernetes/gpu-pool.json", {"gpus": 0}, "gpus"),
    ("kubernetes/gpu-pool.json", {"gpus": None}, "gpus"),
    ("kubernetes/cpu-pool.json", {"cpu": "all"}, "cpu"),
    ("kubernetes/cpu-pool.json", {"cpu": "100000"}, "cpu"),
    ("kubernetes/cpu-pool.json", {"memory": "16"}, "memory"),
    ("kubernetes/cpu-pool.json", {"memory": None}, "memory"),
    ("kubernetes/gpu-pool.json", {"shm_size": "1Ei"}, "shm_size"),
    ("kubernetes/cpu-pool.json", {"labels": {"app": "x" * 64}}, "labels"),
    ("kubernetes/cpu-pool.json", {"finished_job_ttl": 10**9}, "finished_job_ttl"),
    ("docker/cpu-pool.json", {"volumes": ["/:/host", "/var/run/docker.sock:/var/run/docker.sock"]}, "volumes"),
    ("docker/cpu-pool.json", {"network_mode": "host"}, "network_mode"),
    ("docker/cpu-pool.json", {"networks": ["other-team"]}, "networks"),
    ("docker/cpu-pool.json", {"container_create_kwargs": {"privileged": True}}, "privileged"),
    ("docker/cpu-pool.json", {"container_create_kwargs": {"mounts": [{"Source": "/", "Target": "/h"}]}}, "mounts"),
    ("docker/cpu-pool.json", {"container_create_kwargs": {"networking_config": {
        "aiayn-nodes": {"Aliases": ["aiayn-node0"]}, "other-team": {}}}}, "networking_config"),
    ("docker/cpu-pool.json", {"container_create_kwargs": {"networking_config": {
        "aiayn-nodes": {"Aliases": ["n0"], "IPAMConfig": {"IPv4Address": "10.0.0.5"}}}}}, "IPAMConfig"),
    ("docker/cpu-pool.json", {"mem_limit": "lots"}, "mem_limit"),
    # the local stack's process pools: a run's command, environment or folder would be any code, anywhere
    ("process/pool.json", {"command": "sh -c 'cat ~/.ssh/id_rsa'"}, "command"),
    ("process/pool.json", {"env": {"AIAYN_WORK_DIR": "/elsewhere"}}, "env"),
    ("process/pool.json", {"working_dir": "/"}, "working_dir"),
]


@pytest.mark.parametrize(("name", "values", "field"), REFUSED)
def test_a_flow_run_sets_no_variable_but_the_bounded_ones(name: str, values: dict, field: str) -> None:
    template = pool(name)
    with pytest.raises(ValidationError, match=re.escape(field)):
        run_check(template, {}, values)  # a flow run's job variables
    with pytest.raises(ValidationError, match=re.escape(field)):
        run_check(template, values, {})  # a deployment's


@pytest.mark.parametrize(("name", "values"), [
    ("kubernetes/gpu-pool.json", {"gpus": 8, "cpu": "500m", "memory": "8Gi", "shm_size": "32Gi", "name": "wmt14"}),
    ("kubernetes/cpu-pool.json", {"cpu": "0.5", "memory": "512Mi", "labels": {"example.com/team": "ml"}}),
    ("docker/cpu-pool.json", {"mem_limit": "8g", "container_create_kwargs": {
        "networking_config": {"aiayn-nodes": {"Aliases": ["aiayn-node0"]}}}}),
])
def test_a_flow_run_may_set_its_resources_and_node_0s_alias(name: str, values: dict) -> None:
    template = pool(name)
    run_check(template, {}, values)
    job = render(template, values)
    assert not find_placeholders(json.dumps(job))


def test_the_pools_gpu_maximum_is_the_platform_teams() -> None:
    from ops.pools import PoolError, template

    four = template("kubernetes", "aiayn-gpu", {"image": "reg/img:1"}, max_gpus=4)
    assert four["variables"]["properties"]["gpus"]["default"] == 4
    run_check(four, {}, {"gpus": 4})
    with pytest.raises(ValidationError, match="gpus"):
        run_check(four, {}, {"gpus": 5})
    with pytest.raises(PoolError, match="gpus=6 is refused"):
        template("kubernetes", "aiayn-gpu", {"image": "reg/img:1", "gpus": 6}, max_gpus=4)
    with pytest.raises(PoolError, match="--max-gpus 0"):
        template("kubernetes", "aiayn-gpu", {"image": "reg/img:1"}, max_gpus=0)


def test_the_image_holds_the_project_where_the_pull_step_looks() -> None:
    """prefect.yaml's pull step runs every flow in $AIAYN_PROJECT_DIR; the image sets it to where it copied the
    checkout, installs the pins CI tests, and torch 2.13.0 first (scripts/install.sh's order)."""
    pull = yaml.safe_load((DEPLOY.parent / "prefect.yaml").read_text(encoding="utf-8"))["pull"]
    assert pull == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $AIAYN_PROJECT_DIR }}"}}]
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    project = re.search(r"^ENV AIAYN_PROJECT_DIR=(\S+)", dockerfile, re.M).group(1)
    assert re.search(rf"^WORKDIR {re.escape(project)}$", dockerfile, re.M)
    torch_at, rest_at = dockerfile.index("torch==2.13.0"), dockerfile.index("-c requirements/constraints.txt")
    assert torch_at < rest_at


def test_pools_take_a_teams_defaults_and_refuse_what_the_schema_refuses() -> None:
    from ops.pools import PoolError, templates

    bases = templates("kubernetes", "reg/aiayn-pipeline:abc", {"namespace": "ml", **CLUSTER},
                      gpu_image="reg/aiayn-pipeline-gpu:abc", gpu_values={"gpus": 4})
    assert sorted(bases) == ["aiayn-cpu", "aiayn-gpu"]
    cpu, gpu = (bases[p]["job_configuration"] for p in ("aiayn-cpu", "aiayn-gpu"))
    images = [c["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["image"] for c in (cpu, gpu)]
    assert images == ["reg/aiayn-pipeline:abc", "reg/aiayn-pipeline-gpu:abc"]
    assert cpu["namespace"] == gpu["namespace"] == "ml"
    assert bases["aiayn-gpu"]["variables"]["properties"]["gpus"]["default"] == 4
    job = render(bases["aiayn-gpu"], {})  # a deployment setting nothing gets the team's pod
    assert job["job_manifest"]["spec"]["template"]["spec"]["tolerations"] == CLUSTER["tolerations"]
    for values, why in (({"gpus": 0}, "gpus=0 is refused"), ({"node_selecter": {}}, "no variable 'node_selecter'")):
        with pytest.raises(PoolError, match=why):
            templates("kubernetes", "reg/img:1", {}, gpu_values=values)
    with pytest.raises(PoolError, match="needs the project's image"):
        templates("docker", "", {})


def test_pools_apply_makes_one_pool_with_pool_and_names_a_type_without_its_template(capsys) -> None:
    """A Docker team's GPU pool: Docker's templates hold the CPU pool only, so ``--pool aiayn-gpu`` takes another
    type's template (process) and leaves the CPU pool alone; a pool the type has no template for is refused."""
    import json

    from ops.pools import main

    assert main(["show", "--type", "process", "--pool", "aiayn-gpu"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)) == ["aiayn-gpu"]
    assert main(["show", "--type", "docker", "--image", "reg/img:1", "--pool", "aiayn-gpu"]) == 2
    assert capsys.readouterr().err == ("error: --pool aiayn-gpu: --type docker has no template for it (deploy/docker/ "
                                       "makes aiayn-cpu); make it with another --type, e.g. process\n")


@pytest.mark.integration
def test_pools_are_applied_to_the_server_at_prefect_api_url(tmp_path: Path) -> None:
    """On servers started as a team's (``ops.localstack up --worker none``: no pool, deployment or worker of the
    stack's own): the pools are made with the team's values pinned, the server refuses a flow run that sets a
    pinned variable or asks for more GPUs than the pool's maximum, and a pool is never re-made as another type
    (Prefect would keep its type and swap only its template)."""
    import os
    import subprocess
    import sys
    import urllib.error

    from ops.localstack import Stack, free_port
    from tests.conftest import api

    stack = [sys.executable, "-m", "ops.localstack", "--home", str(tmp_path / "stack")]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "AIAYN_STACK_PASSWORD"))},
           "PREFECT_HOME": str(tmp_path / "client")}
    try:
        up = subprocess.run([*stack, "up", "--worker", "none", "--prefect-port", str(free_port()), "--mlflow-port",
                             str(free_port())], env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "workers:     none (--worker none)" in up.stdout
        services = Stack(tmp_path / "stack").load()
        assert sorted(services) == ["mlflow", "prefect-server"]
        env["PREFECT_API_URL"] = services["prefect-server"].url + "/api"
        assert api(env["PREFECT_API_URL"], "/work_pools/filter", {}) == []
        assert api(env["PREFECT_API_URL"], "/deployments/filter", {}) == []
        # before the pools: `ops.localstack deploy` names the pool to make first, not Prefect's "does not exist"
        res = subprocess.run([sys.executable, "-m", "ops.localstack", "deploy"], env=env, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2 and res.stderr == (
            f"error: PREFECT_API_URL {env['PREFECT_API_URL']}: the server has no work pool aiayn-cpu (answer 404), "
            "which prefect.yaml's deployments run on; make the pools first: python -m ops.pools apply "
            "(docs/how-to/team-servers.md)\n"), res.stderr
        cmd = [sys.executable, "-m", "ops.pools", "apply", "--type", "kubernetes", "--image",
               "reg/aiayn-pipeline:t1", "--var", "namespace=ml", "--gpu-var", "gpus=2"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        pools = {p["name"]: p for p in api(env["PREFECT_API_URL"], "/work_pools/filter", {})}
        assert {pools[p]["type"] for p in ("aiayn-cpu", "aiayn-gpu")} == {"kubernetes"}
        gpu = pools["aiayn-gpu"]["base_job_template"]
        assert (gpu["job_configuration"]["namespace"], gpu["variables"]["properties"]["gpus"]["default"]) == ("ml", 2)
        # applied again with other values: the pools are overwritten, of the same type
        res = subprocess.run([*cmd[:-4], "--var", "namespace=ml2", "--gpu-var", "gpus=3"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        again = {p["name"]: p for p in api(env["PREFECT_API_URL"], "/work_pools/filter", {})}
        assert {p["id"]: p["type"] for p in again.values()} == {p["id"]: p["type"] for p in pools.values()}
        gpu = again["aiayn-gpu"]["base_job_template"]
        assert (gpu["job_configuration"]["namespace"], gpu["variables"]["properties"]["gpus"]["default"]) == ("ml2", 3)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)  # back to the first values
        assert res.returncode == 0, res.stdout + res.stderr
        # a deployment on the pool: its flow runs' job variables are checked by the server as they are created
        flow = api(env["PREFECT_API_URL"], "/flows/", {"name": "bounded"})
        deployment = api(env["PREFECT_API_URL"], "/deployments/", {
            "name": "bounded", "flow_id": flow["id"], "work_pool_name": "aiayn-gpu", "entrypoint": "flows/x.py:f"})

        def create_flow_run(job_variables: dict) -> tuple[int, str]:
            try:
                run = api(env["PREFECT_API_URL"], f"/deployments/{deployment['id']}/create_flow_run",
                          {"job_variables": job_variables})
                return 201, run["id"]
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        for refused, field in (({"namespace": "kube-system"}, "namespace"), ({"gpus": 100}, "gpus"),
                               ({"command": "sh"}, "command"), ({"env.AIAYN_WORK_DIR": "/x"}, "env.AIAYN_WORK_DIR")):
            code, detail = create_flow_run(refused)
            assert code == 422 and field in detail, (refused, code, detail)
        assert create_flow_run({"gpus": 2, "memory": "8Gi"})[0] == 201
        res = subprocess.run([sys.executable, "-m", "ops.pools", "apply", "--type", "docker", "--image", "reg/x:1"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert (res.returncode, res.stderr) == (2, (
            "error: work pool aiayn-cpu exists as a kubernetes pool, not docker, and Prefect does not change a "
            "pool's type: stop its kubernetes workers and delete it first (prefect work-pool delete aiayn-cpu)\n"))
        cpu = api(env["PREFECT_API_URL"], "/work_pools/aiayn-cpu")
        assert cpu["type"] == "kubernetes" and "job_manifest" in cpu["base_job_template"]["job_configuration"]
        unset = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
        res = subprocess.run(cmd, env=unset, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and "PREFECT_API_URL is not set" in res.stderr
    finally:
        subprocess.run([*stack, "down"], env=env, capture_output=True, timeout=120)


def test_the_cluster_manifests_agree_with_the_templates_and_prefect_yaml() -> None:
    """One namespace, one claim, one Service name and one label across deploy/kubernetes/*.yaml, the pools'
    templates, prefect.yaml's two-node deployment and the label the training stage sets."""
    from ops.pools import TEMPLATES

    docs = {(d["kind"], d["metadata"]["name"]): d for f in ("namespace", "node0-service", "workers")
            for d in yaml.safe_load_all((DEPLOY / "kubernetes" / f"{f}.yaml").read_text(encoding="utf-8"))}
    for name in TEMPLATES["kubernetes"].values():
        variables = load(name)["variables"]["properties"]
        namespace, claim = variables["namespace"]["default"], variables["shared_claim"]["default"]
        assert ("Namespace", namespace) in docs and ("PersistentVolumeClaim", claim) in docs, name
        assert docs[("PersistentVolumeClaim", claim)]["spec"]["accessModes"] == ["ReadWriteMany"]
    service = docs[("Service", "aiayn-node0")]
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["selector"] == {"aiayn-node-rank": "0"}
    from pipeline.config import LaunchConfig
    from tasks.training import _node_job_variables

    labels = {"team": "ml"}
    launch = LaunchConfig(nnodes=2, node_job_variables={"0": {"labels": labels}})
    assert _node_job_variables(launch, 0)["labels"] == {**labels, **service["spec"]["selector"]}
    spec = yaml.safe_load((DEPLOY.parent / "prefect.yaml").read_text(encoding="utf-8"))
    (two,) = [d for d in spec["deployments"] if d["name"] == "wmt14-base-2nodes"]
    host, port = two["parameters"]["overrides"]["launch.rdzv_endpoint"].split(":")
    assert host == f"aiayn-node0.{namespace}.svc.cluster.local" and int(port) == service["spec"]["ports"][0]["port"]
    workers = {d["spec"]["template"]["spec"]["containers"][0]["args"][4]: d for k, d in docs.items()
               if k[0] == "Deployment"}
    assert sorted(workers) == sorted(TEMPLATES["kubernetes"])
    assert all(w["spec"]["template"]["spec"]["serviceAccountName"] == "prefect-worker" for w in workers.values())
    rules = docs[("Role", "prefect-worker")]["rules"]
    assert any("jobs" in r["resources"] and "create" in r["verbs"] for r in rules)
