"""Trainer: loss goes down, exact resume, checkpoint integrity, accumulation maths, non-finite updates, torchrun (1
and 2 "nodes", refusals)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model import Transformer, TransformerConfig, transformer_lr
from pipeline.checkpoint import (CheckpointError, check_compatible, find_latest, load_checkpoint, read_index,
                                 save_checkpoint)
from pipeline.config import ConfigError, load_config
from pipeline.shards import ShardDataset, build_shards
from pipeline.train import TrainStep, accumulation_steps, make_batch, setup, train, usable_batches
from pipeline.train.optim import build_optimizer, load_optimizer
from tests.conftest import OpCounter, copy_lines, resolved_tiny_config, tiny_config

REPO = Path(__file__).resolve().parents[1]


def config(shared_data: Path, *overrides: str):
    return tiny_config(shared_data, *overrides)


@pytest.fixture(scope="session")
def shards(tiny_stack) -> Path:
    return tiny_stack.shards


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


# ------------------------------------------------------------------------------------------- one process


@pytest.mark.integration
def test_loss_decreases_and_metrics(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=30", "train.lr_scale=2.0", "train.dev_every_steps=15")
    out = train(cfg, shards, tmp_path / "run")
    lines = metrics(out)
    params = [m["params"] for m in lines if "params" in m]
    assert params and params[0]["model.d_model"] == 32 and params[0]["world_size"] == 1
    logged = [m for m in lines if "loss" in m]
    required = {"loss", "nll", "ppl", "lr", "grad_norm", "src_tokens_per_s", "tgt_tokens_per_s", "step_time_s",
                "peak_memory_mb", "step"}
    assert all(required <= m.keys() for m in logged)
    # MFU against this CPU's own matmul peak: the best of repeated products at the model's shapes (feed-forward in
    # and out, the output projection) in the run's precision; never above 1
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[params[0]["precision"]]
    source = params[0]["mfu_peak_source"]
    assert source.startswith("measured torch.mm ") and f" {dtype} (best of 512x32x64, 512x64x32, 512x32x1000)" in source
    assert params[0]["precision_reason"].startswith("train.precision=auto: ")
    assert params[0]["mfu_peak_tflops"] > 0 and all(0 < m["mfu"] <= 1 for m in logged)
    assert all(m["mfu_peak_tflops"] >= params[0]["mfu_peak_tflops"] for m in logged)
    # beside the measured roofline, the CPU's nominal peak where its class is known: never a higher MFU
    if params[0]["mfu_nominal_peak_tflops"]:
        assert params[0]["mfu_nominal_peak_source"].startswith("nominal: ")
        nominal = params[0]["mfu_nominal_peak_tflops"]  # the same achieved FLOP/s over the other peak
        assert all(m["mfu_nominal"] == pytest.approx(m["mfu"] * m["mfu_peak_tflops"] / nominal) for m in logged)
    else:
        assert params[0]["mfu_nominal_peak_source"].startswith("no nominal peak known") and not any(
            "mfu_nominal" in m for m in logged)
    assert [m["step"] for m in logged] == list(range(2, 31, 2))
    assert np.mean([m["loss"] for m in logged[-3:]]) < np.mean([m["loss"] for m in logged[:3]]) - 0.5
    dev = [m for m in lines if "dev_loss" in m]
    assert [m["step"] for m in dev] == [15, 30] and all(m["dev_ppl"] > 1 for m in dev)
    # per sentence: the per-token nll times the dev set's target tokens per sentence (eos included)
    assert all(m["dev_sentence_nll"] > m["dev_nll"] * 5 for m in dev)
    assert 0 < dev[0]["train_seconds"] < dev[1]["train_seconds"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 30 and summary["stopped_by"] == "max_steps" and summary["tokens"]["tgt"] > 0
    assert summary["final_dev"]["dev_loss"] == dev[-1]["dev_loss"]
    # what trained it, named in the summary and the params alike (the tests' config: recipe none on every machine)
    from pipeline.hardware import cpu_class

    assert (summary["machine"], summary["precision"], summary["recipe"]) == (
        f"CPU class {cpu_class()}", params[0]["precision"], "none") and params[0]["machine"] == summary["machine"]
    assert [c["step"] for c in summary["checkpoints"]] == [30]


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
def test_epochs_cycle_through_the_sampled_copies_of_the_training_split(shared_data, small_stack, tmp_path):
    extra = ["tokenizer.sampling_alpha=0.1", "tokenizer.sampled_copies=2", "train.max_tokens=4096",
             "train.update_tokens=4096"]  # one batch per update, a dozen or so per epoch
    cfg = config(shared_data, *extra)
    sampled = build_shards(small_stack.corpus, small_stack.tokenizer, cfg.tokenizer, tmp_path)
    copies = [ShardDataset(sampled, k) for k in ("train.sampled1", "train.sampled2")]
    epochs = [usable_batches(ds, 4096, cfg.model.max_positions, cfg.train.seed, e) for e, ds in enumerate(copies)]
    # the whole of epoch 0, then the first update of epoch 1
    state = final_state(train(config(shared_data, *extra, f"train.max_steps={len(epochs[0]) + 1}"), sampled,
                              tmp_path / "run"))
    assert (state["epoch"], state["batch_pos"]) == (1, 1)
    # target tokens (+ eos) trained: all of copy 1 and the first batch of copy 2 (the "train" split holds fewer)
    want = sum(int(copies[e].tgt_len[b].sum()) + len(b) for e, bs in enumerate((epochs[0], epochs[1][:1])) for b in bs)
    assert state["totals"][0] == want


@pytest.mark.integration
def test_truncated_newest_checkpoint_falls_back(shared_data, shards, tmp_path, caplog):
    cfg = config(shared_data, "train.max_steps=6", "train.checkpoint_every_steps=2")
    out = train(cfg, shards, tmp_path / "run")
    ckpts = out / "checkpoints"
    assert [e["step"] for e in read_index(ckpts)] == [2, 4, 6]
    reference = final_state(out)["model"]
    newest = ckpts / "ckpt-00000006.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        train(cfg, shards, out)
    assert any("ckpt-00000006.pt" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert any("resuming from" in r.getMessage() and "ckpt-00000004.pt" in r.getMessage() for r in caplog.records)
    # Resumed from step 4 and redid steps 5-6 exactly: the rewritten newest checkpoint matches the lost one.
    assert_same_tensors(final_state(out)["model"], reference)


def test_corrupt_checkpoint_detected_by_hash(tmp_path, caplog):
    folder = tmp_path / "ckpts"
    for step in (1, 2):
        save_checkpoint(folder, {"step": step, "w": torch.full((4,), float(step))}, step, keep_last=5)
    newest = folder / "ckpt-00000002.pt"
    data = bytearray(newest.read_bytes())
    data[-20] ^= 0xFF  # same size, different bytes
    newest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="aiayn.train"):
        name, state = find_latest(folder)
    assert name == "ckpt-00000001.pt" and state["step"] == 1
    assert "ckpt-00000002.pt" in caplog.text and "sha256" in caplog.text


@pytest.mark.integration
def test_keep_last_checkpoints(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=5", "train.checkpoint_every_steps=1", "train.keep_last_checkpoints=2")
    out = train(cfg, shards, tmp_path / "run")
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.pt")) == ["ckpt-00000004.pt", "ckpt-00000005.pt"]
    index = read_index(ckpts)
    assert [e["step"] for e in index] == [4, 5]
    assert not list(ckpts.glob(".*tmp*"))


@pytest.mark.integration
def test_incompatible_checkpoint_refused(shared_data, shards, tmp_path):
    out = train(config(shared_data, "train.max_steps=2"), shards, tmp_path / "run")
    with pytest.raises(CheckpointError, match="different model config.*d_model"):
        train(config(shared_data, "train.max_steps=4", "model.d_model=16"), shards, out)
    state = final_state(out)
    with pytest.raises(CheckpointError, match="shards"):
        check_compatible(state, state["model_config"], "0" * 64, out / "x.pt")


# ------------------------------------------------------------------ damaged checkpoint folders, bad checkpoint files


def _tiny_checkpoints(folder: Path, steps=(1, 2)) -> None:
    for step in steps:
        save_checkpoint(folder, {"step": step, "w": torch.full((4,), float(step))}, step, keep_last=5)


def test_half_written_index_is_rebuilt_from_the_files(tmp_path, caplog):
    folder = tmp_path / "ckpts"
    _tiny_checkpoints(folder, (1, 2, 3))
    (folder / "ckpt-00000003.pt").write_bytes(b"truncated")  # the newest file is damaged too
    index = folder / "index.json"
    index.write_text(index.read_text()[:40])  # cut mid-write
    with caplog.at_level(logging.WARNING, logger="aiayn.train"):
        name, state = find_latest(folder)
    assert name == "ckpt-00000002.pt" and state["step"] == 2
    assert "index.json is unreadable" in caplog.text and "rebuilt the index from 2 intact" in caplog.text
    assert "ckpt-00000003.pt is unusable" in caplog.text
    assert [e["step"] for e in json.loads(index.read_text())["checkpoints"]] == [1, 2]  # rewritten, valid


@pytest.mark.integration
def test_deleted_index_resumes_from_the_newest_checkpoint_not_step_0(shared_data, shards, tmp_path, caplog):
    cfg = config(shared_data, "train.max_steps=4", "train.checkpoint_every_steps=2")
    out = train(cfg, shards, tmp_path / "run")
    (out / "checkpoints" / "index.json").unlink()
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        train(config(shared_data, "train.max_steps=6", "train.checkpoint_every_steps=2"), shards, out)
    assert "index.json is missing: rebuilt the index from 2 intact checkpoint file(s), newest ckpt-00000004.pt" \
        in caplog.text
    assert "resuming from" in caplog.text and "step 4" in caplog.text
    assert final_state(out)["step"] == 6


def test_every_checkpoint_corrupt_says_training_restarts(tmp_path, caplog):
    folder = tmp_path / "ckpts"
    _tiny_checkpoints(folder)
    for f in folder.glob("ckpt-*.pt"):
        f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="aiayn.train"):
        assert find_latest(folder) is None
    assert "none of the 2 checkpoints" in caplog.text and "training restarts from step 0" in caplog.text


def _bad_checkpoint(kind: str, tmp_path: Path) -> Path:
    import argparse

    path = tmp_path / f"{kind}.pt"
    if kind == "text":
        path.write_text("not a checkpoint\n")
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)
    elif kind == "code":  # a pickle whose loading would construct an arbitrary Python object
        torch.save({"model": {}, "args": argparse.Namespace(lr=1.0)}, path)
    elif kind == "folder":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind, words", [
    ("missing", "not found"),
    ("folder", "is a folder, not a checkpoint file"),
    ("text", "refused"),
    ("tensor", "holds a Tensor, not a checkpoint"),
    ("code", "loading them could run code"),
])
def test_checkpoint_argument_that_is_no_checkpoint_is_one_clear_line(kind, words, tmp_path, capsys):
    from pipeline.cli import main

    bad = _bad_checkpoint(kind, tmp_path)
    (tmp_path / "in.txt").write_text("a man rides a bike .\n")
    status = main(["translate", "--checkpoint", str(bad), "--tokenizer", str(tmp_path), "--input",
                   str(tmp_path / "in.txt")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and str(bad) in err, err
    assert words in err and "pass a checkpoint file written by training or averaging" in err, err
    assert "weights_only" not in err  # the user is never told to turn the safe load off


@pytest.mark.integration
def test_disk_full_during_a_checkpoint_keeps_the_last_one_and_says_so(shared_data, shards, tmp_path):
    import resource
    import signal

    out = tmp_path / "run"
    cmd = [sys.executable, *train_command(shared_data, shards, out, "train.max_steps=2")]
    assert subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, timeout=300).returncode == 0
    size = (out / "checkpoints" / "ckpt-00000002.pt").stat().st_size

    def small_disk() -> None:  # writes past half a checkpoint fail as on a full disk (EFBIG instead of ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    cmd = [sys.executable, *train_command(shared_data, shards, out, "train.max_steps=4")]
    res = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300,
                         preexec_fn=small_disk)
    assert res.returncode == 2, res.stderr[-3000:]
    error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"could not write checkpoint {out.resolve()}/checkpoints/ckpt-00000004.pt: the write failed, usually a " \
           "full disk" in error[0]
    assert f"the last intact checkpoint, {out.resolve()}/checkpoints/ckpt-00000002.pt (step 2), is still there" \
        in error[0] and "MB free there" in error[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["ckpt-00000002.pt", "index.json"]
    assert find_latest(out / "checkpoints")[0] == "ckpt-00000002.pt"


@pytest.mark.integration
def test_leftover_temporary_files_of_a_killed_run_are_removed(shared_data, shards, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    left = [out / "checkpoints" / f".ckpt-00000002.pt.tmp-{host}-{dead.pid}",
            out / f".config.yaml.tmp-{host}-{dead.pid}"]
    live = out / "checkpoints" / f".ckpt-00000009.pt.tmp-{host}-{os.getpid()}"  # a live writer's: kept
    for f in (*left, live):
        f.write_bytes(b"x" * 1000)
    train(config(shared_data, "train.max_steps=2"), shards, out)
    assert not any(f.exists() for f in left) and live.exists()


@pytest.mark.integration
def test_a_second_training_of_one_folder_waits_for_the_first(shared_data, shards, tmp_path):
    from pipeline.fsutil import exclusive

    out = tmp_path / "run"
    log_file = tmp_path / "second.log"
    cmd = [sys.executable, *train_command(shared_data, shards, out, "train.max_steps=4")]
    with exclusive(out.resolve(), "run folder"):  # the first training, as far as the lock goes
        with open(log_file, "w") as log:
            second = subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 120
        while "is in use by another run; waiting for it" not in log_file.read_text():
            assert second.poll() is None and time.monotonic() < deadline, log_file.read_text()[-3000:]
            time.sleep(0.2)
        assert not (out / "metrics.jsonl").exists()  # it waits before writing anything
    assert second.wait(timeout=300) == 0, log_file.read_text()[-3000:]
    assert [m["step"] for m in metrics(out) if "loss" in m] == [2, 4]


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


# -------------------------------------------------------------------------------------------- non-finite updates


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state["model"].values())


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


# --------------------------------------------------------------------- initialising from another run's weights


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


def test_torchrun_command_passes_init_checkpoint(tmp_path):
    from pipeline.config import LaunchConfig
    from pipeline.train.launch import torchrun_command

    cmd = torchrun_command(LaunchConfig(), tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o", ["--x", "y"],
                           init_checkpoint=tmp_path / "champion.pt")
    assert cmd[-4:] == ["--x", "y", "--init-checkpoint", str(tmp_path / "champion.pt")]
    assert "--init-checkpoint" not in torchrun_command(LaunchConfig(), tmp_path / "c.yaml", tmp_path / "s",
                                                       tmp_path / "o")


@pytest.mark.integration
def test_max_minutes_stops_and_checkpoints_and_counts_over_resumes(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=100000", "train.max_minutes=0.05")
    out = train(cfg, shards, tmp_path / "run")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["stopped_by"] == "max_minutes" and 0 < summary["steps"] < 100000
    assert summary["checkpoints"][-1]["step"] == summary["steps"] and summary["train_seconds"] >= 3
    last = load_checkpoint(out / "checkpoints" / summary["checkpoints"][-1]["file"])
    assert last["train_seconds"] >= 3
    # Run again (a crashed run's retry, a re-run): the budget is spent, so not one more update is trained.
    train(cfg, shards, out)
    again = json.loads((out / "train_summary.json").read_text())
    assert (again["stopped_by"], again["steps"]) == ("max_minutes", summary["steps"])
    # A larger budget continues the same run for the difference only.
    train(config(shared_data, "train.max_steps=100000", "train.max_minutes=0.1"), shards, out)
    longer = json.loads((out / "train_summary.json").read_text())
    assert longer["steps"] > summary["steps"] and longer["train_seconds"] >= 6
    assert longer["wall_seconds"] < summary["wall_seconds"] + 1.5  # ~3 s more training, not 6


# ------------------------------------------------------------------------------------------- budget schedule


def test_the_budget_schedule_fits_the_warm_up_to_the_updates_the_clock_buys():
    from model import TransformerLRLambda
    from pipeline.train.budget import BudgetWarmup, predict

    # 30 minutes at 0.4 s per update (bf16 matrix units) and at 2.3 s (AVX2 only): the tiny preset's 1,000 stays
    # where ~4,400 updates come, and a quarter of ~780 where they do not
    fast, slow = predict(20, 20, 8.0, 1792.0, 20000, 1000, 0.25), predict(20, 20, 46.0, 1754.0, 20000, 1000, 0.25)
    assert (fast.updates, fast.warmup) == (4500, 1000) and (slow.updates, slow.warmup) == (782, 196)
    assert predict(20, 0, 0.0, 1800.0, 20000, 1000, 0.25) is None  # nothing timed yet
    capped = predict(20, 20, 8.0, 1792.0, 300, 1000, 0.25)  # max_steps ends the run first: a step budget
    assert (capped.updates, capped.warmup) == (300, 1000)

    schedule = TransformerLRLambda(d_model=256, warmup_steps=1000)
    budget = BudgetWarmup(schedule, 20000, 1800.0, 0.25)
    assert budget.update(20, 60.0) is None and schedule.ramp_steps is None  # the first call times from here
    # a busy first minute (another job on the machine): 20 updates in 60 s predict ~590, so a short warm-up ...
    first = budget.update(40, 120.0)
    assert first.updates == 40 + int(20 / 60 * 1680) and schedule.ramp_steps == round(first.updates / 4)
    # ... that grows once the machine's real pace shows, going on from the rate reached (no jump)
    rate = schedule.rate(60)
    second = budget.update(60, 128.0)
    assert second.updates > first.updates and schedule.ramp_steps == round(second.updates / 4)
    assert schedule.rate(60) == pytest.approx(rate, rel=1e-12) and schedule.rate(schedule.ramp_steps) == \
        pytest.approx(schedule.rate(1000), rel=1e-12)
    assert budget.summary() == {"kind": "budget", "warmup_steps": schedule.ramp_steps,
                                "predicted_updates": second.updates, "peak_lr": schedule.rate(1000),
                                "decay_from": 1000}
    # once the warm-up is over, the schedule is fixed whatever the pace does
    ramp = schedule.ramp_steps
    assert budget.update(ramp, 500.0) is None and budget.update(ramp + 20, 1700.0) is None
    assert schedule.ramp_steps == ramp


def test_auto_fits_a_clock_budget_and_budget_asked_for_fits_a_step_budget_too(caplog):
    from model import TransformerLRLambda
    from pipeline.config import load_config
    from pipeline.train.budget import BudgetWarmup

    assert load_config("multi30k-cpu").train.budget_schedule  # the embedded default: 30 minutes
    assert not load_config("multi30k-cpu", ["train.schedule=paper"]).train.budget_schedule
    assert not load_config("multi30k-cpu", ["train.max_minutes=null"]).train.budget_schedule
    assert load_config("multi30k-cpu", ["train.max_minutes=null", "train.schedule=budget"]).train.budget_schedule
    # a budget of 780 updates (an AVX2 machine's 30 minutes) on any machine: fitted at the first call, untimed
    schedule = TransformerLRLambda(d_model=256, warmup_steps=1000)
    with caplog.at_level(logging.INFO, logger="aiayn.train"):
        steps = BudgetWarmup(schedule, 780, math.inf, 0.25, fit_steps=True).update(20, 9.0)
    assert (steps.updates, steps.warmup, schedule.ramp_steps) == (780, 195, 195)
    # the log names the step budget, not a pace it never measured
    assert "a step budget of 780 updates; warm-up to the peak" in caplog.text and "updates/s" not in caplog.text


@pytest.mark.integration
def test_a_clock_budget_run_warms_up_to_the_peak_and_records_its_schedule(shared_data, shards, tmp_path):
    """A warm-up of 20,000 updates that a 15-second budget cannot reach: the run fits it to its predicted updates,
    trains at the paper's peak before the end, logs the prediction, and a resume goes on with the warm-up it chose;
    a step budget keeps the paper's schedule."""
    # why 20,000: the tiny test model ran 1,118 updates in 15 s on a Zen 4 EPYC, past a warm-up of 1,000
    warmup = 20000
    overrides = ("train.max_steps=100000", f"train.warmup_steps={warmup}", "train.log_every_steps=2")
    out = train(config(shared_data, *overrides, "train.max_minutes=0.25"), shards, tmp_path / "clock")
    summary = json.loads((out / "train_summary.json").read_text())
    sched, rows = summary["schedule"], metrics(out)
    fits = [r for r in rows if "schedule_warmup_steps" in r]
    assert sched["kind"] == "budget" and fits and sched["warmup_steps"] == fits[-1]["schedule_warmup_steps"]
    assert sched["predicted_updates"] == fits[-1]["schedule_predicted_updates"] < warmup
    assert sched["warmup_steps"] < summary["steps"]  # the run reached its peak ...
    peak = transformer_lr(warmup, 32, warmup)
    assert sched["peak_lr"] == pytest.approx(peak) and max(r["lr"] for r in rows if "lr" in r) == pytest.approx(peak)
    state = final_state(out)["scheduler"]["lr_lambdas"][0]  # ... and a resume goes on with the warm-up it chose
    assert (state["ramp_steps"], state["predicted_updates"]) == (sched["warmup_steps"], sched["predicted_updates"])
    steps = train(config(shared_data, *overrides, "train.max_steps=12"), shards, tmp_path / "steps")
    paper = json.loads((steps / "train_summary.json").read_text())["schedule"]
    assert (paper["kind"], paper["warmup_steps"]) == ("paper", warmup)
    assert [r["lr"] for r in metrics(steps) if "lr" in r] == pytest.approx(
        [transformer_lr(s, 32, warmup) for s in range(2, 13, 2)], rel=1e-12)


