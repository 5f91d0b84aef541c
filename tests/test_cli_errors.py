"""Bad input at the command line: one `error: ...` line naming what is wrong and what to do, exit status 2."""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.average import average_checkpoints
from pipeline.cli import COMMANDS, READ_ONLY_COMMANDS, main
from pipeline.config import DecodeConfig, load_config
from pipeline.data import prepare_corpus
from pipeline.inference import load_model, translate
from pipeline.tokenize import Tokenizer
from pipeline.train import train
from pipeline.translation.evaluate import evaluate_translation
from tests.conftest import tiny_config

pytestmark = pytest.mark.integration  # every test runs `python -m pipeline` or trains on the shared data

REPO = Path(__file__).resolve().parents[1]
POSITIONS = 128  # the tiny model's max_positions (training needs 98 for Multi30k's longest pair)
LONG_LINE = " ".join(["A man rides a red bike down the street."] * 250)  # 2,000 words
GREEDY = DecodeConfig(beam_size=1, max_len_a=0.0, max_len_b=2, batch_sentences=512)


def cli(*args: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], input=stdin, capture_output=True, cwd=REPO,
                          timeout=300, env={**os.environ, **(env or {})})


def only_error(res: subprocess.CompletedProcess) -> str:
    """The one error line of a failed command (asserting exit status 2 and no traceback)."""
    err = res.stderr.decode()
    assert res.returncode == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------- the work dir


def test_a_work_dir_under_a_file_stops_every_writing_command_before_it_starts(tmp_path, capsys) -> None:
    (tmp_path / "file.txt").write_text("kept")
    work = tmp_path / "file.txt" / "work"
    assert only_error(cli("prepare-data", "--work-dir", str(work))) == (
        f"error: work dir {work} cannot be used: {tmp_path / 'file.txt'} is a file; set work_dir (in the config or "
        "--set work_dir=...), --work-dir or AIAYN_WORK_DIR to a writable folder")
    assert only_error(cli("train", env={"AIAYN_WORK_DIR": str(work)})).endswith("to a writable folder")
    for command in set(COMMANDS) - set(READ_ONLY_COMMANDS):  # in this process: each fails at the same check
        assert main([command, "--work-dir", str(work)]) == 2, command
        assert f"{tmp_path / 'file.txt'} is a file" in capsys.readouterr().err, command
    assert (tmp_path / "file.txt").read_text() == "kept"
    # commands that write nothing do not need the work dir
    res = cli("config", "--work-dir", str(work))
    assert res.returncode == 0 and f"work_dir: {work}" in res.stdout.decode()


def test_an_unwritable_work_dir_names_the_reason() -> None:
    # Tests run as root, whom chmod does not stop; sysfs refuses new folders even to root (EPERM). A read-only
    # file system (EROFS) goes the same way, as "read-only file system", but none can be mounted here.
    if not Path("/sys/kernel").is_dir():
        pytest.skip("needs Linux sysfs at /sys")
    work = "/sys/aiayn-test-work/run"
    msg = only_error(cli("tokenize", "--work-dir", work))
    assert msg.startswith(f"error: work dir {work} cannot be used: /sys/aiayn-test-work: ") and (
        "not permitted" in msg or "permission denied" in msg) and msg.endswith("to a writable folder"), msg


# ---------------------------------------------------------------------------------- translate's input


@pytest.mark.parametrize("data, where", [
    (b"A man rides a bike.\ncaf\xe9 au lait\n", "line 2: invalid UTF-8 at byte offset 23 (byte 0xe9); re-encode the "
                                                "text as UTF-8 (e.g. iconv -f latin1 -t utf-8)"),
    (b"ok\nab\x00c\n", "line 2: a NUL byte at byte offset 5: binary data, not text; give UTF-8 text"),
    (gzip.compress(b"A man rides a bike.\n", mtime=0), "line 1: invalid UTF-8 at byte offset 1 (byte 0x8b); it looks "
                                                      "gzip-compressed: gunzip it first"),
])
def test_binary_input_is_refused_with_its_line_and_offset_before_the_model_loads(data, where, tmp_path) -> None:
    # no checkpoint exists: the input is decoded first, so its error is the one reported
    args = ("translate", "--checkpoint", str(tmp_path / "none.pt"), "--tokenizer", str(tmp_path))
    assert only_error(cli(*args, stdin=data)).startswith(f"error: stdin: {where}")
    path = tmp_path / "input.txt"
    path.write_bytes(data)
    assert only_error(cli(*args, "--input", str(path))).startswith(f"error: {path}: {where}")


