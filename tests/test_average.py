"""Checkpoint averaging on real checkpoint files written by the trainer's checkpoint code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model import Transformer, TransformerConfig
from pipeline.average import average_checkpoints
from pipeline.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

ARCH = dict(encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, n_heads=2, dropout=0.0)


def write_checkpoints(folder: Path, steps: list[int], seed: int = 0, **arch) -> list[dict]:
    states = []
    for i, step in enumerate(steps):
        torch.manual_seed(seed + i)
        m = Transformer(TransformerConfig(20, 0, **{**ARCH, **arch}))
        state = {"model": m.state_dict(), "model_config": m.config.to_dict(), "config": {"name": "t"},
                 "shards": {"fingerprint": "f" * 64}, "step": step}
        save_checkpoint(folder, state, step, keep_last=50)
        states.append(state)
    return states


def test_average_of_the_last_n_by_step(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    states = write_checkpoints(folder, [100, 200, 300, 400])
    out = average_checkpoints(folder, 3, tmp_path / "avg.pt")
    avg = load_checkpoint(out)  # weights_only load, like any checkpoint
    for k, v in avg["model"].items():
        expected = sum(s["model"][k].double() for s in states[1:]) / 3
        assert torch.equal(v, expected.to(v.dtype)), k
    assert [e["step"] for e in avg["averaged_from"]] == [200, 300, 400] and avg["step"] == 400
    model = Transformer(TransformerConfig.from_dict(avg["model_config"]))
    model.load_state_dict(avg["model"])  # a standalone model
    assert "optimizer" not in avg


def test_float64_accumulation(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    states = write_checkpoints(folder, list(range(1, 21)))
    out = load_checkpoint(average_checkpoints(folder, 20, tmp_path / "avg.pt"))
    k = "output_projection.weight"
    f32 = sum(s["model"][k] for s in states) / 20  # the float32 running sum the module avoids
    f64 = (sum(s["model"][k].double() for s in states) / 20).float()
    assert torch.equal(out["model"][k], f64) and not torch.equal(f32, f64)


def test_refuses_mismatched_architectures(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    write_checkpoints(folder, [1, 2])
    write_checkpoints(folder, [3], d_ff=64)
    with pytest.raises(CheckpointError, match=r"ckpt-00000003\.pt and ckpt-00000002\.pt have different "
                                              r"architectures \(fields \['d_ff'\]\)"):
        average_checkpoints(folder, 2, tmp_path / "avg.pt")
    assert not (tmp_path / "avg.pt").exists()


def test_refuses_different_parameter_names_and_shapes(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    states = write_checkpoints(folder, [1, 2])
    renamed = dict(states[1], model={("x." + k if "encoder.layers.0" in k else k): v
                                     for k, v in states[1]["model"].items()})
    save_checkpoint(folder, renamed, 3, keep_last=10)
    with pytest.raises(CheckpointError, match=r"different parameter names: only in ckpt-00000003\.pt: \['x\.enc"):
        average_checkpoints(folder, 2, tmp_path / "avg.pt")
    reshaped = dict(states[1], model={k: (v[:-1] if k == "output_projection.weight" else v)
                                      for k, v in states[1]["model"].items()})
    save_checkpoint(tmp_path / "other", states[0], 1, keep_last=10)
    save_checkpoint(tmp_path / "other", reshaped, 4, keep_last=10)
    with pytest.raises(CheckpointError, match=r"ckpt-00000004\.pt: parameter output_projection\.weight has shape"):
        average_checkpoints(tmp_path / "other", 2, tmp_path / "avg.pt")


def test_refuses_a_corrupt_or_missing_member(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    write_checkpoints(folder, [1, 2, 3])
    data = bytearray((folder / "ckpt-00000002.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "ckpt-00000002.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"ckpt-00000002\.pt: sha256 differs"):
        average_checkpoints(folder, 2, tmp_path / "avg.pt")
    with pytest.raises(CheckpointError, match=r"only 3 exist"):
        average_checkpoints(folder, 5, tmp_path / "avg.pt")


def test_dev_score_is_sacrebleu_for_translation_and_evalb_f1_for_parsing(tmp_path: Path) -> None:
    from pipeline.average import dev_score
    from pipeline.config import load_config

    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"splits": {"dev": {"sacrebleu": {"score": 31.5}, "chrf": {"score": 55.0},
                                                     "f1": 88.25}}}))
    assert dev_score(load_config("multi30k-cpu"), scores) == ("sacreBLEU", 31.5)
    assert dev_score(load_config("ptb-sample-cpu"), scores) == ("EVALB F1", 88.25)