# ---------------------------------------------------------------------------------------------- accumulation


@pytest.mark.integration
def test_cooldown_takes_the_learning_rate_linearly_to_zero_at_the_end_of_the_budget(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=20", "train.cooldown=0.5")
    rows = [r for r in metrics(train(cfg, shards, tmp_path / "steps")) if "lr" in r]
    d, warmup = cfg.model.d_model, cfg.train.warmup_steps
    # the update numbered s trains at the paper's rate of step s times the cooldown at (s - 1) / 20 of the budget
    assert [r["lr"] for r in rows] == pytest.approx(
        [transformer_lr(r["step"], d, warmup) * min(1.0, (1 - (r["step"] - 1) / 20) / 0.5) for r in rows], rel=1e-9)
    assert rows[-1]["step"] == 20 and rows[-1]["lr"] < 0.11 * transformer_lr(20, d, warmup)
    # on the clock: the factor on the paper's rate falls update by update and the last updates before max_minutes
    # run at a fraction of it (how small depends on how long one update takes: loose on a busy machine)
    timed = config(shared_data, "train.max_steps=100000", "train.max_minutes=0.1", "train.cooldown=1.0")
    rows = [r for r in metrics(train(timed, shards, tmp_path / "minutes")) if "lr" in r]
    factors = [r["lr"] / transformer_lr(r["step"], d, warmup) for r in rows]
    assert factors == sorted(factors, reverse=True) and factors[-1] < 0.5, factors


def lever_setup(cfg, shards: Path) -> tuple[ShardDataset, object, Transformer, list]:
    """The lever tests' start: the training split, this process, a model of ``cfg``'s shape from seed 0, and the
    split's batches of 512 tokens in epoch 0's order (index arrays)."""
    ds = ShardDataset(shards, "train")
    info = setup()
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(1000, ds.special.pad, **cfg.model.model_dump()))
    return ds, info, model, usable_batches(ds, 512, 1024, seed=1, epoch=0)


