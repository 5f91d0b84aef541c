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
