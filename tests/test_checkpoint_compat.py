"""Checkpoints and configs written before an option was retired keep working (docs/explanation/architecture.md,
"When a lever leaves the product"): ``tests/fixtures/checkpoint-734e28a/`` is a training checkpoint, its tokenizer
and its beam-search translations of five sentences, all written by commit 734e28a (the last with the nanoGPT
speedrun's model options and Muon), and the same command decodes them to the same translations now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

OLD = REPO_ROOT / "tests" / "fixtures" / "checkpoint-734e28a"


@pytest.mark.integration  # a `python -m pipeline` subprocess
def test_a_checkpoint_of_734e28a_decodes_to_the_translations_it_gave_then(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pipeline", "translate", "--config", "multi30k-cpu",
                          "--work-dir", str(tmp_path), "--checkpoint", str(OLD / "ckpt-00000200.pt"),
                          "--tokenizer", str(OLD / "tokenizer"), "--input", str(OLD / "input.en")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (OLD / "expected.de").read_text(encoding="utf-8")
