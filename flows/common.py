"""The stage sequence every pipeline flow composes (translation and parsing differ only in their configs):

    data -> [distill: teachers resolved from the registry, their translations of the training sources; for
             parsing, their kept parses of distill.unlabelled beside the gold trees (pipeline.silver)]
    -> tokenizer -> shards -> train (torchrun) -> average -> evaluate -> export (CTranslate2 + its quality
    gate; translation) -> register (+ champion) -> report

With ``distill.teachers`` the stages after ``distill`` read the distilled corpus instead of the data stage's: the
student trains its own tokenizer on it and is evaluated on the same dev and test sets. Each stage task is cached
across runs on the content of its inputs, its config and its code; each stage also gets a child run in MLflow
under the pipeline's parent run, reused stages included.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.exceptions import CancelledRun
from prefect.logging.loggers import flow_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel

from pipeline import tracking
from pipeline.config import (ConfigError, DevDomainWarning, FlowRunTrust, RunConfig, ensure_work_dir, flow_overrides,
                             unshown_character)
from pipeline.support.urls import shown_url
from tasks.caching import run_cached
from tasks.report import publish_report
from tasks.stages import (average_stage, data_stage, distill_stage, evaluate_stage, export_stage, shards_stage,
                          silver_stage, tokenizer_stage, unlabelled_stage)
from tasks.tracking import fetch_champion, log_stage, register, resolve_teachers, start_tracking
from tasks.training import train_stage


Precision = Literal["auto", "fp32", "bf16"]  # a flow's ``precision`` parameter: train.precision


def flow_config(config: str, overrides: dict[str, Any], data_root: str | None, flow_name: str,
                expect: dict[str, str], tracking_uri: str | None = None) -> RunConfig:
    """The run's config, resolved once under the trust model's rules (:meth:`pipeline.config.FlowRunTrust.resolve`:
    configs from the allowed folders only, the worker's environment, then the run's parameters, of which those
    the environment decides are refused, ``tracking_uri`` included); refuses one this flow is not for (``expect``:
    field -> value, e.g. the language pair, or ``task: parsing``) and one that cannot leave the checkpoints
    its averaging needs (:meth:`pipeline.config.RunConfig.averaging_shortfall`). A flow run named with a
    character that is not shown as itself is refused too: the name becomes its MLflow run's."""
    if (name := flow_run.get_name()) and (why := unshown_character(name)):
        raise ConfigError(f"flow run name {name!r}: {why}; start the run with a name in printable characters "
                          "(prefect deployment run ... --flow-run-name NAME)")
    trust = FlowRunTrust.from_environ()
    with warnings.catch_warnings(record=True) as caught:  # into the flow run's logs, where users look
        warnings.simplefilter("always", DevDomainWarning)
        cfg = trust.resolve(config, overrides, data_root)
    trust.tracking_uri(tracking_uri, Path(cfg.work_dir).expanduser().resolve())  # refused before anything starts
    for w in caught:
        get_run_logger().warning(str(w.message))
    if (short := cfg.averaging_shortfall()) is not None:  # refused now, not once training has ended
        raise ConfigError(f"config {config!r}: {short}")
    got = {"src_lang": cfg.data.src_lang, "tgt_lang": cfg.data.tgt_lang, "task": cfg.task}
    wrong = {k: got[k] for k, v in expect.items() if got[k] != v}
    if wrong:
        other = "" if "task" in wrong else " (train-translation runs a translation config of any language pair)"
        raise ValueError(f"config {config!r} has {wrong}, but flow {flow_name} needs {expect}; pick a config for "
                         f"this flow or run the flow made for that config{other}")
    return cfg


