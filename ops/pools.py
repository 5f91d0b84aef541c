"""The work pools a team's Prefect server needs, made from the templates under deploy/ with the team's own defaults
(the image it pushed, the namespace, the shared volume, node selectors, tolerations, pull secrets, secrets), so
that no template is edited by hand.

    python -m ops.pools apply --type kubernetes --image REGISTRY/aiayn-pipeline:TAG \\
        [--gpu-image REGISTRY/aiayn-pipeline-gpu:TAG] [--var VARIABLE=JSON ...] [--gpu-var VARIABLE=JSON ...] \\
        [--max-gpus N]
    python -m ops.pools apply --type docker --image aiayn-pipeline:TAG --var 'volumes=["/srv/aiayn:/shared"]'
    python -m ops.pools apply --type process --pool aiayn-gpu    # one pool only: Docker's has no GPU pool
    python -m ops.pools show ...      # the templates ``apply`` would send, as JSON, creating nothing

Pools by role, as prefect.yaml's deployments name them: ``aiayn-cpu`` (the CPU pipeline runs and their node runs)
and ``aiayn-gpu`` (the paper-scale runs and their nodes: one pod with its GPUs; Kubernetes only). Each value of
``--var`` (both pools) or ``--gpu-var`` (the GPU pool) is JSON (a bare word is a string) and is checked against the
variable's schema before anything is sent.

What a flow run (or a deployment: Prefect checks both against the same schema) may set is the templates' variables
that are not ``readOnly``: its labels and job name, its resources (Kubernetes quantities, 1 to ``--max-gpus`` GPUs),
how long its finished job is kept, and on Docker node 0's network alias. The ``readOnly`` ones (the image, the
environment and its secrets, the command, the namespace, the service account, the volumes, the networks, node
selectors, tolerations, pull secrets) are the pool creator's: ``apply`` writes their values into the pools' job
configuration and leaves them out of the variables, which take no name they do not list. ``apply`` talks to the
server at PREFECT_API_URL, which must be set: without it prefect.toml sends the Prefect CLI to this machine's
127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"kubernetes": {"aiayn-cpu": "kubernetes/cpu-pool.json", "aiayn-gpu": "kubernetes/gpu-pool.json"},
             "docker": {"aiayn-cpu": "docker/cpu-pool.json"},
             # process workers run flows in their own checkout (the local stack's): no image
             "process": {"aiayn-cpu": "process/pool.json", "aiayn-gpu": "process/pool.json"}}


class PoolError(ValueError):
    """A value the template refuses, or a server that refused the pool; the message names which."""


def template(kind: str, pool: str, defaults: dict, max_gpus: int | None = None) -> dict:
    """The base job template of ``pool`` on a ``kind`` worker as the server gets it: its variables' defaults
    replaced by ``defaults``, each checked against its variable's schema (Prefect's own validation, as the server
    checks job variables), and every pinned variable (``readOnly`` in deploy/) written into the job configuration
    and dropped from the variables, so that no deployment or flow run can set it (the schema takes no variable it
    does not name). ``max_gpus``: the most GPUs a run of the GPU pool may ask for (default: the template's)."""
    from prefect.utilities.schema_tools.validation import ValidationError, validate
    from prefect.utilities.templating import NotSet

    base = json.loads((REPO / "deploy" / TEMPLATES[kind][pool]).read_text(encoding="utf-8"))
    variables = base["variables"]["properties"]
    if max_gpus is not None and "gpus" in variables:
        if max_gpus < 1:
            raise PoolError(f"--max-gpus {max_gpus}: give 1 or more")
        variables["gpus"]["maximum"] = max_gpus
        variables["gpus"]["default"] = min(variables["gpus"]["default"], max_gpus)
    for name, value in defaults.items():
        if name not in variables:
            raise PoolError(f"{pool} ({TEMPLATES[kind][pool]}) has no variable {name!r}; it has "
                            f"{', '.join(sorted(variables))}")
        try:
            validate({name: value}, {"type": "object", "properties": {name: variables[name]}}, raise_on_error=True)
        except ValidationError as e:
            raise PoolError(f"{pool}: {name}={json.dumps(value)} is refused: {e}") from None
        variables[name]["default"] = value
    if "image" in variables and not variables["image"].get("default"):  # a team's own, as it pushed it
        raise PoolError(f"{pool} needs the project's image (--image REGISTRY/aiayn-pipeline:TAG)")
    pinned = {name: v.get("default", NotSet) for name, v in variables.items() if v.get("readOnly")}
    base["job_configuration"] = _pin(base["job_configuration"], pinned)
    for name in pinned:
        del variables[name]
    return base


def _pin(config, pinned: dict):
    """``config`` with every placeholder of a pinned variable replaced by its value; a key whose pinned variable
    has no value is dropped (as the worker drops it), so that the worker's own default applies (the command)."""
    from prefect.utilities.templating import NotSet, apply_values, find_placeholders

    if isinstance(config, dict):
        out = {k: _pin(v, pinned) for k, v in config.items()}
        return {k: v for k, v in out.items() if v is not NotSet}
    if isinstance(config, list):
        return [_pin(v, pinned) for v in config]
    if isinstance(config, str) and (names := {p.name for p in find_placeholders(config)}) and names <= set(pinned):
        return apply_values(config, pinned, remove_notset=False)
    return config


def templates(kind: str, image: str, values: dict, gpu_image: str | None = None,
              gpu_values: dict | None = None, max_gpus: int | None = None) -> dict[str, dict]:
    """Every pool of ``kind`` with its template: ``image`` and ``values`` for all, ``gpu_image`` (default
    ``image``), ``gpu_values`` over them and ``max_gpus`` for the GPU pool."""
    out = {}
    for pool in TEMPLATES[kind]:
        gpu = pool == "aiayn-gpu"
        pinned = {**values, **((gpu_values or {}) if gpu else {})}
        if kind != "process":
            pinned["image"] = (gpu_image or image) if gpu else image
        out[pool] = template(kind, pool, pinned, max_gpus if gpu else None)
    return out


def server_call(env: dict[str, str], path: str, body: dict | None = None, method: str | None = None,
                attempts: int = 5, timeout: float = 30.0):
    """One call of the Prefect REST API at ``env``'s PREFECT_API_URL (with its PREFECT_API_AUTH_STRING): GET, or POST
    with ``body`` unless ``method`` says otherwise; the decoded JSON answer (None for an empty one). Raises
    urllib's HTTPError for an error status, URLError or OSError when no server answers.

    A busy server (its SQLite database locked by another writer) answers 503 or 429 for a moment, or not within
    ``timeout`` seconds; like Prefect's own client, the call is retried then, a few times with a growing pause."""
    auth = env.get("PREFECT_API_AUTH_STRING")
    headers = {"Content-Type": "application/json",
               **({"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {})}
    req = urllib.request.Request(env["PREFECT_API_URL"].rstrip("/") + path, headers=headers,
                                 data=None if body is None else json.dumps(body).encode(),
                                 method=method or ("GET" if body is None else "POST"))
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                answer = r.read()
            return json.loads(answer) if answer else None
        except urllib.error.HTTPError as e:
            if e.code not in (429, 503) or attempt == attempts - 1:
                raise
            wait = e.headers.get("Retry-After", "")
            pause = float(wait) if wait.isdigit() else 2.0 ** attempt
        except TimeoutError:  # the answer did not come in time (a server stalled on its database)
            if attempt == attempts - 1:
                raise
            pause = 2.0 ** attempt
        time.sleep(min(pause, 10.0))


def existing_type(pool: str, env: dict[str, str]) -> str | None:
    """The type of work pool ``pool`` on the server at ``env``'s PREFECT_API_URL (with its PREFECT_API_AUTH_STRING),
    None when it has no such pool."""
    try:
        return server_call(env, f"/work_pools/{urllib.parse.quote(pool)}")["type"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise PoolError(f"work pool {pool}: the server at PREFECT_API_URL answered {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise PoolError(f"work pool {pool}: no server answers at PREFECT_API_URL ({getattr(e, 'reason', e)})") from None


def create(pool: str, kind: str, base: dict, env: dict[str, str]) -> None:
    """Create work pool ``pool`` of type ``kind`` with job template ``base`` on the server at PREFECT_API_URL, or
    give the existing one that template (what ``prefect work-pool create --overwrite`` does, in REST calls rather
    than a Prefect CLI process); a PoolError when the pool exists with another type: Prefect keeps an
    existing pool's type and would only swap its template, leaving a pool whose workers get a template of another
    kind."""
    if (had := existing_type(pool, env)) not in (None, kind):
        raise PoolError(f"work pool {pool} exists as a {had} pool, not {kind}, and Prefect does not change a pool's "
                        f"type: stop its {had} workers and delete it first (prefect work-pool delete {pool})")
    # what the CLI sends: the template, unpaused, with no description and no concurrency limit
    fields = {"base_job_template": base, "is_paused": False, "description": None, "concurrency_limit": None}
    try:
        try:
            server_call(env, "/work_pools/", {"name": pool, "type": kind, **fields})
        except urllib.error.HTTPError as e:
            if e.code != 409:  # 409: it exists (of this type, checked above): its template is replaced
                raise
            server_call(env, f"/work_pools/{urllib.parse.quote(pool)}", fields, method="PATCH")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[-2000:]
        raise PoolError(f"work pool {pool}: the server at PREFECT_API_URL refused it ({e.code}): {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise PoolError(f"work pool {pool}: no server answers at PREFECT_API_URL ({getattr(e, 'reason', e)})") from None


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
    p.add_argument("--image", help="the project's image, as the workers pull it (docker, kubernetes)")
    p.add_argument("--gpu-image", help="the GPU pool's image (deploy/Dockerfile with the CUDA torch; default --image)")
    p.add_argument("--var", dest="values", type=_assignment, action="append", default=[], metavar="VARIABLE=JSON",
                   help="a template variable's default, for every pool (e.g. namespace=ml, "
                        "'image_pull_secrets=[{\"name\": \"regcred\"}]')")
    p.add_argument("--gpu-var", dest="gpu_values", type=_assignment, action="append", default=[],
                   metavar="VARIABLE=JSON", help="the same, for the GPU pool only (e.g. gpus=4, tolerations=...)")
    p.add_argument("--max-gpus", type=int, help="the most GPUs a run of the GPU pool may ask for (job variable gpus; "
                                                "default 8)")
    p.add_argument("--pool", choices=["aiayn-cpu", "aiayn-gpu"],
                   help="only this pool (default: every pool --type has a template for), e.g. --type process --pool "
                        "aiayn-gpu beside Docker's CPU pool, which has no GPU twin")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        bases = templates(args.kind, args.image, dict(args.values), args.gpu_image, dict(args.gpu_values),
                          args.max_gpus)
        if args.pool is not None:
            if args.pool not in bases:
                raise PoolError(f"--pool {args.pool}: --type {args.kind} has no template for it (deploy/{args.kind}/ "
                                f"makes {', '.join(bases)}); make it with another --type, e.g. process")
            bases = {args.pool: bases[args.pool]}
        if args.action == "show":
            print(json.dumps(bases, indent=2))
            return 0
        if not os.environ.get("PREFECT_API_URL"):
            raise PoolError("PREFECT_API_URL is not set: export the team server's API address first "
                            "(export PREFECT_API_URL=http://HOST:4200/api), or the pools go to this machine's server")
        for pool, base in bases.items():
            create(pool, args.kind, base, dict(os.environ))
            image = (args.gpu_image or args.image) if pool == "aiayn-gpu" else args.image
            print(f"work pool {pool} ({args.kind})" + (f": image {image}" if args.kind != "process" else ""))
    except PoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
