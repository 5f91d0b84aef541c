"""The root of the schema: :class:`RunConfig`, everything one run needs, its sections and the rules across them."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Literal, Mapping

from pydantic import Field, model_validator

from pipeline.config.base import DisplayName, Strict, canonical_json
from pipeline.config.data import DataConfig
from pipeline.config.distill import DistillConfig
from pipeline.config.evaluation import AverageConfig, DecodeConfig, ExportConfig
from pipeline.config.launch import LaunchConfig
from pipeline.config.model import ModelConfig
from pipeline.config.tokenizer import TokenizerConfig
from pipeline.config.tracking import TrackingConfig
from pipeline.config.train import TrainConfig

Task = Literal["translation", "parsing"]


class RunConfig(Strict):
    """Everything one pipeline run needs; resolved once and passed down."""

    name: DisplayName = Field(min_length=1, description=(
        "The run config's name; tracking logs it as the config_name tag. Printable characters only."))
    task: Task = Field(default="translation", description=(
        "translation: sentence pairs, scored by BLEU; parsing (paper section 6.3): words to a linearised tree, "
        "scored by EVALB F1."))
    preset: DisplayName = Field(default="base", description=(
        "The paper row (or CPU size) this run is built on, e.g. base, big, tiny; a tag, not a switch. Printable "
        "characters only."))
    work_dir: str = Field(default="runs", description=(
        "Folder for stage outputs, in sub-folders named by content hashes (overridden by --work-dir or "
        "AIAYN_WORK_DIR)."))
    data: DataConfig = Field(description="The corpora, language pair and cleaning rules.")
    tokenizer: TokenizerConfig = Field(default=TokenizerConfig(), description="The shared subword tokenizer.")
    model: ModelConfig = Field(default=ModelConfig(), description="The Transformer's hyperparameters.")
    train: TrainConfig = Field(default=TrainConfig(), description="Optimisation, budget and checkpoints.")
    average: AverageConfig = Field(default=AverageConfig(), description="Checkpoint averaging.")
    decode: DecodeConfig = Field(default=DecodeConfig(), description="Beam search settings.")
    export: ExportConfig = Field(default=ExportConfig(), description="The serving export and its quality gate.")
    launch: LaunchConfig = Field(default=LaunchConfig(), description=(
        "How training processes are started (no stage folder's hash or cache key depends on it)."))
    tracking: TrackingConfig = Field(default=TrackingConfig(), description=(
        "MLflow experiment, registered model and promotion rule."))
    distill: DistillConfig = Field(default=DistillConfig(), description=(
        "Sequence-level knowledge distillation: teachers whose translations of the training sources replace its "
        "targets. No teachers = none."))
    recipes: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "Compute recipes: named sets of settings, each a partial config (sections and fields, as in the YAML), "
        "that recipe applies over the YAML files and under the overrides. Keyed by the precision a machine trains "
        "at for recipe auto: fp32 (a CPU without native bf16, which buys a fraction of the updates in the same "
        "minutes), bf16. Not in the paper."))
    recipe: str = Field(default="auto", description=(
        "Which of recipes to apply. auto: where the clock ends the run (train.max_minutes set), the recipe named "
        "by the precision this machine trains at (train.precision resolved: bf16 or fp32), if recipes has it; "
        "a run with a step budget gets the same compute on any machine and keeps the config as written. none: "
        "the config as written. A key of recipes: that recipe. Overrides (--set, deployment parameters) win over "
        "the recipe's settings. Not in the paper."))
    recipe_applied: str | None = Field(default=None, description=(
        "Set when the config is loaded: the recipe applied (none: none), with recipe auto resolved on this machine; "
        "logged with the run. A config that holds it is resolved already and gets no recipe again."))

    @property
    def exports(self) -> bool:
        """Whether the run has a serving export stage: translation models, unless ``export.engine`` is none."""
        return self.task == "translation" and self.export.engine != "none"

    @property
    def promotion_split(self) -> str:
        """The corpus split key promotion reads: ``dev`` or ``test.<name>`` (from ``tracking.promote_on``)."""
        on = self.tracking.promote_on
        return "dev" if on in ("dev", self.data.dev.name) else f"test.{on}"

    @property
    def promotion_metric(self) -> str:
        """``tracking.promote_metric`` with ``auto`` resolved for the task."""
        metric = self.tracking.promote_metric
        return metric if metric != "auto" else ("f1" if self.task == "parsing" else "sacrebleu")

    @property
    def guard_metric(self) -> str:
        """The score the test-set guard compares: chrF for translation, EVALB F1 for parsing."""
        return "f1" if self.task == "parsing" else "chrf"

    @property
    def registered_model_name(self) -> str:
        """The MLflow registered model: ``tracking.registered_model``, or ``transformer-<src>-<tgt>``."""
        return self.tracking.registered_model or f"transformer-{self.data.src_lang}-{self.data.tgt_lang}"

    def averaging_shortfall(self) -> str | None:
        """Why this run cannot be sure to end with the checkpoints its averaging needs (``average.last_n``, or the
        smallest of ``average.choose_from``), or None. Training writes one every ``train.checkpoint_every_steps``
        and one at the end, and keeps ``train.keep_last_checkpoints``; a ``train.checkpoint_every_minutes`` one may
        come in between, but nothing promises it. For the runs that average (the pipeline flows, ``run``)."""
        t, a = self.train, self.average
        field, need = ("average.choose_from", min(a.choose_from)) if a.choose_from else ("average.last_n", a.last_n)
        if t.keep_last_checkpoints < need:
            return (f"{field} needs {need} checkpoints, but train.keep_last_checkpoints keeps "
                    f"{t.keep_last_checkpoints}: raise it to {need} or more, or lower {field}")
        written = math.ceil(t.max_steps / t.checkpoint_every_steps)
        if written < need:
            return (f"{field} needs {need} checkpoints, but train.max_steps={t.max_steps} writes {written} (one "
                    f"every train.checkpoint_every_steps={t.checkpoint_every_steps} and one at the end): set "
                    f"train.checkpoint_every_steps to {max(t.max_steps // need, 1)} or less, raise train.max_steps "
                    f"or lower {field}")
        return None

    @model_validator(mode="after")
    def _task_fits(self) -> "RunConfig":
        sources = [("data.dev", self.data.dev)] + [(f"data.train[{i}]", s) for i, s in enumerate(self.data.train)] + [
            (f"data.test[{i}]", s) for i, s in enumerate(self.data.test)]
        if self.task == "parsing":
            wrong = [f"{where} ({s.format})" for where, s in sources if s.format != "ptb"]
            if wrong:
                raise ValueError(f"task 'parsing' reads treebanks: every source needs format 'ptb', not {wrong}")
            if self.tokenizer.model_type != "word":
                raise ValueError("task 'parsing' needs tokenizer.model_type 'word' (one piece per word and per "
                                 "bracket symbol)")
            d = self.distill
            if d.translations:
                raise ValueError("distill.translations: translations made elsewhere are for translation; a "
                                 "parser's teachers parse distill.unlabelled here")
            if d.teachers and not d.unlabelled:
                raise ValueError("distill.teachers: a parser's teachers parse unlabelled sentences, never the "
                                 "training trees (their gold trees stay): name text files of English sentences "
                                 "under data.root in distill.unlabelled")
            if d.unlabelled and not d.keep_original:
                raise ValueError("distill.keep_original false: the semi-supervised parser trains on the gold trees "
                                 "and the kept silver trees together; set distill.keep_original: true")
            if d.nbest != 1 or d.select != "best":
                raise ValueError(f"distill.nbest {d.nbest}, distill.select {d.select!r}: unlabelled sentences have "
                                 "no reference to choose among hypotheses by; set nbest: 1 and select: best")
            if self.decode.search == "static" and self.decode.tree_constraint:
                raise ValueError("decode.search 'static' cannot apply decode.tree_constraint (it reads every prefix "
                                 "on the host at each step); use decode.search: dynamic for parsing")
        else:
            if self.distill.unlabelled:
                raise ValueError("distill.unlabelled is for task parsing (its semi-supervised setting); "
                                 "translation distils its own training sources")
            wrong = [where for where, s in sources if s.format == "ptb"]
            if wrong:
                raise ValueError(f"format 'ptb' sources ({wrong}) are for task 'parsing'; set task: parsing")
        for where, dec in (("decode", self.decode), ("distill.decode", self.distill.decode)):
            if dec.tree_leaf_mass and not (self.task == "parsing" and self.data.tree_leaves == "words"
                                           and dec.tree_constraint):
                raise ValueError(f"{where}.tree_leaf_mass {dec.tree_leaf_mass}: it weighs the leaf a parser writes "
                                 f"for the next input word, which only parsing with data.tree_leaves 'words' and "
                                 f"{where}.tree_constraint has; set it to 0")
        sets = ["dev", self.data.dev.name, *(s.name for s in self.data.test)]
        if self.tracking.promote_on not in sets:
            raise ValueError(f"tracking.promote_on {self.tracking.promote_on!r} is not a set of this config; "
                             f"use one of {sets}")
        room = self.model.max_positions - 1  # bos takes position 0
        if self.decode.min_len > room:
            raise ValueError(f"decode.min_len ({self.decode.min_len}) exceeds the longest output the model has "
                             f"positions for, model.max_positions - 1 = {room}: lower decode.min_len")
        fits = ("f1",) if self.task == "parsing" else ("sacrebleu", "chrf")
        if self.tracking.promote_metric not in ("auto", *fits):
            raise ValueError(f"tracking.promote_metric {self.tracking.promote_metric!r} is not a {self.task} "
                             f"score; use auto or one of {list(fits)}")
        return self

    def section_hash(self, *sections: str, exclude: Mapping[str, set[str]] | None = None) -> str:
        """Stable short hash of the named sections (all when none), without the fields of ``exclude`` (section ->
        field names): names folders and cache keys."""
        dump = self.model_dump(mode="json", exclude=exclude)
        picked = {k: dump[k] for k in (sections or tuple(dump))}
        return hashlib.sha256(canonical_json(picked).encode()).hexdigest()[:16]
