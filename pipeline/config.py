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
from typing import Annotated, Any, Literal, Mapping, Sequence, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from pipeline.errors import UserError
from pipeline.fsutil import write_text

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(UserError, ValueError):
    """A configuration that cannot be loaded; the message names the file and the field."""


class DevDomainWarning(UserWarning):
    """The dev set comes from another source than every training source: what is chosen on it (dev loss, N for
    averaging, promotion) is then chosen out of domain."""


class _Strict(BaseModel):
    # strict: "512" is not an int and 1 is not a bool; frozen: a resolved config is a value, not state.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


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

    name: str = Field(min_length=1)
    format: SourceFormat
    path: str | None = None
    files: dict[str, str] | None = None
    columns: list[str] | None = None
    fields: dict[str, str] | None = None
    dataset: str | None = None
    subset: str | None = None
    split: str | None = None
    revision: str | None = None
    include: list[str] | None = None  # ptb: glob patterns under the folder ``path``

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        # The name becomes a file name (test.<name>.parquet) and a tag; keep it portable.
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError(f"name {v!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (it is used in file names)")
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

    nfc: bool = True
    normalize_whitespace: bool = True
    min_words: int = Field(default=1, ge=0)
    max_words: int = Field(default=250, ge=1)
    max_ratio: float = Field(default=1.5, gt=0)  # Moses: drop if len(a)/len(b) or len(b)/len(a) exceeds it
    dedup: bool = True
    decontaminate: Literal["off", "pair", "source", "either"] = "pair"

    @model_validator(mode="after")
    def _bounds(self) -> "CleaningConfig":
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) must not exceed max_words ({self.max_words})")
        return self


class DataConfig(_Strict):
    root: str = "../shared/data"  # every local source path resolves inside this folder
    src_lang: str = "en"
    tgt_lang: str = "de"
    train: list[SourceSpec] = Field(min_length=1)
    dev: SourceSpec
    test: list[SourceSpec] = Field(default_factory=list)
    cleaning: CleaningConfig = CleaningConfig()
    # Parsing targets (``ptb`` sources): every preterminal written as the placeholder ``XX`` (Vinyals et al.
    # 2015, which the paper follows), or as its word (``words``: not the paper; the decoder then copies each
    # word, which teaches it the word-by-word alignment to the source in far fewer updates, see
    # configs/presets/parsing-cpu.yaml). Scoring is the same: the tree's leaves are the input words either way.
    tree_leaves: Literal["XX", "words"] = "XX"
    write_batch_rows: int = Field(default=65_536, ge=1)  # rows held in memory per write; bounds peak RSS

    def dev_domain_mismatch(self) -> str | None:
        """Why the dev set looks out of the training data's domain (its origin differs from every training
        source's: a hub dataset, or the first folder of a local path), or None."""
        train = sorted({s.origin for s in self.train})
        if self.dev.origin in train:
            return None
        return (f"dev set {self.dev.name!r} comes from {self.dev.origin!r}, but every training source comes from "
                f"another source ({', '.join(repr(t) for t in train)}): dev loss, choosing N for averaging and "
                "promotion would measure out of domain; point data.dev at held-out data of a training source")

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

    pad: int = 0
    unk: int = 1
    bos: int = 2
    eos: int = 3


