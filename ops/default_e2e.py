"""The README's main job end to end, timed, and what it gave, as one record (what each CPU class gets).

Runs what a new user runs after the install: ``python -m ops.localstack up`` and ``prefect deployment run
'train-en-de/<deployment>' --watch``, on a stack of its own (fresh databases, a fresh work dir, free ports, under
``--home``), so that nothing an earlier run cached is reused and every stage runs. Then it reads the flow run's
task times from the Prefect API, the run's files (training summary, the choice of N, scores, the export gate and
the chosen model's translations) from the work dir, and the promotion decision from the MLflow registry, stops
the stack, and writes the record the ledger cites (``job_seconds`` from ``up`` to the flow run finished)::

    python -m ops.default_e2e --tag zen3        # bench/results/default_e2e/multi30k-cpu_zen3_<date>.json

Run it on an idle machine: the job trains on a clock budget, so what it gets depends on what else runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path


from ops.localstack import free_port, prefect_api
from pipeline.config import REPO_ROOT as REPO, load_config
from pipeline.support.fsutil import write_json
from pipeline.support.hardware import cpu_class
from pipeline.speed import cpu_name
from pipeline.support.provenance import short_commit

FLOW = "train-en-de"


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").rstrip("\n").split("\n")


def _one(parent: Path, pattern: str) -> Path:
    """The single match of ``pattern`` under ``parent``: a fresh work dir holds exactly one of each output."""
    found = sorted(parent.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"expected one {pattern} under {parent}, found {len(found)}: was the work dir fresh?")
    return found[0]


def run_job(home: Path, env: dict[str, str], deployment: str, data_root: Path, params: list[str]) -> float:
    """Start the stack under ``home`` on the ports of ``env``'s URLs, run the deployment and watch it; the job's
    seconds (from ``up`` to the flow run finished). The stack is left up for the reads."""
    prefect_port, mlflow_port = (urllib.parse.urlsplit(env[k]).port for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))
    prefect = str(Path(sys.executable).with_name("prefect"))
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "ops.localstack", "up", "--home", str(home / "stack"), "--work-dir",
                    str(home / "runs"), "--data-root", str(data_root), "--prefect-port", str(prefect_port),
                    "--mlflow-port", str(mlflow_port)], cwd=REPO, env=env, check=True)
    subprocess.run([prefect, "deployment", "run", f"{FLOW}/{deployment}", "--watch",
                    *[a for kv in params for a in ("-p", kv)]], cwd=REPO, env=env, check=True)
    return time.monotonic() - start


def flow_times(api: str, deployment: str) -> tuple[dict, dict[str, float], str]:
    """The deployment's latest flow run (its seconds, state and parameters' config) and each task's seconds."""
    dep = prefect_api(api, f"/deployments/name/{FLOW}/{deployment}")
    runs = prefect_api(api, "/flow_runs/filter", {"deployments": {"id": {"any_": [dep["id"]]}},
                                                  "sort": "START_TIME_DESC", "limit": 1})
    if not runs:
        raise SystemExit(f"no flow run of {FLOW}/{deployment} on {api}")
    fr = runs[0]
    tasks = prefect_api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [fr["id"]]}}, "limit": 200})
    seconds: dict[str, float] = {}
    for t in sorted(tasks, key=lambda t: t["start_time"] or ""):
        name = t["name"].rsplit("-", 1)[0]  # a task run is named <task>-<suffix>
        seconds[name] = round(seconds.get(name, 0.0) + t["total_run_time"], 1)
    config = (fr.get("parameters") or {}).get("config") or dep["parameters"].get("config")
    return {"seconds": round(fr["total_run_time"], 1), "state": fr["state_type"], "config": config}, seconds, fr["id"]


def promotion(mlflow: str, model: str) -> dict:
    """The newest registered version of ``model`` and its promotion tags (``promotion.*``)."""
    query = urllib.parse.urlencode({"filter": f"name='{model}'"})
    with urllib.request.urlopen(f"{mlflow}/api/2.0/mlflow/model-versions/search?{query}", timeout=30) as r:
        found = json.loads(r.read()).get("model_versions", [])
    if not found:
        return {"version": None, "decision": "not registered"}
    newest = max(found, key=lambda v: int(v["version"]))
    tags = {t["key"]: t["value"] for t in newest.get("tags", [])}
    return {"version": int(newest["version"]), "decision": tags.get("promotion.decision"),
            "reason": tags.get("promotion.reason")}


