"""Test tiers: unit and integration run by default; `slow` ones (end-to-end, benchmark-scale) need --run-slow."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Real data lives beside the repo (never copied into it); AIAYN_SHARED_DATA points elsewhere.
SHARED_DATA = Path(os.environ.get("AIAYN_SHARED_DATA", REPO_ROOT.parent / "shared" / "data")).resolve()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "multi30k" / "train.en").is_file():
        pytest.fail(f"shared data not found at {SHARED_DATA}: put ../shared/data beside the repo or set AIAYN_SHARED_DATA")
    return SHARED_DATA


# A tiny model on real Multi30k: the integration tests check the machinery, not translation quality.
TINY = ["model.encoder_layers=1", "model.decoder_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
        "tokenizer.vocab_size=1000", "train.max_tokens=512", "train.update_tokens=512", "train.warmup_steps=10",
        "train.log_every_steps=2", "train.dev_every_steps=1000", "train.dev_max_sentences=64",
        "train.checkpoint_every_steps=1000", "train.checkpoint_every_minutes=60.0"]


def tiny_config(shared_data: Path, *overrides: str):
    """The multi30k-cpu config shrunk by TINY, reading the shared data, plus ``overrides``."""
    from pipeline.config import load_config

    return load_config("multi30k-cpu", [("data.root", str(shared_data)), *TINY, *overrides])


@dataclass(frozen=True)
class Stack:
    """The stage outputs a tiny run trains on: corpus, tokenizer and shard folders (built once per session)."""

    work: Path
    corpus: Path
    tokenizer: Path
    shards: Path


@pytest.fixture(scope="session")
def tiny_stack(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    from pipeline.data import prepare_corpus
    from pipeline.shards import build_shards
    from pipeline.tokenize import train_tokenizer

    cfg = tiny_config(shared_data)
    work = tmp_path_factory.mktemp("work")
    corpus = prepare_corpus(cfg.data, work)
    tokenizer = train_tokenizer(corpus, cfg.tokenizer, work)
    return Stack(work, corpus, tokenizer, build_shards(corpus, tokenizer, cfg.tokenizer, work))


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """A real MLflow tracking server (SQLite + local artifacts) on a free port; yields its URL."""
    from pipeline.localstack import free_port, start_mlflow

    service = start_mlflow(tmp_path_factory.mktemp("mlflow"), free_port())
    try:
        yield service.url
    finally:
        service.stop()
