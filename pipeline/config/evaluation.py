"""The sections after training: checkpoint averaging (``average``), beam search (``decode``) and the serving
export (``export``)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Strict


class AverageConfig(Strict):
    """Checkpoint averaging (paper section 6.1): the last ``last_n`` checkpoints.

    ``choose_from`` (not in the paper; empty = the paper's fixed N): candidate values of N; each average is
    decoded on the dev split with the run's decoding settings and the best dev score (translation: sacreBLEU;
    parsing: EVALB F1) picks N. The choice and every candidate's score are recorded (``choice.json``).
    """

    last_n: int = Field(default=5, ge=1, description=(
        "Average the last this many checkpoints (used when choose_from is empty). Paper: 5 base, 20 big."))
    choose_from: list[int] = Field(default=[], description=(
        "Candidate values of N (distinct, positive): each average is decoded on dev and the best dev score picks "
        "N. Empty = the fixed last_n (the paper). Not in the paper."))

    @field_validator("choose_from")
    @classmethod
    def _positive_distinct(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v) or len(set(v)) != len(v):
            raise ValueError(f"candidates must be distinct positive checkpoint counts, got {v}")
        return sorted(v)


class DecodeConfig(Strict):
    """Beam search (paper section 6.1): beam 4, GNMT length penalty alpha 0.6, max length = source + 50."""

    beam_size: int = Field(default=4, ge=1, le=64, description=(
        "Beam width of beam search. Paper: 4 (21 for parsing). At most 64: wider beams cost memory and time in "
        "proportion and find nothing better (Koehn and Knowles, 2017: quality falls past a few dozen)."))
    length_penalty: float = Field(default=0.6, ge=0, description=(
        "GNMT length penalty alpha, lp(Y) = ((5 + |Y|) / 6)^alpha; 0 = none. Paper: 0.6 (0.3 for parsing)."))
    max_len_a: float = Field(default=1.0, ge=0, description=(
        "Longest output = max_len_a * source length + max_len_b, in tokens. Paper: 1 (source length + 50)."))
    max_len_b: int = Field(default=50, ge=0, description=(
        "Longest output = max_len_a * source length + max_len_b, in tokens. Paper: 50 (300 for parsing)."))
    min_len: int = Field(default=1, ge=1, description=(
        "Shortest output in tokens, eos included (eos is blocked before it); 1 = no limit. Not in the paper."))
    # Benchmarks force equal output lengths with min_len = max_len_b, max_len_a = 0, as fairseq's --min-len does.
    batch_sentences: int = Field(default=64, ge=1, description="Sentences per decoding batch (PyTorch).")
    precision: Literal["fp32", "bf16"] = Field(default="fp32", description=(
        "bf16: decode with a bf16 copy of the model (log-softmax in float32, scores in float64); fp32 = the paper."))
    search: Literal["dynamic", "static"] = Field(default="dynamic", description=(
        "dynamic: beam search drops finished sentences and grows its key/value cache step by step; static: every "
        "step keeps the same shapes (finished sentences masked, a preallocated cache), so on a GPU the step is "
        "captured once as a CUDA graph and replayed. The same translations; static is for GPUs, and takes no "
        "parsing tree constraint. Not in the paper: an implementation choice."))
    # the constraint and the shape limits below: pipeline/parsing/constraint.py
    tree_constraint: bool = Field(default=True, description=(
        "Parsing only: beam search may write only well-formed trees over the input's words (brackets balance, one "
        "leaf per word, no empty constituent, one root); false = free decoding, every output repaired afterwards. "
        "Not in the paper, which does not say how ill-formed outputs were handled."))
    tree_max_open_run: int | None = Field(default=None, ge=1, description=(
        "Parsing only, with tree_constraint: at most this many brackets opened in a row, against an undertrained "
        "model's runs of brackets over one word. None = no limit. Not in the paper."))
    tree_max_unary_chain: int | None = Field(default=None, ge=1, description=(
        "Parsing only, with tree_constraint: at most this many brackets over the same words (1 = no unary "
        "chains). None = no limit. Not in the paper."))
    tree_leaf_mass: float = Field(default=0.0, ge=0, le=1, description=(
        "Parsing with words as leaves, with tree_constraint: the weight of the probability of writing any word in "
        "the next input word's score (1: that mass alone, the word itself being the input's; 0: the word's own "
        "probability; between: the weighted mean of the two log-probabilities). Not in the paper."))

    def shortest_limit(self) -> int:
        """The length limit of the shortest source (its eos alone): ``max_len_a * 1 + max_len_b``, rounded down, at
        least 1 (the rule of ``pipeline.engines.max_output_length``); a longer source's is no shorter."""
        return max(1, math.floor(self.max_len_a + self.max_len_b))

    @model_validator(mode="after")
    def _min_len_reachable(self) -> "DecodeConfig":
        # a sentence whose length limit comes before min_len would end with no hypothesis at all
        if self.min_len > self.shortest_limit():
            raise ValueError(f"min_len ({self.min_len}) exceeds the length limit of the shortest source, "
                             f"max_len_a * 1 + max_len_b = {self.shortest_limit()}: such a sentence would end with no "
                             "output; lower min_len, or raise max_len_b")
        return self


class ExportConfig(Strict):
    """The serving export (pipeline/export.py; not in the paper): the averaged model as a CTranslate2 model, which
    serves only if its dev sacreBLEU is at most ``max_bleu_drop`` below the PyTorch model's (the quality gate).
    ``quantization``: its weights' type (int8: a quarter of float32's memory; int8_float32: int8 weights, float32
    activations). ``engine: none`` skips the export: the registered model serves with PyTorch."""

    engine: Literal["ctranslate2", "none"] = Field(default="ctranslate2", description=(
        "ctranslate2: export the averaged model for serving; none: no export, the registered model serves with "
        "PyTorch."))
    quantization: Literal["int8", "int8_float32", "float32", "bfloat16"] = Field(default="int8", description=(
        "The exported weights' type: int8 (a quarter of float32's memory), int8_float32 (int8 weights, float32 "
        "activations), float32 or bfloat16."))
    max_bleu_drop: float = Field(default=0.5, ge=0, description=(
        "Quality gate: the export serves only if its dev sacreBLEU is at most this many points below the PyTorch "
        "model's."))
    batch_sentences: int = Field(default=256, ge=1, description=(
        "Sentences per CTranslate2 batch when serving (decode.batch_sentences is PyTorch's)."))
    # why larger than decode.batch_sentences: CTranslate2 runs larger batches faster on a CPU
    shortlist: int = Field(default=0, ge=0, description=(
        "Vocabulary shortlist (pipeline/shortlist.py): above 0, the export ships a CTranslate2 vocabulary map "
        "(vmap.txt) that gives each source piece this many candidate target pieces, its most probable under IBM "
        "Model 1 estimated on the training split, and decodes with it (translate_batch's use_vmap, also in "
        "export.json's options): a batch scores only its sources' candidates and the shortlist_frequent most "
        "frequent target pieces, not the whole vocabulary. 0 = the whole vocabulary. Not in the paper."))
    shortlist_frequent: int = Field(default=100, ge=0, description=(
        "With shortlist > 0: how many of the training targets' most frequent pieces are candidates of every batch."))