@pytest.mark.integration
def test_accumulation_equals_one_big_batch(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=fp32")  # exact to float32 rounding
    ds, info, model, ids = lever_setup(cfg, shards)
    a, b = ids[:2]

    def grads(micro) -> dict:
        step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
        step.accumulate(micro)
        return {n: p.grad.clone() for n, p in step.model.named_parameters()}

    two = grads([make_batch(ds, a, info.device), make_batch(ds, b, info.device)])
    one = grads([make_batch(ds, np.concatenate([a, b]), info.device)])
    for name in two:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5, msg=name)
    # And the normalisation is by target tokens: the same gradient as a hand-written sum / count.
    ref = copy.deepcopy(model)
    full = make_batch(ds, np.concatenate([a, b]), info.device)
    loss, _, n = TrainStep(ref, cfg, info, ds.special.pad).criterion(ref(full.src, full.tgt_in), full.tgt_out)
    assert int(n) == full.n_tgt
    (loss / n).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, one[name], atol=1e-6, rtol=1e-5, msg=name)


def lever_step(cfg, model: Transformer, info, pad_id: int, **train) -> TrainStep:
    """A TrainStep over a copy of ``model`` with the ``train`` fields of ``cfg`` replaced (one lever at a time)."""
    return TrainStep(copy.deepcopy(model), cfg.model_copy(update={"train": cfg.train.model_copy(update=train)}), info,
                     pad_id)