class TokenizerConfig(_Strict):
    """Shared source-target sentencepiece model (paper: BPE ~37k for En-De, 32k word-pieces for En-Fr)."""

    model_type: Literal["bpe", "unigram", "word", "char"] = "bpe"
    vocab_size: int = Field(default=37_000, ge=8)
    character_coverage: float = Field(default=1.0, gt=0, le=1)
    input_sentence_size: int = Field(default=10_000_000, ge=0)  # sentences sampled to train; 0 = all
    seed: int = Field(default=0, ge=0)  # draws the input_sentence_size sample
    # Characters outside the vocabulary become byte pieces instead of <unk>: encoding is lossless, as with the
    # paper's invertible subword encoder, also on test text with characters the training split never had.
    byte_fallback: bool = True
    # Word model only: a word outside the vocabulary becomes the unknown token of its class (its shape:
    # lower-case, capitalised, all capitals, with a digit, other; a hyphen; a suffix such as -ing, -ed, -s) instead
    # of the one <unk>, as parsers of small treebanks do (Petrov et al., 2006). Not in the paper (subword text
    # has no unknown words).
    unknown_word_classes: bool = False
    # BPE-dropout (Provilkov et al., 2020; subword regularisation, Kudo, 2018 for unigram). Not in the paper: its
    # 4.5M-pair corpus is seen ~20 times, Multi30k's 29k pairs ~40 times in the 30-minute CPU run. With alpha > 0
    # the training split is also encoded ``sampled_copies`` times with sentencepiece's sampling (bpe: each merge
    # is skipped with probability alpha; unigram: segmentations drawn with smoothing alpha), and epoch e trains on
    # copy e mod sampled_copies; dev, test and decoding keep the one deterministic segmentation. 0 = off (paper).
    sampling_alpha: float = Field(default=0.0, ge=0, lt=1)
    sampled_copies: int = Field(default=8, ge=1)
    shard_rows: int = Field(default=1_000_000, ge=1)
    num_workers: int = Field(default=2, ge=1)
    special: SpecialIds = SpecialIds()

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

    encoder_layers: int = Field(default=6, ge=1)  # N
    decoder_layers: int = Field(default=6, ge=1)  # N
    d_model: int = Field(default=512, ge=1)
    d_ff: int = Field(default=2048, ge=1)
    n_heads: int = Field(default=8, ge=1)  # h; d_k = d_v = d_model / h
    dropout: float = Field(default=0.1, ge=0, lt=1)  # P_drop: sub-layer outputs, embeddings + positions
    attention_dropout: float = Field(default=0.0, ge=0, lt=1)  # not in the paper; 0 = paper
    activation_dropout: float = Field(default=0.0, ge=0, lt=1)  # inside the FFN; not in the paper
    norm: Literal["post", "pre"] = "post"  # paper: post-norm LayerNorm(x + Dropout(Sublayer(x)))
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    share_embeddings: bool = True  # one matrix: source emb, target emb, pre-softmax projection
    max_positions: int = Field(default=1024, ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads


# ---------------------------------------------------------------------------------------------- training


class TrainConfig(_Strict):
    """Optimisation (paper section 5). Token counts are target tokens."""

    max_steps: int = Field(default=100_000, ge=1)
    max_minutes: float | None = Field(default=None, gt=0)  # wall-clock budget; None = steps only
    max_tokens: int = Field(default=4096, ge=1)  # per process per forward pass
    update_tokens: int = Field(default=25_000, ge=1)  # per optimizer update, reached by accumulation
    warmup_steps: int = Field(default=4000, ge=1)
    lr_scale: float = Field(default=1.0, gt=0)  # multiplies d_model^-0.5 * min(step^-0.5, step*warmup^-1.5)
    # Not in the paper: over the last `cooldown` fraction of the budget (max_steps or max_minutes, whichever ends
    # first) the learning rate falls linearly to 0 (budgeted training, Li et al., 2020), so a run that stops on
    # the clock ends annealed instead of mid-decay. 0 = the paper's schedule to the end.
    cooldown: float = Field(default=0.0, ge=0, le=1)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.98, ge=0, lt=1)
    adam_eps: float = Field(default=1e-9, gt=0)
    label_smoothing: float = Field(default=0.1, ge=0, lt=1)
    # Not in the paper: R-Drop (Liang et al., 2021). Above 0, every batch runs through the model twice in one
    # forward (the batch repeated, so each copy draws its own dropout masks) and the update's loss is the mean of
    # the two copies' smoothed cross-entropies plus alpha / 2 times the symmetric KL divergence of their predicted
    # distributions, per target token (the R-Drop paper's loss, halved): a regulariser that spends compute, each
    # update taking ~2.6x the time (tiny preset, 2 threads: 1.07-1.11 s against 0.42 s per update in the training
    # logs of the runs in the README). 0 = one pass (the paper).
    rdrop_alpha: float = Field(default=0.0, ge=0)
    clip_norm: float = Field(default=0.0, ge=0)  # 0 = no clipping (paper)
    seed: int = 1
    checkpoint_every_steps: int = Field(default=1000, ge=1)
    checkpoint_every_minutes: float = Field(default=10.0, gt=0)  # paper: every 10 minutes
    keep_last_checkpoints: int = Field(default=20, ge=1)
    dev_every_steps: int = Field(default=1000, ge=1)
    dev_max_sentences: int | None = Field(default=None, ge=1)  # dev loss on the first N dev pairs; None = all
    log_every_steps: int = Field(default=100, ge=1)
    # fp32: the paper's (its presets name it). auto (the CPU presets): bf16 where the hardware computes it natively
    # (a CUDA device that supports it; a CPU with AMX tiles or AVX512-BF16, as torch reports), fp32 otherwise; the
    # trainer logs which and why (pipeline.train.trainer.training_precision). bf16 on a CPU (a bf16 working copy of
    # the model, fp32 weights and Adam: TrainStep) trained the tiny model ~2.1x and base ~2.1x faster than fp32 on
    # the AMX machine at the same loss (bench/bench_vs_fairseq.py); on a CPU without native bf16 it is slower.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # champion: start from the weights of the registered model's current champion instead of a random
    # initialisation (not the paper, which trains from scratch); the run then reuses the champion's tokenizer so
    # the vocabularies match. The schedule (warm-up included) runs as configured, from step 0.
    init_from: Literal["champion"] | None = None
    # torch.compile; on the 2-core CPU here compiled steps were no faster than eager ones (~1.3x slower) after
    # 80-100 s of compiling and a recompile for dynamic batch shapes, so off
    compile: bool = False


