"""Prefect tasks for the data, distillation (and its semi-supervised parsing twin), tokenizer, shard, averaging
and evaluation stages: thin wrappers over the plain stage functions (paths and configs in, paths out), adding
cross-run caching and, where the network is involved, retries."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.tasks import exponential_backoff

from pipeline.average import average_run
from pipeline.config import DataConfig, DistillConfig, RunConfig, TokenizerConfig
from pipeline.data import DataError, corpus_fingerprint, prepare_corpus
from pipeline.data.sources import HubUnavailable
from pipeline.distill import distill_corpus
from pipeline.evaluate import evaluate_checkpoint
from pipeline.export import export_model
from pipeline.support.fsutil import sha256_file
from pipeline.inference import decode_device
from pipeline.shards import build_shards
from pipeline.silver import prepare_unlabelled, silver_corpus
from pipeline.tokenize import train_tokenizer
from tasks.caching import recorded, stage_cache_key
from tasks.progress import ProgressArtifact


def _hub_unavailable(task, task_run, state) -> bool:
    """Retry only what may pass later (the hub down or slow), never bad input: that fails the same way again."""
    try:
        state.result()
    except HubUnavailable:
        return True
    except Exception:
        return False
    return False


def _corpus_content(data: DataConfig) -> str:
    """The corpus fingerprint; when a source cannot be opened, a key no finished run has (the task then runs
    and fails with the source's own error, instead of the cache-key hook logging it as its own)."""
    try:
        return corpus_fingerprint(data)
    except DataError as e:
        return f"unresolved:{type(e).__name__}:{e}"


@task(name="prepare-data", persist_result=True, retries=3, retry_delay_seconds=exponential_backoff(10),
      retry_condition_fn=_hub_unavailable,
      cache_key_fn=stage_cache_key(prepare_corpus, content={"data": _corpus_content}))
@recorded
def data_stage(data: DataConfig, work_dir: Path) -> Path:
    """Read, clean and version the corpus, with a ``data-progress`` artifact (training pairs read); the cache key
    covers every input file's content hash."""
    with ProgressArtifact("data-progress", "reading and cleaning the training pairs") as artifact:
        return prepare_corpus(data, work_dir, progress=artifact.fraction)


def _teachers_content(teachers: list[Path]) -> str:
    """The teachers by content: a version downloaded again, or named by another alias, keys the same."""
    return ",".join(sha256_file(Path(t)) for t in teachers)


@task(name="distill-corpus", persist_result=True,
      cache_key_fn=stage_cache_key(distill_corpus, content={"teachers": _teachers_content}))
@recorded
def distill_stage(corpus: Path, teachers: list[Path], tokenizer_dir: Path, distill: DistillConfig,
                  work_dir: Path, export: Path | None = None) -> Path:
    """The corpus with its training targets replaced by what the teachers (checkpoints sharing ``tokenizer_dir``,
    decoding as one ensemble) translate of its sources, the failed pairs dropped, with a ``distill-progress``
    artifact (sources decoded); on the GPU when there is one, else through ``export`` (one teacher's CTranslate2
    export) when there is one. Keyed like the distilled corpus's fingerprint: the corpus, the teachers' content,
    the export and the distill settings."""
    if decode_device() == "cuda":
        export = None  # our engine on the GPU; CTranslate2's CPU build is what the export is for
    engine = "its CTranslate2 export" if export is not None else "our engine"
    with ProgressArtifact("distill-progress", f"{len(teachers)} teacher(s) translating the training sources "
                                              f"with {engine}") as artifact:
        return distill_corpus(corpus, teachers, tokenizer_dir, distill, work_dir,
                              device=decode_device(), progress=artifact.fraction, export=export)


@task(name="prepare-unlabelled")
def unlabelled_stage(files: list[str], data_root: str, corpus: Path, work_dir: Path) -> Path:
    """The semi-supervised parser's unlabelled sentences as treebank words, checked against the corpus's dev and
    test sentences; not cached across runs: the stage itself reuses its folder by the files' content, which only
    reading them tells."""
    return prepare_unlabelled(files, data_root, corpus, work_dir)


@task(name="silver-corpus", persist_result=True,
      cache_key_fn=stage_cache_key(silver_corpus, content={"teachers": _teachers_content}))
@recorded
def silver_stage(corpus: Path, teachers: list[Path], tokenizer_dir: Path, distill: DistillConfig, unlabelled: Path,
                 work_dir: Path) -> Path:
    """The parsing corpus with the kept silver trees the teachers (parser checkpoints) parse of the ``unlabelled``
    sentences after its gold trees, with a ``silver-progress`` artifact (sentences parsed). Keyed on the corpus,
    the teachers' content, the unlabelled folder's content and the distill settings."""
    with ProgressArtifact("silver-progress", f"{len(teachers)} teacher(s) parsing the unlabelled sentences") \
            as artifact:
        return silver_corpus(corpus, teachers, tokenizer_dir, distill, unlabelled, work_dir,
                             device=decode_device(), progress=artifact.fraction)


@task(name="train-tokenizer", persist_result=True, cache_key_fn=stage_cache_key(train_tokenizer))
@recorded
def tokenizer_stage(corpus: Path, tokenizer: TokenizerConfig, work_dir: Path) -> Path:
    """The sentencepiece model shared by source and target, trained on the corpus's training split."""
    return train_tokenizer(corpus, tokenizer, work_dir)


@task(name="write-shards", persist_result=True, cache_key_fn=stage_cache_key(build_shards))
@recorded
def shards_stage(corpus: Path, tokenizer_dir: Path, tokenizer: TokenizerConfig, work_dir: Path) -> Path:
    """Every split encoded into memory-mappable token shards, with a ``tokenize-progress`` artifact (pairs
    encoded)."""
    with ProgressArtifact("tokenize-progress", "encoding every split into token shards") as artifact:
        return build_shards(corpus, tokenizer_dir, tokenizer, work_dir, progress=artifact.fraction)


@task(name="average-checkpoints", persist_result=True,
      cache_key_fn=stage_cache_key(average_run, content={"cfg": lambda c: c.section_hash("average", "task", "decode")}))
@recorded
def average_stage(cfg: RunConfig, checkpoints: Path, tokenizer_dir: Path, corpus: Path) -> Path:
    """The element-wise mean of the last ``average.last_n`` checkpoints (float64 accumulation), or, with
    ``average.choose_from``, the best such mean on the dev split (the corpus and tokenizer decode it, with an
    ``averaging-progress`` artifact)."""
    if not cfg.average.choose_from:
        return average_run(cfg, checkpoints.parent)
    with ProgressArtifact("averaging-progress", f"choosing N among {cfg.average.choose_from} on dev") as artifact:
        return average_run(cfg, checkpoints.parent, corpus, tokenizer_dir, progress=artifact.fraction)


@task(name="evaluate", persist_result=True,
      cache_key_fn=stage_cache_key(evaluate_checkpoint, content={"cfg": lambda c: c.section_hash("task", "decode")}))
@recorded
def evaluate_stage(cfg: RunConfig, checkpoint: Path, tokenizer_dir: Path, corpus: Path) -> Path:
    """Decode dev and every test split and score them as the task demands (translation: every BLEU variant
    and chrF; parsing: EVALB F1), with an ``evaluation-progress`` artifact; returns ``scores.json``."""
    with ProgressArtifact("evaluation-progress", f"decoding dev and test sets with {checkpoint.name}") as artifact:
        return evaluate_checkpoint(cfg, checkpoint, corpus, tokenizer_dir, progress=artifact.fraction)


@task(name="export-ctranslate2", persist_result=True,
      cache_key_fn=stage_cache_key(export_model, content={"cfg": lambda c: c.section_hash("export", "decode")}))
@recorded
def export_stage(cfg: RunConfig, checkpoint: Path, tokenizer_dir: Path, corpus: Path, scores: Path) -> Path:
    """The averaged model as a CTranslate2 model (``export.quantization``) and its quality gate on dev against
    the PyTorch model's translations (``gate.json``: passed when it loses at most ``export.max_bleu_drop``)."""
    return export_model(cfg, checkpoint, tokenizer_dir, corpus, scores)
