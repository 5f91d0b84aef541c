"""Test tiers: unit and integration run by default; `slow` ones (end-to-end, benchmark-scale) need --run-slow."""

from __future__ import annotations

import os
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
