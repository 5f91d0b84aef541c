"""All-or-nothing writes shared by every stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.support.fsutil import atomic_file, disk_mb, write_json


def test_atomic_file_replaces_on_success_and_keeps_the_old_file_on_error(tmp_path: Path) -> None:
    target = tmp_path / "scores.json"
    write_json(target, {"bleu": 1})
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text('{"bleu": 2, "trunc')
            raise RuntimeError("crash mid-write")
    assert target.read_text() == '{\n  "bleu": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]  # no temporary file left behind
    write_json(target, {"bleu": 2})
    assert target.read_text() == '{\n  "bleu": 2\n}\n'


def test_exclusive_lets_one_holder_in_at_a_time(tmp_path: Path) -> None:
    """Two runs of one config: the second waits for the first instead of writing beside it."""
    import threading
    import time

    from pipeline.support.fsutil import exclusive

    events: list[str] = []

    def hold(name: str) -> None:
        with exclusive(tmp_path / "run", "run folder"):
            events.append(f"{name} in")
            time.sleep(0.3)
            events.append(f"{name} out")

    threads = [threading.Thread(target=hold, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert events == ["a in", "a out", "b in", "b out"]


def test_disk_mb_counts_a_file_or_every_file_under_a_folder(tmp_path):
    """A file's MiB, and a folder's as the sum of the files under it (nested ones included), rounded to 0.01."""
    (tmp_path / "export" / "sub").mkdir(parents=True)
    (tmp_path / "export" / "model.bin").write_bytes(b"\0" * 3 * 2**20)
    (tmp_path / "export" / "sub" / "vocab.txt").write_bytes(b"\0" * 2**19)
    assert disk_mb(tmp_path / "export" / "model.bin") == 3.0
    assert disk_mb(tmp_path / "export") == 3.5


def test_a_finished_stage_folder_whose_listed_file_changed_is_not_reused(tmp_path: Path, caplog) -> None:
    """A manifest's file entries are checked on reuse: intact, the folder is reused; one file altered (same size,
    other bytes), it is removed and the stage writes it again, with one warning naming the file."""
    import logging

    from pipeline.support.fsutil import sha256_file, stage_folder

    out, _, done = stage_folder(tmp_path, "shards", {"format": "test"})
    assert not done
    out.mkdir(parents=True)
    (out / "train-00000.arrow").write_bytes(b"tokens")
    write_json(out / "manifest.json", {"splits": {"train": {"shards": [
        {"file": "train-00000.arrow", "bytes": 6, "sha256": sha256_file(out / "train-00000.arrow")}]}},
        "train": {"file": "train.parquet", "sha256": "0" * 64}})  # another folder's file: not this folder's to check
    assert stage_folder(tmp_path, "shards", {"format": "test"})[2]
    (out / "train-00000.arrow").write_bytes(b"TOKENS")
    with caplog.at_level(logging.WARNING, logger="aiayn.stages"):
        assert stage_folder(tmp_path, "shards", {"format": "test"})[2] is False
    assert not out.exists()
    assert f"{out / 'train-00000.arrow'}: sha256" in caplog.text and "writing it again" in caplog.text


def test_a_full_disk_in_a_stage_is_one_error_naming_the_file_and_the_space_left(tmp_path: Path) -> None:
    """ENOSPC raised by a write deep in a stage becomes a DiskFullError (a UserError: one line from the CLI) that
    names the file, or the work dir when the error names none; other OS errors pass as they are."""
    import errno
    import os

    from pipeline.support.errors import UserError
    from pipeline.support.fsutil import DiskFullError, names_full_disk

    @names_full_disk
    def stage(corpus: Path, work_dir: Path, error: OSError) -> Path:
        raise error

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "corpus" / "train.parquet"))
    with pytest.raises(DiskFullError) as caught:
        stage(tmp_path, work_dir=tmp_path, error=full)
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert message.startswith(f"{tmp_path / 'corpus' / 'train.parquet'}: no space left on device (")
    assert "MiB free on /" in message and f"work_dir {tmp_path}" in message
    with pytest.raises(DiskFullError, match=f"^{tmp_path}: no space left"):  # pyarrow's: the message, no errno
        stage(tmp_path, tmp_path, OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"))
    with pytest.raises(PermissionError):
        stage(tmp_path, tmp_path, PermissionError(errno.EACCES, "Permission denied"))
