"""Trainer, checkpoints: keep-last, integrity (hashes, truncated files, a damaged or deleted index), refusals of
an incompatible or bad checkpoint, a full disk, a killed run's temporary files, one training per run folder."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointError, check_compatible, find_latest, read_index, save_checkpoint
from pipeline.train import train
from tests.train_helpers import REPO, assert_same_tensors, config, final_state, metrics, torchrun_env, train_command


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
    from pipeline.support.fsutil import exclusive

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
