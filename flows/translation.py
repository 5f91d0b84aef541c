"""Translation flows: ``train-en-de`` and ``train-en-fr``, the same stages (flows/common.py) on their configs.

Parameters are what a deployment (prefect.yaml) or ``prefect deployment run ... -p key=value`` sets.
"""

from __future__ import annotations

from prefect import flow

from flows.common import Precision, close_tracking_runs, run_pipeline
from pipeline.config import ConfigName, FlowOverrides


@flow(name="train-en-de", log_prints=True, on_crashed=[close_tracking_runs],
      on_cancellation=[close_tracking_runs])
def train_en_de(config: ConfigName | str = "multi30k-cpu-hub", data_root: str | None = None,
                overrides: FlowOverrides | None = None, max_steps: int | None = None,
                max_minutes: float | None = None, precision: Precision | None = None,
                tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train, evaluate and register an English->German Transformer.

    Args:
        config: a config under configs/ (``multi30k-cpu-hub``, ``wmt14-en-de-base``, ``wmt14-en-de-big``) or a path.
        data_root: a folder of local corpora (e.g. ../shared/data) instead of the hub; env AIAYN_DATA_ROOT.
        overrides: config fields by their dotted names, typed and checked against the config schema when the run
            is created, e.g. {"train.warmup_steps": 8000, "launch.nproc_per_node": 8}.
        max_steps, max_minutes: training budget shortcuts (train.max_steps, train.max_minutes).
        precision: train.precision (auto: bf16 where the hardware computes it natively; fp32: the paper's).
        tracking_uri: the MLflow server; default env MLFLOW_TRACKING_URI, else SQLite in the work dir.
        register_model: register the averaged model and decide on the champion alias.
    """
    return run_pipeline("train-en-de", {"task": "translation", "src_lang": "en", "tgt_lang": "de"}, config,
                        data_root, overrides, max_steps, max_minutes, precision, tracking_uri, register_model)


@flow(name="train-en-fr", log_prints=True, on_crashed=[close_tracking_runs],
      on_cancellation=[close_tracking_runs])
def train_en_fr(config: ConfigName | str = "wmt14-en-fr-base", data_root: str | None = None,
                overrides: FlowOverrides | None = None, max_steps: int | None = None,
                max_minutes: float | None = None, precision: Precision | None = None,
                tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train, evaluate and register an English->French Transformer (parameters as ``train-en-de``)."""
    return run_pipeline("train-en-fr", {"task": "translation", "src_lang": "en", "tgt_lang": "fr"}, config,
                        data_root, overrides, max_steps, max_minutes, precision, tracking_uri, register_model)
