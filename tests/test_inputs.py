"""User text is read by one reader (pipeline/data/sources/lines.py): ``translate``'s ``--input`` and stdin and the
data stage's files alike drop a byte order mark and refuse what is no text (bad UTF-8, a NUL byte) with the same
line; and the command line answers a file argument that is missing, a folder, empty or damaged with one line.

``tests/fixtures/checkpoint-734e28a/`` (a small checkpoint, its tokenizer, five sentences and their translations)
is what ``translate`` decodes here, in this process.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import main
from pipeline.config import DataConfig
from pipeline.data import DataError, prepare_corpus
from tests.conftest import REPO_ROOT

OLD = REPO_ROOT / "tests" / "fixtures" / "checkpoint-734e28a"
BOM = b"\xef\xbb\xbf"
MODEL = ["--checkpoint", str(OLD / "ckpt-00000200.pt"), "--tokenizer", str(OLD / "tokenizer")]


def translate(capsys, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``translate`` of the fixture's model in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["translate", "--work-dir", str(tmp_path / "work"), *MODEL, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def data_cfg(root: Path, train: dict) -> DataConfig:
    return DataConfig.model_validate({"root": str(root), "train": [train], "test": [],
                                      "dev": {"name": "dev", "format": "text", "path": "dev"}})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A data root holding a dev pair (dev.en, dev.de) and the training pair train.en, train.de."""
    r = tmp_path / "data"
    r.mkdir()
    for name, text in (("dev.en", "Dev one.\nDev two.\n"), ("dev.de", "Dev eins.\nDev zwei.\n"),
                       ("train.en", "A dog runs.\nTwo cats sleep.\nA man reads.\n"),
                       ("train.de", "Ein Hund rennt.\nZwei Katzen schlafen.\nEin Mann liest.\n")):
        (r / name).write_text(text, encoding="utf-8")
    return r


TEXT = {"name": "t", "format": "text", "path": "train"}


# ------------------------------------------------------------------------------- translate's input


def test_a_byte_order_mark_or_gzip_changes_no_translation(capsys, monkeypatch, tmp_path: Path) -> None:
    """The fixture's translations, from its input as written and from the same text opening with a byte order mark
    (a Windows editor's), on stdin and as --input, and gzip-compressed as a .gz file."""
    expected = (OLD / "expected.de").read_text(encoding="utf-8")
    text = (OLD / "input.en").read_bytes()
    assert translate(capsys, tmp_path, "--input", str(OLD / "input.en")) == (0, expected, "")
    (tmp_path / "bom.en").write_bytes(BOM + text)
    assert translate(capsys, tmp_path, "--input", str(tmp_path / "bom.en")) == (0, expected, "")
    stdin(monkeypatch, BOM + text)
    assert translate(capsys, tmp_path) == (0, expected, "")
    (tmp_path / "input.en.gz").write_bytes(gzip.compress(BOM + text, mtime=0))
    assert translate(capsys, tmp_path, "--input", str(tmp_path / "input.en.gz")) == (0, expected, "")


@pytest.mark.parametrize("bad, line", [
    (b"Two cats\x00 sleep.\n", "line 2: a NUL byte at byte offset 23: binary data, not text; give UTF-8 text, one "
                               "sentence per line (if the rest is text, delete the NUL bytes: tr -d '\\000')"),
    (b"Zwei Katzen schl\xe4fen.\n", "line 2: invalid UTF-8 at byte offset 31 (byte 0xe4); re-encode the text as "
                                    "UTF-8 (e.g. iconv -f latin1 -t utf-8)"),
])
def test_translate_and_the_data_stage_refuse_what_is_no_text_with_one_line(bad: bytes, line: str, root: Path,
                                                                            tmp_path: Path, capsys, monkeypatch
                                                                            ) -> None:
    """A training file whose second line holds a NUL byte or a Latin-1 byte (after a byte order mark): the data
    stage refuses it naming the file and line, before writing a corpus; translate refuses the same file, and the
    same bytes on stdin, with the same line."""
    data = BOM + b"A dog runs.\n" + bad + b"A man reads.\n"
    (root / "train.en").write_bytes(data)
    with pytest.raises(DataError) as refused:
        prepare_corpus(data_cfg(root, TEXT), tmp_path / "work")
    assert str(refused.value) == f"{root / 'train.en'}: {line}"
    assert not (tmp_path / "work" / "corpus").exists() or not any((tmp_path / "work" / "corpus").iterdir())
    assert translate(capsys, tmp_path, "--input", str(root / "train.en")) == (2, "", f"error: {refused.value}\n")
    stdin(monkeypatch, data)
    assert translate(capsys, tmp_path) == (2, "", f"error: stdin: {line}\n")


