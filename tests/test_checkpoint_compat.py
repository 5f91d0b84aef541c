"""Configs and checkpoints written before an option left the product keep working (pipeline/support/retired.py;
docs/explanation/architecture.md, "When a lever leaves the product"): at the product's value the option is dropped,
at another it is refused, naming it and the commit whose code runs it.

``tests/fixtures/checkpoint-734e28a/`` is a training checkpoint, its tokenizer and its beam-search translations of
five sentences, all written by commit 734e28a (the last with the nanoGPT speedrun's model options and Muon); the
same command decodes them to the same translations now."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.checkpoint import CheckpointError, load_checkpoint
from pipeline.config import ConfigError, dump_config, load_config, load_resolved
from pipeline.support.retired import RETIRED
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


@pytest.mark.parametrize("option, value", [(r.path, r.value) for r in RETIRED])
def test_a_retired_option_at_the_products_value_is_dropped_on_load(tmp_path: Path, option: str, value) -> None:
    """In a config file, an override and a resolved config file: the option is gone from the loaded config and
    the run is the one it was (the same run identity as a config that never named it)."""
    section, field = option.split(".")
    plain = load_config("multi30k-cpu")
    assert field not in type(getattr(plain, section)).model_fields
    old = tmp_path / "old.yaml"
    old.write_text(f"extends: multi30k-cpu\n{section}:\n  {field}: {json.dumps(value)}\n", encoding="utf-8")
    for cfg in (load_config(old), load_config("multi30k-cpu", [(option, value)])):
        assert cfg.section_hash() == plain.section_hash()
    resolved = tmp_path / "resolved.yaml"
    tree = yaml.safe_load(dump_config(plain))
    tree[section][field] = value
    resolved.write_text(yaml.safe_dump(tree), encoding="utf-8")
    assert load_resolved(resolved).section_hash() == plain.section_hash()


@pytest.mark.parametrize("option, other", [("model.qk_norm", True), ("model.activation", "relu2"),
                                           ("model.zero_init_output", True), ("train.optimizer", "muon"),
                                           ("train.muon_lr_scale", 2.0)])
def test_a_retired_option_at_another_value_is_refused_naming_it_and_the_commit(tmp_path, option, other) -> None:
    with pytest.raises(ConfigError, match=rf"--set {option}=.*: {option}: .* left the product .* commit 734e28a"):
        load_config("multi30k-cpu", [f"{option}={json.dumps(other)}"])
    section, field = option.split(".")
    old = tmp_path / "old.yaml"
    old.write_text(f"extends: multi30k-cpu\n{section}:\n  {field}: {json.dumps(other)}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{old}: {option}: .*git checkout 734e28a"):
        load_config(old)


def test_a_checkpoint_trained_with_a_retired_option_on_is_refused_by_name(tmp_path: Path) -> None:
    """The fixture's architecture and config hold the retired options at the product's values (it loads, above);
    the same file with QK-norm on is refused before anything decodes or trains from it."""
    state = torch.load(OLD / "ckpt-00000200.pt", map_location="cpu", weights_only=True)
    assert state["model_config"]["qk_norm"] is False and state["config"]["train"]["optimizer"] == "adam"
    loaded = load_checkpoint(OLD / "ckpt-00000200.pt")
    assert "qk_norm" not in loaded["model_config"] and "optimizer" not in loaded["config"]["train"]
    state["model_config"]["qk_norm"] = True
    torch.save(state, tmp_path / "qk.pt")
    with pytest.raises(CheckpointError, match=r"qk.pt: model.qk_norm: true is an option that left the product"):
        load_checkpoint(tmp_path / "qk.pt")