def pipeline_config(flow_name: str, expect: dict[str, str], config: str, data_root: str | None,
                    overrides: BaseModel | dict[str, Any] | None, max_steps: int | None, max_minutes: float | None,
                    precision: str | None, tracking_uri: str | None = None) -> RunConfig:
    """A pipeline flow's config from its parameters: ``overrides`` with the shortcuts (``max_steps``,
    ``max_minutes``, ``precision``) merged in, resolved by :func:`flow_config`."""
    shortcuts = {k: v for k, v in (("train.max_steps", max_steps), ("train.max_minutes", max_minutes),
                                   ("train.precision", precision)) if v is not None}
    return flow_config(config, {**flow_overrides(overrides), **shortcuts}, data_root, flow_name, expect,
                       tracking_uri)


def run_pipeline(flow_name: str, cfg: RunConfig, tracking_uri: str | None, register_model: bool) -> dict:
    """The stages in order on the resolved ``cfg`` (:func:`pipeline_config`); returns the stage outputs, the scores
    file, the registered model's name and the promotion decision."""
    work = ensure_work_dir(cfg.work_dir)  # a clear error before tracking and the stages start
    uri = FlowRunTrust.from_environ().tracking_uri(tracking_uri, work)
    parent = start_tracking(cfg, uri, run_name=flow_run.get_name() or cfg.name,
                            tags={"prefect.flow": flow_name, "prefect.flow_run_id": str(flow_run.get_id() or ""),
                                  "prefect.flow_run_url": str(flow_run.get_flow_run_ui_url() or "")})
    try:
        stages: dict[str, tuple[Path, bool]] = {}
        corpus, hit = stages["data"] = run_cached(data_stage, data=cfg.data, work_dir=work)
        log_stage(parent, "data", hit, {"corpus": corpus})
        teachers = []
        if cfg.distill.teachers:  # the stages after this read the distilled corpus
            teachers = resolve_teachers(cfg, work)
            files, shared = [t.checkpoint for t in teachers], tracking.shared_tokenizer(teachers)
            if cfg.task == "parsing":  # semi-supervised: the teachers parse unlabelled sentences
                unlabelled = unlabelled_stage(cfg.distill.unlabelled, cfg.data.root, corpus, work)
                corpus, hit = stages["distill"] = run_cached(
                    silver_stage, corpus=corpus, teachers=files, tokenizer_dir=shared, distill=cfg.distill,
                    unlabelled=unlabelled, work_dir=work)
            else:  # one teacher whose export passed its gate decodes through it (several times faster on a CPU)
                export = teachers[0].export if len(teachers) == 1 else None
                corpus, hit = stages["distill"] = run_cached(
                    distill_stage, corpus=corpus, teachers=files, tokenizer_dir=shared, distill=cfg.distill,
                    work_dir=work, export=export)
            log_stage(parent, "distill", hit, {"corpus": corpus}, teachers=[t.label for t in teachers])
        # train.init_from=champion continues from the champion's weights, so it reads its vocabulary too.
        init = fetch_champion(cfg, work) if cfg.train.init_from == "champion" else None
        if init is not None:
            tokenizer, hit = stages["tokenizer"] = init[1], True
        else:
            tokenizer, hit = stages["tokenizer"] = run_cached(tokenizer_stage, corpus=corpus,
                                                              tokenizer=cfg.tokenizer, work_dir=work)
        shards, hit_shards = stages["shards"] = run_cached(shards_stage, corpus=corpus, tokenizer_dir=tokenizer,
                                                           tokenizer=cfg.tokenizer, work_dir=work)
        log_stage(parent, "tokenize", hit and hit_shards, {"tokenizer": tokenizer, "shards": shards})
        train_run = tracking.start_stage_run(parent, "train")  # training streams its metrics into it
        train = train_stage.with_options(retries=cfg.launch.retries)  # a lost node resumes on the retry
        run, hit = stages["train"] = run_cached(train, cfg=cfg, shards=shards, launch=cfg.launch,
                                                tracking_run_id=train_run, init_checkpoint=init and init[0])
        log_stage(parent, "train", hit, {"run": run}, run_id=train_run)
        averaged, hit = stages["average"] = run_cached(average_stage, cfg=cfg, checkpoints=run / "checkpoints",
                                                       tokenizer_dir=tokenizer, corpus=corpus)
        log_stage(parent, "average", hit, {"checkpoint": averaged})
        scores, hit = stages["evaluate"] = run_cached(evaluate_stage, cfg=cfg, checkpoint=averaged,
                                                      tokenizer_dir=tokenizer, corpus=corpus)
        log_stage(parent, "evaluate", hit, {"checkpoint": averaged, "tokenizer": tokenizer, "scores": scores},
                  attention_sentences=cfg.tracking.attention_sentences)
        export = None
        if cfg.exports:
            export, hit = stages["export"] = run_cached(export_stage, cfg=cfg, checkpoint=averaged,
                                                        tokenizer_dir=tokenizer, corpus=corpus, scores=scores)
            log_stage(parent, "export", hit, {"export": export})
        decision = register(cfg, parent, averaged, tokenizer, scores, corpus, export,
                            teachers) if register_model else None
        publish_report(cfg, stages, decision, parent, [t.label for t in teachers])
    except BaseException as e:
        # Interrupted (cancelled: SIGTERM, Ctrl-C) is not failed: MLflow's KILLED says so.
        interrupted = not isinstance(e, Exception) or isinstance(e, CancelledRun)
        try:  # the stage runs too: a failed training leaves its train run RUNNING
            tracking.end_pipeline_run(parent, "KILLED" if interrupted else "FAILED")
        except Exception as closing:  # never hide why the run stopped behind why its runs could not be ended
            get_run_logger().warning("could not end this run's MLflow runs (%s); the next run of %s ends them",
                                     closing, cfg.name)
        raise
    tracking.finish_run(parent)
    return {"stages": {k: str(v[0]) for k, v in stages.items()}, "scores": str(scores),
            "registered_model": cfg.registered_model_name, "decision": decision}


