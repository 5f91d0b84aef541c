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
TEMPLATES = ("kubernetes/pipeline-pool.json", "kubernetes/node-pool.json", "docker/pipeline-pool.json")
# what a team's deployment or worker sets (docs/how-to/team-servers.md)
TEAM = {"image": "registry.internal/ml/aiayn-pipeline:5ec8025",
        "env": {"PREFECT_API_URL": "http://prefect.mlops.svc:4200/api",
                "MLFLOW_TRACKING_URI": "http://mlflow.mlops.svc:5000",
                "AIAYN_DATA_ROOT": "/shared/data", "AIAYN_WORK_DIR": "/shared/work"},
        "labels": {"aiayn-node-rank": "0"}}


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
    assert validate_base_job_template(template) is template  # every placeholder declared as a variable
    is_valid_schema(template["variables"])
    validate(TEAM, template["variables"], raise_on_error=True)  # a deployment's job variables, as the server checks
    job = render(template, TEAM)
    assert not find_placeholders(json.dumps(job)), name  # nothing left for the worker to trip on
    assert job["env"] == TEAM["env"] and job["labels"] == TEAM["labels"]
    if name.startswith("kubernetes/"):
        pod = job["job_manifest"]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        assert container["image"] == TEAM["image"] and container["env"] == TEAM["env"]
        # the pod carries the job's labels: the headless Service of multi-node training selects node 0 by them
        assert pod["metadata"]["labels"] == TEAM["labels"]
        assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
        assert job["job_manifest"]["spec"]["backoffLimit"] == 0  # a failed run is resumed by Prefect, not re-run
        limits = container["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (name == "kubernetes/node-pool.json")
    else:
        assert job["image"] == TEAM["image"] and "/srv/aiayn:/shared" in job["volumes"]


@pytest.mark.parametrize(("name", "values", "field"), [
    ("kubernetes/node-pool.json", {"gpus": 0}, "gpus"),
    ("kubernetes/pipeline-pool.json", {"image_pull_policy": "Sometimes"}, "image_pull_policy"),
    ("docker/pipeline-pool.json", {"volumes": "/srv:/shared"}, "volumes"),
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
