"""Registry: one pyfunc version per new model, and the ``champion`` alias that serving follows.

Each version carries its evidence: its scores as version tags, the sha256 of its checkpoint and the corpus
fingerprint it was trained on, and its *promotion set* (hypotheses and references on the set promotion reads,
``promotion/`` in the version's run), so that a later challenger is tested against the champion's stored
outputs without decoding the champion again. The decision rule itself is :mod:`pipeline.promotion`; callers
serialise :func:`promote` per registered model (the flow holds a Prefect global concurrency limit around it).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import NamedTuple

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.models import Model

from pipeline.checkpoint import load_checkpoint
from pipeline.config import DecodeConfig
from pipeline.support.fsutil import sha256_file
from pipeline.inference import model_from_state
from pipeline.parsing.trees import PLACEHOLDER
from pipeline.promotion import Decision, Policy, PromotionSet, decide, guards, paired_bootstrap

from .pyfunc import model_arguments
from .runs import client, set_tags

CHAMPION = "champion"
MODEL_NAME = "translator"  # the logged model's name inside its run
PROMOTION_DIR = "promotion"  # the promotion set's folder in a version's run
_FILES = {"hypotheses": "hypotheses.txt", "references": "references.txt"}


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def log_promotion_set(run_id: str, promotion: PromotionSet) -> None:
    """Store a version's promotion set in its run: hypotheses, references and ``set.json`` (name, split,
    metric, segment count, references' sha256)."""
    with tempfile.TemporaryDirectory(prefix="aiayn-promotion-") as tmp:
        _write_lines(Path(tmp) / _FILES["hypotheses"], promotion.hypotheses)
        _write_lines(Path(tmp) / _FILES["references"], promotion.references)
        (Path(tmp) / "set.json").write_text(json.dumps(promotion.meta(), indent=2), encoding="utf-8")
        client().log_artifacts(run_id, tmp, PROMOTION_DIR)


def promotion_set(name: str, version: str) -> PromotionSet | None:
    """The promotion set stored with a version, or None when it has none (registered before promotion sets
    were stored)."""
    run_id = client().get_model_version(name, version).run_id
    with tempfile.TemporaryDirectory(prefix="aiayn-promotion-") as tmp:
        try:
            folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=PROMOTION_DIR, dst_path=tmp))
        except (MlflowException, OSError):
            return None
        if not (folder / "set.json").is_file():
            return None
        meta = json.loads((folder / "set.json").read_text(encoding="utf-8"))
        lines = {k: (folder / f).read_text(encoding="utf-8").split("\n")[:-1] for k, f in _FILES.items()}
    return PromotionSet(meta["name"], meta["split"], meta["metric"], lines["hypotheses"], lines["references"])


def model_size(state: dict, checkpoint: Path, export: Path | None) -> dict[str, float]:
    """What a model weighs, by its version tags' names: ``model.parameters`` (trainable parameters, shared
    embeddings once) and ``serving.model_mb`` (MiB on disk of what it serves with: the CTranslate2 export's
    weights when given, else the checkpoint file). ``state``: the loaded checkpoint."""
    parameters = sum(p.numel() for p in model_from_state(state).parameters())
    served = Path(export) / "model.bin" if export is not None else Path(checkpoint)
    return {"model.parameters": parameters, "serving.model_mb": round(served.stat().st_size / 2**20, 2)}


def register_model(run_id: str, checkpoint: Path, tokenizer_dir: Path, decode: DecodeConfig, name: str,
                   scores: dict[str, float], promotion: PromotionSet | None = None,
                   tags: dict[str, str] | None = None, export: Path | None = None,
                   evaluated: list[tuple[str, float, str, str]] = ()) -> str:
    """Log the translator pyfunc (checkpoint + tokenizer + decoding settings, and the CTranslate2 ``export`` folder
    when given: the engine it then serves with) and the promotion set in ``run_id``, register it as a new version
    of ``name`` tagged with ``scores``, the checkpoint's sha256, the serving engine and ``tags``, and return the
    version number. The version's size (:func:`model_size`) is among its tags. ``evaluated``: scores as (metric,
    value, dataset name, dataset digest), logged as MLflow 3 model metrics (on the logged model and its dataset)
    besides the run. The promotion set is logged first: no version exists without it."""
    checkpoint, tokenizer_dir = Path(checkpoint), Path(tokenizer_dir)
    if promotion is not None:
        log_promotion_set(run_id, promotion)
    state = load_checkpoint(checkpoint)
    config = state["config"]
    cleaning = config["data"]["cleaning"]
    # a parser serves trees: its task and leaves travel in the model config (checkpoints older than either are
    # translators' and write XX)
    arguments = model_arguments(checkpoint, tokenizer_dir, decode, cleaning, export, config.get("task", "translation"),
                                config["data"].get("tree_leaves", PLACEHOLDER))
    # MLflow files a logged model under the active experiment (Default, "0", when none was set), not its source
    # run's: the model page belongs in the run's experiment.
    mlflow.set_experiment(experiment_id=client().get_run(run_id).info.experiment_id)
    info = Model.log(artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc, run_id=run_id, **arguments)
    for key, value, dataset, digest in evaluated:
        client().log_metric(run_id, key, value, dataset_name=dataset, dataset_digest=digest, model_id=info.model_id)
    all_tags = {**{k: str(v) for k, v in scores.items()}, "checkpoint_sha256": sha256_file(checkpoint),
                "serving.engine": arguments["model_config"]["engine"],
                **{k: str(v) for k, v in model_size(state, checkpoint, export).items()}, **(tags or {})}
    return str(mlflow.register_model(info.model_uri, name, tags=all_tags).version)