def test_a_nul_byte_in_any_format_of_training_data_is_refused_naming_where(root: Path, tmp_path: Path) -> None:
    """No source lets a NUL byte into the corpus (where it would also join a pair's sides in its dedup key): a
    TSV line, a treebank line, a Parquet row, each named."""
    (root / "pairs.tsv").write_bytes(b"A dog runs.\tEin Hund rennt.\nTwo cats.\tZwei\x00Katzen.\n")
    with pytest.raises(DataError, match=rf"^{root / 'pairs.tsv'}: line 2: a NUL byte at byte offset 42: binary"):
        prepare_corpus(data_cfg(root, {"name": "t", "format": "tsv", "path": "pairs.tsv", "columns": ["en", "de"]}),
                       tmp_path / "tsv")
    pq.write_table(pa.table({"en": ["A dog runs.", "Two cats."], "de": ["Ein Hund rennt.", "Zwei\x00Katzen."]}),
                   root / "pairs.parquet")
    with pytest.raises(DataError, match=rf"^{root / 'pairs.parquet'}: row 2: column 'de' holds a NUL byte"):
        prepare_corpus(data_cfg(root, {"name": "t", "format": "parquet", "path": "pairs.parquet"}), tmp_path / "pq")
    (root / "t.mrg").write_bytes(b"(S (NP (DT A) (NN dog)) (VP (VBZ runs)))\n(S (NP (NN c\x00at)))\n")
    ptb = {"name": "t", "format": "ptb", "path": "t.mrg"}
    with pytest.raises(DataError, match=rf"^{root / 't.mrg'}: line 2: a NUL byte at byte offset 53: binary"):
        prepare_corpus(DataConfig.model_validate({"root": str(root), "src_lang": "en", "tgt_lang": "tree",
                                                  "train": [ptb], "dev": {**ptb, "name": "d"}}), tmp_path / "ptb")
    assert not any(tmp_path.glob("*/corpus/*/train.parquet"))


# ---------------------------------------------------------------------------- the command line's files


def test_input_files_that_cannot_be_read_are_one_line(capsys, tmp_path: Path) -> None:
    assert translate(capsys, tmp_path, "--input", str(tmp_path / "none.txt")) == (
        2, "", f"error: --input {tmp_path / 'none.txt'}: cannot read it: No such file or directory; give a text "
               "file, one sentence per line\n")
    assert translate(capsys, tmp_path, "--input", str(tmp_path))[2] == (
        f"error: --input {tmp_path}: cannot read it: Is a directory; give a text file, one sentence per line\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    assert translate(capsys, tmp_path, "--input", str(tmp_path / "empty.txt")) == (0, "", "")  # no lines, none out


@pytest.mark.parametrize("manifest, why", [
    (b"", "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
    (b'{"format": "caf\xe9"}', "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 15: invalid "
                               "continuation byte"),
])
def test_a_tokenizer_folder_with_a_damaged_manifest_is_one_line(manifest: bytes, why: str, capsys,
                                                               tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(OLD / "tokenizer", tokenizer)
    (tokenizer / "manifest.json").write_bytes(manifest)
    (tmp_path / "in.txt").write_text("A dog runs.\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", "--work-dir", str(tmp_path / "work"), "--checkpoint", MODEL[1], "--tokenizer",
                 str(tokenizer), "--input", str(tmp_path / "in.txt")]) == 2
    assert capsys.readouterr().err == (f"error: {tokenizer / 'manifest.json'}: not a tokenizer manifest ({why}); "
                                       "re-run train_tokenizer\n")
    (tokenizer / "manifest.json").write_text(json.dumps(["a list"]), encoding="utf-8")
    assert main(["translate", "--work-dir", str(tmp_path / "work"), "--checkpoint", MODEL[1], "--tokenizer",
                 str(tokenizer), "--input", str(tmp_path / "in.txt")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tokenizer / 'manifest.json'}: format None, expected ")


def test_config_out_that_cannot_be_written_is_one_line(capsys, tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("kept", encoding="utf-8")
    for out, err in [
        (tmp_path / "folder", f"--out {tmp_path / 'folder'}: a folder; give a file path (e.g. "
                              f"{tmp_path / 'folder' / 'resolved.yaml'})"),
        (tmp_path / "file" / "x.yaml", f"--out {tmp_path / 'file' / 'x.yaml'}: the folder {tmp_path / 'file'} cannot "
                                       f"be used: {tmp_path / 'file'} is a file; give --out a file path in a writable "
                                       "folder"),
    ]:
        assert main(["config", "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"error: {err}\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file", "folder"]  # nothing written, nothing left
    assert (tmp_path / "file").read_text(encoding="utf-8") == "kept"


def test_a_data_file_that_is_a_folder_is_named_so(root: Path, tmp_path: Path) -> None:
    (root / "train.en").unlink()
    (root / "train.en").mkdir()
    with pytest.raises(DataError, match=rf"^data.train\[0\]: {root / 'train.en'} is a folder, not a file; name the "
                                        "file itself$"):
        prepare_corpus(data_cfg(root, TEXT), tmp_path / "work")
