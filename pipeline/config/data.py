"""The ``data`` section: the training sources, the dev set, the test sets, the language pair and the cleaning
rules."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Strict

SourceFormat = Literal["text", "tsv", "sgm", "parquet", "arrow", "hf_disk", "hub", "ptb"]


class SourceSpec(Strict):
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


class CleaningConfig(Strict):
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


class DataConfig(Strict):
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
