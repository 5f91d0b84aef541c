"""Translation flows, the same stages (flows/common.py) on a translation config:

- ``train-en-de`` and ``train-en-fr``: the paper's two pairs, each refusing a config for another language pair;
- ``train-translation``: any language pair, the one the config's data section names (``data.src_lang`` ->
  ``data.tgt_lang``), e.g. a config written for a new pair, given by its path.

Parameters are what a deployment (prefect.yaml) or ``prefect deployment run ... -p key=value`` sets.
"""

from __future__ import annotations

from flows.common import Precision, pipeline_config, pipeline_flow, run_pipeline
from pipeline.config import ConfigName, FlowOverrides

# What each flow requires of its config (field -> value; :func:`flows.common.flow_config` refuses any other).
EXPECT = {
    "train-en-de": {"task": "translation", "src_lang": "en", "tgt_lang": "de"},
    "train-en-fr": {"task": "translation", "src_lang": "en", "tgt_lang": "fr"},
    "train-translation": {"task": "translation"},  # any language pair
}


def _train(name: str, config: str, data_root: str | None, overrides: FlowOverrides | None, max_steps: int | None,
           max_minutes: float | None, precision: Precision | None, tracking_uri: str | None,
           register_model: bool) -> dict:
    """The body of every translation flow: the pipeline on ``config``, which must be what flow ``name`` expects."""
    cfg = pipeline_config(name, EXPECT[name], config, data_root, overrides, max_steps, max_minutes, precision,
                          tracking_uri)
    return run_pipeline(name, cfg, tracking_uri, register_model)


@pipeline_flow("train-en-de")
def train_en_de(config: ConfigName | str = "multi30k-cpu-hub", data_root: str | None = None,
                overrides: FlowOverrides | None = None, max_steps: int | None = None,
                max_minutes: float | None = None, precision: Precision | None = None,
                tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train, evaluate and register an English->German Transformer; a config for another pair is refused.

    Args:
        config: a config under configs/ (``multi30k-cpu-hub``, ``wmt14-en-de-base``, ``wmt14-en-de-big``) or a path
            there or under a folder of the worker's AIAYN_CONFIG_DIRS.
        data_root: a folder of local corpora (e.g. ../shared/data) instead of the hub; env AIAYN_DATA_ROOT, which
            it may differ from only where AIAYN_RUNS_MAY_SET allows data_root.
        overrides: config fields by their dotted names, typed and checked against the config schema when the run
            is created, e.g. {"train.warmup_steps": 8000, "launch.nproc_per_node": 8}.
        max_steps, max_minutes: training budget shortcuts (train.max_steps, train.max_minutes).
        precision: train.precision (auto: bf16 where the hardware computes it natively; fp32: the paper's).
        tracking_uri: the MLflow server; default env MLFLOW_TRACKING_URI, else SQLite in the work dir; another only
            where AIAYN_RUNS_MAY_SET allows tracking_uri.
        register_model: register the averaged model and decide on the champion alias.
    """
    return _train("train-en-de", config, data_root, overrides, max_steps, max_minutes, precision, tracking_uri,
                  register_model)


@pipeline_flow("train-en-fr")
def train_en_fr(config: ConfigName | str = "wmt14-en-fr-base", data_root: str | None = None,
                overrides: FlowOverrides | None = None, max_steps: int | None = None,
                max_minutes: float | None = None, precision: Precision | None = None,
                tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train, evaluate and register an English->French Transformer; a config for another pair is refused.

    Args:
        config: a config under configs/ (``multi30k-en-fr-cpu``, ``wmt14-en-fr-base``, ``wmt14-en-fr-big``) or a
            path.
        data_root, overrides, max_steps, max_minutes, precision, tracking_uri, register_model: as for
            ``train-en-de``.
    """
    return _train("train-en-fr", config, data_root, overrides, max_steps, max_minutes, precision, tracking_uri,
                  register_model)


@pipeline_flow("train-translation")
def train_translation(config: ConfigName | str, data_root: str | None = None,
                      overrides: FlowOverrides | None = None, max_steps: int | None = None,
                      max_minutes: float | None = None, precision: Precision | None = None,
                      tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train, evaluate and register a Transformer for any language pair: the one the config names
    (``data.src_lang`` -> ``data.tgt_lang``); only a config that is not a translation config is refused.

    Args:
        config: required: a translation config under configs/ (e.g. ``multi30k-en-fr-cpu``) or the path of one
            there or under a folder of the worker's AIAYN_CONFIG_DIRS (absolute, or relative to the project folder),
            e.g. a config written for a new language pair.
        data_root, overrides, max_steps, max_minutes, precision, tracking_uri, register_model: as for
            ``train-en-de``.

    The model registers as ``transformer-<src_lang>-<tgt_lang>`` unless ``tracking.registered_model`` names another.
    """
    return _train("train-translation", config, data_root, overrides, max_steps, max_minutes, precision,
                  tracking_uri, register_model)
