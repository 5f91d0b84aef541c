"""Where each stage's output lives in the work dir for a config, and the input stages in order (CLI, torchrun).

Every stage folder is content-addressed (corpus, distilled corpus, tokenizer, shards) or derived from the config
hash (the run folder), so running the same config twice reuses what is done and resumes what is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pipeline.config import ConfigError, RunConfig, outside_run_identity
from pipeline.data import prepare_corpus
from pipeline.support.fsutil import sha256_file
from pipeline.shards import build_shards, read_shard_manifest
from pipeline.tokenize import train_tokenizer


@dataclass(frozen=True)
class Inputs:
    """What training reads: the corpus (distilled, with ``distill.teachers``), the tokenizer trained on it and the
    shards encoded with it."""

    corpus: Path
    tokenizer: Path
    shards: Path


def checkpoint_teachers(cfg: RunConfig) -> list[Path]:
    """``distill.teachers`` as checkpoint files (none: no distillation). Registered teachers (``models:/``) need the
    tracking server and are refused (:class:`~pipeline.distill.DistillError`): the distill-translation flow
    resolves them."""
    from pipeline.distill import DistillError  # decoding code: imported only where there are teachers

    teachers = cfg.distill.teachers
    if registered := [t for t in teachers if t.startswith("models:/")]:
        raise DistillError(f"distill.teachers {registered}: a registered model is resolved through the tracking "
                           "server, which only the distill-translation flow does; run that flow, or name the "
                           "teachers' checkpoint files (.pt) here")
    return [Path(t) for t in teachers]


def build_corpus(cfg: RunConfig, progress: Callable[[str, str], Callable[[int, int], None]] | None = None) -> Path:
    """The corpus training reads: the data stage's, or with ``distill.teachers`` its distilled corpus (the
    teachers' tokenizer found in the work dir by :func:`~pipeline.distill.teacher_tokenizer`; for parsing, the
    gold trees and the teachers' kept silver trees of ``distill.unlabelled``: :mod:`pipeline.silver`), or with
    ``distill.translations`` the distilled corpus of translations made elsewhere. A no-op returning
    the folder when unchanged; ``progress`` as for :func:`build_inputs`."""
    work = Path(cfg.work_dir)
    if cfg.distill.translations:  # translations made elsewhere (a GPU): only the filters run here
        from pipeline.distill import distill_from_translations

        corpus = prepare_corpus(cfg.data, work, progress=progress and progress("reading the training pairs", "pairs"))
        return distill_from_translations(corpus, Path(cfg.distill.translations), cfg.distill, work)
    if cfg.distill.unlabelled and not cfg.distill.teachers:
        raise ConfigError("distill.unlabelled names sentences for teachers to parse, but distill.teachers is empty: "
                          "set it to the checkpoint files (.pt) of trained parsers, e.g. --set "
                          "'distill.teachers=[runs/train/<run>/averaged/last3.pt]'")
    if not cfg.distill.teachers:
        return prepare_corpus(cfg.data, work, progress=progress and progress("reading the training pairs", "pairs"))
    # Only here: the decoding code (beam search, sacreBLEU) stays out of every process that does not distill,
    # the torchrun ranks included.
    from pipeline.distill import distill_corpus, teacher_tokenizer
    from pipeline.inference import decode_device

    # the teachers before the data stage: a registered, missing or unmatched teacher is refused at once
    teachers = checkpoint_teachers(cfg)
    tokenizer = teacher_tokenizer(teachers, work)
    corpus = prepare_corpus(cfg.data, work, progress=progress and progress("reading the training pairs", "pairs"))
    if cfg.task == "parsing":  # the semi-supervised setting: the teachers parse unlabelled sentences
        from pipeline.silver import prepare_unlabelled, silver_corpus

        unlabelled = prepare_unlabelled(cfg.distill.unlabelled, cfg.data.root, corpus, work)
        return silver_corpus(corpus, teachers, tokenizer, cfg.distill, unlabelled, work, device=decode_device(),
                             progress=progress and progress("parsing the unlabelled sentences", "sentences"))
    # the teachers decode on a GPU when there is one (hours on a CPU for a WMT corpus)
    return distill_corpus(corpus, teachers, tokenizer, cfg.distill, work, device=decode_device(),
                          progress=progress and progress("distilling the training sources", "sentences"))


def build_inputs(cfg: RunConfig, progress: Callable[[str, str], Callable[[int, int], None]] | None = None) -> Inputs:
    """Corpus (:func:`build_corpus`: distilled with ``distill.teachers``), tokenizer and shards in order; each is a
    no-op returning its folder when unchanged, so every caller (the CLI's commands, each torchrun rank) finds the
    same folders. ``progress(what, unit)`` gives the data, distillation and shard stages a callback for their
    progress (done, total)."""
    work = Path(cfg.work_dir)
    corpus = build_corpus(cfg, progress)
    tokenizer = train_tokenizer(corpus, cfg.tokenizer, work)
    shards = build_shards(corpus, tokenizer, cfg.tokenizer, work,
                          progress=progress and progress("encoding token shards", "pairs"))
    return Inputs(corpus, tokenizer, shards)


def run_dir(cfg: RunConfig, shards: Path, init_checkpoint: Path | None = None) -> Path:
    """The training run folder: one per (data, tokenizer, model, train) config and shard content, so a re-run
    resumes it, and per initial weights (``init_checkpoint``'s sha256).

    The shards' fingerprint is in the name because one data config can read changing content (a glob source
    that grew, a file replaced in place): new data is a new run, never a resume of checkpoints trained on other
    shards. A run from a newer champion is likewise a new run. Budgets, and the settings of how a run is carried out
    or watched (the fields marked outside the run's identity where they are declared,
    :func:`pipeline.config.outside_run_identity`: fusions, dev and logging intervals), are left out: changing them
    continues the same run.
    """
    name = cfg.section_hash("data", "tokenizer", "model", "train", exclude=outside_run_identity(RunConfig))
    name += f"-{read_shard_manifest(Path(shards))['fingerprint'][:12]}"
    if init_checkpoint is not None:
        name += f"-init-{sha256_file(Path(init_checkpoint))[:12]}"
    return Path(cfg.work_dir).resolve() / "train" / name
