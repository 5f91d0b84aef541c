"""Data lineage: the raw sources, the cleaned corpus, the distilled corpus and the token shards as MLflow dataset
inputs.

Each dataset carries a source (where it came from) and a digest (its content hash from the stage manifest), so
two runs on different data show different datasets in the UI's "Datasets used" column and run comparison.
Inputs are logged on the given run and on its parent (the pipeline run), where runs are usually compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mlflow.data.dataset_source import DatasetSource
from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import DatasetInput, InputTag
from mlflow.types import ColSpec, DataType, Schema
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_PARENT_RUN_ID

from pipeline.data import read_manifest
from pipeline.support.fsutil import MANIFEST
from pipeline.shards import read_shard_manifest
from pipeline.tokenize import Tokenizer

from .runs import client, content_digest, log_metrics, set_tags

# The corpus Parquet columns (docs/explanation/formats.md), shown as the dataset schema.
CORPUS_SCHEMA = Schema([ColSpec(DataType.string, "split"), ColSpec(DataType.string, "origin"),
                        ColSpec(DataType.long, "line"), ColSpec(DataType.string, "src"),
                        ColSpec(DataType.string, "tgt"), ColSpec(DataType.string, "tgt_raw", required=False)])


def _dataset_input(name: str, source: DatasetSource, digest: str, context: str, schema: Schema | None = None,
                   **tags: object) -> DatasetInput:
    ds = MetaDataset(source, name=name, digest=digest[:32], schema=schema)
    input_tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)] + [InputTag(k, str(v)) for k, v in tags.items()]
    return DatasetInput(ds._to_mlflow_entity(), input_tags)


def log_inputs(run_id: str, inputs: list[DatasetInput]) -> None:
    """Log dataset inputs on ``run_id`` and, for a child run, on its parent as well."""
    c = client()
    c.log_inputs(run_id, inputs)
    parent = c.get_run(run_id).data.tags.get(MLFLOW_PARENT_RUN_ID)
    if parent:
        c.log_inputs(parent, inputs)


def _raw_source(entry: dict) -> DatasetSource:
    loc = entry["location"]
    if entry["format"] == "hub":
        return HuggingFaceDatasetSource(loc["dataset"], config_name=loc["subset"] or None, split=loc["split"],
                                        revision=loc["revision"] or None)
    # Local sources: paths relative to data.root, as the manifest records them (the root differs per machine).
    return LocalArtifactDatasetSource(loc.get("files") or loc.get("file") or loc["path"])


def log_corpus(run_id: str, corpus_dir: Path) -> dict:
    """Log the data stage: its manifest (artifact), row and cleaning counts (metrics), and as inputs each raw
    source (context ``raw``: source = its files or hub dataset, digest = hash of its input file hashes) and each
    cleaned split (context ``corpus``: source = its Parquet file, digest = its sha256). Returns the metrics."""
    corpus_dir = Path(corpus_dir).resolve()
    manifest = read_manifest(corpus_dir)
    c = client()
    c.log_artifact(run_id, str(corpus_dir / MANIFEST), "data/corpus")
    metrics: dict[str, float] = {f"corpus.{key}.rows": split["rows"] for key, split in manifest["splits"].items()}
    cleaning = manifest["splits"]["train"]["cleaning"]
    metrics["corpus.train.read"], metrics["corpus.train.kept"] = cleaning["read"], cleaning["kept"]
    metrics.update({f"corpus.train.removed.{k}": v for k, v in cleaning["removed"].items()})
    metrics.update({f"corpus.train.normalized.{k}": v for k, v in cleaning["normalized"].items()})
    metrics["corpus.bom_stripped_files"] = sum(len(e.get("bom_stripped", [])) for es in manifest["inputs"].values()
                                               for e in es)
    log_metrics(run_id, metrics)
    set_tags(run_id, {"corpus_fingerprint": manifest["fingerprint"][:16]})

    inputs = []
    for role, entries in manifest["inputs"].items():
        for entry in entries:
            digest = content_digest({"files": entry.get("files"), "fingerprint": entry.get("fingerprint")})
            inputs.append(_dataset_input(entry["name"], _raw_source(entry), digest, "raw", role=role,
                                         format=entry["format"], rows_read=entry["rows_read"]))
    for key, split in manifest["splits"].items():
        inputs.append(_dataset_input(f"corpus/{key}", LocalArtifactDatasetSource(str(corpus_dir / split["file"])),
                                     split["sha256"], "corpus", CORPUS_SCHEMA, split=key, rows=split["rows"]))
    log_inputs(run_id, inputs)
    return metrics


def log_distillation(run_id: str, corpus_dir: Path, teachers: Sequence[str]) -> dict:
    """Log the distillation stage: the distilled corpus's manifest (artifact), what its filters did (metrics
    ``distill.read``, ``distill.kept``, ``distill.removed.<rule>``, ``distill.references``: human pairs kept beside
    the teachers', and ``distill.truncated``: sources cut to the teachers' positions), the teachers by ``teachers``
    (their labels: registered versions, not aliases) and both corpora's fingerprints (tags), and its training split
    as an input (context ``distilled``: source = its Parquet file, digest = its sha256), each teacher's sha256
    (``distill.teacher_sha256.<i>``) and, for semi-supervised parsing, each unlabelled file with its sha256
    (``distill.unlabelled.<i>``), the rule (``distill.rule``, ``distill.keep_fraction``) and its threshold
    (``distill.threshold``). Dev and test are the source corpus's files, logged by the data stage. Returns the
    metrics."""
    corpus_dir = Path(corpus_dir).resolve()
    manifest = read_manifest(corpus_dir)
    entry = manifest["distillation"]
    client().log_artifact(run_id, str(corpus_dir / MANIFEST), "data/distilled")
    metrics = {"distill.read": entry["read"], "distill.kept": entry["kept"], "distill.truncated": entry["truncated"],
               "distill.references": entry.get("references", 0),  # a corpus distilled before keep_original: none
               **{f"distill.removed.{k}": v for k, v in entry["removed"].items()}}
    tags = {"distill.teachers": ",".join(teachers), "corpus_fingerprint": manifest["fingerprint"][:16],
            "source_corpus_fingerprint": entry["source_corpus"]["fingerprint"][:16],
            **{f"distill.teacher_sha256.{i}": t["sha256"] for i, t in enumerate(entry["teachers"])}}
    if unlabelled := entry.get("unlabelled"):  # semi-supervised parsing: what the teachers parsed, and the rule
        rule = entry["rule"]
        tags |= {"distill.rule": rule["name"], "distill.keep_fraction": str(rule["keep_fraction"]),
                 "distill.threshold": str(rule["threshold"]),
                 **{f"distill.unlabelled.{i}": f"{s['path']} sha256:{s['sha256']}"
                    for i, s in enumerate(unlabelled["sources"])}}
    log_metrics(run_id, metrics)
    set_tags(run_id, tags)
    train = manifest["splits"]["train"]
    log_inputs(run_id, [_dataset_input("distilled/train", LocalArtifactDatasetSource(str(corpus_dir / train["file"])),
                                       train["sha256"], "distilled", CORPUS_SCHEMA, split="train", rows=train["rows"],
                                       teachers=",".join(teachers))])
    return metrics


def log_tokenizer(run_id: str, tokenizer_dir: Path, shards_dir: Path) -> dict:
    """Log the tokenizer stage: sentencepiece model, vocabulary and both manifests (artifacts), vocabulary and
    token statistics (metrics), and each split's shards as an input (context ``shards``: source = the shard
    folder, digest = hash of its shard files' sha256). Returns the metrics."""
    tokenizer_dir, shards_dir = Path(tokenizer_dir).resolve(), Path(shards_dir).resolve()
    tok = Tokenizer(tokenizer_dir)  # checks the model file against its manifest
    shards = read_shard_manifest(shards_dir)
    c = client()
    for name in (tok.model_path.name, "spm.vocab", MANIFEST):
        c.log_artifact(run_id, str(tokenizer_dir / name), "tokenizer")
    c.log_artifact(run_id, str(shards_dir / MANIFEST), "data/shards")

    trained_on = tok.manifest["train"]
    metrics: dict[str, float] = {"tokenizer.vocab_size": tok.vocab_size,
                                 "tokenizer.train_sentences": trained_on["sentences"],
                                 "tokenizer.sample_sentences": trained_on["used"]}
    inputs = []
    for key, split in shards["splits"].items():
        metrics[f"shards.{key}.rows"] = split["rows"]
        for side in ("src", "tgt"):
            for stat in ("tokens", "mean_len", "max_len", "unk_rate", "byte_rate"):
                metrics[f"shards.{key}.{side}.{stat}"] = split[side][stat]
        digest = content_digest([s["sha256"] for s in split["shards"]])
        inputs.append(_dataset_input(f"shards/{key}", LocalArtifactDatasetSource(str(shards_dir)), digest, "shards",
                                     split=key, rows=split["rows"], files=len(split["shards"]),
                                     tokenizer_sha256=tok.sha256[:16]))
    log_metrics(run_id, metrics)
    set_tags(run_id, {"tokenizer_sha256": tok.sha256[:16], "shards_fingerprint": shards["fingerprint"][:16]})
    log_inputs(run_id, inputs)
    return metrics