class AverageConfig(_Strict):
    """Checkpoint averaging (paper section 6.1): the last ``last_n`` checkpoints.

    ``choose_from`` (not in the paper; empty = the paper's fixed N): candidate values of N; each average is
    decoded on the dev split with the run's decoding settings and the best dev score (translation: sacreBLEU;
    parsing: EVALB F1) picks N. The choice and every candidate's score are recorded (``choice.json``).
    """

    last_n: int = Field(default=5, ge=1)  # paper: 5 for base, 20 for big
    choose_from: list[int] = []

    @field_validator("choose_from")
    @classmethod
    def _positive_distinct(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v) or len(set(v)) != len(v):
            raise ValueError(f"candidates must be distinct positive checkpoint counts, got {v}")
        return sorted(v)


class DecodeConfig(_Strict):
    """Beam search (paper section 6.1): beam 4, GNMT length penalty alpha 0.6, max length = source + 50."""

    beam_size: int = Field(default=4, ge=1)
    length_penalty: float = Field(default=0.6, ge=0)
    max_len_a: float = Field(default=1.0, ge=0)  # max output length = a * source_len + b
    max_len_b: int = Field(default=50, ge=0)
    # Shortest output, eos included (eos is blocked before it); not in the paper (1 = no limit). Benchmarks
    # force equal output lengths with min_len = max_len_b, max_len_a = 0, as fairseq's --min-len does.
    min_len: int = Field(default=1, ge=1)
    batch_sentences: int = Field(default=64, ge=1)
    # bf16: decode with a bf16 copy of the model (log-softmax float32, scores float64); fp32 = paper.
    precision: Literal["fp32", "bf16"] = "fp32"
    # Parsing only: beam search may write only well-formed trees over the input's words (brackets balance, n
    # leaves, no empty constituent, one root; pipeline/parsing/constraint.py). Not in the paper, which does not
    # say how ill-formed outputs were handled; false = free decoding, every output repaired afterwards.
    tree_constraint: bool = True
    # Parsing only, with tree_constraint: shape limits (pipeline/parsing/constraint.py) against an undertrained
    # model's runs of brackets over one word. At most this many brackets opened in a row, and at most this many
    # brackets over the same words (1 = no unary chains). Not in the paper; None = no limit.
    tree_max_open_run: int | None = Field(default=None, ge=1)
    tree_max_unary_chain: int | None = Field(default=None, ge=1)


