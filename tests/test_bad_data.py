"""Issue #14 through the CLI: damaged compressed input is one clear error, and a killed stage leaves nothing
behind (no worker process running on, no temporary folder after the next run)."""

from __future__ import annotations

import gzip
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration  # every test reads the shared data and runs the CLI

CONFIG = """\
extends: [presets/tiny]
name: bad-data
data:
  root: .
  src_lang: en
  tgt_lang: de
  train: [{train}]
  dev: {dev}
tokenizer: {{vocab_size: 1000, num_workers: 2}}
"""
TEXT = "{name: m, format: text, path: c/train}"
DEV = "{name: val, format: text, path: c/val}"


def write_config(tmp_path: Path, train: str = TEXT, dev: str = DEV) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(train=train, dev=dev), encoding="utf-8")
    return path


def multi30k_lines(shared_data: Path, split: str, lang: str, n: int) -> bytes:
    """The first ``n`` lines of a real Multi30k file (a temporary copy for the test, never kept in the repo)."""
    with open(shared_data / "multi30k" / f"{split}.{lang}", "rb") as f:
        return b"".join(f.readline() for _ in range(n))


def pipeline_cli(cmd: str, cfg: Path, root: Path, work: Path) -> list[str]:
    """``python -m pipeline <cmd>`` on ``cfg`` with data under ``root`` and outputs under ``work``."""
    return [sys.executable, "-m", "pipeline", cmd, "--config", str(cfg), "--data-root", str(root),
            "--work-dir", str(work)]


def leftovers(work: Path) -> list[Path]:
    """Temporary files and folders (``.<name>.tmp-<host>-<pid>...``) anywhere under ``work``."""
    return [p for p in work.rglob(".*") if ".tmp-" in p.name]


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flipped(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]


def _lines_before_gzip_notices(path: Path) -> int:
    """How many lines Python's own gzip reader gives from a damaged .gz before it raises."""
    n = 0
    try:
        with gzip.open(path, "rb") as f:
            for _ in f:
                n += 1
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return n
    pytest.fail(f"{path} reads without error: the test did not damage it")


@pytest.mark.parametrize("damage", [_truncated, _flipped], ids=["truncated", "corrupt"])
@pytest.mark.parametrize("fmt", ["text", "tsv", "sgm"])
def test_damaged_gzip_input_is_one_clear_error_and_nothing_is_written(shared_data: Path, tmp_path: Path, fmt: str,
                                                                      damage) -> None:
    root, work = tmp_path / "data", tmp_path / "work"
    (root / "c").mkdir(parents=True)
    en, de = (multi30k_lines(shared_data, "train", lang, 2000) for lang in ("en", "de"))
    for lang in ("en", "de"):
        (root / "c" / f"val.{lang}").write_bytes(multi30k_lines(shared_data, "val", lang, 200))
    train, dev = TEXT, DEV
    if fmt == "text":
        (root / "c" / "train.en.gz").write_bytes(gzip.compress(en, mtime=0))
        bad = root / "c" / "train.de.gz"
        bad.write_bytes(damage(gzip.compress(de, mtime=0)))
    elif fmt == "tsv":
        bad = root / "c" / "train.tsv.gz"
        rows = b"".join(e + b"\t" + d for e, d in zip(en.splitlines(), de.splitlines(keepends=True)))
        bad.write_bytes(damage(gzip.compress(rows, mtime=0)))
        train = "{name: m, format: tsv, path: c/train.tsv.gz, columns: [en, de]}"
    else:  # a WMT SGML dev set: its reader opens .gz files the same way
        (root / "c" / "train.en").write_bytes(en)
        (root / "c" / "train.de").write_bytes(de)
        sgm = shared_data / "wmt14-en-de" / "sgm"
        (root / "c" / "src.en.sgm.gz").write_bytes(gzip.compress((sgm / "newstest2014-deen-src.en.sgm").read_bytes()))
        bad = root / "c" / "ref.de.sgm.gz"
        bad.write_bytes(damage(gzip.compress((sgm / "newstest2014-deen-ref.de.sgm").read_bytes(), mtime=0)))
        dev = "{name: nt14, format: sgm, files: {en: c/src.en.sgm.gz, de: c/ref.de.sgm.gz}}"
    res = subprocess.run(pipeline_cli("prepare-data", write_config(tmp_path, train, dev), root, work),
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    error = next(line for line in res.stderr.splitlines() if line.startswith("error: "))
    assert error.startswith(f"error: {bad.resolve()}: the compressed file is truncated or corrupt ("), error
    good = re.search(r"reading stopped after line (\d+), the last one that read intact\. Re-download the file, "
                     r"or re-compress it from the original \(gzip -t ", error)
    assert good, error
    # Cut off: exactly the complete lines before the cut. Corrupt: a flipped byte may decompress to garbage lines
    # before gzip notices, and the first bad one (bad UTF-8, a stray tab) ends the good ones earlier.
    seen = _lines_before_gzip_notices(bad)
    assert int(good[1]) == seen if damage is _truncated else 0 < int(good[1]) <= seen
    assert not (work / "corpus").exists() or not any((work / "corpus").iterdir())
    assert not leftovers(work)


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an orphan's zombie may linger where nothing reaps it; it works no more)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pool_workers(parent: psutil.Process) -> list[psutil.Process]:
    """``parent``'s multiprocessing spawn children (the encoding pool's workers)."""
    workers = []
    for child in parent.children(recursive=True):
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return workers


@pytest.mark.integration
def test_tokenize_killed_while_encoding_takes_its_workers_down_and_the_rerun_cleans_up(shared_data: Path,
                                                                                       tmp_path: Path) -> None:
    """kill -9 of ``python -m pipeline tokenize`` while its pool encodes the shards: every worker exits within
    seconds (parent-death signal), and the same command run again succeeds, leaving no temporary or partial shard
    folder."""
    root, work = tmp_path / "data", tmp_path / "work"
    (root / "c").mkdir(parents=True)
    for lang in ("en", "de"):
        (root / "c" / f"train.{lang}").write_bytes(multi30k_lines(shared_data, "train", lang, 20_000))
        (root / "c" / f"val.{lang}").write_bytes(multi30k_lines(shared_data, "val", lang, 500))
    cmd = pipeline_cli("tokenize", write_config(tmp_path), root, work)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    descendants: list[psutil.Process] = []
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 90
        while len(workers := _pool_workers(parent)) < 2:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the encoding pool's workers never started"
            time.sleep(0.02)
        descendants = parent.children(recursive=True)  # the workers and multiprocessing's resource tracker
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)  # reaped: a zombie's pid still looks alive to the next run
        gone_by = time.monotonic() + 5
        while any(_alive(p) for p in descendants) and time.monotonic() < gone_by:
            time.sleep(0.1)
        left = [p.pid for p in descendants if _alive(p)]
    finally:
        # Should they survive (the failure this checks), they must not run on; orphans are no longer our children.
        for p in descendants:
            if _alive(p):
                p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(workers) >= 2
    assert not left, f"still running 5 s after their parent was killed: {left}"
    assert list((work / "shards").glob(".*.partial")), "the kill left no partial shard folder: it came too late"

    rerun = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    shards = Path(rerun.stdout.split("shards:")[1].strip())
    assert (shards / "manifest.json").is_file()
    assert not leftovers(work), leftovers(work)
    assert not list((work / "shards").glob(".*.partial"))  # resumed, then removed once the output was whole
