"""Trainer, resuming: bitwise the uninterrupted run (in process, across an epoch boundary, after kill -9), the
metrics rows a resumed run trains again, and starting from another run's weights (train.init_from)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointError, load_checkpoint, read_index
from pipeline.shards import ShardDataset
from pipeline.train import train, usable_batches
from tests.train_helpers import (REPO, assert_same_rng, assert_same_tensors, config, final_state, metrics, torchrun_env,
                                 train_command)


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_exact_resume_bitwise(shared_data, shards, tmp_path, precision):
    # Dropout on, accumulation 2: the resumed run must replay data order, RNG and optimizer state exactly (bf16:
    # the bf16 working copy is rebuilt from the checkpoint's fp32 weights).
    extra = ["train.update_tokens=1024", "model.dropout=0.1", f"train.precision={precision}"]
    whole = train(config(shared_data, "train.max_steps=8", *extra), shards, tmp_path / "whole")
    split = tmp_path / "split"
    train(config(shared_data, "train.max_steps=4", *extra), shards, split)
    train(config(shared_data, "train.max_steps=8", *extra), shards, split)
    a, b = final_state(whole), final_state(split)
    assert a["step"] == b["step"] == 8 and (a["epoch"], a["batch_pos"]) == (b["epoch"], b["batch_pos"])
    assert_same_tensors(a["model"], b["model"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    assert_same_rng(a["rng"], b["rng"])
    assert a["totals"] == b["totals"]


@pytest.mark.slow
def test_exact_resume_across_epoch_boundary(shared_data, small_stack, tmp_path):
    # Two batches an update on the small corpus, so that the resumed part crosses an epoch boundary.
    extra = ["train.max_tokens=4096", "train.update_tokens=8192", "model.dropout=0.1"]
    cfg = config(shared_data, *extra)
    batches = len(usable_batches(ShardDataset(small_stack.shards, "train"), 4096, cfg.model.max_positions,
                                 cfg.train.seed, 0))
    per_epoch = batches // 2  # an update never spans two epochs: an odd last batch is left out
    whole = train(config(shared_data, f"train.max_steps={per_epoch + 2}", *extra), small_stack.shards,
                  tmp_path / "whole")
    split = tmp_path / "split"
    train(config(shared_data, f"train.max_steps={per_epoch - 1}", *extra), small_stack.shards, split)
    assert (final_state(split)["epoch"], final_state(split)["batch_pos"]) == (0, 2 * (per_epoch - 1))
    train(config(shared_data, f"train.max_steps={per_epoch + 2}", *extra), small_stack.shards, split)
    a, b = final_state(whole), final_state(split)
    assert a["step"] == b["step"] == per_epoch + 2
    assert (a["epoch"], a["batch_pos"]) == (b["epoch"], b["batch_pos"]) == (1, 4)
    assert_same_tensors(a["model"], b["model"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    assert_same_rng(a["rng"], b["rng"])
    assert a["totals"] == b["totals"]


@pytest.mark.integration
def test_kill_9_then_rerun_equals_uninterrupted(shared_data, shards, tmp_path):
    """SIGKILL the training process at a random step, rerun the same command: bitwise the uninterrupted result."""
    import random
    import signal

    extra = ("train.max_steps=16", "train.checkpoint_every_steps=2", "model.dropout=0.1")
    straight = train(config(shared_data, *extra), shards, tmp_path / "straight")
    out = tmp_path / "killed"
    cmd = [sys.executable, *train_command(shared_data, shards, out, *extra)]
    kill_after = random.Random().choice([4, 6, 8, 10, 12])
    proc = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        entries = read_index(out / "checkpoints") if (out / "checkpoints" / "index.json").is_file() else []
        if entries and entries[-1]["step"] >= kill_after:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill at step {kill_after}"
    assert read_index(out / "checkpoints")[-1]["step"] < 16
    rerun = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr
    assert_same_tensors(final_state(out)["model"], final_state(straight)["model"])
    # Steps logged after the last checkpoint and trained again appear once.
    assert [m["step"] for m in metrics(out) if "loss" in m] == [m["step"] for m in metrics(straight) if "loss" in m]


def test_metrics_rows_past_the_resumed_step_are_dropped(tmp_path):
    from pipeline.train.metrics import JsonlSink

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log_params({"a": 1})
    for step in (2, 4, 6):
        sink.log_metrics({"loss": 1.0}, step)
    sink.close()
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # killed mid-line
    JsonlSink(path, resume_step=4).close()
    assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [None, 2, 4]


@pytest.fixture(scope="session")
def trained(shared_data, shards, tmp_path_factory) -> Path:
    """A 20-step run (checkpoints at 10 and 20) whose weights later runs start from."""
    cfg = config(shared_data, "train.max_steps=20", "train.lr_scale=2.0", "train.checkpoint_every_steps=10")
    return train(cfg, shards, tmp_path_factory.mktemp("trained") / "run")


@pytest.mark.integration
def test_init_checkpoint_starts_from_its_weights_with_fresh_counters(shared_data, shards, trained, tmp_path, caplog):
    from pipeline.average import average_checkpoints

    # The average of the last two checkpoints, as a champion is: it must carry the tokenizer to be usable.
    init = average_checkpoints(trained / "checkpoints", 2, tmp_path / "average.pt")
    assert load_checkpoint(init)["tokenizer_sha256"] == ShardDataset(shards).manifest["tokenizer"]["sha256"]
    cfg = config(shared_data, "train.max_steps=2", "train.lr_scale=2.0")
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        out = train(cfg, shards, tmp_path / "run", init_checkpoint=init)
    assert f"initialised from {init.resolve()} (step 20 of its run)" in caplog.text
    scratch_loss = next(m["loss"] for m in metrics(trained) if "loss" in m)  # same config, steps 1-2, random init
    init_loss = next(m["loss"] for m in metrics(out) if "loss" in m)
    assert init_loss < scratch_loss - 0.5, (init_loss, scratch_loss)
    state = final_state(out)
    assert state["step"] == 2 and state["scheduler"]["last_epoch"] == 2  # counters and schedule started fresh
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["init_checkpoint"] == {"path": str(init.resolve()), "step": 20,
                                          "sha256": hashlib.sha256(init.read_bytes()).hexdigest()}


@pytest.mark.integration
def test_init_checkpoint_weights_are_the_first_step_weights(shared_data, shards, trained, tmp_path):
    init = trained / "checkpoints" / "ckpt-00000020.pt"
    # One update at a learning rate of ~1e-11 moves no weight measurably: what is saved is what training began with.
    out = train(config(shared_data, "train.max_steps=1", "train.lr_scale=1e-9"), shards, tmp_path / "run",
                init_checkpoint=init)
    source, started = load_checkpoint(init)["model"], final_state(out)["model"]
    assert source.keys() == started.keys()
    for k in source:
        torch.testing.assert_close(started[k], source[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.integration
def test_resumed_run_ignores_init_checkpoint(shared_data, shards, trained, tmp_path):
    init = trained / "checkpoints" / "ckpt-00000020.pt"
    out = train(config(shared_data, "train.max_steps=2"), shards, tmp_path / "run", init_checkpoint=init)
    # Were the argument used on resume, this absent file would be refused.
    train(config(shared_data, "train.max_steps=4"), shards, out, init_checkpoint=tmp_path / "absent.pt")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["init_checkpoint"]["path"] == str(init)  # where its weights began


@pytest.mark.integration
def test_init_checkpoint_of_another_shape_or_vocabulary_is_refused(shared_data, shards, trained, tmp_path):
    init = trained / "checkpoints" / "ckpt-00000020.pt"
    with pytest.raises(CheckpointError, match=r"different model config.*'d_model': \(32, 16\).*train\.init_from"):
        train(config(shared_data, "train.max_steps=2", "model.d_model=16"), shards, tmp_path / "a",
              init_checkpoint=init)
    state = load_checkpoint(init)
    for sha, words in (("f" * 64, "trained with tokenizer sha256 ffffffffffffffff"),
                       (None, "trained with an unrecorded tokenizer")):  # None: a checkpoint from before the record
        forged = tmp_path / "other-vocabulary.pt"
        torch.save({**state, "tokenizer_sha256": sha}, forged)
        with pytest.raises(CheckpointError, match=f"vocabularies differ: it was {words}.*checkpoint's tokenizer"):
            train(config(shared_data, "train.max_steps=2"), shards, tmp_path / "b", init_checkpoint=forged)
    assert not (tmp_path / "a" / "checkpoints").exists() and not (tmp_path / "b" / "checkpoints").exists()
    # The command line: a clear one-line error and exit status 2, as the orchestrator expects for refused input.
    res = subprocess.run([sys.executable, *train_command(shared_data, shards, tmp_path / "c", "train.max_steps=2"),
                          "--init-checkpoint", str(forged)], capture_output=True, text=True, cwd=REPO,
                         env=torchrun_env(), timeout=300)
    assert res.returncode == 2 and "vocabularies differ" in res.stderr and "Traceback" not in res.stderr
