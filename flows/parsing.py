"""English constituency parsing (the paper's section 6.3): ``parse-wsj``, the same stages (flows/common.py) on a
treebank config; scored with EVALB's bracketing F1."""

from __future__ import annotations

from flows.common import Precision, pipeline_config, pipeline_flow, run_pipeline
from pipeline.config import ConfigName, FlowOverrides


@pipeline_flow("parse-wsj")
def parse_wsj(config: ConfigName | str = "ptb-sample-cpu", data_root: str | None = None,
              overrides: FlowOverrides | None = None, max_steps: int | None = None, max_minutes: float | None = None,
              precision: Precision | None = None, tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Train and evaluate a Transformer parser.

    Args:
        config: ``ptb-sample-cpu`` (the NLTK WSJ sample, CPU preset) or ``wsj-parsing`` (the licensed WSJ
            treebank, sections 02-21 / 22 / 23, the paper's parsing preset), or a path.
        data_root: the folder holding the treebank; env AIAYN_DATA_ROOT.
        overrides, max_steps, max_minutes, precision, tracking_uri, register_model: as for ``train-en-de``.
    """
    cfg = pipeline_config("parse-wsj", {"task": "parsing"}, config, data_root, overrides, max_steps, max_minutes,
                          precision, tracking_uri)
    return run_pipeline("parse-wsj", cfg, tracking_uri, register_model)
