"""MLflow tracking and registry: the only package that imports mlflow.

The Prefect flow drives it by run id (:func:`connect` first, fail fast), the trainer reaches it only through
:class:`MlflowSink`, its ``MetricsSink`` (``python -m pipeline.train --mlflow-run-id``). Layout of a pipeline run:
a parent run (resolved config as params and ``config.yaml``; git commit, config hash, preset, language pair and
the Prefect flow run as tags) with one child run per stage (data, tokenize, train, average, evaluate, register),
dataset inputs for the raw sources, the cleaned corpus and the token shards, and the registered model
``transformer-<src>-<tgt>`` whose ``champion`` alias serving follows.
"""

from .lineage import log_corpus, log_tokenizer
from .pyfunc import Translator
from .registry import (CHAMPION, champion, champion_artifacts, promote, promotion_set, register_model, version_tags,
                       version_with_checkpoint)
from .results import flat_scores, log_averaging, log_evaluation, log_training
from .runs import (TrackingError, check_reachable, close_flow_run, close_stale_runs, connect, finish_run, flatten,
                   log_metrics, log_params, run_url, set_tags, start_pipeline_run, start_stage_run)
from .sink import MlflowSink

__all__ = ["CHAMPION", "MlflowSink", "TrackingError", "Translator", "champion", "champion_artifacts", "check_reachable",
           "close_flow_run", "close_stale_runs", "connect",
           "finish_run", "flat_scores", "flatten", "log_averaging", "log_corpus", "log_evaluation", "log_metrics",
           "log_params", "log_tokenizer", "log_training", "promote", "promotion_set", "register_model", "run_url",
           "set_tags",
           "start_pipeline_run", "start_stage_run", "version_tags", "version_with_checkpoint"]