class Registered(NamedTuple):
    """A version that holds a given checkpoint, and whether its promotion was decided (``promotion.decision`` among
    its tags: :func:`promote` sets it; a run stopped between registering and deciding leaves it unset)."""

    version: str
    decided: bool


def version_with_checkpoint(name: str, checkpoint_sha256: str) -> Registered | None:
    """The newest version of ``name`` whose checkpoint has this sha256 (the same model registered before)."""
    try:
        found = client().search_model_versions(f"name = '{name}' and tags.checkpoint_sha256 = '{checkpoint_sha256}'")
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
            return None
        raise
    if not found:
        return None
    newest = max(found, key=lambda v: int(v.version))
    return Registered(str(newest.version), "promotion.decision" in newest.tags)


def undecided_versions(name: str, besides: str) -> list[str]:
    """The versions of ``name`` that the pipeline registered (they carry a checkpoint sha256) and nobody decided,
    oldest first, but the one holding checkpoint ``besides``: each run that registered one stopped before its
    decision (killed, crashed). Read under the model's promotion lock, there is no live run between the two."""
    try:
        found = client().search_model_versions(f"name = '{name}'")
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
            return []
        raise
    return [str(v.version) for v in sorted(found, key=lambda v: int(v.version))
            if v.tags.get("checkpoint_sha256", besides) != besides and "promotion.decision" not in v.tags]


def version_tags(name: str, version: str) -> dict[str, str]:
    """A version's tags (its scores, checkpoint sha256, corpus fingerprint, promotion evidence)."""
    return dict(client().get_model_version(name, version).tags)


def _scores(tags: dict[str, str]) -> dict[str, float]:
    out = {}
    for k, v in tags.items():
        try:
            out[k] = float(v)
        except ValueError:
            continue
    return out


def alias_version(name: str, alias: str) -> str | None:
    """The version the alias ``alias`` of ``name`` points at, or None when it points nowhere (or the model does
    not exist)."""
    try:
        return str(client().get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def champion(name: str) -> str | None:
    """The version the ``champion`` alias points at, or None when there is none yet."""
    return alias_version(name, CHAMPION)


class ModelFiles(NamedTuple):
    """A registered version's files, downloaded: its checkpoint, tokenizer folder and the CTranslate2 export it
    serves with (None: it serves with PyTorch)."""

    checkpoint: Path
    tokenizer: Path
    export: Path | None


def version_files(name: str, version: str, dst: Path) -> ModelFiles:
    """Download version ``version`` of ``name`` under ``dst`` and return its files (paths as its pyfunc records
    them)."""
    root = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(dst)))
    artifacts = Model.load(str(root / "MLmodel")).flavors["python_function"].get("artifacts", {})
    try:
        export = artifacts.get("ctranslate2")
        return ModelFiles(root / artifacts["checkpoint"]["path"], root / artifacts["tokenizer"]["path"],
                          root / export["path"] if export else None)
    except KeyError:
        raise RuntimeError(f"version {version} of {name} ({root}) records no checkpoint and tokenizer artifacts; "
                           "register a model with this pipeline first") from None


def champion_artifacts(name: str, dst: Path) -> tuple[Path, Path] | None:
    """Download the champion's checkpoint and tokenizer folder under ``dst``; None when there is no champion."""
    version = champion(name)
    return None if version is None else version_files(name, version, dst)[:2]


def _judge(name: str, version: str, current: str, policy: Policy) -> Decision:
    """The decision of a challenger against the current champion, from both versions' stored evidence."""
    challenger_set, champion_set = promotion_set(name, version), promotion_set(name, current)
    if challenger_set is None:
        return Decision("not promoted", version, f"version {version} has no promotion set stored: register it "
                        "through the pipeline's flow (register-model) to compare it", current)
    if champion_set is None or champion_set.references_sha256 != challenger_set.references_sha256 \
            or champion_set.metric != challenger_set.metric:
        have = "none" if champion_set is None else f"{champion_set.name} ({champion_set.metric}, references " \
                                                    f"{champion_set.references_sha256[:12]})"
        return Decision("not promoted", version,
                        f"champion version {current} has no hypotheses on this promotion set ({challenger_set.name}, "
                        f"{challenger_set.metric}, references {challenger_set.references_sha256[:12]}; it has "
                        f"{have}): no paired test is possible. Move the alias by hand after comparing, or promote "
                        "on the set the champion was registered with (tracking.promote_on)", current,
                        challenger_set.name, "test" if policy.on_test_set else "dev")
    comparison = paired_bootstrap(policy.metric, champion_set.hypotheses, challenger_set.hypotheses,
                                  challenger_set.references, policy.resamples)
    set_guards = guards(policy, _scores(version_tags(name, version)), _scores(version_tags(name, current)))
    return decide(policy, version, current, comparison, set_guards)


def promote(name: str, version: str, policy: Policy, *, run_id: str | None = None) -> Decision:
    """Decide whether ``version`` becomes champion and move the alias if so: the first version does; a later
    one must win :func:`pipeline.promotion.decide` on the stored promotion sets. Reads the alias itself, so a
    caller that holds the model's lock between read and move gets a race-free decision. The evidence goes to
    the version's tags (and ``run_id``'s, when given)."""
    current = champion(name)
    if current is None:
        decision = Decision("promoted", version, f"first model of {name}: it becomes champion")
    elif current == str(version):
        decision = Decision("no decision", version, f"version {version} already is the champion", current)
    else:
        decision = _judge(name, str(version), current, policy)
    if decision.promoted:
        client().set_registered_model_alias(name, CHAMPION, str(version))
    tags = decision.tags()
    for k, v in tags.items():
        client().set_model_version_tag(name, str(version), k, v)
    if run_id:
        set_tags(run_id, tags)
    return decision