def pipeline_flow(name: str):
    """The decorator of the pipeline flow ``name``: its hooks end its MLflow runs as KILLED when the flow run crashes
    or is cancelled (:func:`close_tracking_runs`)."""
    return flow(name=name, log_prints=True, on_crashed=[close_tracking_runs], on_cancellation=[close_tracking_runs])


def close_tracking_runs(flow: Any, flow_run: Any, state: Any) -> None:
    """``on_crashed`` / ``on_cancellation`` hook of the pipeline flows (and ``on_failure`` of the sweep flows): end
    the flow run's RUNNING MLflow runs (its parent run and open stage runs) as KILLED, or FAILED when it failed.

    A flow-run process that is killed (kill -9, the OOM killer, a cancellation) never reaches run_pipeline's
    ``except``, so its runs would stay RUNNING forever. The process worker runs this hook itself, in the worker,
    once the flow-run process is gone; so the tracking server comes from the run's parameters or the worker's
    environment. A hook must never raise (Prefect would only log it): failures are logged here instead.
    """
    logger = flow_run_logger(flow_run, flow)
    given = (flow_run.parameters or {}).get("tracking_uri")
    try:  # the run's own tracking_uri only where the trust model let the run use it
        trusted = bool(given) and FlowRunTrust.from_environ().allows("tracking_uri", given)
    except ConfigError:
        trusted = False
    uri = given if trusted else os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        logger.warning("no tracking URI (parameter tracking_uri, env MLFLOW_TRACKING_URI): MLflow runs of flow run "
                       "%s left as they are", flow_run.id)
        return
    status = "FAILED" if state.is_failed() else "KILLED"
    try:
        closed = tracking.close_flow_run(str(flow_run.id), status, tracking_uri=uri,
                                         reason=f"Prefect flow run {flow_run.id} {state.name}")
    except Exception:
        logger.exception("could not end the MLflow runs of flow run %s at %s", flow_run.id, shown_url(uri))
        return
    logger.info("flow run %s: ended %d MLflow run(s) as %s: %s", state.name, len(closed), status, ", ".join(closed))