@pytest.mark.integration
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 0.02)])
def test_the_fused_output_loss_trains_as_the_logits_loss(shared_data, shards, precision, tol):
    """train.fused_output_loss: the same sums and gradients as the loss over the whole logits (fp32: to float32
    rounding; bf16, the CPU's bf16 copy: to bf16 rounding), the shared embedding's gradient included."""
    cfg = config(shared_data, "model.dropout=0.0", f"train.precision={precision}")
    ds, info, model, ids = lever_setup(cfg, shards)
    micro = [make_batch(ds, b, info.device) for b in ids[:2]]
    out = {}
    for fused in (False, True):
        step = lever_step(cfg, model, info, ds.special.pad, fused_output_loss=fused)
        sums, _ = step.accumulate(micro)
        out[fused] = sums, {n: p.grad for n, p in step.model.named_parameters()}
    torch.testing.assert_close(out[True][0], out[False][0], atol=tol, rtol=tol)
    for name, grad in out[False][1].items():
        fused = out[True][1][name]
        assert float((fused - grad).norm()) <= tol * float(grad.norm()) + 1e-6, name
    with pytest.raises(ConfigError, match="fused_output_loss never forms the logits, and R-Drop"):
        config(shared_data, "train.fused_output_loss=true", "train.rdrop_alpha=1.0")


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