def run_files(work: Path) -> dict:
    """What the run wrote under a fresh work dir: training summary, choice of N, scores, export gate, and the
    chosen model's translations of dev and test2016."""
    train = _one(work / "train", "*/train_summary.json").parent
    choose = _one(train / "averaged", "choose-*/choice.json").parent
    evaluated = _one(choose, "eval-*/scores.json").parent
    gate = sorted(choose.glob("ctranslate2-*/gate.json"))
    choice = _read(choose / "choice.json")
    scores = {split: {k: s[k]["score"] for k in ("sacrebleu", "chrf")}
              for split, s in _read(evaluated / "scores.json")["splits"].items()}
    return {"train_summary": _read(train / "train_summary.json"),
            "choose_n": {"chosen_n": choice["chosen_n"],
                         "candidates": [{k: c[k] for k in ("n", "dev", "steps")} for c in choice["candidates"]]},
            "scores": scores,
            "export_gate": _read(gate[0]) if gate else None,
            "outputs": {"dev": _lines(evaluated / "dev.hyp"), "test2016": _lines(evaluated / "test.test2016.hyp")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", default="multi30k-cpu", help=f"a deployment of {FLOW} in prefect.yaml")
    p.add_argument("--data-root", type=Path, default=REPO.parent / "shared" / "data")
    p.add_argument("--home", type=Path, help="the stack's and the run's folder (default: a new temporary one; "
                                             "it must not hold an earlier run)")
    p.add_argument("--tag", required=True, help="the machine in the record's name, e.g. zen3 (the CPU's name and "
                                                "class are recorded in it too)")
    p.add_argument("--out", type=Path, help="default bench/results/default_e2e/<deployment>_<tag>_<date>.json")
    p.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a flow parameter, as prefect deployment run -p takes it (a rehearsal: -p max_steps=20)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary home (checkpoints, databases) after the record; a --home is always kept")
    args = p.parse_args()
    home = (args.home or Path(tempfile.mkdtemp(prefix="aiayn-e2e-"))).resolve()
    if (home / "runs").exists() and any((home / "runs").iterdir()):
        raise SystemExit(f"{home / 'runs'} holds an earlier run: its cached stages would not run again; "
                         "give another --home")
    commit, date = short_commit(), datetime.date.today().isoformat()
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",
           "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}
    try:  # the stack goes down whatever happens, a failed flow run included
        job_seconds = run_job(home, env, args.deployment, args.data_root.resolve(), args.param)
        flow, tasks, flow_run_id = flow_times(env["PREFECT_API_URL"], args.deployment)
        model = load_config(flow["config"]).registered_model_name
        record = {"config": flow["config"], "machine": cpu_name(), "cpu_class": cpu_class(),
                  "cpus": os.cpu_count(), "commit": commit,
                  "command": " ".join(["python -m ops.default_e2e --deployment", args.deployment, "--tag", args.tag,
                                       *[f"-p {kv}" for kv in args.param]]),
                  "job_seconds": round(job_seconds, 1),
                  "job_seconds_what": "localstack up (servers, worker, deployments) to the flow run finished",
                  "flow_run_id": flow_run_id, "flow_state": flow["state"], "flow_seconds": flow["seconds"],
                  "tasks_seconds": tasks, **run_files(home / "runs"),
                  "registry": promotion(env["MLFLOW_TRACKING_URI"], model)}
    finally:
        subprocess.run([sys.executable, "-m", "ops.localstack", "down", "--home", str(home / "stack")], cwd=REPO,
                       env=env, check=False)
    out = args.out or REPO / "bench" / "results" / "default_e2e" / f"{args.deployment}_{args.tag}_{date}.json"
    write_json(out, record)
    if not args.keep and args.home is None:
        shutil.rmtree(home, ignore_errors=True)
    print(f"{out}: {record['flow_state']}, job {job_seconds / 60:.1f} min, train {tasks.get('train', 0) / 60:.1f} "
          f"min, updates {record['train_summary']['steps']}, test2016 {record['scores']}")


if __name__ == "__main__":
    main()
