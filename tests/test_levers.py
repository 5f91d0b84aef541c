"""The exit rule (docs/explanation/architecture.md, "When a lever leaves the product"): every option of the
tokenizer, model and train sections is set by a shipped config (a file under configs/, or prefect.yaml's
deployments) or named by a how-to (docs/how-to/), so no option stays in the product that nothing uses or asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import yaml

from pipeline.config import ModelConfig, TokenizerConfig, TrainConfig
from tests.conftest import REPO_ROOT

SECTIONS = {"tokenizer": TokenizerConfig, "model": ModelConfig, "train": TrainConfig}


def dotted_keys(node: Any) -> Iterator[str]:
    """Every ``section.field`` a YAML document sets: a field under a section's mapping (at any depth: presets,
    recipes, deployment overrides), or a dotted key (overrides, a sweep's space and hunches)."""
    if isinstance(node, dict):
        for key, value in node.items():
            key = str(key)
            if "." in key:
                yield key
            if key in SECTIONS and isinstance(value, dict):
                yield from (f"{key}.{field}" for field in value)
            yield from dotted_keys(value)
    elif isinstance(node, list):
        for item in node:
            yield from dotted_keys(item)


def shipped_settings() -> set[str]:
    files = [*sorted((REPO_ROOT / "configs").rglob("*.yaml")), REPO_ROOT / "prefect.yaml"]
    return {key for f in files for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")) for key in dotted_keys(doc)}


def test_every_option_is_set_by_a_shipped_config_or_named_by_a_how_to() -> None:
    shipped = shipped_settings()
    how_tos = "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO_ROOT / "docs" / "how-to").glob("*.md")))
    orphans = [f"{section}.{field}" for section, schema in SECTIONS.items() for field in schema.model_fields
               if f"{section}.{field}" not in shipped and f"{section}.{field}" not in how_tos]
    assert not orphans, (f"options that no shipped config sets and no how-to names: {orphans}; ship a config that "
                         "sets each, name the need it serves in a how-to, or retire it (pipeline/support/retired.py)")


def test_the_scan_sees_sections_overrides_and_sweep_spaces(tmp_path: Path) -> None:
    doc = {"model": {"dropout": 0.2}, "recipes": {"fp32": {"train": {"cooldown": 0.3}}},
           "deployments": [{"parameters": {"overrides": {"train.rdrop_alpha": 1.0}}}],
           "space": {"tokenizer.sampling_alpha": {"type": "categorical"}}}
    assert set(dotted_keys(doc)) == {"model.dropout", "train.cooldown", "train.rdrop_alpha", "tokenizer.sampling_alpha"}
