"""MLflow tracking and registry: the only package that imports mlflow.

The Prefect flow drives it by run id (:func:`connect` first, fail fast), the trainer reaches it only through
:class:`MlflowSink`, its ``MetricsSink`` (``python -m pipeline.train --mlflow-run-id``). Layout of a pipeline run:
a parent run (resolved config as params and ``config.yaml``; git commit, config hash, preset, language pair and
the Prefect flow run as tags) with one child run per stage (data, distill when the config has teachers, tokenize,
train, average, evaluate, export, register), dataset inputs for the raw sources, the cleaned corpus, the distilled
corpus and the token shards, and the registered model ``transformer-<src>-<tgt>`` whose ``champion`` alias serving
follows. Teachers of a distillation (registered versions or checkpoint files) are resolved here too.
"""

from __future__ import annotations

import importlib
from typing import Any

# Names are imported from their module on first use (PEP 562): a server that loads the pyfunc imports this package
# but needs only .pyfunc, and the others pull in torch (checkpoints, plots, evaluation), most of a served
# CTranslate2 model's memory.
_SOURCES = {
    "lineage": ("log_corpus", "log_distillation", "log_tokenizer"),
    "pyfunc": ("ServedModel",),
    "registry": ("CHAMPION", "champion", "champion_artifacts", "promote", "promotion_set", "register_model",
                 "undecided_versions", "version_tags", "version_with_checkpoint"),
    "teachers": ("Teacher", "TeacherError", "TeacherRef", "describe_student", "lineage_tags", "resolve_teachers",
                 "shared_tokenizer", "speedup_tag"),
    "results": ("flat_scores", "log_averaging", "log_evaluation", "log_export", "log_training", "model_scores"),
    "runs": ("TrackingError", "check_reachable", "close_flow_run", "close_stale_runs", "connect",
             "end_pipeline_run", "finish_run", "flatten", "flow_run_pages", "log_headline", "log_metrics",
             "log_params", "run_url", "runs_view_url", "set_tags", "start_pipeline_run", "start_stage_run", "ui_link",
             "version_url", "wait_until_reachable"),
    "sink": ("MlflowSink",),
    "sweep": ("dev_curve", "log_child", "log_sweep_result", "run_outcome", "start_sweep_run"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_MODULE_OF)