def test_the_default_adam_is_the_fused_kernel_and_the_lever_gives_the_grouped_one_back() -> None:
    linear = torch.nn.Linear(4, 4)
    default = build_optimizer(linear, load_config("multi30k-cpu").train)
    grouped = build_optimizer(linear, load_config("multi30k-cpu", ["train.fused_adam=false"]).train)
    assert (default.defaults["fused"], default.defaults["foreach"]) == (True, False)
    assert (grouped.defaults["fused"], grouped.defaults["foreach"]) == (False, True)


@pytest.mark.integration
def test_fused_adam_updates_as_the_grouped_adam_and_resumes_its_state(shared_data, shards):
    """train.fused_adam: the same weights after three updates as the grouped (foreach) Adam, to float32 rounding;
    and since it leaves the run folder as it is, a run resumed with it switched on continues from the grouped
    Adam's state (and back) as the run would have."""
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=fp32")
    ds, info, model, ids = lever_setup(cfg, shards)
    batches = [[make_batch(ds, b, info.device)] for b in ids[:3]]

    def step_of(fused: bool, weights: Transformer) -> TrainStep:
        return lever_step(cfg, weights, info, ds.special.pad, fused_adam=fused)

    def update(step: TrainStep, micro) -> None:
        assert step.apply(*step.accumulate(micro)).applied

    grouped, fused = step_of(False, model), step_of(True, model)
    assert fused.optimizer.defaults["fused"] and not grouped.optimizer.defaults["fused"]
    for micro in batches:
        update(grouped, micro)
        update(fused, micro)
    assert_close_except_key_biases(grouped.model.state_dict(), fused.model.state_dict(), model.state_dict())
    # resumed with the lever switched (the same run folder): the other kernel continues from this one's state and
    # schedule as this one would have, through the trainer's loading, which keeps the kernel it was built with
    for source, fused_after in ((grouped, True), (fused, False)):
        saved = copy.deepcopy({"optimizer": source.optimizer.state_dict(), "scheduler": source.scheduler.state_dict()})
        resumed, cont = step_of(fused_after, source.model), step_of(not fused_after, source.model)
        for step in (resumed, cont):
            load_optimizer(step.optimizer, copy.deepcopy(saved["optimizer"]))
            step.scheduler.load_state_dict(saved["scheduler"])
        assert resumed.optimizer.param_groups[0]["fused"] is fused_after
        update(resumed, batches[0])
        update(cont, batches[0])
        assert resumed.optimizer.state[next(resumed.model.parameters())]["step"] == len(batches) + 1
        assert_close_except_key_biases(cont.model.state_dict(), resumed.model.state_dict(), source.model.state_dict())


@pytest.mark.integration
def test_rdrop_runs_each_batch_twice_under_its_own_dropout_and_adds_their_symmetric_kl(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.3", "train.precision=fp32", "train.rdrop_alpha=2.0")
    ds, info, model, ids = lever_setup(cfg, shards)
    batch = make_batch(ds, ids[0], info.device)
    step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
    torch.manual_seed(5)  # the dropout masks
    sums, counts = step.accumulate([batch])

    # By hand: one forward of the batch repeated (each copy its own masks), plain autograd for the KL.
    ref = copy.deepcopy(model)
    torch.manual_seed(5)
    logits = ref(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))  # [2B, T, V]
    loss, nll, n = step.criterion(logits, batch.tgt_out.repeat(2, 1))
    lp, lq = logits.log_softmax(-1).chunk(2)  # [B, T, V] each
    real = batch.tgt_out.ne(ds.special.pad)
    kl = 0.5 * (torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none")
                + torch.nn.functional.kl_div(lp, lq, log_target=True, reduction="none")).sum(-1)[real].sum()
    assert kl.item() > 0.01 * loss.item()  # the two passes really differ
    ((loss + 2.0 * kl) / 2 / batch.n_tgt).backward()
    assert int(n) == 2 * batch.n_tgt and counts[0].item() == batch.n_tgt  # the update counts each token once
    torch.testing.assert_close(sums, torch.stack([loss, nll]).detach().double() / 2)  # logged: the passes' mean
    for name, p in ref.named_parameters():
        torch.testing.assert_close(step.model.get_parameter(name).grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)



@pytest.mark.integration
def test_rdrop_mfu_counts_both_passes(shared_data, shards, tmp_path):
    # The same batches with and without R-Drop: FLOP/s achieved per target token/s is the model's FLOPs per token,
    # twice over with R-Drop (each batch runs forward and backward twice).
    per_token = {}
    for alpha in ("0.0", "1.0"):
        out = train(config(shared_data, "train.max_steps=4", f"train.rdrop_alpha={alpha}"), shards,
                    tmp_path / alpha)
        logged = [m for m in metrics(out) if "mfu" in m]
        per_token[alpha] = [m["mfu"] * m["mfu_peak_tflops"] * 1e12 / m["tgt_tokens_per_s"] for m in logged]
    assert len(per_token["0.0"]) == 2
    for one, two in zip(per_token["0.0"], per_token["1.0"], strict=True):
        assert two == pytest.approx(2 * one, rel=1e-6)


