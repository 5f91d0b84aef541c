"""The teachers of sequence-level knowledge distillation (``distill.teachers``), resolved to files, and what the
registry shows of them beside the student.

A teacher is named the way MLflow names a model version, ``models:/<name>@<alias>`` or ``models:/<name>/<version>``,
or is a checkpoint file (``.pt``). Resolution pins an alias to the version it points at now and downloads that
version's checkpoint and tokenizer under the work dir, so lineage (the distill run's tags, the student version's
tags and description, the report) names versions, which never move, not aliases, which do. The teachers decode as
one ensemble, so they must share one tokenizer (the same sentencepiece model, by its sha256): a piece id must mean
the same piece to every member.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.checkpoint import load_checkpoint
from pipeline.data import read_manifest
from pipeline.distill import teacher_tokenizer
from pipeline.support.errors import UserError
from pipeline.speed import STUDENT, SideBySide
from pipeline.tokenize import Tokenizer

from .registry import alias_version, model_size, version_files, version_tags
from .runs import client

_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[0-9]+))")


class TeacherError(UserError, ValueError):
    """A teacher that cannot be used: a reference of no known form, an alias that points nowhere, a missing
    checkpoint file, teachers that do not share a tokenizer. The message names them and what to do."""


@dataclass(frozen=True)
class TeacherRef:
    """One entry of ``distill.teachers``, parsed: a registered model (``name``) with an ``alias`` or a ``version``
    number, or (``name`` None) a checkpoint file, the reference itself."""

    ref: str
    name: str | None = None
    alias: str | None = None
    version: str | None = None

    @classmethod
    def parse(cls, ref: str) -> TeacherRef:
        """``models:/<name>@<alias>``, ``models:/<name>/<version>`` or a path ending in ``.pt``; anything else is
        refused, naming the forms."""
        m = _MODEL_URI.fullmatch(ref)
        if m:
            return cls(ref, m["name"], m["alias"], m["version"])
        if ref.endswith(".pt"):
            return cls(ref)
        raise TeacherError(f"teacher {ref!r} is neither a registered version (models:/<name>@<alias>, "
                           "models:/<name>/<version>) nor a checkpoint file (.pt)")


@dataclass(frozen=True)
class Teacher:
    """A resolved teacher: ``label`` names it in lineage (``<name>/<version>`` for a registered version, the
    checkpoint's path for a file), its checkpoint and tokenizer folder on disk, the tokenizer's sha256, its size
    (:func:`pipeline.tracking.registry.model_size`: parameters, MiB on disk of what it serves with, and that
    engine), and its registered score on the dev set (``dev_score`` of ``score_key``; None for a file, or a
    version without that score)."""

    ref: str
    label: str
    checkpoint: Path
    tokenizer: Path
    tokenizer_sha256: str
    parameters: int
    serving_mb: float
    engine: str
    score_key: str
    dev_score: float | None = None
    export: Path | None = None  # the CTranslate2 export it serves with (engine "ctranslate2")

    def describe(self) -> str:
        """One line: the teacher, its dev score and its size."""
        score = "no registered score" if self.dev_score is None else f"{self.score_key} {self.dev_score:.2f}"
        return (f"{self.label}: {score}; {self.parameters:,} parameters; {self.serving_mb:.2f} MiB served with "
                f"{self.engine}")


def _registered(ref: TeacherRef, work_dir: Path, score_key: str) -> Teacher:
    """A registered version's files, downloaded under ``<work_dir>/teachers/<name>/<version>/``."""
    version = ref.version or alias_version(ref.name, ref.alias)
    if version is None:
        raise TeacherError(f"teacher {ref.ref}: registered model {ref.name!r} has no version with alias "
                           f"{ref.alias!r}: register one first (e.g. run its training flow), or name a version "
                           f"(models:/{ref.name}/<version>)")
    files = version_files(ref.name, version, Path(work_dir) / "teachers" / ref.name / version)
    size = model_size(load_checkpoint(files.checkpoint), files.checkpoint, files.export)
    score = version_tags(ref.name, version).get(score_key)
    return Teacher(ref.ref, f"{ref.name}/{version}", files.checkpoint, files.tokenizer,
                   Tokenizer(files.tokenizer).sha256, int(size["model.parameters"]), size["serving.model_mb"],
                   "torch" if files.export is None else "ctranslate2", score_key,
                   None if score is None else float(score), files.export)


def _files(refs: Sequence[TeacherRef], work_dir: Path, score_key: str) -> list[Teacher]:
    """Checkpoint files, with the tokenizer they were trained with (:func:`pipeline.distill.teacher_tokenizer`)."""
    if not refs:
        return []
    paths = [Path(r.ref).expanduser() for r in refs]
    tokenizer = teacher_tokenizer(paths, work_dir)  # refuses a missing file, and files of different tokenizers
    sha256 = Tokenizer(tokenizer).sha256
    out = []
    for ref, path in zip(refs, paths):
        size = model_size(load_checkpoint(path), path, None)
        out.append(Teacher(ref.ref, str(path.resolve()), path, tokenizer, sha256, int(size["model.parameters"]),
                           size["serving.model_mb"], "torch", score_key))
    return out


def resolve_teachers(refs: Sequence[str], work_dir: Path, score_key: str) -> list[Teacher]:
    """The teachers ``refs`` (``distill.teachers``) in their order, each registered version downloaded under the
    work dir; ``score_key`` (``<dev set>.<metric>``) is the registered score shown beside each. Refuses, naming
    them, teachers that do not share one tokenizer (:func:`shared_tokenizer`)."""
    parsed = [TeacherRef.parse(r) for r in refs]
    files = iter(_files([r for r in parsed if r.name is None], work_dir, score_key))
    teachers = [next(files) if r.name is None else _registered(r, work_dir, score_key) for r in parsed]
    shared_tokenizer(teachers)
    return teachers


def shared_tokenizer(teachers: Sequence[Teacher]) -> Path:
    """The tokenizer folder every teacher was trained with; a :class:`TeacherError` naming the teachers of each
    tokenizer when they differ (an ensemble averages the members' distributions over one vocabulary)."""
    if not teachers:
        raise TeacherError("no teachers: set distill.teachers (models:/<name>@<alias>, models:/<name>/<version> or "
                           "a .pt checkpoint)")
    groups: dict[str, list[str]] = {}
    for t in teachers:
        groups.setdefault(t.tokenizer_sha256, []).append(t.label)
    if len(groups) > 1:
        raise TeacherError("the teachers do not share one tokenizer, so they cannot decode as one ensemble: "
                           + "; ".join(f"{', '.join(labels)} with tokenizer sha256 {sha[:16]}..."
                                       for sha, labels in groups.items())
                           + ". Pick teachers trained with the same tokenizer (runs of configs with the same data "
                           "and tokenizer sections), or distil from one of them")
    return teachers[0].tokenizer


def lineage_tags(teachers: Sequence[Teacher], distilled: Path) -> dict[str, str]:
    """What a model trained on the ``distilled`` corpus comes from, as tags: ``distill.teachers`` (their labels:
    versions, not aliases), the source corpus's fingerprint and one ``distill.teacher.<i>`` per teacher with its
    dev score and size (:meth:`Teacher.describe`)."""
    entry = read_manifest(distilled)["distillation"]
    return {"distill.teachers": ",".join(t.label for t in teachers),
            "distill.source_corpus_fingerprint": entry["source_corpus"]["fingerprint"],
            **{f"distill.teacher.{i}": t.describe() for i, t in enumerate(teachers, 1)}}


def speedup_tag(teachers: Sequence[Teacher], speeds: SideBySide) -> dict[str, str]:
    """``distill.speedup``: the student's sentences/s over its fastest teacher's, from one side-by-side
    measurement (a ratio, which travels between machines where sentences/s do not)."""
    fastest = max(speeds.per_s[t.label] for t in teachers)
    return {"distill.speedup": f"{speeds.per_s[STUDENT] / fastest:.2f}"}


def describe_student(name: str, version: str, teachers: Sequence[Teacher], speeds: SideBySide | None = None) -> str:
    """Set the student version's description: a table of its teachers and itself side by side (dev score, parameters,
    MiB on disk of what serves, engine, and with ``speeds`` the sentences/s each served at in one side-by-side
    measurement, named under the table with its machine), every other value as the registry records it; returns
    the text."""
    tags = version_tags(name, version)
    key = teachers[0].score_key
    score = tags.get(key)
    cell = lambda v: "n/a" if v is None else f"{float(v):.2f}"  # noqa: E731
    speed = (lambda label: "") if speeds is None else (lambda label: f" {speeds.per_s[label]:.1f} |")  # noqa: E731
    rows = [f"| {t.label} | teacher | {cell(t.dev_score)} | {t.parameters:,} | {t.serving_mb:.2f} | {t.engine} |"
            f"{speed(t.label)}" for t in teachers]
    rows.append(f"| {name}/{version} | student | {cell(score)} | {int(tags['model.parameters']):,} | "
                f"{float(tags['serving.model_mb']):.2f} | {tags['serving.engine']} |{speed(STUDENT)}")
    header = f"| model | role | {key} | parameters | served MiB | engine |"
    rule = "|---|---|---|---|---|---|"
    notes = []
    if speeds is not None:
        header, rule = header + " sentences/s |", rule + "---|"
        notes = ["", f"Sentences/s: {speeds.describe()}."]
    text = "\n".join([
        f"Student of sequence-level knowledge distillation: trained on what {', '.join(t.label for t in teachers)} "
        f"translated of the training sources (corpus {tags.get('corpus_fingerprint', '?')[:16]}); dev and test "
        "keep their human references.", "", header, rule, *rows, *notes])
    client().update_model_version(name, version, description=text)
    return text
