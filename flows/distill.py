"""Sequence-level knowledge distillation (Kim & Rush, 2016), ``distill-translation``: a student trained on what its
teachers translate of the training sources, registered as its own model.

    [teacher_configs: each trained, evaluated and registered first, a train-translation child flow run]
    -> the student's pipeline (flows/common.py) with its teachers: data -> distill -> tokenizer -> ... -> register

The teachers are ``distill.teachers`` (registered versions, ``models:/<name>@<alias>`` or
``models:/<name>/<version>``, or checkpoint files): the config's, those of the ``teachers`` parameter instead, and
the versions the ``teacher_configs`` runs registered. Every one of them reaches the run as the one override
``distill.teachers``, resolved with the rest of the config.
"""

from __future__ import annotations

from typing import Callable

from prefect.runtime import flow_run

from flows.common import Precision, flow_config, pipeline_config, pipeline_flow, run_pipeline
from flows.translation import train_translation
from pipeline.config import ConfigError, ConfigName, FlowOverrides, RunConfig, flow_overrides

NAME = "distill-translation"
EXPECT = {"task": "translation"}  # any language pair; the teachers must translate the same one


def student_config(config: str, data_root: str | None, overrides: FlowOverrides | dict | None,
                   teachers: list[str] | None, trained: list[str], max_steps: int | None, max_minutes: float | None,
                   precision: Precision | None, tracking_uri: str | None = None) -> RunConfig:
    """The student's config: ``teachers`` (when given) replaces ``distill.teachers``, and the versions teacher runs
    registered (``trained``) join them, as the one override ``distill.teachers``."""
    student = flow_overrides(overrides)
    if teachers is not None or trained:
        student["distill.teachers"] = [*(teachers or []), *trained]
    return pipeline_config(NAME, EXPECT, config, data_root, student, max_steps, max_minutes, precision, tracking_uri)


@pipeline_flow(NAME)
def distill_translation(config: ConfigName | str = "multi30k-student-tiny", teachers: list[str] | None = None,
                        teacher_configs: list[ConfigName | str] | None = None, data_root: str | None = None,
                        overrides: FlowOverrides | None = None, max_steps: int | None = None,
                        max_minutes: float | None = None, precision: Precision | None = None,
                        tracking_uri: str | None = None, register_model: bool = True) -> dict:
    """Distil a student from its teachers: their translations of the training sources become its targets; it
    trains, is evaluated on the human references and registers as its own model.

    Args:
        config: the student's config under configs/ (``multi30k-student-tiny``, ``multi30k-student-deep-shallow``,
            ``multi30k-en-fr-student-tiny``) or a path; its distill section names the teachers.
        teachers: replaces the config's distill.teachers: registered versions (``models:/<name>@<alias>``,
            ``models:/<name>/<version>``) or checkpoint files (.pt); several decode as one ensemble.
        teacher_configs: translation configs (of the student's language pair) trained first, each a
            ``train-translation`` child flow run that registers its model; their versions become the teachers
            (beside ``teachers``, when given). data_root, max_steps, max_minutes, precision and tracking_uri apply
            to these runs too; overrides are the student's only.
        data_root, overrides, max_steps, max_minutes, precision, tracking_uri: as for ``train-en-de``, for the
            student.
        register_model: register the student (as tracking.registered_model, e.g. transformer-en-de-student) and
            decide on its champion alias.
    """
    # The student's config first: a wrong one is refused before any teacher trains.
    cfg = student_config(config, data_root, overrides, teachers, [], max_steps, max_minutes, precision, tracking_uri)
    if not cfg.distill.teachers and not teacher_configs:
        raise ConfigError(f"config {config!r} has no teachers (distill.teachers is empty) and none were given: pass "
                          "-p teachers='[\"models:/<name>@champion\"]', or -p teacher_configs='[\"<config>\"]' to "
                          "train them first, or run a student config (e.g. multi30k-student-tiny)")
    if teacher_configs:
        trained = train_teachers(NAME, train_translation, cfg, teacher_configs, data_root, max_steps, max_minutes,
                                 precision, tracking_uri)
        cfg = student_config(config, data_root, overrides, teachers, trained, max_steps, max_minutes, precision,
                             tracking_uri)
    return run_pipeline(NAME, cfg, tracking_uri, register_model)


def train_teachers(name: str, child: Callable[..., dict], cfg: RunConfig, teacher_configs: list[str],
                   data_root: str | None, max_steps: int | None, max_minutes: float | None,
                   precision: Precision | None, tracking_uri: str | None) -> list[str]:
    """Train, evaluate and register each of ``teacher_configs`` as a ``child`` flow run (``train-translation``,
    ``parse-wsj``) under the flow run ``name``; returns the versions they registered (``models:/<name>/<v>``). A
    teacher config of another task or language pair than the student's ``cfg`` is refused before any trains."""
    pair = {"task": cfg.task, "src_lang": cfg.data.src_lang, "tgt_lang": cfg.data.tgt_lang}
    for teacher in teacher_configs:
        flow_config(teacher, {}, data_root, f"{name} (teacher_configs)", pair, tracking_uri)
    trained = []
    for i, teacher in enumerate(teacher_configs, 1):
        run = child.with_options(flow_run_name=f"{flow_run.get_name()}-teacher-{i}")(
            config=teacher, data_root=data_root, max_steps=max_steps, max_minutes=max_minutes,
            precision=precision, tracking_uri=tracking_uri, register_model=True)
        trained.append(f"models:/{run['registered_model']}/{run['decision']['version']}")
    return trained
