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


def test_a_full_disk_in_a_stage_is_one_error_naming_the_file_and_the_space_needed(tmp_path: Path) -> None:
    """ENOSPC or EDQUOT raised by a write deep in a stage becomes a DiskFullError (a UserError: one line from the
    CLI): a write in an atomic folder names the file under the final folder and, as a lower bound, what the folder
    held when the disk filled; an error naming no file names the work dir and the free space alone; other OS
    errors pass as they are. (A real full disk: tests/test_disk_full.py.)
    """
    import errno
    import os

    from pipeline.support.errors import UserError
    from pipeline.support.fsutil import DiskFullError, atomic_dir, names_full_disk

    @names_full_disk
    def stage(work_dir: Path, error: OSError) -> Path:
        with atomic_dir(work_dir / "corpus" / "abc") as tmp:
            (tmp / "dev.parquet").write_bytes(b"x" * 3 * 2**20)
            (tmp / "train.parquet").write_bytes(b"y" * 2**20)  # the file the disk filled in, half written
            raise error

    with pytest.raises(DiskFullError) as caught:
        stage(tmp_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert message.startswith(f"{tmp_path / 'corpus' / 'abc' / 'train.parquet'}: no space left on device: this write "
                              "needs at least 4.0 MiB, ")
    assert " MiB free on /" in message and "or point work_dir (--work-dir, AIAYN_WORK_DIR) at a larger disk" in message
    assert not list((tmp_path / "corpus").iterdir())  # the partial folder is gone

    @names_full_disk
    def raw(corpus: Path, work_dir: Path, error: OSError) -> Path:
        raise error

    with pytest.raises(DiskFullError, match=f"^{tmp_path}: no space left on device: this write needs more than the "):
        raw(tmp_path, tmp_path, OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"))
    with pytest.raises(PermissionError):
        raw(tmp_path, tmp_path, PermissionError(errno.EACCES, "Permission denied"))


def test_a_file_of_known_size_names_it_and_what_is_missing(tmp_path: Path) -> None:
    """A single file of known size (a checkpoint's state, a copy) names "about" its size and how much more to free
    than the disk has; the partial file is removed and the file written before is kept."""
    import errno
    import os

    from pipeline.support.fsutil import NeedsSpace, atomic_file, disk_full_line

    (tmp_path / "model.pt").write_bytes(b"old")
    free = __import__("shutil").disk_usage(tmp_path).free
    with pytest.raises(NeedsSpace) as caught:
        with atomic_file(tmp_path / "model.pt", size=free + 2**30) as tmp:
            tmp.write_bytes(b"new, half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (caught.value.filename, caught.value.need, caught.value.at_least) == (str(tmp_path / "model.pt"),
                                                                                free + 2**30, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"] and (tmp_path / "model.pt").read_bytes() == b"old"
    line = disk_full_line(tmp_path / "model.pt", caught.value.need, False, "--out", "the old file is kept")
    assert "this write needs about " in line and "; free at least 1,024.0 MiB more there, or point --out at" in line
