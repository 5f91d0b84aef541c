"""Trainer, non-finite updates: skipped whole within train.max_nonfinite_updates, the run stopped beyond it naming
the update and the last finite checkpoint, and weights that are not finite never checkpointed."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch

from model import Transformer
from pipeline.checkpoint import read_index
from pipeline.train import train
from tests.train_helpers import REPO, all_finite, config, final_state, metrics, torchrun_env, train_command


@pytest.mark.integration
def test_a_nonfinite_loss_stops_the_run_naming_the_update_and_keeps_the_last_finite_checkpoint(shared_data, shards,
                                                                                             tmp_path):
    # A learning rate that legitimately overflows: update 1 moves every weight by about 1e27, so that from update 2
    # on the attention logits overflow float32 and the loss is nan, batch after batch.
    out = tmp_path / "run"
    cmd = [sys.executable, *train_command(shared_data, shards, out, "train.lr_scale=1e30", "train.max_steps=10",
                                          "train.checkpoint_every_steps=1", "train.log_every_steps=1",
                                          "train.max_nonfinite_updates=2")]
    res = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    newest = out.resolve() / "checkpoints" / "ckpt-00000001.pt"
    assert error == [
        "error: training stopped at update 2 (loss nan, gradient norm nan): non-finite updates in a row: 3, more "
        "than train.max_nonfinite_updates=2 allows (a skipped update is tried again on new batches); the newest "
        f"checkpoint, {newest} (step 1), holds the last finite weights. Try a lower learning rate (train.lr_scale) "
        "or a longer warm-up (train.warmup_steps), gradient clipping (train.clip_norm, e.g. 1.0), or check the "
        "training data for broken pairs"], res.stderr[-3000:]
    skips = [line for line in res.stderr.splitlines() if "so skipped" in line]
    assert len(skips) == 2 and all("update 2 (loss nan, gradient norm nan): not finite, so skipped" in line
                                   for line in skips)
    assert "; 1 in a row, train.max_nonfinite_updates=2" in skips[0] and "; 2 in a row," in skips[1]
    assert [e["step"] for e in read_index(out / "checkpoints")] == [1] and all_finite(final_state(out))
    assert metrics(out)[-1]["skipped_updates"] == 3 and not (out / "train_summary.json").exists()


@pytest.mark.integration
def test_nonfinite_updates_within_the_limit_are_skipped_and_training_goes_on(shared_data, shards, tmp_path, caplog):
    forwards = []

    def nan_on_forwards_3_and_4(module, args, output):  # torch's global hook: the model, as train() builds it
        if isinstance(module, Transformer) and module.training:
            forwards.append(1)
            return output * float("nan") if len(forwards) in (3, 4) else output
        return output

    cfg = config(shared_data, "train.max_steps=5", "train.log_every_steps=1", "train.max_nonfinite_updates=2")
    hook = torch.nn.modules.module.register_module_forward_hook(nan_on_forwards_3_and_4)
    try:
        with caplog.at_level(logging.WARNING, logger="aiayn.train"):
            out = train(cfg, shards, tmp_path / "run")
    finally:
        hook.remove()
    assert len(forwards) == 7  # 5 updates made, 2 skipped
    assert [r.getMessage().split(":")[0] for r in caplog.records if "so skipped" in r.getMessage()] == \
        ["update 3 (loss nan, gradient norm nan)"] * 2
    logged = [m for m in metrics(out) if "loss" in m]
    assert [(m["step"], m["skipped_updates"]) for m in logged] == [(1, 0), (2, 0), (3, 2), (4, 2), (5, 2)]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in logged)
    state = final_state(out)
    # Skipped whole: Adam stepped 5 times, the schedule too; the skipped batches were used up (7 groups of 1).
    assert state["scheduler"]["last_epoch"] == 5 and state["skipped_updates"] == 2 and state["batch_pos"] == 7
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {5.0}
    assert logged[-1]["tgt_tokens"] == state["totals"][0]  # tokens of the updates made only
    assert all_finite(state) and json.loads((out / "train_summary.json").read_text())["steps"] == 5


@pytest.mark.integration
def test_weights_that_are_not_finite_are_never_checkpointed(shared_data, shards, tmp_path):
    from pipeline.train.trainer import NonFiniteError

    def break_a_bias_on_forward_2(module, args, output):
        # after the forward of update 2: its loss and gradient stay finite, and Adam's step keeps the inf
        if isinstance(module, Transformer) and module.training:
            module.calls = getattr(module, "calls", 0) + 1
            if module.calls == 2:
                with torch.no_grad():  # a bias: backward does not read it, so changing it in place is allowed
                    module.decoder.layers[0].ffn.w_2.bias[0] = float("inf")
        return output

    cfg = config(shared_data, "train.max_steps=4", "train.checkpoint_every_steps=2", "train.precision=fp32")
    hook = torch.nn.modules.module.register_module_forward_hook(break_a_bias_on_forward_2)
    try:
        with pytest.raises(NonFiniteError) as err:
            train(cfg, shards, tmp_path / "run")
    finally:
        hook.remove()
    assert str(err.value).startswith(
        "the weights after update 2 are not finite (decoder.layers.0.ffn.w_2.bias), so they are not saved; no "
        "checkpoint was written. Try a lower learning rate (train.lr_scale)")
    assert read_index(tmp_path / "run" / "checkpoints") == []
