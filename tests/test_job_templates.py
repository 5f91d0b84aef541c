"""The work pools' base job templates a team deploys with (deploy/, docs/how-to/team-servers.md): each passes the
check the Prefect server makes when a pool is created with it, its job variables validate as the server validates a
deployment's, and each renders, with Prefect's own templating as its worker does, into a job with nothing left
unresolved. The image (deploy/Dockerfile) sets the folder prefect.yaml's pull step runs the flows in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.schema_tools.validation import ValidationError, is_valid_schema, validate
from prefect.utilities.templating import apply_values, find_placeholders

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
TEMPLATES = ("kubernetes/cpu-pool.json", "kubernetes/gpu-pool.json", "docker/cpu-pool.json")
# what a team's deployment or worker sets (docs/how-to/team-servers.md)
TEAM = {"image": "registry.internal/ml/aiayn-pipeline:5ec8025",
        "env": {"PREFECT_API_URL": "http://prefect.mlops.svc:4200/api",
                "MLFLOW_TRACKING_URI": "http://mlflow.mlops.svc:5000",
                "AIAYN_DATA_ROOT": "/shared/data", "AIAYN_WORK_DIR": "/shared/work"},
        "labels": {"aiayn-node-rank": "0"}}
# and on Kubernetes: where the pods go, how they pull the image, and secrets read from the cluster's own
CLUSTER = {"node_selector": {"nvidia.com/gpu.present": "true"},
           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
           "image_pull_secrets": [{"name": "regcred"}],
           "secret_env": [{"name": "MLFLOW_TRACKING_PASSWORD",
                           "valueFrom": {"secretKeyRef": {"name": "aiayn-mlflow", "key": "password"}}}]}


def load(name: str) -> dict:
    return json.loads((DEPLOY / name).read_text(encoding="utf-8"))


def render(template: dict, values: dict) -> dict:
    """The job a worker builds for a flow run: the variables' defaults, overlaid by the deployment's job variables,
    substituted into the job configuration (as prefect.workers.base.BaseJobConfiguration does)."""
    schema = template["variables"]["properties"]
    variables = {k: v["default"] for k, v in schema.items() if v.get("default") is not None} | values
    return apply_values(template["job_configuration"], variables)


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_base_job_template_passes_the_servers_checks_and_renders_whole(name: str) -> None:
    template = load(name)
    values = TEAM | (CLUSTER if name.startswith("kubernetes/") else {})
    assert validate_base_job_template(template) is template  # every placeholder declared as a variable
    is_valid_schema(template["variables"])
    validate(values, template["variables"], raise_on_error=True)  # a deployment's job variables, as the server checks
    job = render(template, values)
    assert not find_placeholders(json.dumps(job)), name  # nothing left for the worker to trip on
    assert job["env"] == TEAM["env"] and job["labels"] == TEAM["labels"]
    if name.startswith("kubernetes/"):
        pod = job["job_manifest"]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        # the worker puts env's plain values before these (prefect-kubernetes: _populate_env_in_manifest)
        assert container["image"] == TEAM["image"] and container["env"] == CLUSTER["secret_env"]
        spec = pod["spec"]
        assert (spec["nodeSelector"], spec["tolerations"], spec["imagePullSecrets"]) == (
            CLUSTER["node_selector"], CLUSTER["tolerations"], CLUSTER["image_pull_secrets"])
        # the pod carries the job's labels: the headless Service of multi-node training selects node 0 by them
        assert pod["metadata"]["labels"] == TEAM["labels"]
        assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
        assert job["job_manifest"]["spec"]["backoffLimit"] == 0  # a failed run is resumed by Prefect, not re-run
        limits = container["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (name == "kubernetes/gpu-pool.json")
    else:
        assert job["image"] == TEAM["image"] and "/srv/aiayn:/shared" in job["volumes"]


@pytest.mark.parametrize(("name", "values", "field"), [
    ("kubernetes/gpu-pool.json", {"gpus": 0}, "gpus"),
    ("kubernetes/cpu-pool.json", {"image_pull_policy": "Sometimes"}, "image_pull_policy"),
    ("docker/cpu-pool.json", {"volumes": "/srv:/shared"}, "volumes"),
    ("kubernetes/gpu-pool.json", {"image_pull_secrets": ["regcred"]}, "image_pull_secrets"),
])
def test_bad_job_variables_are_refused_naming_the_variable(name: str, values: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        validate(values, load(name)["variables"], raise_on_error=True)


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
    cpu, gpu = (bases[p]["variables"]["properties"] for p in ("aiayn-cpu", "aiayn-gpu"))
    assert cpu["image"]["default"] == "reg/aiayn-pipeline:abc"
    assert gpu["image"]["default"] == "reg/aiayn-pipeline-gpu:abc"
    assert cpu["namespace"]["default"] == gpu["namespace"]["default"] == "ml" and gpu["gpus"]["default"] == 4
    job = render(bases["aiayn-gpu"], {})  # a deployment setting nothing gets the team's pod
    assert job["job_manifest"]["spec"]["template"]["spec"]["tolerations"] == CLUSTER["tolerations"]
    for values, why in (({"gpus": 0}, "gpus=0 is refused"), ({"node_selecter": {}}, "no variable 'node_selecter'")):
        with pytest.raises(PoolError, match=why):
            templates("kubernetes", "reg/img:1", {}, gpu_values=values)
    with pytest.raises(PoolError, match="needs the project's image"):
        templates("docker", "", {})


@pytest.mark.integration
def test_pools_are_applied_to_the_server_at_prefect_api_url(tmp_path: Path) -> None:
    """On a Prefect server of its own (the stack's pools are process pools that other tests' workers serve)."""
    import os
    import subprocess
    import sys

    from ops.localstack import free_port, start_prefect_server
    from tests.conftest import api

    server = start_prefect_server(tmp_path / "prefect", free_port())
    try:
        env = {**os.environ, "PREFECT_API_URL": server.url + "/api", "PREFECT_HOME": str(tmp_path / "prefect")}
        cmd = [sys.executable, "-m", "ops.pools", "apply", "--type", "kubernetes", "--image",
               "reg/aiayn-pipeline:t1", "--var", "namespace=ml", "--gpu-var", "gpus=2"]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        pools = {p["name"]: p for p in api(env["PREFECT_API_URL"], "/work_pools/filter", {})}
        assert {pools[p]["type"] for p in ("aiayn-cpu", "aiayn-gpu")} == {"kubernetes"}
        variables = pools["aiayn-gpu"]["base_job_template"]["variables"]["properties"]
        assert (variables["image"]["default"], variables["namespace"]["default"], variables["gpus"]["default"]) == (
            "reg/aiayn-pipeline:t1", "ml", 2)
        unset = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
        res = subprocess.run(cmd, env=unset, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and "PREFECT_API_URL is not set" in res.stderr
    finally:
        server.stop()


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