class ExportConfig(_Strict):
    """The serving export (pipeline/export.py; not in the paper): the averaged model as a CTranslate2 model, which
    serves only if its dev sacreBLEU is at most ``max_bleu_drop`` below the PyTorch model's (the quality gate).
    ``quantization``: its weights' type (int8: a quarter of float32's memory; int8_float32: int8 weights, float32
    activations). ``engine: none`` skips the export: the registered model serves with PyTorch."""

    engine: Literal["ctranslate2", "none"] = "ctranslate2"
    quantization: Literal["int8", "int8_float32", "float32", "bfloat16"] = "int8"
    max_bleu_drop: float = Field(default=0.5, ge=0)
    # Sentences per CTranslate2 batch when serving (decode.batch_sentences is PyTorch's): it runs larger batches
    # faster on a CPU (beam 4 on 2 cores, tiny model: 64 -> 256 sentences, 125 -> 192 sentences/s).
    batch_sentences: int = Field(default=256, ge=1)


class TrackingConfig(_Strict):
    """MLflow experiment, registered model and promotion rule. The server address is not configuration but
    environment (``MLFLOW_TRACKING_URI``): the same config runs against any tracking server.

    Promotion (the ``champion`` alias, which serving follows): a new version replaces the champion only when,
    on the promotion set ``promote_on``, its ``promote_metric`` beats the champion's by more than
    ``promote_margin`` AND the difference is significant (sacreBLEU's paired bootstrap resampling over the
    set's segments, ``promote_resamples`` resamples, p < ``promote_p``), and no reported test set loses more
    than ``guard_margin`` (chrF for translation, EVALB F1 for parsing). Not in the paper; a registry rule.
    """

    experiment: str = Field(default="aiayn", min_length=1)
    registered_model: str = ""  # empty: transformer-<src_lang>-<tgt_lang> (RunConfig.registered_model_name)
    # "dev" (default: the in-domain dev set, data.dev) or the name of a test set (allowed; the decision then
    # says that it selected on a test set, whose reported score is no longer an unbiased estimate).
    promote_on: str = Field(default="dev", min_length=1)
    # auto: sacrebleu for translation, f1 (EVALB, labelled) for parsing.
    promote_metric: Literal["auto", "sacrebleu", "chrf", "f1"] = "auto"
    promote_margin: float = Field(default=0.0, ge=0)  # in the metric's points
    promote_p: float = Field(default=0.05, gt=0, le=1)
    promote_resamples: int = Field(default=1000, ge=100)
    guard_margin: float = Field(default=1.0, ge=0)  # largest allowed drop on any reported test set
    attention_sentences: int = Field(default=3, ge=0)  # dev sentences drawn as attention heat-maps


# ------------------------------------------------------------------------------------------------- a run


