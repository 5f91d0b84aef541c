"""The ``distill`` section: sequence-level knowledge distillation from registered teachers."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Strict
from pipeline.config.evaluation import DecodeConfig


class DistillConfig(Strict):
    """Sequence-level knowledge distillation (Kim & Rush, 2016; not in the paper), the production road of machine
    translation: the teachers translate the training split's source side with beam search, the pairs where they
    failed are dropped (each rule counted), and this config's model (the student) trains on what is left. Dev and
    test sets keep their human references. No teachers: the run trains on the corpus as it is.

    For parsing the same road is the paper's semi-supervised setting: the teachers are trained parsers, they parse
    the ``unlabelled`` sentences, the ``keep_fraction`` most confident silver trees are kept (rule ``confident``)
    and the parser trains on them beside every gold tree (``keep_original`` must stay true).

    A teacher is a registered version, ``models:/<registered model>@<alias>`` or
    ``models:/<registered model>/<version>`` (MLflow's model URIs), or a checkpoint file (``.pt``); several decode as
    one ensemble (their log-probabilities averaged at each step). They must share one tokenizer; the student trains
    its own on the distilled corpus.
    """

    teachers: list[str] = Field(default_factory=list, description=(
        "The teacher models: registered versions (models:/<name>@<alias>, models:/<name>/<version>) or checkpoint "
        "files (.pt); several decode as one ensemble. Empty = no distillation (train on the corpus as it is)."))
    translations: str | None = Field(default=None, description=(
        "Instead of teachers: a translations folder made elsewhere (translations.txt, one line per training source "
        "in corpus order, and its manifest.json recording the teachers' lineage), as bench/gpu_teacher.py brings "
        "back from a GPU; the filters below run on it here. Set teachers or this, not both."))
    decode: DecodeConfig = Field(default=DecodeConfig(), description=(
        "How the teachers translate the training sources (beam search; the paper's beam 4 and length penalty 0.6 "
        "by default)."))
    nbest: int = Field(default=1, ge=1, description=(
        "Hypotheses the teachers keep per source (at most decode.beam_size); the one kept is chosen by select."))
    select: Literal["best", "chrf"] = Field(default="best", description=(
        "Which of the nbest hypotheses becomes the target: best = the teachers' best-scoring one; chrf = the one "
        "closest to the human reference by chrF, as mozilla/translations does. Not in the paper."))
    max_ratio: float = Field(default=3.0, ge=1, description=(
        "Drop a pair whose teacher output is more than this many times longer or shorter, in words, than its "
        "source (a hallucination or a truncated translation). At least 1: below it every pair fails one way or "
        "the other."))
    drop_copies: bool = Field(default=True, description=(
        "Drop a pair whose teacher output equals its source (the teacher copied instead of translating)."))
    keep_original: bool = Field(default=False, description=(
        "Train the student on the human references as well: the distilled training split holds every training "
        "pair as it is and, beside it, its source with the teachers' translation (about twice the pairs; the "
        "filters drop only failed translations). False = the teachers' targets alone (Kim & Rush, 2016). Not in "
        "the paper."))
    unlabelled: list[str] = Field(default_factory=list, description=(
        "Parsing only (the paper's semi-supervised setting, section 6.3): text files under data.root, one "
        "sentence of ordinary English per line, that the teachers (parsers) parse; the kept silver trees join "
        "the gold training trees. Their words are split by Penn Treebank conventions first, and a file holding a "
        "dev or test sentence is refused. Translation distils its training sources and takes none."))
    keep_fraction: float = Field(default=0.5, gt=0, le=1, description=(
        "Parsing only: the rule confident keeps this fraction of the silver trees, the ones the teachers are most "
        "confident of (the highest length-normalised log-probability); 1 keeps them all. The paper's silver "
        "trees are a high-confidence corpus (Vinyals et al., 2015: the sentences on which two parsers agreed)."))
    chunk_sentences: int = Field(default=4096, ge=1, description=(
        "Training sources decoded per chunk; each finished chunk is kept on disk, so a killed run resumes with the "
        "next one."))
    speed_sentences: int = Field(default=100, ge=0, description=(
        "Dev sentences the student and each teacher translate side by side when the student is registered: their "
        "speeds (sentences per second), each with the engine it serves with, go into the student version's "
        "description and its distill.speedup tag (0: not measured)."))

    @field_validator("teachers")
    @classmethod
    def _teacher_forms(cls, v: list[str]) -> list[str]:
        for ref in v:
            if not (re.fullmatch(r"models:/[^/@]+(@[A-Za-z0-9_-]+|/[0-9]+)", ref) or ref.endswith(".pt")):
                raise ValueError(f"teacher {ref!r} is neither a registered version (models:/<name>@<alias>, "
                                 "models:/<name>/<version>) nor a checkpoint file (.pt)")
        if len(set(v)) < len(v):
            raise ValueError(f"teachers {v} name one model twice: an ensemble member counts once")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "DistillConfig":
        if self.teachers and self.translations:
            raise ValueError(f"distill.teachers {self.teachers} and distill.translations {self.translations!r} both "
                             "set: the student learns from teachers decoded here or from translations made "
                             "elsewhere; empty one of them")
        return self

    @model_validator(mode="after")
    def _nbest_fits(self) -> "DistillConfig":
        if self.nbest > self.decode.beam_size:
            raise ValueError(f"nbest ({self.nbest}) must not exceed decode.beam_size ({self.decode.beam_size}): a "
                             f"beam of {self.decode.beam_size} finds at most {self.decode.beam_size} hypotheses")
        return self
