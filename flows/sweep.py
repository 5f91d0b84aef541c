"""The recipe search: ``sweep-translation`` (any translation pair: the base config says which) and ``sweep-parse``
(a parser's), controller flows over trial runs of the pipeline's own deployment (``train-en-de``, ``parse-wsj``).
``sweep-en-de`` is the former name of ``sweep-translation``, kept so that what started it (``prefect deployment
run 'sweep-en-de/multi30k-cpu'``, schedules, scripts) still does. One body for all three, scored on the task's
own metric: sacreBLEU for translation, EVALB F1 (over sentences, against the gold trees) for parsing.

    open the Optuna study (resumable) -> search: trials as flow runs on the work pool, pruned on dev NLL
    -> confirm: the top trials and the base with paired seeds -> verdicts (pooled paired bootstrap, Bonferroni)
    -> winner preset YAML, leaderboard and report (Prefect artifacts, MLflow parent run with a child per run)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from flows.common import close_tracking_runs
from pipeline import tracking
from pipeline.config import ConfigError, FlowRunTrust, ensure_work_dir
from pipeline.support.fsutil import exclusive, write_text
from pipeline.sweep.config import base_point, check_space, expand, load_sweep, resolve_base, variations
from pipeline.sweep.search import arms, finished, open_study, search
from pipeline.sweep.search import confirm as confirm_arms
from pipeline.sweep.verdict import Verdict, judge, leaderboard, markdown, winner, write_winner
from tasks.sweep import DeploymentRunner, cancel_started_runs, publish

# A flow parameter that counts runs: refused below 1 when the run is created (the deployment's schema), not
# taken as "unset"; None (left out) is the sweep file's value.
Count = Annotated[int, Field(ge=1)]


def _sweep_flow(name: str):
    """The decorator of sweep flow ``name``. A sweep that fails or crashes cancels the trial runs it started
    (:func:`tasks.sweep.cancel_started_runs`) and ends its MLflow run as FAILED or KILLED
    (:func:`flows.common.close_tracking_runs`, as the pipeline flows' hooks do); a cancelled one ends its MLflow
    run as KILLED, and Prefect cancels its trial runs."""
    return flow(name=name, log_prints=True, on_failure=[cancel_started_runs, close_tracking_runs],
                on_crashed=[cancel_started_runs, close_tracking_runs], on_cancellation=[close_tracking_runs])


@_sweep_flow("sweep-translation")
def sweep_translation(sweep: str = "multi30k-cpu", data_root: str | None = None, trials: Count | None = None,
                      max_in_flight: Count | None = None, tracking_uri: str | None = None,
                      confirm: bool = True) -> dict:
    """Search the recipe of a run config on dev, confirm the best with paired seeds, write the winner as a preset.

    Args:
        sweep: a sweep under configs/sweeps/ (``multi30k-cpu``) or a path to one.
        data_root: local corpora for every trial (as the pipeline flow's data_root); default the worker's.
        trials, max_in_flight: override the sweep's budget and how many trial runs train at once (1 or more; left
            out: the sweep file's).
        tracking_uri: the MLflow server; default env MLFLOW_TRACKING_URI. Every trial logs there too.
        confirm: False stops after the search with the leaderboard published: a long sweep spread over several
            windows of machine time (``-p trials=4 -p confirm=false``, then more); a later run goes on from there.
    """
    return _run_sweep(sweep, data_root, trials, max_in_flight, tracking_uri, confirm, "translation")


@_sweep_flow("sweep-parse")
def sweep_parse(sweep: str = "ptb-sample-cpu", data_root: str | None = None, trials: Count | None = None,
                max_in_flight: Count | None = None, tracking_uri: str | None = None, confirm: bool = True) -> dict:
    """Study a parsing config's recipe on dev EVALB F1, confirm with paired seeds, write the winner as a preset.

    Args:
        sweep: a sweep under configs/sweeps/ whose base is a parsing config (``ptb-sample-cpu``: the fixed arms
            of the CPU parser's study) or a path to one.
        data_root, trials, max_in_flight, tracking_uri, confirm: as for ``sweep-translation``.
    """
    return _run_sweep(sweep, data_root, trials, max_in_flight, tracking_uri, confirm, "parsing")


@_sweep_flow("sweep-en-de")
def sweep_en_de(sweep: str = "multi30k-cpu", data_root: str | None = None, trials: Count | None = None,
                max_in_flight: Count | None = None, tracking_uri: str | None = None, confirm: bool = True) -> dict:
    """``sweep-translation`` under its former name, kept for compatibility (it runs any language pair, not only
    En-De): the same sweep, parameters and study; a run of either re-attaches to the other's trials, and waits
    while the other's controller runs (a lock on the sweep's folder).

    Args:
        sweep, data_root, trials, max_in_flight, tracking_uri, confirm: as for ``sweep-translation``.
    """
    get_run_logger().info("flow sweep-en-de is kept for compatibility: it is sweep-translation under its former "
                          "name; run 'sweep-translation/multi30k-cpu' instead")
    return _run_sweep(sweep, data_root, trials, max_in_flight, tracking_uri, confirm, "translation")


# The sweep flow of each task: a base config of another task is refused, naming the flow that studies it.
FLOW_OF_TASK = {"translation": "sweep-translation", "parsing": "sweep-parse"}


def _run_sweep(sweep: str, data_root: str | None, trials: int | None, max_in_flight: int | None,
               tracking_uri: str | None, confirm: bool, task: str) -> dict:
    """The body of the sweep flows (their parameters; ``task``: the base config's task the flow studies): the
    study, the search, the confirmation and the winner. Everything the sweep file, the flow run's parameters and
    the deployment can get wrong is refused before the study, the sweep's MLflow run or any trial run exists."""
    logger = get_run_logger()
    trust = FlowRunTrust.from_environ()  # the sweep file and its base from the allowed folders; data_root checked
    trust.check("data_root", data_root, f"parameter data_root={data_root!r}")
    cfg = load_sweep(sweep, {k: v for k, v in (("trials", trials), ("max_in_flight", max_in_flight)) if v is not None},
                     allowed=trust.config_dirs)
    base = resolve_base(cfg, data_root)  # what every trial starts from
    if base.task != task:
        raise ConfigError(f"{cfg.source}: base {cfg.base!r} is a {base.task} config and flow {FLOW_OF_TASK[task]} "
                          f"studies {task}: run the sweep with {FLOW_OF_TASK[base.task]}")
    point = base_point(cfg, base)
    check_space(cfg, point, data_root)
    work = ensure_work_dir(base.work_dir)
    folder = work / "sweeps" / cfg.name
    uri = trust.tracking_uri(tracking_uri, work)  # what every trial gets: the environment's unless allowed
    runner = DeploymentRunner(cfg.deployment, {"config": cfg.base, "data_root": data_root, "tracking_uri": uri,
                                               "register_model": False}, folder, [f"sweep:{cfg.name}"], cfg.source)
    # every field and kind of value a trial or a confirmation run sends, against the deployment, before anything
    runner.check([*((f"space.{key} = {value!r}", o) for key, value, o in variations(cfg, point)),
                  *((f"enqueue[{i}]", expand(cfg, {**point, **hunch})) for i, hunch in enumerate(cfg.enqueue)),
                  ("the confirmation", {**expand(cfg, point), "train.seed": cfg.confirm.seeds[0]})])
    # one controller per study, whichever of the two flow names started it: a second waits, then re-attaches
    with exclusive(folder, f"sweep {cfg.name}"):
        tracking.connect(uri, base.tracking.experiment)
        objective = f"{base.data.dev.name}.{base.promotion_metric}"
        study = open_study(cfg, work, point, objective)
        parent = tracking.start_sweep_run(base.tracking.experiment, cfg.name, cfg.model_dump(mode="json"),
                                          {"prefect.flow_run_id": str(flow_run.get_id() or "")})

        search(cfg, study, runner, lambda params: expand(cfg, params), logger=logger)
        rows = leaderboard(study)
        for r in rows:
            tracking.log_child(parent, f"trial-{r['trial']}", r["params"], {objective: r["value"], "steps": r["steps"]},
                               runner.curve(r["run_id"]) if r["run_id"] else [],
                               {"state": r["state"], "trial": r["trial"], "trial.flow_run_id": r["run_id"] or ""})
        key = f"sweep-{cfg.name.lower().replace('_', '-').replace('.', '-')}"
        if not confirm:
            _conclude(folder, parent, key, rows, markdown(cfg, rows, [], [], None, objective), [], None, {},
                      {"winner": "pending confirmation"})
            logger.info("sweep %s: %d trials finished; confirmation left to a later run", cfg.name, finished(study))
            return {"winner": None, "leaderboard": rows, "verdicts": []}
        candidates = confirm_arms(cfg, study, runner, arms(cfg, study, point), lambda params: expand(cfg, params),
                                  logger=logger)
        for arm in candidates:
            for seed, outcome in arm.outcomes.items():
                tracking.log_child(parent, f"confirm-{arm.label}-seed-{seed}", {**arm.params, "train.seed": seed},
                                   outcome.metrics, [], {"state": outcome.state, "trial.flow_run_id": arm.runs[seed]})
        # every split judged on the task's metric (BLEU, EVALB F1); the tests are reported, never chosen on
        metric = base.promotion_metric
        dev = judge(cfg, candidates, "dev", objective, metric)
        tests = [v for t in base.data.test for v in judge(cfg, candidates, f"test.{t.name}", f"{t.name}.{metric}",
                                                           metric)]
        chosen = winner(candidates, dev)
        preset = write_winner(cfg, chosen, dev, tests, folder / "winner.yaml", base)
        best = next((v for v in dev if v.label == chosen.label), None)
        _conclude(folder, parent, key, rows, markdown(cfg, rows, dev, tests, chosen, objective), [*dev, *tests], preset,
                  {"winner.dev_delta": best.comparison.delta, "winner.dev_p": best.comparison.p_value} if best else {},
                  {"winner": chosen.label})
        logger.info("sweep %s: winner %s; preset %s", cfg.name, chosen.label, preset)
        return {"winner": chosen.label, "params": chosen.params, "preset": str(preset),
                "leaderboard": rows, "verdicts": [v.as_dict() for v in (*dev, *tests)]}


def _conclude(folder: Path, parent: str, key: str, rows: list[dict], report: str, verdicts: list[Verdict],
              preset: Path | None, metrics: dict[str, float], tags: dict[str, str]) -> None:
    """Write the leaderboard, the report and the verdicts (when confirmed) under ``folder``, log them with the
    winner preset to the sweep's MLflow run, and publish the Prefect artifacts."""
    files = {folder / "leaderboard.json": json.dumps(rows, indent=1, default=str), folder / "report.md": report}
    if verdicts:
        files[folder / "confirmation.json"] = json.dumps([v.as_dict() for v in verdicts], indent=1)
    for path, text in files.items():
        write_text(path, text)
    tracking.log_sweep_result(parent, [*files, *([preset] if preset else [])], metrics, tags)
    publish(key, rows, report)