def test_random_bytes_on_stdin_are_refused(tmp_path) -> None:
    noise = random.Random(0).randbytes(4096)  # what `head -c 4096 /dev/urandom` gives, reproducibly
    msg = only_error(cli("translate", "--checkpoint", str(tmp_path / "none.pt"), "--tokenizer", str(tmp_path),
                         stdin=noise))
    assert re.fullmatch(r"error: stdin: line \d+: (invalid UTF-8|a NUL byte) at byte offset \d+.*", msg), msg


# ------------------------------------------------------------------------------ lines beyond max_positions


@pytest.fixture(scope="module")
def short_model(shared_data, tiny_stack, tmp_path_factory) -> Path:
    """A tiny model with POSITIONS positions, trained two steps (the machinery, not quality)."""
    cfg = tiny_config(shared_data, f"model.max_positions={POSITIONS}", "train.max_steps=2",
                      "train.checkpoint_every_steps=2")
    run = train(cfg, tiny_stack.shards, tmp_path_factory.mktemp("short"))
    return average_checkpoints(run / "checkpoints", 1, run / "averaged" / "last1.pt")


def test_long_lines_are_warned_about_and_counted(short_model, tiny_stack, shared_data, caplog) -> None:
    tokenizer = Tokenizer(tiny_stack.tokenizer)
    lines = ["A dog runs.", LONG_LINE, "Two girls play."]
    tokens = len(tokenizer.encode(LONG_LINE))
    truncated: list[int] = []
    with caplog.at_level(logging.WARNING, logger="aiayn.evaluate"):
        out = translate(load_model(short_model), tokenizer, lines, GREEDY, source="talk.txt", truncated=truncated)
    assert len(out) == 3 and truncated == [2]
    assert [r.getMessage() for r in caplog.records] == [
        f"talk.txt: line 2 has {tokens} tokens, more than the model's {POSITIONS} positions hold "
        f"({POSITIONS - 1} tokens and end-of-sentence); only its first {POSITIONS - 1} tokens are translated"]

    res = cli("translate", "--checkpoint", str(short_model), "--tokenizer", str(tiny_stack.tokenizer),
              "--set", "decode.beam_size=1", "--set", "decode.max_len_b=2",
              stdin="\n".join(lines).encode() + b"\n", env={"AIAYN_DATA_ROOT": str(shared_data)})
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert len(res.stdout.decode().splitlines()) == 3
    assert f"stdin: line 2 has {tokens} tokens" in err
    assert err.rstrip().endswith(f"stdin: 1 of 3 lines were longer than the model's {POSITIONS} positions; only their "
                                 f"first {POSITIONS - 1} tokens were translated"), err


def test_an_empty_line_translates_to_an_empty_line_as_the_served_model_answers(short_model, tiny_stack,
                                                                              shared_data) -> None:
    """Given only end-of-sentence a model writes a made-up sentence; the CLI, like serving, answers "" instead
    (tests/test_tracking.py holds the served model to it), keeping the other lines' translations and numbers."""
    lines = ["A dog runs.", "", " \t ", "Two girls play."]
    res = cli("translate", "--checkpoint", str(short_model), "--tokenizer", str(tiny_stack.tokenizer),
              "--set", "decode.beam_size=1", "--set", "decode.max_len_a=0", "--set", "decode.max_len_b=2",
              stdin="\n".join(lines).encode() + b"\n", env={"AIAYN_DATA_ROOT": str(shared_data)})
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode().split("\n")[:-1]
    alone = translate(load_model(short_model), Tokenizer(tiny_stack.tokenizer), [lines[0], lines[3]],
                      GREEDY)
    assert out == [alone[0], "", "", alone[1]] and all(alone)