@pytest.mark.integration
def test_bf16_on_a_cpu_runs_a_bf16_copy_and_adam_updates_the_fp32_weights(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=bf16")
    ds, info, model, ids = lever_setup(cfg, shards)
    a, b = ids[:2]
    micro = [make_batch(ds, a, info.device), make_batch(ds, b, info.device)]
    step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
    work = step.work
    assert {p.dtype for p in work.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in step.model.parameters()} == {torch.float32}
    assert work.output_projection.weight is work.encoder.embed_tokens.weight  # still shared in the copy

    sums, counts = step.accumulate(micro)  # two micro-batches: their bf16 gradients summed into fp32 ones
    assert all(p.grad is None for p in work.parameters())
    ref = TrainStep(copy.deepcopy(model), config(shared_data, "model.dropout=0.0"), info, ds.special.pad)
    ref.accumulate(micro)
    for (name, p), r in zip(step.model.named_parameters(), ref.model.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert float((p.grad - r.grad).norm()) <= 0.05 * float(r.grad.norm()) + 1e-6, name  # bf16 rounding only

    before = [p.detach().clone() for p in step.model.parameters()]
    assert step.apply(sums, counts).applied
    for p, w, old in zip(step.model.parameters(), work.parameters(), before):
        assert p.dtype == torch.float32 and not torch.equal(p, old)  # Adam stepped the fp32 weights...
        assert torch.equal(w, p.detach().to(torch.bfloat16))  # ...and the bf16 copy follows them

    # The bf16 gradients reach the fp32 ones in grouped kernels, not one or two per parameter (on a GPU each is a
    # launch): a cast for the first micro-batch, an add for the next, both exact.
    grads = [torch.randn_like(w) for w in work.parameters()]
    for passes in (1, 2):
        for w, g in zip(work.parameters(), grads):
            w.grad = g.clone()
        with OpCounter() as counter:
            step._gradients_to_master()
        assert counter.ops <= 2 < len(grads), counter.ops
        for p, g in zip(step.model.parameters(), grads):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, passes * g.float())


@pytest.mark.integration
def test_bf16_copy_or_autocast_both_train_and_keep_fp32_weights(shared_data, shards):
    """train.bf16_copy: on, forward and backward run a bf16 copy and Adam the fp32 weights; off, autocast runs the
    fp32 model. Both train to about the same loss from the same weights and batches (bf16 rounding apart)."""
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=bf16")
    ds, info, model, ids = lever_setup(cfg, shards)
    batches = [[make_batch(ds, b, info.device)] for b in ids[:3]]
    losses = {}
    for mode in ("on", "off"):
        step = lever_step(cfg, model, info, ds.special.pad, bf16_copy=mode)
        assert (step.work is not step.model) == (mode == "on")
        assert next(step.work.parameters()).dtype == (torch.bfloat16 if mode == "on" else torch.float32)
        assert next(step.model.parameters()).dtype == torch.float32  # what Adam updates and checkpoints hold
        assert step.autocast().__class__ is torch.autocast and step.autocast()._enabled == (mode == "off")
        losses[mode] = [step.apply(*step.accumulate(micro)).loss for micro in batches]
    assert losses["on"][-1] < losses["on"][0] and losses["off"][-1] < losses["off"][0]
    assert losses["on"] == pytest.approx(losses["off"], rel=0.02)


@pytest.mark.integration
def test_max_tokens_update_takes_the_update_in_one_micro_batch_per_process(shared_data, small_stack, tmp_path):
    """train.max_tokens=update (the paper presets'): no accumulation, each update one batch of at most
    train.update_tokens positions on one process, into the next epoch."""
    update = 8192
    extra = [f"train.update_tokens={update}", "train.max_tokens=update", "train.checkpoint_every_steps=100"]
    cfg = config(shared_data, *extra)
    steps = len(usable_batches(ShardDataset(small_stack.shards, "train"), update, cfg.model.max_positions,
                               cfg.train.seed, 0)) + 2
    out = train(config(shared_data, *extra, f"train.max_steps={steps}"), small_stack.shards, tmp_path / "run")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["accumulation_steps"] == 1 and summary["epoch"] == 1
    assert steps * update // 2 < summary["tokens"]["tgt"] <= steps * update  # one full batch per update


def test_accumulation_steps():
    assert accumulation_steps(25_000, 4096, 1) == 6
    assert accumulation_steps(25_000, 4096, 8) == 1
    assert accumulation_steps(4096, 4096, 2) == 1
    assert accumulation_steps(8192, 1024, 2) == 4


# -------------------------------------------------------------------------------------------------- torchrun


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


def check_ranks_agree(out: Path, world: int, steps: int) -> None:
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == world and summary["steps"] == steps
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert {r["step"] for r in ranks} == {steps}
    assert len({r["params_sha256"] for r in ranks}) == 1, ranks
    assert final_state(out)["step"] == steps and len(final_state(out)["rng"]) == world


def launched(launch, shared_data: Path, shards: Path, out: Path, *overrides: str, **node) -> subprocess.Popen:
    """torchrun as the flow starts it (``torchrun_command``), with the tiny test config's overrides; ``node``:
    ``node_rank`` and ``rendezvous`` of one node of several."""
    from pipeline.train.launch import torchrun_command

    cmd = torchrun_command(launch, resolved_tiny_config(shared_data, Path(out).parent, *overrides), shards, out,
                           **node)
    return subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def listening_addresses(proc: subprocess.Popen, until_done: bool = True) -> set[str]:
    """Every local address that ``proc`` or a descendant listened on (TCP), sampled until it exits."""
    import psutil

    seen: set[str] = set()
    while proc.poll() is None:
        try:
            tree = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            break
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.pid in tree:
                seen.add(c.laddr.ip)
        time.sleep(0.2)
    return seen


@pytest.mark.integration
def test_torchrun_two_processes_listen_on_loopback_only(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig

    # Dropout off, so that 2 ranks x 2 micro-batches must equal 1 process x 4 micro-batches (same batches).
    # fp32: DDP over 2 processes and accumulation in one must agree to float32 rounding
    extra = ("train.max_steps=4", "train.update_tokens=2048", "model.dropout=0.0", "train.precision=fp32")
    out = tmp_path / "run"
    proc = launched(LaunchConfig(nproc_per_node=2), shared_data, shards, out, *extra)
    addresses = listening_addresses(proc)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    # The rendezvous store, the store shared with the workers and gloo: torchrun's own c10d backend binds "*".
    assert addresses == {"127.0.0.1"}, addresses
    assert stdout.strip().splitlines()[-1] == str(out.resolve())
    assert "accumulation_steps=2" in stderr  # 2048 tokens / (512 x 2 ranks)
    check_ranks_agree(out, world=2, steps=4)
    single = train(config(shared_data, *extra), shards, tmp_path / "single")
    assert json.loads((single / "train_summary.json").read_text())["accumulation_steps"] == 4
    assert_close_except_key_biases(final_state(out)["model"], final_state(single)["model"], atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_torchrun_two_processes_train_bf16_on_a_cpu(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig

    # DDP over the bf16 working copies: gradients all-reduced in bf16, Adam on each rank's fp32 weights.
    out = tmp_path / "run"
    proc = launched(LaunchConfig(nproc_per_node=2), shared_data, shards, out, "train.max_steps=3",
                    "train.update_tokens=2048", "train.precision=bf16")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    check_ranks_agree(out, world=2, steps=3)  # the same fp32 weights on both ranks
    state = final_state(out)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}


@pytest.mark.integration
def test_torchrun_two_nodes_bind_the_configured_interface(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig
    from pipeline.train.launch import Rendezvous

    out, port = tmp_path / "run", free_port()
    rendezvous = Rendezvous(f"127.0.0.1:{port}", f"test-{port}")
    procs = [launched(LaunchConfig(nproc_per_node=1, nnodes=2, interface="lo"), shared_data, shards, out,
                      "train.max_steps=4", "train.update_tokens=1024", node_rank=node, rendezvous=rendezvous)
             for node in (0, 1)]
    addresses = listening_addresses(procs[0])
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    assert addresses == {"127.0.0.1"}, addresses
    check_ranks_agree(out, world=2, steps=4)


def refused_by_torchrun(shared_data: Path, shards: Path, out: Path, *overrides: str, monkeypatch) -> Exception:
    """Two processes started as the training task starts them (``torchrun_command``, ``run_torchrun``), whose ranks
    refuse: the launcher's error, a user error that the task's retry condition does not retry."""
    import asyncio

    from prefect.states import exception_to_failed_state

    from pipeline.config import LaunchConfig
    from pipeline.errors import UserError
    from pipeline.train.launch import torchrun_command
    from tasks.training import TrainingFailed, TrainingRefused, _retry_unless_refused, run_torchrun

    for name, value in torchrun_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)
    cmd = torchrun_command(LaunchConfig(nproc_per_node=2),
                           resolved_tiny_config(shared_data, Path(shards).parent, *overrides), shards, out)
    with pytest.raises(TrainingRefused) as err:
        run_torchrun(cmd, logging.getLogger("test.torchrun"))
    assert isinstance(err.value, UserError)
    retried = [_retry_unless_refused(None, None, asyncio.run(exception_to_failed_state(e)))
               for e in (err.value, TrainingFailed("torchrun exited with status 1"))]
    assert retried == [False, True]
    return err.value


@pytest.mark.integration
def test_torchrun_ranks_stop_together_on_a_nonfinite_loss_and_are_not_retried(shared_data, shards, tmp_path,
                                                                              monkeypatch):
    out = tmp_path / "run"
    err = refused_by_torchrun(shared_data, shards, out, "train.lr_scale=1e30", "train.max_steps=10",
                              "train.update_tokens=1024", "train.checkpoint_every_steps=1",
                              "train.max_nonfinite_updates=0", monkeypatch=monkeypatch)
    # Both ranks refused with the same message (once here): the loss was summed over them before either stepped.
    assert str(err) == (
        "training stopped on its config or input and is not retried (a retry would stop the same way): "
        "training stopped at update 2 (loss nan, gradient norm nan): non-finite updates in a row: 1, more than "
        "train.max_nonfinite_updates=0 allows (a skipped update is tried again on new batches); the newest "
        f"checkpoint, {out.resolve() / 'checkpoints' / 'ckpt-00000001.pt'} (step 1), holds the last finite weights. "
        "Try a lower learning rate (train.lr_scale) or a longer warm-up (train.warmup_steps), gradient clipping "
        "(train.clip_norm, e.g. 1.0), or check the training data for broken pairs")
    assert [e["step"] for e in read_index(out / "checkpoints")] == [1] and all_finite(final_state(out))


@pytest.mark.integration
def test_torchrun_refusal_of_rank_0_alone_is_not_retried(shared_data, shards, tmp_path, monkeypatch):
    # Only rank 0 checks --out; rank 1 goes on to its first collective and fails there, or torchrun stops it.
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "run"
    err = refused_by_torchrun(shared_data, shards, out, "train.update_tokens=1024", monkeypatch=monkeypatch)
    assert str(err).endswith(f"(a retry would stop the same way): --out {out} cannot be used: {tmp_path / 'file.txt'} "
                             "is a file; pass --out a writable folder")


def test_a_node_refused_makes_the_training_stage_refused():
    """Several nodes: each node's torchrun runs in its own flow run, so its refusal reaches the stage as the
    state message of that run."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Crashed, Failed

    from tasks.training import TrainingRefused, _nodes_failed

    refused = FlowRun(flow_id=uuid4(), name="n0", state=Failed(
        message="Flow run encountered an exception: TrainingRefused: the training processes refused ..."))
    lost = FlowRun(flow_id=uuid4(), name="n1", state=Crashed(message="Flow run infrastructure exited with code 137"))
    assert type(_nodes_failed([(0, refused), (1, lost)], 2)) is TrainingRefused
    failed = _nodes_failed([(1, lost)], 2)
    assert type(failed) is not TrainingRefused and str(failed) == (
        f"node 1 of 2 (flow run n1, {lost.id}) ended CRASHED: Flow run infrastructure exited with code 137")


# ------------------------------------------------------------------------------------ refused before training


@pytest.mark.parametrize("overrides, words", [
    (["tokenizer.vocab_size=999"], "tokenizer.vocab_size=999 but the shards"),
    (["train.max_tokens=40", "train.update_tokens=40"], "needs"),
    (["train.update_tokens=600"], "cannot be split over 2 processes"),
    (["train.lr_scale=1e300"], "train.lr_scale=1e[+]300 makes the peak learning rate 5.59e[+]298 .at step "
                               "train.warmup_steps=10., beyond what float32 weights can take"),
])
@pytest.mark.integration
def test_bad_config_fails_before_training(shared_data, shards, tmp_path, overrides, words):
    from pipeline.train.trainer import TrainConfigError, preflight

    cfg = config(shared_data, *overrides)
    world = 2 if "600" in overrides[0] else 1
    with pytest.raises(TrainConfigError, match=words) as err:
        preflight(cfg, ShardDataset(shards, "train"), world)
    assert "set " in str(err.value) or "raise " in str(err.value)
    if world == 1:  # through train(): nothing is written
        with pytest.raises(TrainConfigError):
            train(cfg, shards, tmp_path / "run")
        assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_kill_9_then_rerun_equals_uninterrupted(shared_data, shards, tmp_path):
    """SIGKILL the training process at a random step, rerun the same command: bitwise the uninterrupted result."""
    import random
    import signal
    import time

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


@pytest.mark.slow
def test_tiny_model_overfits_a_few_hundred_shared_pairs(shared_data, tmp_path):
    """200 Multi30k pairs, no label smoothing, no dropout: the per-token nll falls to near zero."""
    from pipeline.data import prepare_corpus
    from pipeline.shards import build_shards
    from pipeline.tokenize import train_tokenizer

    root = tmp_path / "data"
    for lang in ("en", "de"):
        copy_lines(shared_data / "multi30k" / f"train.{lang}", root / f"train.{lang}", 200)
        copy_lines(shared_data / "multi30k" / f"train.{lang}", root / f"dev.{lang}", 20)
    cfg = tiny_config(root, "data.train=[{name: m200, format: text, path: train}]",
                      "data.dev={name: d, format: text, path: dev}", "data.test=[]", "tokenizer.vocab_size=600",
                      "model.encoder_layers=2", "model.decoder_layers=2", "model.d_model=64", "model.d_ff=128",
                      "model.dropout=0.0", "train.label_smoothing=0.0", "train.max_tokens=1024",
                      "train.update_tokens=1024", "train.warmup_steps=50", "train.lr_scale=0.3",
                      "train.max_steps=400", "train.log_every_steps=50")
    corpus = prepare_corpus(cfg.data, tmp_path / "work")
    shard_dir = build_shards(corpus, train_tokenizer(corpus, cfg.tokenizer, tmp_path / "work"), cfg.tokenizer,
                             tmp_path / "work")
    out = train(cfg, shard_dir, tmp_path / "run")
    nll = [m["nll"] for m in metrics(out) if "nll" in m]
    assert nll[0] > 4.0 and nll[-1] < 0.3, nll


@pytest.mark.integration
def test_cpu_threads_split_the_cores_unless_set_explicitly() -> None:
    code = "import torch; from pipeline.train import setup; setup(); print(torch.get_num_threads())"
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("AIAYN_CPU_THREADS", "LOCAL_WORLD_SIZE")}
    cores = len(os.sched_getaffinity(0))
    for extra, expected in (({}, cores), ({"LOCAL_WORLD_SIZE": str(cores)}, 1), ({"AIAYN_CPU_THREADS": "1"}, 1),
                            ({"AIAYN_CPU_THREADS": "3"}, 3)):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, cwd=repo, capture_output=True,
                             text=True, check=True).stdout
        assert int(out.strip().splitlines()[-1]) == expected, extra


@pytest.mark.integration
def test_training_out_under_a_file_is_one_clear_line(shared_data, shards, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "run"
    res = subprocess.run([sys.executable, *train_command(shared_data, shards, out, "train.max_steps=2")], cwd=REPO,
                         env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"error: --out {out} cannot be used: {tmp_path / 'file.txt'} is a file; pass --out a writable folder" \
        in res.stderr


@pytest.mark.integration
def test_the_run_config_is_written_once(shared_data, shards, tmp_path):
    """The launcher writes the run folder's config.yaml, the file every rank reads; the trainer keeps it as it is
    and writes one itself only when there is none (in process) or it differs (a raised budget)."""
    from pipeline.config import load_resolved, write_resolved

    cfg = config(shared_data, "train.max_steps=1")
    out = tmp_path / "run"
    record = write_resolved(cfg, out / "config.yaml")
    inode = record.stat().st_ino  # every write is a rename of a new file
    train(cfg, shards, out)
    assert record.stat().st_ino == inode
    train(config(shared_data, "train.max_steps=2"), shards, out)
    assert load_resolved(record).train.max_steps == 2


def test_a_node_names_the_rendezvous_it_cannot_reach():
    from pipeline.train.rendezvous import EndpointUnreachable, check_hosts, wait_for_endpoint

    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(EndpointUnreachable, match=rf"endpoint 127.0.0.1:{port} \(launch.rdzv_endpoint\) did not "
                                                  r"answer within 1 s"):
        wait_for_endpoint("127.0.0.1", port, 1.0)
    assert time.monotonic() - started < 5
    check_hosts("localhost", port, "lo", "127.0.0.1")  # node 0's own address: fine
    with pytest.raises(EndpointUnreachable, match=r"resolves to \['127.0.0.2'\], but node 0 hosts the rendezvous "
                                                  r"on 127.0.0.1, its address on interface lo"):
        check_hosts("127.0.0.2", port, "lo", "127.0.0.1")



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_heap_keeps_freed_memory_once_per_process():
    from pipeline.allocator import SETTINGS, keep_freed_memory

    applied = keep_freed_memory()
    assert applied == {name: value for name, (_, value) in SETTINGS.items()}  # glibc took every setting
    assert keep_freed_memory() is applied  # once per process


def test_auto_precision_follows_the_hardware() -> None:
    from pipeline.hardware import native_bf16, training_precision

    cpu = torch.device("cpu")
    assert training_precision("fp32", cpu) == ("fp32", "train.precision=fp32")
    assert training_precision("bf16", cpu) == ("bf16", "train.precision=bf16")
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    precision, why = training_precision("auto", cpu)
    assert precision == ("bf16" if native else "fp32") and native_bf16(cpu)[0] == native
    assert why.startswith("train.precision=auto: this CPU has ") and "(torch.cpu" in why


def test_the_nominal_cpu_peak_is_cores_times_flops_per_cycle_times_the_clock() -> None:
    from pipeline.hardware import _FLOPS_PER_CYCLE, cpu_class, cpuinfo, nominal_cpu_peak

    info = cpuinfo()
    key = (info["vendor_id"], cpu_class())
    table = _FLOPS_PER_CYCLE.get((*key, int(info["cpu family"]))) or _FLOPS_PER_CYCLE.get(key) or {}
    for precision in ("fp32", "bf16"):
        peak, how = nominal_cpu_peak(precision, 1)
        if precision not in table:
            assert peak is None and how.startswith("no nominal peak known for"), how
            continue
        assert peak == pytest.approx(table[precision] * float(info["cpu MHz"]) * 1e6)  # one thread: one core
        assert f"1 core(s) x {table[precision]} {precision} FLOPs/cycle" in how
    # threads on SMT siblings of one core share its units: never more cores than the threads allow
    assert nominal_cpu_peak("fp32", 4)[0] in (None, pytest.approx(4 * nominal_cpu_peak("fp32", 1)[0] /
                                                                  (int(info["siblings"]) // int(info["cpu cores"]))))
