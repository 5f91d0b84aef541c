"""Helpers of the trainer's tests (tests/test_train*.py): the tiny config, a run's final checkpoint and metrics,
exact comparisons, the lever tests' set-up and the ``python -m pipeline.train`` command line."""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import torch

from model import Transformer, TransformerConfig
from pipeline.checkpoint import load_checkpoint, read_index
from pipeline.shards import ShardDataset
from pipeline.train import TrainStep, setup, usable_batches
from tests.conftest import resolved_tiny_config, tiny_config

REPO = Path(__file__).resolve().parents[1]


def config(shared_data: Path, *overrides: str):
    return tiny_config(shared_data, *overrides)


def final_state(out: Path) -> dict:
    entry = read_index(out / "checkpoints")[-1]
    return load_checkpoint(out / "checkpoints" / entry["file"])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_rng(a: list[dict], b: list[dict]) -> None:
    """Every rank's torch, CUDA and numpy streams equal. Python's global ``random`` is left out: this test process
    also hosts the session's Prefect and MLflow clients, whose threads draw from it while a trainer runs here (a
    torchrun worker hosts no such threads, and the trainer itself never draws from it)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert_same_tensors({k: v for k, v in x.items() if k != "python"},
                            {k: v for k, v in y.items() if k != "python"})


def assert_same_tensors(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y)
    else:
        assert a == b


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state["model"].values())


def lever_setup(cfg, shards: Path) -> tuple[ShardDataset, object, Transformer, list]:
    """The lever tests' start: the training split, this process, a model of ``cfg``'s shape from seed 0, and the
    split's batches of 512 tokens in epoch 0's order (index arrays)."""
    ds = ShardDataset(shards, "train")
    info = setup()
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(1000, ds.special.pad, **cfg.model.model_dump()))
    return ds, info, model, usable_batches(ds, 512, 1024, seed=1, epoch=0)


def lever_step(cfg, model: Transformer, info, pad_id: int, **train) -> TrainStep:
    """A TrainStep over a copy of ``model`` with the ``train`` fields of ``cfg`` replaced (one lever at a time)."""
    return TrainStep(copy.deepcopy(model), cfg.model_copy(update={"train": cfg.train.model_copy(update=train)}), info,
                     pad_id)


def assert_close_except_key_biases(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], before: dict | None = None,
                        atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """``a`` and ``b`` (parameter name -> weights or gradients) are equal to float32 rounding (and differ from
    ``before`` when given), except the keys' biases: adding a constant to every key of a query shifts its logits
    alike, so their true gradient is zero and what is left is rounding noise, which Adam (eps 1e-9) turns into
    full-sized steps of either sign. They are left out ([W^Q; W^K; W^V] / [W^K; W^V])."""
    for name, x in a.items():
        y = b[name]
        if before is not None:
            assert not torch.equal(x, before[name]), name  # trained
        if name.endswith("qkv_proj.bias"):
            x, y = x.view(3, -1)[[0, 2]], y.view(3, -1)[[0, 2]]
        elif name.endswith("kv_proj.bias"):
            x, y = x.view(2, -1)[1], y.view(2, -1)[1]
        torch.testing.assert_close(y, x, atol=atol, rtol=rtol, msg=name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(shared_data: Path, shards: Path, out: Path, *overrides: str) -> list[str]:
    """``python -m pipeline.train`` (less the interpreter) on the tiny config with ``overrides``, resolved into a
    file (beside the shards: ``out`` may be a path that cannot be written) as the pipeline hands it over."""
    config = resolved_tiny_config(shared_data, Path(shards).parent, *overrides)
    return ["-m", "pipeline.train", "--config", str(config), "--shards", str(shards), "--out", str(out)]


def torchrun_env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("AIAYN_WORK_DIR", None)
    return env
