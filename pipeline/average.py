"""Checkpoint averaging (paper section 6.1: the last 5 checkpoints for base, the last 20 for big).

The parameters of the last N checkpoints, by step, are averaged element-wise in float64 (a float32 running sum
over 20 checkpoints loses the low bits the average is for) and cast back to each tensor's dtype. Checkpoints
whose architecture, parameter names or shapes differ are refused, naming them: averaging them would be
meaningless. A listed checkpoint that is missing or corrupt is refused too, rather than silently averaging a
different set. The result is a standalone checkpoint in the training format (model, configs, shards, step),
without optimizer state, that loads like any other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.fsutil import atomic_file
from pipeline.train.checkpoint import CHECKPOINT_FORMAT, CheckpointError, read_index, verify_and_load


def select_last(folder: Path, last_n: int) -> list[dict]:
    """The index entries of the ``last_n`` highest-step checkpoints in ``folder``, oldest first."""
    entries = sorted(read_index(folder), key=lambda e: e["step"])
    if not entries:
        raise CheckpointError(f"{folder}: no checkpoints listed (no index.json); train first")
    if last_n > len(entries):
        raise CheckpointError(f"{folder}: asked to average the last {last_n} checkpoints, only {len(entries)} exist "
                              f"(steps {[e['step'] for e in entries]}); lower average.last_n, train longer or "
                              "checkpoint more often (train.checkpoint_every_steps), or, if older ones were pruned, "
                              "raise train.keep_last_checkpoints")
    return entries[-last_n:]


def average_checkpoints(folder: Path, last_n: int, out_path: Path) -> Path:
    """Average the last ``last_n`` checkpoints of ``folder`` (a run's ``checkpoints/``) into ``out_path``."""
    folder = Path(folder)
    entries = select_last(folder, last_n)
    total: dict[str, torch.Tensor] = {}
    first: dict | None = None
    for entry in entries:
        state, problem = verify_and_load(folder, entry)
        if state is None:
            raise CheckpointError(f"{folder / entry['file']}: {problem}; cannot average it (pick another "
                                  "last_n or restore the file)")
        params = state["model"]
        if first is None:
            first = state
            ref_name = entry["file"]
            total = {k: v.to(torch.float64) for k, v in params.items()}
            continue
        if state["model_config"] != first["model_config"]:
            diff = sorted(k for k in first["model_config"] if first["model_config"][k] != state["model_config"].get(k))
            raise CheckpointError(f"{entry['file']} and {ref_name} have different architectures (fields {diff})")
        if params.keys() != total.keys():
            extra, missing = sorted(params.keys() - total.keys()), sorted(total.keys() - params.keys())
            raise CheckpointError(f"{entry['file']} and {ref_name} have different parameter names: only in "
                                  f"{entry['file']}: {extra[:5]}, only in {ref_name}: {missing[:5]}")
        for k, v in params.items():
            if v.shape != total[k].shape:
                raise CheckpointError(f"{entry['file']}: parameter {k} has shape {tuple(v.shape)}, "
                                      f"{ref_name} has {tuple(total[k].shape)}")
            total[k] += v.to(torch.float64)
    averaged = {k: (v / len(entries)).to(first["model"][k].dtype) for k, v in total.items()}
    state = {
        "format": CHECKPOINT_FORMAT,
        "model": averaged,
        "model_config": first["model_config"],
        "config": first["config"],
        "shards": first["shards"],
        "step": entries[-1]["step"],
        "averaged_from": [{"file": e["file"], "step": e["step"], "sha256": e["sha256"]} for e in entries],
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out_path) as tmp:
        torch.save(state, tmp)
    return out_path

