"""The flow's side of tracking: the parent run of a pipeline run, one child run per stage, and the registry. Never
cached: every pipeline run records its own lineage, also for stages reused from the cache.

Bookkeeping (opening, logging and closing runs) is plain function calls of the flow, not tasks, so that the flow
run's graph in the Prefect UI shows the pipeline's own stages in order (data -> tokenizer -> shards -> train ->
average -> evaluate -> export -> register -> report), not eight bookkeeping nodes between them. Registering, and
resolving a distillation's teachers from the registry, are tasks: they are stages of the pipeline, with their own
state."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Iterator, Sequence
from uuid import UUID

from prefect import get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound

from pipeline import tracking
from pipeline.config import RunConfig
from pipeline.export import servable
from pipeline.promotion import Decision, Policy, lock_name, read_promotion_set
from pipeline.speed import Served, student_speeds

# The promotion lock's lease: its holder renews it while it runs; one killed without releasing it holds it
# until the lease runs out (Prefect's default; a shorter lease would cut a live holder off in a Prefect outage).
LOCK_LEASE_S = 300


def start_tracking(cfg: RunConfig, uri: str, run_name: str, tags: dict[str, str]) -> str:
    """Check the tracking server (fail now, not after hours of training), end the stale runs of this config (see
    below) and open the parent run.

    Stale: a RUNNING parent run of the same config name whose Prefect flow run is final or no longer exists. A
    flow run killed together with its worker (or its machine) never ran its on_crashed hook, so its runs would
    stay RUNNING in MLflow forever; they are ended KILLED here, with their RUNNING children.
    """
    logger = get_run_logger()
    tracking.connect(uri, cfg.tracking.experiment)
    final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
    try:
        with get_client(sync_client=True) as prefect:
            def is_over(flow_run_id: str) -> str | None:
                """The final state's name (or "deleted"), named in the closed run's tag; None: may still run."""
                try:
                    state = prefect.read_flow_run(UUID(flow_run_id)).state
                except ValueError:  # not a flow run id this pipeline wrote: leave the run alone
                    return None
                except ObjectNotFound:  # deleted flow run (or another server's): nothing will ever end its runs
                    return "deleted"
                return state.type.value if state is not None and state.type.value in final else None

            closed = tracking.close_stale_runs(cfg.tracking.experiment, cfg.name, is_over)
    except Exception:  # the cleanup is a courtesy: never let it stop a new run from training
        logger.warning("could not check for stale MLflow runs of %s", cfg.name, exc_info=True)
    else:
        if closed:
            logger.info("ended %d stale MLflow run(s) of %s as KILLED (their Prefect flow run is over): %s",
                        len(closed), cfg.name, ", ".join(closed))
    return tracking.start_pipeline_run(cfg, run_name=run_name, tags=tags)


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The flow or task run's logger; this module's outside a run (log_stage called as a plain function)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


def log_stage(parent_run_id: str, stage: str, cached: bool, outputs: dict[str, Path], run_id: str | None = None,
              attention_sentences: int = 3, teachers: Sequence[str] = ()) -> str:
    """Record a finished stage's outputs in its child run (opened here unless ``run_id`` is given), and its headline
    figures on the parent run too (:data:`pipeline.tracking.runs.HEADLINE`); ``teachers`` names the distill stage's
    teachers (registered versions). A tracking server that does not answer is waited for, saying so
    (:func:`pipeline.tracking.wait_until_reachable`)."""
    tracking.wait_until_reachable(_logger().warning)
    run_id = run_id or tracking.start_stage_run(parent_run_id, stage)
    tracking.set_tags(run_id, {"cached": str(cached).lower()})
    if stage == "data":
        tracking.log_corpus(run_id, outputs["corpus"])
    elif stage == "distill":
        tracking.log_distillation(run_id, outputs["corpus"], teachers)
    elif stage == "tokenize":
        tracking.log_tokenizer(run_id, outputs["tokenizer"], outputs["shards"])
    elif stage == "train":
        tracking.log_training(run_id, outputs["run"])
    elif stage == "average":
        tracking.log_averaging(run_id, outputs["checkpoint"])
    elif stage == "export":
        tracking.log_export(run_id, outputs["export"])
    elif stage == "evaluate":
        tracking.log_evaluation(run_id, outputs["checkpoint"], outputs["tokenizer"], outputs["scores"],
                                attention_sentences=attention_sentences)
    tracking.finish_run(run_id)
    tracking.log_headline(parent_run_id, stage, run_id)  # the runs table compares pipeline runs on these
    return run_id


@task(name="fetch-champion")
def fetch_champion(cfg: RunConfig, work_dir: Path) -> tuple[Path, Path] | None:
    """The current champion's checkpoint and tokenizer folder, downloaded under ``<work_dir>/champion/`` (for
    ``train.init_from: champion``); None, with a warning, when the model has no champion yet."""
    name = cfg.registered_model_name
    found = tracking.champion_artifacts(name, Path(work_dir) / "champion" / name)
    if found is None:
        get_run_logger().warning("train.init_from=champion, but %s has no champion yet: training from scratch", name)
    return found


@task(name="resolve-teachers")
def resolve_teachers(cfg: RunConfig, work_dir: Path) -> list[tracking.Teacher]:
    """``distill.teachers`` as files: each registered version (an alias pinned to the version it points at now)
    downloaded under ``<work_dir>/teachers/``, with its dev score (the promotion metric on the config's dev set)
    and size; refused unless they share one tokenizer."""
    teachers = tracking.resolve_teachers(cfg.distill.teachers, work_dir,
                                         f"{cfg.data.dev.name}.{cfg.promotion_metric}")
    for t in teachers:
        get_run_logger().info("teacher %s: %s", t.ref, t.describe())
    return teachers


def ensure_promotion_lock(model: str) -> str:
    """Create the model's promotion limit (one slot) if it does not exist yet; returns its name. The local
    stack creates the limits of every deployed config; this covers models named only in overrides. Says so when
    another run holds it (the wait that follows is that run's registration and decision)."""
    name = lock_name(model)
    with get_client(sync_client=True) as c:
        try:
            held = c.read_global_concurrency_limit_by_name(name).active_slots
        except ObjectNotFound:
            held = 0
            try:
                c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:  # created meanwhile by a concurrent run
                pass
    if held:  # in the run's log; outside a run (promote_locked called as a plain function) in this module's
        _logger().info("promotion lock %s is held by another run: waiting for it (a holder killed without "
                       "releasing it holds it until its lease of %d s runs out)", name, LOCK_LEASE_S)
    return name


@contextlib.contextmanager
def promotion_lock(name: str) -> Iterator[None]:
    """Hold the promotion lock of registered model ``name`` for the block: one run at a time reads the registry,
    registers and moves the champion alias. Without it, two flows finishing together both compare against the same
    old champion and both move the alias (the last to move wins whatever it scored), or both find the checkpoint
    unregistered and register it twice."""
    with concurrency(ensure_promotion_lock(name), occupy=1, strict=True, lease_duration=LOCK_LEASE_S):
        yield


def promote_locked(name: str, version: str, policy: Policy, run_id: str | None = None) -> Decision:
    """:func:`pipeline.tracking.promote` holding the model's promotion lock: reading the champion, comparing
    and moving the alias are one step."""
    with promotion_lock(name):
        return tracking.promote(name, version, policy, run_id=run_id)


def _no_new_data(name: str, sha256: str, version: str, parent_run_id: str) -> dict:
    """The decision of a run whose checkpoint is a decided version already: none."""
    decision = Decision("no decision", version, f"no new data: this run's model (checkpoint sha256 {sha256[:12]}) is "
                        f"version {version} of {name} already; nothing registered, nothing to decide",
                        tracking.champion(name))
    tracking.set_tags(parent_run_id, decision.tags())
    get_run_logger().info(decision.reason)
    return decision.as_dict()


def _decide_orphans(name: str, sha256: str, policy: Policy) -> None:
    """Decide, oldest first, the versions of other checkpoints that runs registered and stopped before deciding
    (killed, crashed), as those runs would have: a model's versions are each decided once, in order, whatever
    the next run registers. Called under the model's promotion lock."""
    for version in tracking.undecided_versions(name, besides=sha256):
        decision = tracking.promote(name, version, policy)
        _logger().warning("version %s of %s was registered by a run that stopped before deciding on it: %s. %s",
                          version, name, decision.decision, decision.reason)


@task(name="register-model")
def register(cfg: RunConfig, parent_run_id: str, checkpoint: Path, tokenizer_dir: Path, scores: Path,
             corpus: Path, export: Path | None = None, teachers: Sequence[tracking.Teacher] = ()) -> dict:
    """Register the averaged model (in a ``register`` child run) with its scores (also as model metrics on the
    ``corpus`` splits they were measured on), checkpoint sha256, corpus fingerprint, size and promotion set, and its
    CTranslate2 ``export`` when that passed its quality gate (a refused export is left out: the version serves with
    PyTorch, and says why in its tags), then decide on the champion alias; returns the decision with its evidence. A
    student (``teachers``: it was trained on their distilled ``corpus``) also gets its lineage as tags and, as its
    description, a table of its teachers and itself side by side, with their speeds measured side by side now
    (``distill.speed_sentences``).

    One version per checkpoint, each decided once: looking the checkpoint up, registering it and deciding happen
    under the model's promotion lock, so two runs of the same model finishing together register it once. A model
    already registered and decided (same checkpoint: no new data, no changed setting) is not registered again and
    nothing is decided; one registered by a run that stopped before its decision (killed, crashed) is decided now,
    whichever checkpoint this run brings.
    """
    logger = get_run_logger()
    tracking.wait_until_reachable(logger.warning)
    name = cfg.registered_model_name
    scores_data = json.loads(scores.read_text(encoding="utf-8"))
    sha256 = scores_data["checkpoint"]["sha256"]
    policy = Policy.of(cfg)
    # A decided version stays decided: no lock needed to see that there is nothing to do, unless another
    # checkpoint's version waits for the decision its run never made.
    if (known := tracking.version_with_checkpoint(name, sha256)) is not None and known.decided:
        if tracking.undecided_versions(name, besides=sha256):
            with promotion_lock(name):
                _decide_orphans(name, sha256, policy)
        return _no_new_data(name, sha256, known.version, parent_run_id)
    tags = {"corpus_fingerprint": scores_data["corpus_fingerprint"]}
    if export is not None:
        export, gate = servable(export)
        tags |= {"export.gate": "passed" if gate["passed"] else "refused", "export.quantization": gate["quantization"],
                 "export.dev_bleu_drop": str(gate["drop"])}
        if export is None:
            logger.warning("the %s CTranslate2 export loses %.2f dev BLEU (more than export.max_bleu_drop %.2f): not "
                           "registered; the model serves with PyTorch", gate["quantization"], gate["drop"],
                           gate["max_bleu_drop"])
    speeds = None
    if teachers:
        tags |= tracking.lineage_tags(teachers, corpus)
        if cfg.distill.speed_sentences and cfg.task == "translation":  # a parser's teachers are its peers
            speeds = student_speeds([Served(t.label, t.checkpoint, t.tokenizer, t.export) for t in teachers],
                                    Served(name, checkpoint, tokenizer_dir, export), corpus,
                                    cfg.distill.speed_sentences, cfg.decode)
            tags |= tracking.speedup_tag(teachers, speeds)
            logger.info("sentences/s: %s (%s)", speeds.per_s, speeds.describe())
    with promotion_lock(name):
        _decide_orphans(name, sha256, policy)
        found = tracking.version_with_checkpoint(name, sha256)  # again: another run may have registered it meanwhile
        if found is not None and found.decided:
            return _no_new_data(name, sha256, found.version, parent_run_id)
        run_id = tracking.start_stage_run(parent_run_id, "register")
        if found is None:
            version = tracking.register_model(run_id, checkpoint, tokenizer_dir, cfg.decode, name,
                                              tracking.flat_scores(scores_data),
                                              read_promotion_set(policy, scores.parent), tags=tags, export=export,
                                              evaluated=tracking.model_scores(scores_data, corpus))
            if teachers:
                tracking.describe_student(name, version, teachers, speeds)
        else:
            version = found.version
            logger.warning("version %s of %s (this run's checkpoint) was registered by a run that stopped before "
                           "deciding on it: deciding now", version, name)
        decision = tracking.promote(name, version, policy, run_id=parent_run_id)
    tracking.finish_run(run_id)
    logger.info("version %s of %s: %s. %s", version, name, decision.decision, decision.reason)
    return decision.as_dict()
