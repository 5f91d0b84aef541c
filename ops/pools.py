"""The work pools a team's Prefect server needs, made from the templates under deploy/ with the team's own defaults
(the image it pushed, the namespace, the shared volume, node selectors, tolerations, pull secrets, secrets), so
that no template is edited by hand.

    python -m ops.pools apply --type kubernetes --image REGISTRY/aiayn-pipeline:TAG \\
        [--gpu-image REGISTRY/aiayn-pipeline-gpu:TAG] [--var VARIABLE=JSON ...] [--gpu-var VARIABLE=JSON ...]
    python -m ops.pools apply --type docker --image aiayn-pipeline:TAG --var 'volumes=["/srv/aiayn:/shared"]'
    python -m ops.pools show ...      # the templates ``apply`` would send, as JSON, creating nothing

Pools by role, as prefect.yaml's deployments name them: ``aiayn-cpu`` (the CPU pipeline runs and their node runs)
and ``aiayn-gpu`` (the paper-scale runs and their nodes: one pod with its GPUs; Kubernetes only). Each value of
``--var`` (both pools) or ``--gpu-var`` (the GPU pool) is JSON (a bare word is a string) and is checked against the
variable's schema before anything is sent. ``apply`` talks to the server at PREFECT_API_URL, which must be set:
without it prefect.toml sends the Prefect CLI to this machine's 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"kubernetes": {"aiayn-cpu": "kubernetes/cpu-pool.json", "aiayn-gpu": "kubernetes/gpu-pool.json"},
             "docker": {"aiayn-cpu": "docker/cpu-pool.json"}}


class PoolError(ValueError):
    """A value the template refuses, or a server that refused the pool; the message names which."""


def template(kind: str, pool: str, defaults: dict) -> dict:
    """The base job template of ``pool`` on a ``kind`` worker, its variables' defaults replaced by ``defaults``,
    each checked against its variable's schema (Prefect's own validation, as the server checks job variables)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    base = json.loads((REPO / "deploy" / TEMPLATES[kind][pool]).read_text(encoding="utf-8"))
    variables = base["variables"]["properties"]
    for name, value in defaults.items():
        if name not in variables:
            raise PoolError(f"{pool} ({TEMPLATES[kind][pool]}) has no variable {name!r}; it has "
                            f"{', '.join(sorted(variables))}")
        try:
            validate({name: value}, {"type": "object", "properties": {name: variables[name]}}, raise_on_error=True)
        except ValidationError as e:
            raise PoolError(f"{pool}: {name}={json.dumps(value)} is refused: {e}") from None
        variables[name]["default"] = value
    if not variables["image"].get("default"):  # the templates name no image: a team's own, as it pushed it
        raise PoolError(f"{pool} needs the project's image (--image REGISTRY/aiayn-pipeline:TAG)")
    return base


def templates(kind: str, image: str, values: dict, gpu_image: str | None = None,
              gpu_values: dict | None = None) -> dict[str, dict]:
    """Every pool of ``kind`` with its template: ``image`` and ``values`` for all, ``gpu_image`` (default
    ``image``) and ``gpu_values`` over them for the GPU pool."""
    out = {}
    for pool in TEMPLATES[kind]:
        gpu = pool == "aiayn-gpu"
        out[pool] = template(kind, pool, {**values, **((gpu_values or {}) if gpu else {}),
                                          "image": (gpu_image or image) if gpu else image})
    return out


def create(pool: str, kind: str, base: dict, env: dict[str, str]) -> None:
    """``prefect work-pool create POOL --type KIND --base-job-template FILE --overwrite`` against PREFECT_API_URL."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(base, f)
    try:
        res = subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", "work-pool", "create",
                              pool, "--type", kind, "--base-job-template", f.name, "--overwrite"], env=env,
                             cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    finally:
        os.unlink(f.name)
    if res.returncode != 0:
        raise PoolError(f"prefect work-pool create {pool} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")


def _assignment(text: str) -> tuple[str, object]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected VARIABLE=JSON")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw  # a bare word: a string


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.pools", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["apply", "show"], help="apply: create or overwrite the pools on the server "
                                                             "at PREFECT_API_URL; show: print their templates")
    p.add_argument("--type", dest="kind", choices=sorted(TEMPLATES), required=True, help="the workers' type")
    p.add_argument("--image", required=True, help="the project's image, as the workers pull it")
    p.add_argument("--gpu-image", help="the GPU pool's image (deploy/Dockerfile with the CUDA torch; default --image)")
    p.add_argument("--var", dest="values", type=_assignment, action="append", default=[], metavar="VARIABLE=JSON",
                   help="a template variable's default, for every pool (e.g. namespace=ml, "
                        "'image_pull_secrets=[{\"name\": \"regcred\"}]')")
    p.add_argument("--gpu-var", dest="gpu_values", type=_assignment, action="append", default=[],
                   metavar="VARIABLE=JSON", help="the same, for the GPU pool only (e.g. gpus=4, tolerations=...)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bases = templates(args.kind, args.image, dict(args.values), args.gpu_image, dict(args.gpu_values))
        if args.action == "show":
            print(json.dumps(bases, indent=2))
            return 0
        if not os.environ.get("PREFECT_API_URL"):
            raise PoolError("PREFECT_API_URL is not set: export the team server's API address first "
                            "(export PREFECT_API_URL=http://HOST:4200/api), or the pools go to this machine's server")
        for pool, base in bases.items():
            create(pool, args.kind, base, dict(os.environ))
            print(f"work pool {pool} ({args.kind}): image {base['variables']['properties']['image']['default']}")
    except PoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
