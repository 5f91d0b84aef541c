"""English constituency parsing (the paper's section 6.3): ``parse-wsj``, the same stages (flows/common.py) on a
treebank config; scored with EVALB's bracketing F1.

With teachers (``distill.teachers``, the ``teachers`` parameter, or ``teacher_configs`` trained first as child
``parse-wsj`` runs), it is the paper's semi-supervised setting: the teachers parse ``distill.unlabelled`` and the
parser trains on the gold trees and the kept silver trees together (pipeline/silver.py).
"""

from __future__ import annotations

from flows.common import Precision, pipeline_config, pipeline_flow, run_pipeline
from flows.distill import train_teachers
from pipeline.config import ConfigError, ConfigName, FlowOverrides, flow_overrides

NAME = "parse-wsj"
EXPECT = {"task": "parsing"}


@pipeline_flow(NAME)
def parse_wsj(config: ConfigName | str = "ptb-sample-cpu", data_root: str | None = None,
              overrides: FlowOverrides | None = None, max_steps: int | None = None, max_minutes: float | None = None,
              precision: Precision | None = None, tracking_uri: str | None = None, register_model: bool = True,
              teachers: list[str] | None = None, teacher_configs: list[ConfigName | str] | None = None) -> dict:
    """Train and evaluate a Transformer parser; with teachers, semi-supervised.

    Args:
        config: ``ptb-sample-cpu`` (the NLTK WSJ sample, CPU preset), ``ptb-sample-semi-cpu`` (the same with
            silver trees of unlabelled news sentences) or ``wsj-parsing`` (the licensed WSJ treebank, sections
            02-21 / 22 / 23, the paper's parsing preset), or a path.
        data_root: the folder holding the treebank (and the unlabelled text); env AIAYN_DATA_ROOT.
        overrides, max_steps, max_minutes, precision, tracking_uri, register_model: as for ``train-en-de``;
            max_steps, max_minutes, precision and tracking_uri apply to the teacher runs too.
        teachers: replaces the config's distill.teachers: registered parser versions (``models:/<name>@<alias>``,
            ``models:/<name>/<version>``) or checkpoint files (.pt); several parse as one ensemble.
        teacher_configs: parsing configs trained first, each a ``parse-wsj`` child flow run that registers its
            model; their versions become the teachers (beside ``teachers``, when given).
    """
    def resolved(trained: list[str]):
        student = flow_overrides(overrides)
        if teachers is not None or trained:
            student["distill.teachers"] = [*(teachers or []), *trained]
        return pipeline_config(NAME, EXPECT, config, data_root, student, max_steps, max_minutes, precision,
                               tracking_uri)

    cfg = resolved([])  # a wrong config is refused before any teacher trains
    if cfg.distill.unlabelled and not cfg.distill.teachers and not teacher_configs:
        raise ConfigError(f"config {config!r} names unlabelled sentences (distill.unlabelled) but no teachers to "
                          "parse them: pass -p teacher_configs='[\"ptb-sample-cpu\"]' to train one first, or -p "
                          "teachers='[\"models:/transformer-en-tree@champion\"]'")
    if teacher_configs:
        if not cfg.distill.unlabelled:
            raise ConfigError(f"config {config!r} has no distill.unlabelled: teachers parse unlabelled sentences; "
                              "run a semi-supervised config (e.g. ptb-sample-semi-cpu)")
        cfg = resolved(train_teachers(NAME, parse_wsj, cfg, teacher_configs, data_root, max_steps, max_minutes,
                                      precision, tracking_uri))
    return run_pipeline(NAME, cfg, tracking_uri, register_model)