class LaunchConfig(_Strict):
    """How the orchestrator starts training: torchrun's processes and rendezvous (not part of any hash).

    One node (``nnodes: 1``): the training task runs torchrun itself. Several: the pipeline's flow run starts one
    run of the node flow per node (the deployment ``node_deployment``; on a Kubernetes pool, a pod per node), each
    a torchrun agent with its node rank, joined at a rendezvous hosted by node 0 at ``rdzv_endpoint``; it waits for
    them all and continues alone (averaging, evaluation and registration happen once). The rendezvous id is
    derived from the flow run and its attempt, so a retry never joins a stale rendezvous. Every socket the job
    listens on is bound to ``interface`` (pipeline.train.rendezvous): loopback unless set, which keeps every node
    on this machine (the local process pool).
    """

    nproc_per_node: int | Literal["auto"] = "auto"  # auto: one per visible GPU, else 1
    nnodes: int = Field(default=1, ge=1)
    # host:port where node 0 hosts the rendezvous; None: 127.0.0.1 and a free port (every node on this machine)
    rdzv_endpoint: str | None = None
    # The network interface (e.g. eth0) the nodes reach each other on; None: loopback (one machine only).
    interface: str | None = None
    rdzv_timeout_s: float = Field(default=600.0, gt=0)  # how long the nodes wait for each other to join
    node_deployment: str = "train-node/local"  # the deployment of flows/nodes.py:train_node that runs a node
    max_restarts: int = Field(default=0, ge=0)  # torchrun's elastic restarts of a node's failed worker group
    # Reruns of the training stage after a failure (a node lost, a crash): every node resumes from the newest
    # intact checkpoint. A refused config or input is never retried.
    retries: int = Field(default=1, ge=0)

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

    name: str = Field(min_length=1)
    # translation: sentence pairs, BLEU. parsing (paper section 6.3): words -> linearised tree, EVALB F1.
    task: Task = "translation"
    preset: str = "base"  # the paper row (or CPU size) this run is built on; a tag, not a switch
    work_dir: str = "runs"  # stage outputs go below it, in folders named by content hashes
    data: DataConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    average: AverageConfig = AverageConfig()
    decode: DecodeConfig = DecodeConfig()
    export: ExportConfig = ExportConfig()
    launch: LaunchConfig = LaunchConfig()
    tracking: TrackingConfig = TrackingConfig()

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

    def section_hash(self, *sections: str) -> str:
        """Stable short hash of the named sections (all when none): names folders and cache keys."""
        dump = self.model_dump(mode="json")
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


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-9`` as a float (YAML 1.1 wants ``1.0e-9``, a trap for learning rates) and
    refuses a key repeated in one mapping (:class:`_DuplicateKey`) instead of keeping the last value."""

    def construct_document(self, node: yaml.Node) -> Any:
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


def _load_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"{path}: 'extends' cycle: {chain}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader) or {}
    except _DuplicateKey as e:
        raise ConfigError(f"{path}: duplicate key {e.key!r} on line {e.first.line + 1} and line {e.second.line + 1}; "
                          "keep one of them (YAML would silently use the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
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
    inside = [label for key, _, label in items if loc and tuple(key.split("."))[: len(loc)] == loc]
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


def _validate(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> RunConfig:
    """The typed config of a merged tree; a :class:`ConfigError` naming, per bad field, where its value came from."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        # a whole-config rule names its fields in its message; echoing the whole config would bury it
        lines = [f"{_error_source(err['loc'], items, path)}: {_field_path(err['loc'])}: {err['msg']}"
                 + (f" (got {err.get('input')!r})" if err["loc"] else "")
                 + (_did_you_mean(err["loc"]) if err["type"] == "extra_forbidden" else "")
                 for err in e.errors()]
        raise ConfigError(lines[0] if len(lines) == 1
                          else "invalid config:\n" + "\n".join(f"  {line}" for line in lines)) from None


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
    cfg = _validate(_apply(tree, items), items, path)
    mismatch = cfg.data.dev_domain_mismatch()
    if mismatch:
        warnings.warn(f"{path}: {mismatch}", DevDomainWarning, stacklevel=2)
    return cfg


ENV_DATA_ROOT = "AIAYN_DATA_ROOT"  # where local corpora live (a deployment's worker points it at them)
ENV_WORK_DIR = "AIAYN_WORK_DIR"  # where stage outputs go


def resolve_config(name_or_path: str | Path, overrides: Overrides | None = None, data_root: str | Path | None = None,
                   environ: Mapping[str, str] | None = None) -> RunConfig:
    """The run's config, resolved once: the one function that owns precedence, used by the CLI and the flows.

    Later wins: the schema's defaults < the YAML file (and the presets it ``extends``) < the environment
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
ConfigName = Literal["multi30k-cpu", "multi30k-cpu-hub", "multi30k-cpu-weekly", "multi30k-en-fr-cpu", "ptb-sample-cpu",
                     "wmt14-en-de-base", "wmt14-en-de-big", "wmt14-en-fr-base", "wmt14-en-fr-big", "wsj-parsing"]


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, type with its constraints) of every field of ``model`` that is not itself a config section."""
    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and prefix + name != "data.dev":
            out += _leaf_fields(kind, f"{prefix}{name}.")
        else:
            out.append((prefix + name, Annotated[kind, *field.metadata] if field.metadata else kind))
    return out


def _flow_overrides_model() -> type[BaseModel]:
    fields = {key.replace(".", "__"): (kind | None, Field(default=None, alias=key))
              for key, kind in _leaf_fields(RunConfig) if key not in ("name",)}
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
