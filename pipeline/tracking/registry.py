"""Registry: one pyfunc version per pipeline run, and the ``champion`` alias that serving follows.

Promotion rule: the first version of a registered model becomes champion; after that the alias moves only when
a new version's score on the promotion metric beats the champion's by more than the margin. The decision, both
scores and the reason are tags on the new version (and on the run, when given), and are returned for the
Prefect report.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.models import Model

from pipeline.config import DecodeConfig
from pipeline.train.checkpoint import load_checkpoint

from .pyfunc import SIGNATURE, Translator, code_paths, pip_requirements
from .runs import TrackingError, client, set_tags

CHAMPION = "champion"
MODEL_NAME = "translator"  # the logged model's name inside its run


def register_model(run_id: str, checkpoint: Path, tokenizer_dir: Path, decode: DecodeConfig, name: str,
                   scores: dict[str, float]) -> str:
    """Log the translator pyfunc (checkpoint + tokenizer + decoding settings) in ``run_id``, register it as a new
    version of ``name`` with ``scores`` as version tags, and return the version number."""
    checkpoint, tokenizer_dir = Path(checkpoint), Path(tokenizer_dir)
    cleaning = load_checkpoint(checkpoint)["config"]["data"]["cleaning"]
    info = Model.log(artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc, run_id=run_id,
                     python_model=Translator(),
                     artifacts={"checkpoint": str(checkpoint), "tokenizer": str(tokenizer_dir)},
                     model_config={"decode": decode.model_dump(mode="json"), "cleaning": cleaning},
                     code_paths=code_paths(), pip_requirements=pip_requirements(), signature=SIGNATURE)
    version = mlflow.register_model(info.model_uri, name, tags={k: str(v) for k, v in scores.items()})
    return str(version.version)


def _version_score(name: str, version: str, metric: str) -> float | None:
    value = client().get_model_version(name, version).tags.get(metric)
    return float(value) if value is not None else None


def champion(name: str) -> str | None:
    """The version the ``champion`` alias points at, or None when there is none yet."""
    try:
        return str(client().get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def promote(name: str, version: str, metric: str, margin: float, *, run_id: str | None = None) -> dict:
    """Move ``champion`` to ``version`` if it is the first, or if its ``metric`` beats the champion's by more than
    ``margin``. Tags the version (and ``run_id``, if given) with the decision; returns {promoted, version,
    score, champion_version, champion_score, metric, margin, reason}."""
    score = _version_score(name, version, metric)
    if score is None:
        raise TrackingError(f"model {name} version {version} has no {metric!r} score tag; set "
                            "tracking.promote_metric to a score the evaluation logs (e.g. newstest2014.sacrebleu)")
    current = champion(name)
    current_score = _version_score(name, current, metric) if current else None
    if current is None:
        promoted, reason = True, f"first model of {name}: it becomes champion"
    elif current == str(version):
        promoted, reason = False, f"version {version} already is the champion"
    elif current_score is None:
        promoted, reason = True, f"champion version {current} has no {metric} score"
    elif score > current_score + margin:
        promoted, reason = True, (f"{metric} {score:.2f} beats champion version {current} ({current_score:.2f}) "
                                  f"by {score - current_score:.2f} > margin {margin}")
    else:
        promoted, reason = False, (f"{metric} {score:.2f} does not beat champion version {current} "
                                   f"({current_score:.2f}) by more than margin {margin}")
    if promoted:
        client().set_registered_model_alias(name, CHAMPION, str(version))
    result = {"promoted": promoted, "version": str(version), "score": score, "champion_version": current,
              "champion_score": current_score, "metric": metric, "margin": margin, "reason": reason}
    tags = {"promotion.decision": "promoted" if promoted else "not promoted", "promotion.metric": metric,
            "promotion.score": score, "promotion.champion_version": current or "none",
            "promotion.champion_score": "none" if current_score is None else current_score,
            "promotion.margin": margin, "promotion.reason": reason}
    for k, v in tags.items():
        client().set_model_version_tag(name, str(version), k, str(v))
    if run_id:
        set_tags(run_id, tags)
    return result
