"""All-or-nothing writes shared by every stage."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.fsutil import atomic_file, write_json


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
