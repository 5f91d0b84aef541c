"""Typed configuration: one schema, YAML presets in ``configs/``, dotted overrides.

A run is described by one :class:`RunConfig`. It is resolved once, at the top (CLI or flow), from a YAML file
that may ``extends:`` other YAML files (presets such as ``presets/base``), then dotted overrides
(``train.max_steps=200`` from the CLI, or a dict from Prefect deployment parameters). The result is validated
strictly: an unknown key, a wrong type or an impossible value fails here, naming the field, never hours later.

Defaults equal the paper (Vaswani et al., 2017, "base" row of Table 3); every deviation lives in a preset file
and is named there.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Mapping, Sequence, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from pipeline.errors import UserError
from pipeline.fsutil import write_text
from pipeline.retired import RetiredOptionError, drop_retired

if TYPE_CHECKING:
    from model import TransformerConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(UserError, ValueError):
    """A configuration that cannot be loaded; the message names the file and the field."""


class DevDomainWarning(UserWarning):
    """The dev set comes from another source than every training source: what is chosen on it (dev loss, N for
    averaging, promotion) is then chosen out of domain."""


class _Strict(BaseModel):
    # strict: "512" is not an int and 1 is not a bool; frozen: a resolved config is a value, not state; no inf or
    # nan in any float field (YAML's .inf / .nan): a loss weight of inf trains NaN weights without a word.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------------- data

SourceFormat = Literal["text", "tsv", "sgm", "parquet", "arrow", "hf_disk", "hub", "ptb"]
Task = Literal["translation", "parsing"]


class SourceSpec(_Strict):
    """One parallel corpus. Local paths are relative to ``data.root`` and must stay inside it.

    - ``text``: ``path`` is a prefix, files ``<path>.<lang>`` or ``<path>.<lang>.gz``; or ``files: {lang: file}``.
      A prefix with glob characters (``multi30k/train*``) reads every matching prefix in sorted order: a source
      that grows with new files (each one's content is in the corpus fingerprint).
    - ``tsv``: ``path`` to one file (optionally .gz) or a glob of files, ``columns`` gives each column's language.
    - ``sgm``: WMT SGML test sets, ``files: {lang: file.sgm}``; segments are matched by (docid, seg id).
    - ``parquet`` / ``arrow`` / ``hf_disk``: ``path`` to a file or directory; ``fields`` maps language to column
      (default: columns named by language, or a ``translation`` struct column as on the hub).
    - ``hub``: a Hugging Face dataset (``dataset``, ``subset``, ``split``, ``revision``) via ``datasets``.
    - ``ptb``: Penn Treebank bracketed trees (``task: parsing``): ``path`` to a ``.mrg`` / one-tree-per-line file,
      or to a folder with ``include`` glob patterns selecting its files (sorted by path), e.g. WSJ sections
      ``[0[2-9]/*.mrg, 1?/*.mrg, 2[01]/*.mrg]``. Pairs are (words, linearised tree); the gold tree is kept.
    """

    name: str = Field(min_length=1, description=(
        "The source's name: it names its files (test.<name>.parquet), tags and reported scores, so it must match "
        "[A-Za-z0-9][A-Za-z0-9._-]* and be unique among the dev and test sets."))
    format: SourceFormat = Field(description=(
        "How the corpus is stored: text, tsv, sgm, parquet, arrow, hf_disk, hub or ptb (see the section's "
        "description for what each reads)."))
    path: str | None = Field(default=None, description=(
        "Where a local source is, relative to data.root: a file prefix (text), a file or glob (tsv), a file or "
        "folder (parquet, arrow, hf_disk, ptb). None for sources named by files or a hub dataset."))
    files: dict[str, str] | None = Field(default=None, description=(
        "One file per language, {language: file} relative to data.root (text, sgm). None = files found from path."))
    columns: list[str] | None = Field(default=None, description=(
        "tsv only: the language of each column, in order (e.g. [en, de]); required for tsv."))
    fields: dict[str, str] | None = Field(default=None, description=(
        "parquet, arrow, hf_disk, hub: the column holding each language, {language: column}. None = columns named "
        "by language, or a 'translation' struct column as on the Hugging Face hub."))
    dataset: str | None = Field(default=None, description=(
        "hub only: the Hugging Face dataset's name (e.g. wmt14); required for hub."))
    subset: str | None = Field(default=None, description=(
        "hub only: the dataset's configuration (e.g. de-en). None = the dataset's default."))
    split: str | None = Field(default=None, description=(
        "hub only: the dataset split to read (train, validation, test); required for hub."))
    revision: str | None = Field(default=None, description=(
        "hub only: the dataset revision (a commit or tag) to pin. None = the newest."))
    include: list[str] | None = Field(default=None, description=(
        "ptb only: glob patterns selecting the treebank files under the folder path (read sorted by path), "
        "e.g. WSJ sections. None = path is one file."))

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        # The name becomes a file name (test.<name>.parquet) and a tag; keep it portable.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError(f"name {v!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (it is used in file names)")
        return v

    @field_validator("dataset")
    @classmethod
    def _hub_id(cls, v: str | None) -> str | None:
        # datasets.load_dataset reads a local path when given one: only a hub id keeps a hub source off the disk.
        if v is not None and (not re.fullmatch(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?", v) or ".." in v
                              or v.endswith(".py")):
            raise ValueError(f"dataset {v!r} is not a Hugging Face hub id (name or owner/name); format hub reads "
                             "only from the hub: for a local copy use format hf_disk, parquet or arrow with a path "
                             "under data.root")
        return v

    @property
    def origin(self) -> str:
        """Where the data comes from: a hub dataset's name, or a local source's first folder under
        ``data.root`` (``multi30k/val`` -> ``multi30k``). Sets from one origin share a domain."""
        if self.format == "hub":
            return str(self.dataset)
        where = self.path or sorted((self.files or {}).values())[0]
        parts = Path(where).parts
        return parts[0] if len(parts) > 1 else Path(where).name.split(".")[0]

    @model_validator(mode="after")
    def _required_per_format(self) -> "SourceSpec":
        need: dict[str, tuple[str, ...]] = {
            "tsv": ("path", "columns"),
            "sgm": ("files",),
            "parquet": ("path",),
            "arrow": ("path",),
            "hf_disk": ("path",),
            "hub": ("dataset", "split"),
            "ptb": ("path",),
        }
        if self.include is not None and (self.format != "ptb" or not self.include):
            raise ValueError("'include' (a non-empty list of glob patterns) is for format 'ptb' only")
        if self.format == "text" and not (self.path or self.files):
            raise ValueError("format 'text' needs 'path' (a prefix: <path>.<lang>) or 'files' ({lang: file})")
        for key in need.get(self.format, ()):
            if getattr(self, key) in (None, [], {}):
                raise ValueError(f"format {self.format!r} needs {key!r}")
        return self


class CleaningConfig(_Strict):
    """Cleaning rules for the training split; each rule's count is written to the manifest.

    Dev and test sets are never filtered (that would change what is measured); they are only normalised, and
    their raw target text is kept for scoring. Length defaults follow fairseq's WMT14 En-De recipe
    (Moses ``clean-corpus-n.perl -ratio 1.5 ... 1 250``); the paper does not say.
    """

    nfc: bool = Field(default=True, description="Normalise every split's text to Unicode NFC.")
    normalize_whitespace: bool = Field(default=True, description=(
        "Collapse every run of whitespace (tabs and no-break spaces included) to one space and strip both ends, "
        "in every split."))
    min_words: int = Field(default=1, ge=0, description=(
        "Training split: drop a pair whose source or target has fewer words (space-separated) than this."))
    max_words: int = Field(default=250, ge=1, description=(
        "Training split: drop a pair whose source or target has more words (space-separated) than this."))
    max_ratio: float = Field(default=1.5, gt=0, description=(
        "Training split: drop a pair whose word-count ratio (longer side over shorter side) exceeds this, as "
        "Moses' clean-corpus-n.perl -ratio does."))
    dedup: bool = Field(default=True, description="Training split: drop exact duplicate pairs, keeping the first.")
    decontaminate: Literal["off", "pair", "source", "either"] = Field(default="pair", description=(
        "Training split: drop pairs that also occur in the dev or test sets. pair: the same source and target; "
        "source: the same source; either: the same source or the same target; off: keep them."))

    @model_validator(mode="after")
    def _bounds(self) -> "CleaningConfig":
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) must not exceed max_words ({self.max_words})")
        return self


class DataConfig(_Strict):
    """The corpora: training sources, the dev set, the test sets, the language pair and the cleaning rules."""

    root: str = Field(default="../shared/data", description=(
        "Folder holding the local corpora: every local source path resolves inside it (overridden by "
        "--data-root or AIAYN_DATA_ROOT)."))
    src_lang: str = Field(default="en", description="Source language code (e.g. en); it names files and columns.")
    tgt_lang: str = Field(default="de", description="Target language code (e.g. de); must differ from src_lang.")
    train: list[SourceSpec] = Field(min_length=1, description=(
        "The training sources, concatenated and cleaned into one training split. Paper: WMT 2014 (En-De, En-Fr)."))
    dev: SourceSpec = Field(description=(
        "The dev set: dev loss, choosing N for checkpoint averaging, and promotion are measured on it. It should "
        "be held-out data of a training source's domain. Paper: newstest2013."))
    test: list[SourceSpec] = Field(default_factory=list, description=(
        "Test sets scored after training and reported (never filtered, never chosen on). Paper: newstest2014."))
    cleaning: CleaningConfig = Field(default=CleaningConfig(), description=(
        "Cleaning rules for the training split (dev and test sets are only normalised)."))
    tree_leaves: Literal["XX", "words"] = Field(default="XX", description=(
        "Parsing only: how a tree's preterminals are written in the target. XX: the placeholder XX (Vinyals et "
        "al., 2015, which the paper follows); words: the word itself (not in the paper; the decoder then copies "
        "each word). Scoring is the same either way."))
    # why ``words`` exists: copying each word teaches the decoder the word-by-word alignment to the source in far
    # fewer updates (configs/presets/parsing-cpu.yaml)
    write_batch_rows: int = Field(default=65_536, ge=1, description=(
        "Pairs the data stage reads, cleans and writes at a time (a Parquet row group); bounds its peak memory."))

    def dev_domain_mismatch(self) -> str | None:
        """Why the dev set looks out of the training data's domain (its origin differs from every training
        source's: a hub dataset, or the first folder of a local path), or None."""
        train = sorted({s.origin for s in self.train})
        if self.dev.origin in train:
            return None
        return (f"dev set {self.dev.name!r} comes from {self.dev.origin!r}, but every training source comes from "
                f"another source ({', '.join(repr(t) for t in train)}): dev loss, choosing N for averaging and "
                "promotion would measure out of domain; point data.dev at held-out data of a training source")

    @field_validator("src_lang", "tgt_lang")
    @classmethod
    def _language_code(cls, v: str) -> str:
        # The code names files (train.<lang>), columns, the registered model (transformer-<src>-<tgt>) and MLflow
        # tags; refusing '/', ':' and spaces here saves a run that would fail only at registration, after training.
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[_-][A-Za-z0-9]+)*", v) or len(v) > 35:
            raise ValueError(f"language code {v!r} must be letters and digits, optionally joined by - or _ "
                             "(e.g. en, de, pt-BR, zh_Hant, tree), at most 35 characters: it names files, columns "
                             "and the registered model")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> "DataConfig":
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"src_lang and tgt_lang are both {self.src_lang!r}")
        names = [s.name for s in self.test] + [self.dev.name]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dev/test source names must be unique, repeated: {dupes}")
        return self


# --------------------------------------------------------------------------------------------- tokenizer


class SpecialIds(_Strict):
    """Fixed special ids, read by the model code from this one place."""

    pad: int = Field(default=0, description="Id of the padding token (ignored by the loss and attention).")
    unk: int = Field(default=1, description="Id of the unknown token <unk>.")
    bos: int = Field(default=2, description="Id of the beginning-of-sentence token that starts every decoder input.")
    eos: int = Field(default=3, description="Id of the end-of-sentence token that ends every sequence.")


class TokenizerConfig(_Strict):
    """Shared source-target sentencepiece model (paper: BPE ~37k for En-De, 32k word-pieces for En-Fr)."""

    model_type: Literal["bpe", "unigram", "word", "char"] = Field(default="bpe", description=(
        "The sentencepiece model: bpe (byte-pair encoding), unigram (word-pieces), word or char. Paper: BPE for "
        "En-De, word-pieces for En-Fr; parsing needs word."))
    vocab_size: int = Field(default=37_000, ge=8, description=(
        "Size of the shared source-target vocabulary, in pieces. Paper: about 37k for En-De, 32k for En-Fr."))
    character_coverage: float = Field(default=1.0, gt=0, le=1, description=(
        "Fraction of the training text's characters the vocabulary must cover (sentencepiece's "
        "character_coverage); 1 = every character."))
    input_sentence_size: int = Field(default=1_000_000, ge=0, description=(
        "Sentences sampled from the training split (both sides) to train the tokenizer on, uniformly with seed; "
        "0 = all of them. The trainer's memory grows with the sample: sentencepiece's unigram trainer peaks at "
        "about 3 GB on 1M news sentences and past 10 GB on 9M (results ledger L44), so the default bounds it at "
        "any corpus size. The paper does not say."))
    seed: int = Field(default=0, ge=0, description="Seed of the input_sentence_size sample.")
    byte_fallback: bool = Field(default=True, description=(
        "Characters outside the vocabulary become byte pieces instead of <unk>, so encoding is lossless, also on "
        "test text with characters the training split never had (as with the paper's invertible subword "
        "encoder). Must be false for model_type word."))
    unknown_word_classes: bool = Field(default=False, description=(
        "Word model only: a word outside the vocabulary becomes the unknown token of its class (its shape, a "
        "hyphen, a suffix such as -ing, -ed, -s) instead of the one <unk>, as parsers of small treebanks do "
        "(Petrov et al., 2006). Not in the paper (subword text has no unknown words)."))
    sampling_alpha: float = Field(default=0.0, ge=0, lt=1, description=(
        "BPE-dropout (Provilkov et al., 2020; subword regularisation, Kudo, 2018, for unigram): above 0 the "
        "training split is also encoded sampled_copies times with sentencepiece's sampling (bpe: each merge is "
        "skipped with this probability; unigram: the smoothing), and epoch e trains on copy e mod sampled_copies; "
        "dev, test and decoding keep the one deterministic segmentation. 0 = off (the paper). Not in the paper."))
    # why: the paper's large corpus is seen few times; a small corpus (Multi30k) is seen many times in a CPU run
    sampled_copies: int = Field(default=8, ge=1, description=(
        "With sampling_alpha > 0: how many sampled segmentations of the training split are encoded (one per "
        "epoch, cycling)."))
    shard_rows: int = Field(default=1_000_000, ge=1, description=(
        "Rows per token shard file (every shard but the last holds this many). Affects encoding only, not the "
        "tokenizer model."))
    num_workers: int = Field(default=2, ge=1, description=(
        "Processes encoding text into token shards; the output does not depend on it."))
    special: SpecialIds = Field(default=SpecialIds(), description="The fixed ids of the special tokens.")

    @model_validator(mode="after")
    def _word_has_no_bytes(self) -> "TokenizerConfig":
        # sentencepiece's word model cannot hold byte pieces (its trainer fails with a bare assertion)
        if self.model_type == "word" and self.byte_fallback:
            raise ValueError("model_type 'word' needs byte_fallback: false (unknown words become <unk>)")
        if self.sampling_alpha and self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"sampling_alpha needs model_type 'bpe' or 'unigram' (a {self.model_type!r} model has one "
                             "segmentation per sentence); set tokenizer.sampling_alpha: 0")
        if self.unknown_word_classes and self.model_type != "word":
            raise ValueError(f"unknown_word_classes needs model_type 'word' (model_type {self.model_type!r} splits "
                             "unknown words into pieces)")
        return self


# ------------------------------------------------------------------------------------------------- model


class ModelConfig(_Strict):
    """Encoder-decoder hyperparameters (paper Table 3 'base' by default)."""

    encoder_layers: int = Field(default=6, ge=1, description=(
        "Number of encoder layers. Paper: N = 6 (base and big), 4 for parsing."))
    decoder_layers: int = Field(default=6, ge=1, description=(
        "Number of decoder layers. Paper: N = 6 (base and big), 4 for parsing."))
    d_model: int = Field(default=512, ge=1, description=(
        "Width of the model (embeddings and every sub-layer's output). Paper: 512 base, 1024 big."))
    d_ff: int = Field(default=2048, ge=1, description=(
        "Inner size of the position-wise feed-forward network. Paper: 2048 base, 4096 big."))
    n_heads: int = Field(default=8, ge=1, description=(
        "Attention heads h; each head has d_k = d_v = d_model / h, so d_model must be divisible by it. "
        "Paper: 8 base, 16 big."))
    dropout: float = Field(default=0.1, ge=0, lt=1, description=(
        "P_drop: dropout on every sub-layer output before the residual add and on embeddings plus positions. "
        "Paper: 0.1 base, 0.3 big (0.1 for En-Fr)."))
    attention_dropout: float = Field(default=0.0, ge=0, lt=1, description=(
        "Dropout on the attention weights. 0 = off (the paper). Not in the paper."))
    activation_dropout: float = Field(default=0.0, ge=0, lt=1, description=(
        "Dropout inside the feed-forward network, after its activation. 0 = off (the paper). Not in the paper."))
    norm: Literal["post", "pre"] = Field(default="post", description=(
        "Where LayerNorm sits. post: LayerNorm(x + Dropout(Sublayer(x))) (the paper); pre: x + "
        "Dropout(Sublayer(LayerNorm(x))), a more stable variant."))
    positions: Literal["sinusoidal", "learned"] = Field(default="sinusoidal", description=(
        "Positional encoding: sinusoidal (the paper) or learned embeddings (Table 3 row E)."))
    share_embeddings: bool = Field(default=True, description=(
        "One weight matrix for the source embedding, the target embedding and the pre-softmax projection (the "
        "paper; needs the shared vocabulary)."))
    max_positions: int = Field(default=1024, ge=1, description=(
        "Longest sequence the model accepts, in tokens; a longer input is cut to fit (with a warning)."))

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    def architecture(self, vocab_size: int, pad_id: int) -> TransformerConfig:
        """This section with the vocabulary: what :class:`model.Transformer` is built from."""
        from model import TransformerConfig  # imports torch: only where a model is built

        return TransformerConfig(vocab_size=vocab_size, pad_id=pad_id, **self.model_dump())


# ---------------------------------------------------------------------------------------------- training


class TrainConfig(_Strict):
    """Optimisation (paper section 5). Token counts are target tokens."""

    max_steps: int = Field(default=100_000, ge=1, description=(
        "Training stops after this many optimizer updates (or at max_minutes, whichever comes first), counted "
        "over resumes. Paper: 100k base, 300k big."))
    max_minutes: float | None = Field(default=None, gt=0, description=(
        "Wall-clock training budget in minutes, counted over resumes; training stops at it or at max_steps, "
        "whichever comes first. None = steps only (the paper)."))
    max_tokens: Annotated[int, Field(ge=1)] | Literal["update"] = Field(default=4096, description=(
        "Target tokens per batch, per process and forward pass (the micro-batch); bounds memory. update: the "
        "update split evenly over the processes, one micro-batch each per update and no accumulation (the paper's "
        "batch on its 8 GPUs; on a GPU the fastest shape where memory allows)."))
    update_tokens: int = Field(default=25_000, ge=1, description=(
        "Target tokens per optimizer update, reached by gradient accumulation over micro-batches and processes. "
        "Paper: about 25,000."))
    warmup_steps: int = Field(default=4000, ge=1, description=(
        "Updates over which the learning rate rises linearly before it decays with the inverse square root of "
        "the step. Paper: 4000."))
    schedule: Literal["auto", "paper", "budget"] = Field(default="auto", description=(
        "The warm-up of the learning-rate schedule. paper: train.warmup_steps updates, the paper's. budget: fitted "
        "to the updates the budget buys: with max_minutes, predicted from the throughput the run measures, again at "
        "every log interval while it warms up; where max_steps ends the run first (or there is no clock), "
        "max_steps. The warm-up takes budget_warmup of them (at most warmup_steps) to the same peak, held until "
        "warmup_steps, then the paper's decay; the prediction and the warm-up are logged. auto: budget where the "
        "clock (max_minutes) ends the run, else the paper's. Not in the paper."))
    budget_warmup: float = Field(default=0.25, gt=0, le=1, description=(
        "With the budget schedule: the share of the predicted updates the warm-up takes, at most warmup_steps. "
        "0.25 keeps a 1,000-update warm-up where the budget buys 4,000 or more."))
    lr_scale: float = Field(default=1.0, gt=0, description=(
        "Multiplies the paper's learning rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); 1 = the paper."))
    cooldown: float = Field(default=0.0, ge=0, le=1, description=(
        "Over this last fraction of the budget (max_steps or max_minutes, whichever ends first) the learning rate "
        "falls linearly to 0 (budgeted training, Li et al., 2020), so a run stopped by the clock ends annealed. "
        "0 = the paper's schedule to the end. Not in the paper."))
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam's beta1. Paper: 0.9.")
    adam_beta2: float = Field(default=0.98, ge=0, lt=1, description="Adam's beta2. Paper: 0.98.")
    adam_eps: float = Field(default=1e-9, gt=0, description="Adam's epsilon. Paper: 1e-9.")
    label_smoothing: float = Field(default=0.1, ge=0, lt=1, description=(
        "Label smoothing of the cross-entropy loss (hurts perplexity, helps BLEU). Paper: 0.1."))
    rdrop_alpha: float = Field(default=0.0, ge=0, description=(
        "R-Drop (Liang et al., 2021): above 0, every batch runs through the model twice in one forward (each copy "
        "with its own dropout masks) and the loss is the mean of the two copies' smoothed cross-entropies plus "
        "this alpha / 2 times the symmetric KL divergence of their predictions, per target token. A regulariser "
        "that costs compute: each update takes about two passes' time or more. 0 = one pass (the paper). Not in "
        "the paper."))
    # the loss is the R-Drop paper's, halved
    clip_norm: float = Field(default=0.0, ge=0, description=(
        "Clip the gradient's global norm to this value; 0 = no clipping (the paper)."))
    max_nonfinite_updates: int = Field(default=5, ge=0, description=(
        "Updates in a row whose loss or gradient is not finite (inf or nan) that training skips before it stops "
        "with an error naming the update. A skipped update changes nothing (weights, Adam's moments, the "
        "learning-rate schedule) and its batches are not trained on, so a rare overflowing batch costs one "
        "update, while a model that has diverged stops early and its newest checkpoint keeps the last finite "
        "weights. 0 = stop at the first. Not in the paper."))
    # in a row, not in total: isolated skips over a long run are harmless; a diverged model skips every update
    seed: int = Field(default=1, description=(
        "Seed of the initial weights, the dropout streams and the data order (with the epoch)."))
    checkpoint_every_steps: int = Field(default=1000, ge=1, description=(
        "Write a checkpoint every this many updates (as well as every checkpoint_every_minutes)."))
    checkpoint_every_minutes: float = Field(default=10.0, gt=0, description=(
        "Write a checkpoint every this many minutes of training (as well as every checkpoint_every_steps). "
        "Paper: every 10 minutes."))
    keep_last_checkpoints: int = Field(default=20, ge=1, description=(
        "Checkpoints kept on disk (the newest); older ones are deleted. Must cover the N averaged."))
    dev_every_steps: int = Field(default=1000, ge=1, description="Compute the dev loss every this many updates.")
    dev_max_sentences: int | None = Field(default=None, ge=1, description=(
        "Compute the dev loss on the first this many dev pairs only; None = all of them."))
    log_every_steps: int = Field(default=100, ge=1, description="Log training metrics every this many updates.")
    precision: Literal["auto", "fp32", "bf16"] = Field(default="auto", description=(
        "Training precision. fp32: the paper's (its presets name it). bf16: a bf16 working copy of the model, "
        "fp32 weights and Adam. auto: bf16 where the hardware computes it natively (a CUDA device that supports "
        "it; a CPU with AMX tiles or AVX512-BF16), fp32 otherwise; the trainer logs which and why."))
    # why auto and not always bf16: on a CPU without native bf16, bf16 trains slower than fp32; where it is native
    # it trains faster at the same loss (bench/bench_vs_fairseq.py). auto is resolved by
    # pipeline.hardware.training_precision.
    bf16_copy: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "How bf16 training runs (with precision bf16). on: forward and backward run a bf16 copy of the model, Adam "
        "updates the fp32 weights, copied into it after each update; off: autocast, which casts weights and "
        "activations around each operation; auto: the copy (measured faster than autocast on a CPU and on a GPU, "
        "see the results ledger). Not in the paper: an implementation choice."))
    # why auto stays a word of its own, equal to on: it is the value existing runs hold (run identity), and it
    # names "the measured choice", should a device ever measure autocast faster
    init_from: Literal["champion"] | None = Field(default=None, description=(
        "champion: start from the weights of the registered model's current champion (reusing its tokenizer so "
        "the vocabularies match); the schedule, warm-up included, still runs from step 0. None = a random "
        "initialisation (the paper, which trains from scratch)."))
    fused_output_loss: bool = Field(default=False, description=(
        "Compute the pre-softmax linear transformation and the label-smoothed loss together, chunk by chunk, so "
        "that the (tokens x vocabulary) logits and their gradient never exist whole: less memory (a larger "
        "train.max_tokens fits a GPU) for one more matrix product of the output layer in the backward. The same "
        "loss and gradients. Not with train.rdrop_alpha > 0 (its consistency term reads the logits). Not in the "
        "paper: an implementation choice."))

    def micro_batch_tokens(self, world_size: int) -> int:
        """``max_tokens`` for ``world_size`` processes: ``update`` is ``update_tokens`` split evenly over them."""
        return self.update_tokens // world_size if self.max_tokens == "update" else self.max_tokens

    fused_adam: bool = Field(default=True, description=(
        "Adam's update as torch's fused kernel over all parameters (CUDA and CPU) instead of a few grouped (foreach) "
        "kernels per step: one pass over the weights and moments instead of one per operation: faster CPU updates in "
        "fp32 (L55, L56; on an H100 within the spread, L28). The same update within float rounding. Not in the "
        "paper: an implementation choice."))

    # How a run is carried out or watched, not what it learns: left out of the run folder's name
    # (pipeline.workdir.run_dir), so that changing one continues the same run, and a new field of this kind added
    # to the config does not rename every run folder. Budgets: raising one continues the run.
    NOT_RUN_IDENTITY: ClassVar[frozenset[str]] = frozenset({
        "max_steps", "max_minutes", "log_every_steps", "dev_every_steps", "dev_max_sentences", "max_nonfinite_updates",
        "fused_output_loss", "fused_adam"})

    @property
    def budget_schedule(self) -> bool:
        """Whether the warm-up may be fitted to the budget (``schedule``: budget, or auto with max_minutes; auto
        fits it only where the clock ends the run)."""
        return self.schedule == "budget" or (self.schedule == "auto" and self.max_minutes is not None)

    @model_validator(mode="after")
    def _fusion_fits(self) -> "TrainConfig":
        if self.fused_output_loss and self.rdrop_alpha > 0:
            raise ValueError("fused_output_loss never forms the logits, and R-Drop's consistency term "
                             f"(rdrop_alpha={self.rdrop_alpha:g}) compares them: turn one of them off")
        return self


class AverageConfig(_Strict):
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


class DecodeConfig(_Strict):
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


class ExportConfig(_Strict):
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
        "Sentences per CTranslate2 batch when serving (decode.batch_sentences is PyTorch's). The default was "
        "chosen by measurement (see the results ledger)."))
    # why larger than decode.batch_sentences: CTranslate2 runs larger batches faster on a CPU
    shortlist: int = Field(default=0, ge=0, description=(
        "Vocabulary shortlist (pipeline/shortlist.py): above 0, the export ships a CTranslate2 vocabulary map "
        "(vmap.txt) that gives each source piece this many candidate target pieces, its most probable under IBM "
        "Model 1 estimated on the training split, and decodes with it (translate_batch's use_vmap, also in "
        "export.json's options): a batch scores only its sources' candidates and the shortlist_frequent most "
        "frequent target pieces, not the whole vocabulary. 0 = the whole vocabulary. Not in the paper."))
    shortlist_frequent: int = Field(default=100, ge=0, description=(
        "With shortlist > 0: how many of the training targets' most frequent pieces are candidates of every batch."))


class TrackingConfig(_Strict):
    """MLflow experiment, registered model and promotion rule. The server address is not configuration but
    environment (``MLFLOW_TRACKING_URI``): the same config runs against any tracking server.

    Promotion (the ``champion`` alias, which serving follows): a new version replaces the champion only when,
    on the promotion set ``promote_on``, its ``promote_metric`` beats the champion's by more than
    ``promote_margin`` AND the difference is significant (sacreBLEU's paired bootstrap resampling over the
    set's segments, ``promote_resamples`` resamples, p < ``promote_p``), and no reported test set loses more
    than ``guard_margin`` (chrF for translation, EVALB F1 for parsing). Not in the paper; a registry rule.
    """

    experiment: str = Field(default="aiayn", min_length=1, description="The MLflow experiment runs are logged to.")
    registered_model: str = Field(default="", description=(
        "The MLflow registered model new versions go to; empty = transformer-<src_lang>-<tgt_lang>."))
    promote_on: str = Field(default="dev", min_length=1, description=(
        "The set promotion compares on: dev (the in-domain dev set, data.dev) or the name of a test set (allowed; "
        "the decision then says it selected on a test set, whose reported score is no longer unbiased)."))
    promote_metric: Literal["auto", "sacrebleu", "chrf", "f1"] = Field(default="auto", description=(
        "The score promotion compares; auto = sacrebleu for translation, f1 (EVALB, labelled) for parsing."))
    promote_margin: float = Field(default=0.0, ge=0, description=(
        "How many points of promote_metric a new version must beat the champion by; 0 = any improvement."))
    promote_p: float = Field(default=0.05, gt=0, le=1, description=(
        "Significance level of the paired bootstrap test: the improvement must have p below this."))
    promote_resamples: int = Field(default=1000, ge=100, description=(
        "Resamples of the paired bootstrap test over the promotion set's segments."))
    guard_margin: float = Field(default=1.0, ge=0, description=(
        "Largest allowed drop, in points (chrF for translation, EVALB F1 for parsing), on any reported test set; "
        "a larger drop blocks promotion."))
    attention_sentences: int = Field(default=3, ge=0, description=(
        "Dev sentences whose attention is logged as heat-maps; 0 = none."))


class DistillConfig(_Strict):
    """Sequence-level knowledge distillation (Kim & Rush, 2016; not in the paper), the production road of machine
    translation: the teachers translate the training split's source side with beam search, the pairs where they
    failed are dropped (each rule counted), and this config's model (the student) trains on what is left. Dev and
    test sets keep their human references. No teachers: the run trains on the corpus as it is.

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


# ------------------------------------------------------------------------------------------------- a run


class LaunchConfig(_Strict):
    """How the orchestrator starts training: torchrun's processes and rendezvous (no stage folder's hash or cache key
    depends on it).

    One node (``nnodes: 1``): the training task runs torchrun itself. Several: the pipeline's flow run starts one
    run of the node flow per node (the deployment ``node_deployment``; on a Kubernetes pool, a pod per node), each
    a torchrun agent with its node rank, joined at a rendezvous hosted by node 0 at ``rdzv_endpoint``; it waits for
    them all and continues alone (averaging, evaluation and registration happen once). The rendezvous id is
    derived from the flow run and its attempt, so a retry never joins a stale rendezvous. Every socket the job
    listens on is bound to ``interface`` (pipeline.train.rendezvous): loopback unless set, which keeps every node
    on this machine (the local process pool).
    """

    nproc_per_node: int | Literal["auto"] = Field(default="auto", description=(
        "Training processes per node; auto = one per visible GPU, else 1."))
    nnodes: int = Field(default=1, ge=1, description=(
        "Nodes (machines or pods) training together; 1 = the training task runs torchrun itself."))
    rdzv_endpoint: str | None = Field(default=None, description=(
        "host:port where node 0 hosts the rendezvous; None = 127.0.0.1 and a free port (every node on this "
        "machine)."))
    interface: str | None = Field(default=None, description=(
        "The network interface (e.g. eth0) the nodes reach each other on; every socket of the job listens "
        "there. None = loopback (one machine only)."))
    rdzv_timeout_s: float = Field(default=600.0, gt=0, description=(
        "How long, in seconds, the nodes wait for each other to join the rendezvous."))
    node_deployment: str = Field(default="train-node/local", description=(
        "The Prefect deployment (<flow>/<deployment>) of flows/nodes.py:train_node that runs one node when "
        "nnodes > 1."))
    max_restarts: int = Field(default=0, ge=0, description=(
        "torchrun's elastic restarts of a node's failed worker group; 0 = none."))
    retries: int = Field(default=1, ge=0, description=(
        "Reruns of the training stage after a failure (a node lost, a crash), each node resuming from the newest "
        "intact checkpoint; a refused config or input is never retried. 0 = none."))

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        if isinstance(self.nproc_per_node, int) and self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node ({self.nproc_per_node}) must be >= 1 or 'auto'")
        host = (self.rdzv_endpoint or "").rpartition(":")[0]
        if not (host and self.rdzv_endpoint.rpartition(":")[2].isdigit()) and self.rdzv_endpoint is not None:
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} must be host:port (node 0's address)")
        if host and not (host == "localhost" or host.startswith("127.")) and self.interface in (None, "lo"):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not on this machine: set interface to the "
                             "network interface (e.g. eth0) the nodes reach each other on; training listens there only")
        return self


class RunConfig(_Strict):
    """Everything one pipeline run needs; resolved once and passed down."""

    name: str = Field(min_length=1, description="The run config's name; tracking logs it as the config_name tag.")
    task: Task = Field(default="translation", description=(
        "translation: sentence pairs, scored by BLEU; parsing (paper section 6.3): words to a linearised tree, "
        "scored by EVALB F1."))
    preset: str = Field(default="base", description=(
        "The paper row (or CPU size) this run is built on, e.g. base, big, tiny; a tag, not a switch."))
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
            if self.distill.teachers:
                raise ValueError("distill.teachers: distillation is for translation; a parse is scored against "
                                 "the gold tree, which a teacher's output would replace")
            if self.decode.search == "static" and self.decode.tree_constraint:
                raise ValueError("decode.search 'static' cannot apply decode.tree_constraint (it reads every prefix "
                                 "on the host at each step); use decode.search: dynamic for parsing")
        else:
            wrong = [where for where, s in sources if s.format == "ptb"]
            if wrong:
                raise ValueError(f"format 'ptb' sources ({wrong}) are for task 'parsing'; set task: parsing")
        sets = ["dev", self.data.dev.name, *(s.name for s in self.data.test)]
        if self.tracking.promote_on not in sets:
            raise ValueError(f"tracking.promote_on {self.tracking.promote_on!r} is not a set of this config; "
                             f"use one of {sets}")
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


# ----------------------------------------------------------------------------------------------- loading


class _DuplicateKey(yaml.YAMLError):
    """A mapping that repeats a key; ``key`` is its dotted path, ``first``/``second`` the two marks."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        super().__init__(f"duplicate key {key!r} (line {first.line + 1} and line {second.line + 1})")
        self.key, self.first, self.second = key, first, second


def _refuse_duplicate_keys(node: yaml.Node, path: str = "", seen: set[int] | None = None) -> None:
    """Raise :class:`_DuplicateKey` for the first key repeated in a mapping of the node tree (PyYAML keeps the
    last value silently, so a doubled ``max_steps:`` would drop the first without a word)."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: its anchor was checked where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        marks: dict[tuple[str, str], yaml.Mark] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` is meant to be overridden
                _refuse_duplicate_keys(value_node, path, seen)
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "<complex key>"
            where = f"{path}.{key}" if path else key
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in marks:
                    raise _DuplicateKey(where, marks[key_node.tag, key_node.value], key_node.start_mark)
                marks[key_node.tag, key_node.value] = key_node.start_mark
            _refuse_duplicate_keys(value_node, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]", seen)


MAX_YAML_VALUES = 100_000  # a config is a few hundred values; a file that expands past this is refused


class _TooLarge(yaml.YAMLError):
    """A document whose aliases expand past :data:`MAX_YAML_VALUES` values (an "alias bomb")."""


def _expanded_values(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values ``node`` holds once every alias is expanded, counted over the node graph (each node once:
    an alias of an alias of ... is a multiplication, not a walk), stopping early past :data:`MAX_YAML_VALUES`."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node met again while counting it (a recursive alias) counts once
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_values(child, memo)
        if total > MAX_YAML_VALUES:
            raise _TooLarge(f"the document expands to more than {MAX_YAML_VALUES:,} values through its aliases "
                            f"(from line {node.start_mark.line + 1}; aliases of aliases: an \"alias bomb\"). A "
                            "config is a few hundred values: write it out without nested aliases")
    memo[id(node)] = total
    return total


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads scalars as YAML 1.2 does where PyYAML's YAML 1.1 sets traps: ``1e-9`` is a float
    (YAML 1.1 wants ``1.0e-9``: a trap for learning rates), and only true/false are booleans (YAML 1.1 also reads
    yes/no/on/off: the language code ``no`` became false, the word ``on`` of a switch true). It also refuses a key
    repeated in one mapping (:class:`_DuplicateKey`) instead of keeping the last value, and a document whose aliases
    expand past :data:`MAX_YAML_VALUES` values (:class:`_TooLarge`), which would hang whatever reads it."""

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_values(node, {})  # before anything walks the values: every reader of them would expand the aliases
        _refuse_duplicate_keys(node)
        return super().construct_document(node)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_BOOL = "tag:yaml.org,2002:bool"
for _resolvers in _YamlLoader.yaml_implicit_resolvers.values():  # the subclass's own copy (made by the call above)
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != _BOOL]
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_value(text: str) -> Any:
    """Parse one override value as YAML (``200`` -> int, ``1e-3`` -> float, ``[a, b]`` -> list)."""
    return yaml.load(text, Loader=_YamlLoader)


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def resolve_config_path(name_or_path: str | Path, relative_to: Path = CONFIG_DIR) -> Path:
    """``multi30k-cpu`` -> ``configs/multi30k-cpu.yaml``; an existing path is taken as it is."""
    p = Path(name_or_path)
    candidates = [p] if p.suffix in (".yaml", ".yml") else []
    candidates += [relative_to / f"{name_or_path}.yaml", relative_to / str(name_or_path),
                   CONFIG_DIR / f"{name_or_path}.yaml"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = sorted(str(q.relative_to(CONFIG_DIR).with_suffix("")) for q in CONFIG_DIR.rglob("*.yaml"))
    raise ConfigError(f"config {str(name_or_path)!r} not found (looked in {relative_to}); known configs: {known}")


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_yaml_file(path: Path) -> dict:
    """The mapping a config file holds (a run config or a sweep: one reader, one message style), read with
    :class:`_YamlLoader`; a :class:`ConfigError` naming the file (and the lines of a repeated key)."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: duplicate key {e.key!r} on line {e.first.line + 1} and line {e.second.line + 1}; "
                          "keep one of them (YAML would silently use the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw


def _load_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"{path}: 'extends' cycle: {chain}")
    raw = read_yaml_file(path)
    parents = raw.pop("extends", [])
    parents = [parents] if isinstance(parents, str) else parents
    merged: dict = {}
    for parent in parents:
        merged = _deep_merge(merged, _load_yaml_tree(resolve_config_path(parent, path.parent), (*seen, path)))
    return _deep_merge(merged, raw)


Overrides = Mapping[str, Any] | Sequence[str | tuple[str, Any]]


def _override_items(overrides: Overrides | None) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, label)`` per override; the label names it in errors: ``--set k=v`` for a CLI
    string, ``override k=<value>`` for a tuple or a mapping entry (deployment parameters)."""
    if not overrides:
        return []
    if isinstance(overrides, Mapping):
        return [(key, value, f"override {key}={value!r}") for key, value in overrides.items()]
    items = []
    for item in overrides:
        if isinstance(item, tuple):
            items.append((item[0], item[1], f"override {item[0]}={item[1]!r}"))
            continue
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item}: an override must look like section.field=value")
        try:
            value = parse_value(text)
        except _DuplicateKey as e:
            raise ConfigError(f"--set {item}: duplicate key {e.key!r} in the value (columns {e.first.column + 1} and "
                              f"{e.second.column + 1} of {text!r}); keep one of them") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                              "write it as YAML (a list: [a, b], a mapping: {k: v}), quoted for the shell") from None
        items.append((key.strip(), value, f"--set {item}"))
    return items


def _apply(tree: dict, items: list[tuple[str, Any, str]]) -> dict:
    out = copy.deepcopy(tree)
    for key, value, label in items:
        node = out
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{label}: {'.'.join(parents[: i + 1])} is a value, not a section")
            node = nxt
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = _deep_merge(node[leaf], value)
        else:
            node[leaf] = value
    return out


def apply_overrides(tree: dict, overrides: Overrides | None) -> dict:
    """Apply dotted overrides: ``["train.max_steps=200"]`` (CLI) or ``{"train.max_steps": 200}`` (deployment).

    A sequence may also hold ``(key, value)`` tuples, taken as they are (no YAML parsing: paths stay strings).
    Nested dicts are merged as well, so ``{"train": {"max_steps": 200}}`` works too.
    """
    return _apply(tree, _override_items(overrides))


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<top level>"


def _sets(key: str, value: Any, loc: tuple[str, ...]) -> bool:
    """Whether an override of ``key`` with ``value`` gave the field at ``loc`` (or a field inside it) its value."""
    parts = tuple(key.split("."))
    if loc[: len(parts)] != parts:
        return False
    for part in loc[len(parts):]:  # a merged mapping sets only the fields it holds
        if not isinstance(value, Mapping):
            return True
        if part not in value:
            return False
        value = value[part]
    return True


def _error_source(loc: tuple, items: list[tuple[str, Any, str]], path: Path) -> str:
    """Where a bad value came from: the last override that set the field, else the config file (with the
    overrides inside the section when a whole-section rule failed)."""
    loc = tuple(str(p) for p in loc)
    setters = [label for key, value, label in items if _sets(key, value, loc)]
    if setters:
        return setters[-1]  # the last one applied is the value that was validated
    # a recipe's settings are the config file's, not overrides named beside it
    inside = [label for key, _, label in items if loc and tuple(key.split("."))[: len(loc)] == loc
              and not label.startswith(f"{path}: recipes.")]
    return f"{path} with {', '.join(inside)}" if inside else str(path)


def _did_you_mean(loc: tuple) -> str:
    """For an unknown field: the closest field name of its section, as a hint (or nothing)."""
    section: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        annotation = section.model_fields[part].annotation
        section = next((t for t in (annotation, *get_args(annotation)) if isinstance(t, type)
                        and issubclass(t, BaseModel)), None)
        if section is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), section.model_fields, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _config_error(errors: list, items: list[tuple[str, Any, str]], path: Path) -> ConfigError:
    """One :class:`ConfigError` for pydantic's ``errors``, naming per bad field where its value came from."""
    # a whole-config rule names its fields in its message; echoing the whole config would bury it
    lines = [f"{_error_source(err['loc'], items, path)}: {_field_path(err['loc'])}: {err['msg']}"
             + (f" (got {err.get('input')!r})" if err["loc"] else "")
             + (_did_you_mean(err["loc"]) if err["type"] == "extra_forbidden" else "")
             for err in errors]
    return ConfigError(lines[0] if len(lines) == 1 else "invalid config:\n" + "\n".join(f"  {line}" for line in lines))


def _without_retired(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> dict:
    try:
        return drop_retired(tree, lambda r: _error_source((r.section, r.field), items, path))
    except RetiredOptionError as e:
        raise ConfigError(str(e)) from None


def _validate(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> RunConfig:
    """The typed config of a merged tree; a :class:`ConfigError` naming, per bad field, where its value came from.
    A retired option is dropped at the product's value and refused at any other (:mod:`pipeline.retired`)."""
    tree = _without_retired(tree, items, path)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise _config_error(e.errors(), items, path) from None


def _leaves(tree: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` per leaf of a nested mapping (a list is a leaf)."""
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


# What a compute recipe may set: how the model is trained and decoded (so it sits between the YAML files and
# everything that points the run at its data and servers: the environment, data_root, the overrides).
RECIPE_SECTIONS = ("tokenizer", "model", "train", "average", "decode")


def _recipes(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> tuple[str | None, dict[str, list]]:
    """The recipe this config gets on this machine (None: resolved already, nothing to apply; ``none``: no recipe)
    and every recipe's settings as override items, labelled ``<file>: recipes.<name>: <key>=<value>``."""
    merged = _apply(tree, items)
    recipes, name = merged.get("recipes") or {}, merged.get("recipe", "auto")
    if merged.get("recipe_applied") is not None:
        return None, {}
    if not isinstance(recipes, Mapping) or not all(isinstance(r, Mapping) for r in recipes.values()):
        return "none", {}  # the schema says what is wrong with them
    sets = {key: [(k, v, f"{path}: recipes.{key}: {k}={v!r}") for k, v in _leaves(recipe)]
            for key, recipe in recipes.items()}
    for recipe_items in sets.values():
        bad = [label for k, _, label in recipe_items if k.split(".")[0] not in RECIPE_SECTIONS]
        if bad:
            raise ConfigError(f"{bad[0]}: a recipe sets how the model is trained and decoded (the sections "
                              f"{', '.join(RECIPE_SECTIONS)}), not the data, the tracking or which recipe applies")
    if name == "auto":
        train = merged.get("train") or {}
        if train.get("max_minutes") is not None and recipes:
            from pipeline.hardware import training_precision  # imports torch: only where a recipe may apply

            precision = training_precision(train.get("precision", "auto"))[0]
            name = precision if precision in recipes else "none"
        else:
            name = "none"
    elif name != "none" and name not in recipes:
        raise ConfigError(f"{path}: recipe {name!r} is not one of recipes ({', '.join(recipes) or 'none defined'}); "
                          "use auto, none or one of them")
    return name, sets


def _check_recipe(tree: dict, recipe_items: list, items: list, path: Path) -> None:
    """Refuse a recipe whose own settings are invalid, though this machine does not apply it: a typo in one fails
    on every machine, not only on the class it was written for."""
    both = [*recipe_items, *items]
    try:
        RunConfig.model_validate(_without_retired(_apply(tree, both), both, path))
    except ValidationError as e:
        labels = {label for _, _, label in recipe_items}
        ours = [err for err in e.errors() if _error_source(err["loc"], both, path) in labels]
        if ours:
            raise _config_error(ours, both, path) from None


def load_config(name_or_path: str | Path, overrides: Overrides | None = None,
                data_root: str | Path | None = None) -> RunConfig:
    """Load, merge presets, apply overrides and validate; the environment is not read (see :func:`resolve_config`).
    Raises :class:`ConfigError` naming each bad field.

    ``data_root`` points the run at local corpora: it sets ``data.root`` and, when the config names a
    ``local_data`` preset (a hub config's local twin, e.g. ``data/multi30k``), takes the data section from it.
    """
    path = resolve_config_path(name_or_path)
    tree = _load_yaml_tree(path)
    local = tree.pop("local_data", None)
    if data_root is not None:
        if local:
            tree["data"] = _load_yaml_tree(resolve_config_path(local, path.parent))["data"]
        tree = apply_overrides(tree, [("data.root", str(data_root))])
    items = _override_items(overrides)
    chosen, recipes = _recipes(tree, items, path)
    applied = [] if chosen is None else [*recipes.get(chosen, []), ("recipe_applied", chosen, f"recipe {chosen}")]
    cfg = _validate(_apply(tree, [*applied, *items]), [*applied, *items], path)
    for name, recipe_items in recipes.items():
        if name != chosen:
            _check_recipe(tree, recipe_items, items, path)
    mismatch = cfg.data.dev_domain_mismatch()
    if mismatch:
        warnings.warn(f"{path}: {mismatch}", DevDomainWarning, stacklevel=2)
    return cfg


ENV_DATA_ROOT = "AIAYN_DATA_ROOT"  # where local corpora live (a deployment's worker points it at them)
ENV_WORK_DIR = "AIAYN_WORK_DIR"  # where stage outputs go


def resolve_config(name_or_path: str | Path, overrides: Overrides | None = None, data_root: str | Path | None = None,
                   environ: Mapping[str, str] | None = None) -> RunConfig:
    """The run's config, resolved once: the one function that owns precedence, used by the CLI and the flows.

    Later wins: the schema's defaults < the YAML file (and the presets it ``extends``) < its compute recipe
    (``recipe``, ``recipes``; training settings only, :data:`RECIPE_SECTIONS`) < the environment
    (``AIAYN_DATA_ROOT``, ``AIAYN_WORK_DIR``; ``environ``, default ``os.environ``) < ``data_root`` < ``overrides``
    (dotted keys, in order). What runs below (the torchrun entry point included) receives the result, written by
    :func:`write_resolved`, and reads no environment of its own.
    """
    env = os.environ if environ is None else environ
    items: list = [("work_dir", env[ENV_WORK_DIR])] if env.get(ENV_WORK_DIR) else []
    if isinstance(overrides, Mapping):
        items += list(overrides.items())
    else:
        items += list(overrides or [])
    return load_config(name_or_path, items, data_root=data_root or env.get(ENV_DATA_ROOT) or None)


def write_resolved(cfg: RunConfig, path: Path) -> Path:
    """Write ``cfg`` as a resolved config file (every field, nothing to merge), atomically; returns ``path``.
    :func:`load_resolved` reads it back as it is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, dump_config(cfg))
    return path


def load_resolved(path: str | Path) -> RunConfig:
    """A resolved config file (``python -m pipeline config --out FILE``, or a run folder's ``config.yaml``) as it
    is: validated, with no presets, environment or overrides applied. A preset (it ``extends`` others or names
    ``local_data``) is refused, saying how to resolve it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the resolved config: {e.strerror or e}; write one with python -m "
                          "pipeline config --config NAME [--set ...] --out FILE") from None
    try:
        tree = yaml.load(text, Loader=_YamlLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    preset = sorted(k for k in ("extends", "local_data") if k in tree)
    if preset:
        raise ConfigError(f"{path}: has {preset}: a preset, not a resolved config; resolve it first: python -m "
                          f"pipeline config --config {path} [--set ...] --out FILE")
    return _validate(tree, [], path)


_WORK_DIR_FIX = "set work_dir (in the config or --set work_dir=...), --work-dir or AIAYN_WORK_DIR to a writable folder"


def ensure_work_dir(work_dir: str | Path, what: str = "work dir", fix: str = _WORK_DIR_FIX) -> Path:
    """Create the work dir (``work_dir``) if needed and return it resolved; a :class:`ConfigError` saying why and
    what to do when it cannot be created or written, so that no stage starts on a folder it cannot write. ``what``
    and ``fix`` name another output folder (e.g. training's ``--out``) and how to change it."""
    path = Path(work_dir).expanduser().resolve()
    # mkdir under a regular file says only "Not a directory": name the file that is in the way
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        reason = f"{blocker} is a file"
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            reason = f"{e.filename or path}: {(e.strerror or str(e)).lower()}"
        else:
            if os.access(path, os.W_OK | os.X_OK):  # also False on a read-only file system, even for root
                return path
            reason = "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "not writable"
    raise ConfigError(f"{what} {path} cannot be used: {reason}; {fix}")


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what was really run; logged with every run)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ------------------------------------------------------------------------------------------ flow parameters

# The run configs under configs/ a flow run can name (tests/test_config.py keeps this equal to the files); a flow
# also takes a path to any other config file.
ConfigName = Literal["multi30k-cpu", "multi30k-cpu-hub", "multi30k-cpu-weekly", "multi30k-en-fr-cpu",
                     "multi30k-en-fr-student-tiny", "multi30k-student-deep-shallow", "multi30k-student-tiny",
                     "multi30k-teacher-gpu", "ptb-sample-cpu", "wmt14-en-de-base", "wmt14-en-de-big",
                     "wmt14-en-fr-base", "wmt14-en-fr-big", "wsj-parsing"]


def _leaf_field_infos(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """(dotted key, pydantic field) of every field of ``model`` that is not itself a config section."""
    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and prefix + name != "data.dev":
            out += _leaf_field_infos(kind, f"{prefix}{name}.")
        else:
            out.append((prefix + name, field))
    return out


def _constrained_type(field: FieldInfo) -> Any:
    """A field's type with its constraints (``Annotated[int, Ge(1)]``)."""
    return Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, type with its constraints) of every field of ``model`` that is not itself a config section."""
    return [(key, _constrained_type(field)) for key, field in _leaf_field_infos(model, prefix)]


def _flow_overrides_model() -> type[BaseModel]:
    # each field keeps its description: Prefect's run form shows it
    fields = {key.replace(".", "__"): (_constrained_type(field) | None,
                                       Field(default=None, alias=key, description=field.description))
              for key, field in _leaf_field_infos(RunConfig) if key not in ("name",)}
    return create_model("FlowOverrides", __config__=ConfigDict(extra="forbid"), **fields)


# A flow's ``overrides`` parameter: every config field under its dotted name (``train.warmup_steps``), typed and
# constrained as in the schema, nothing else. Prefect renders it as a form and, since deployments enforce their
# parameter schema, refuses a run with an unknown key or a wrong value when it is created, naming the field; the
# whole config (cross-field rules included) is validated once more when the run resolves it.
FlowOverrides = _flow_overrides_model()


def flow_overrides(overrides: BaseModel | Mapping[str, Any] | None) -> dict[str, Any]:
    """A flow's ``overrides`` parameter as dotted keys: the fields the caller set, nothing else."""
    if isinstance(overrides, BaseModel):
        return overrides.model_dump(by_alias=True, exclude_unset=True)
    return dict(overrides or {})