def test_evaluation_records_truncated_sources_per_split(short_model, tiny_stack, tmp_path, caplog) -> None:
    # a small corpus whose dev set holds two 2,000-word sentences and a short one (dev and test are never filtered)
    (tmp_path / "x").mkdir()
    for name, lines in (("t", ["A dog runs.", "Two girls play."]), ("d", [LONG_LINE, "A dog runs.", LONG_LINE])):
        for lang in ("en", "de"):
            (tmp_path / "x" / f"{name}.{lang}").write_text("".join(f"{line}\n" for line in lines))
    cfg = load_config("multi30k-cpu", [("data.root", str(tmp_path)), "data.train=[{name: t, format: text, path: x/t}]",
                                       "data.dev={name: d, format: text, path: x/d}", "data.test=[]"])
    corpus = prepare_corpus(cfg.data, tmp_path / "work")
    with caplog.at_level(logging.WARNING, logger="aiayn.evaluate"):
        out = evaluate_translation(short_model, tiny_stack.tokenizer, corpus, GREEDY, tmp_path / "eval")
    assert json.loads(out.read_text())["splits"]["dev"]["truncated_sources"] == 2
    assert f"dev: 2 of 3 lines were longer than the model's {POSITIONS} positions" in caplog.text
    assert "dev: line 1 has " in caplog.text and "dev: line 3 has " in caplog.text


# ------------------------------------------------------------------------------ a checkpoint's own tokenizer


def test_a_checkpoint_meets_only_the_tokenizer_it_was_trained_with(short_model, tiny_stack, shared_data,
                                                                    tmp_path) -> None:
    from pipeline.checkpoint import CheckpointError
    from pipeline.export import export_checkpoint
    from pipeline.tokenize import train_tokenizer

    cfg = tiny_config(shared_data, "tokenizer.vocab_size=900")
    other = train_tokenizer(tiny_stack.corpus, cfg.tokenizer, tmp_path / "work")
    assert Tokenizer(other).sha256 != Tokenizer(tiny_stack.tokenizer).sha256
    # translate: refused before any decoding, naming the checkpoint, both tokenizers and what to pass
    msg = only_error(cli("translate", "--checkpoint", str(short_model), "--tokenizer", str(other),
                         stdin=b"A dog runs.\n", env={"AIAYN_DATA_ROOT": str(shared_data)}))
    assert msg.startswith(f"error: {short_model} was trained with tokenizer sha256 ")
    assert f"but the tokenizer {other} is sha256 {Tokenizer(other).sha256[:16]}" in msg
    assert msg.endswith("pass the tokenizer folder the checkpoint was trained with (the one its run's shards were "
                        "encoded with: runs/tokenizer/<fingerprint>/; --tokenizer of evaluate, export and translate), "
                        "or a checkpoint of this config's data")
    # the commands the message names take that flag: export with the checkpoint's own tokenizer gets past it
    for command in ("evaluate", "export"):
        msg = only_error(cli(command, "--checkpoint", str(short_model), "--tokenizer", str(tmp_path / "nowhere"),
                             env={"AIAYN_DATA_ROOT": str(shared_data)}))
        assert msg.startswith(f"error: --tokenizer {tmp_path / 'nowhere'}: not a tokenizer folder"), msg
    # evaluate and export: the same refusal, and no output folder left behind
    with pytest.raises(CheckpointError, match="was trained with tokenizer sha256"):
        evaluate_translation(short_model, other, tiny_stack.corpus, GREEDY, tmp_path / "eval")
    assert not (tmp_path / "eval").exists()
    with pytest.raises(CheckpointError, match="was trained with tokenizer sha256"):
        export_checkpoint(short_model, other, "int8", tmp_path / "export")
    assert not (tmp_path / "export").exists()
    # its own tokenizer still works
    assert len(translate(load_model(short_model, tokenizer=Tokenizer(tiny_stack.tokenizer)),
                         Tokenizer(tiny_stack.tokenizer), ["A dog runs."], GREEDY)) == 1
