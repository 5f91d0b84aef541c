"""The tokenizer on the real shared data: deterministic training, fixed special ids, lossless round trip, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import CleaningConfig, SpecialIds, TokenizerConfig, load_config
from pipeline.data import prepare_corpus
from pipeline.data.clean import Normalizer
from pipeline.tokenize import Tokenizer, TokenizerError, token_dtype, train_tokenizer, word_class, word_classes
from tests.conftest import TWO_TESTS

REPO = Path(__file__).resolve().parents[1]
SMALL = TokenizerConfig(vocab_size=4000)


def multi30k_corpus(shared_data: Path, work_dir: Path) -> Path:
    """The ``multi30k-cpu`` corpus (train Multi30k; dev Multi30k val) with two tests, test2016 and newstest2014.

    The one place the tokenizer and shard tests get their input from (tests/test_shards.py imports it).
    """
    return prepare_corpus(load_config("multi30k-cpu", [("data.root", str(shared_data)), TWO_TESTS]).data, work_dir)


@pytest.fixture(scope="module")
def corpus(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return multi30k_corpus(shared_data, tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def tokenizer_dir(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(corpus, SMALL, tmp_path_factory.mktemp("tok"))


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def normalised_lines(path: Path) -> list[str]:
    normalize = Normalizer(CleaningConfig(), Counter())
    return [normalize(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------------ reruns and determinism


@pytest.mark.integration
def test_training_is_deterministic_and_a_rerun_is_a_noop(corpus: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    again = train_tokenizer(corpus, SMALL, tmp_path)
    assert again.name == tokenizer_dir.name
    assert sorted(files(again)) == ["manifest.json", "spm.model", "spm.vocab"]
    assert files(again) == files(tokenizer_dir)
    mtimes = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    assert train_tokenizer(corpus, SMALL, tmp_path) == again
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == mtimes


@pytest.mark.integration
def test_sampling_is_seeded_also_across_processes(corpus: Path, tmp_path: Path) -> None:
    # 20k of the 58k training sentences: the sample, hence the model, is fixed by the seed alone (sentencepiece's
    # own sampler is not: it ignores its seed in a fresh process).
    sampled = SMALL.model_copy(update={"input_sentence_size": 20_000})
    a = train_tokenizer(corpus, sampled, tmp_path / "a")
    code = ("import sys; from pathlib import Path; from pipeline.config import TokenizerConfig; "
            "from pipeline.tokenize import train_tokenizer; "
            "cfg = TokenizerConfig.model_validate_json(sys.argv[1]); "
            "print(train_tokenizer(Path(sys.argv[2]), cfg, Path(sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, sampled.model_dump_json(), str(corpus), str(tmp_path / "b")],
                         capture_output=True, text=True, check=True, cwd=REPO)
    b = Path(out.stdout.strip())
    c = train_tokenizer(corpus, sampled.model_copy(update={"seed": 1}), tmp_path / "c")
    assert b.name == a.name and (a / "spm.model").read_bytes() == (b / "spm.model").read_bytes()
    assert (a / "spm.model").read_bytes() != (c / "spm.model").read_bytes()
    assert json.loads((a / "manifest.json").read_text())["train"]["used"] == 20_000


@pytest.mark.integration
def test_model_settings_name_the_folder_encode_settings_do_not(corpus: Path, tokenizer_dir: Path,
                                                              tmp_path: Path) -> None:
    encode_only = SMALL.model_copy(update={"num_workers": 1, "shard_rows": 10})
    assert train_tokenizer(corpus, encode_only, tokenizer_dir.parents[1]) == tokenizer_dir
    other = train_tokenizer(corpus, SMALL.model_copy(update={"vocab_size": 3000}), tmp_path)
    assert other.name != tokenizer_dir.name and Tokenizer(other).vocab_size == 3000


# --------------------------------------------------------------------------------------- special ids, dtype


@pytest.mark.integration
def test_special_ids_are_fixed_in_the_model(corpus: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert [tok.sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == 4000 and tok.dtype == np.uint16
    # Whatever the config says is what the model gets.
    special = SpecialIds(pad=3, unk=0, bos=1, eos=2)
    custom = Tokenizer(train_tokenizer(corpus, SMALL.model_copy(update={"special": special}), tmp_path))
    assert custom.special == special
    assert (custom.sp.pad_id(), custom.sp.unk_id(), custom.sp.bos_id(), custom.sp.eos_id()) == (3, 0, 1, 2)


def test_token_dtype_is_uint16_while_ids_fit() -> None:
    assert token_dtype(37_000) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.int32


# ------------------------------------------------------------------------------------------ encode / decode


@pytest.mark.integration
def test_round_trip_on_all_multi30k_and_newstest2014_both_languages(shared_data: Path, tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    names = [f"multi30k/{split}.{lang}" for split in ("train", "val", "test2016") for lang in ("en", "de")]
    names += ["wmt14-en-de/newstest2014.en", "wmt14-en-de/newstest2014.de"]
    byte_pieces = 0
    for name in names:
        lines = normalised_lines(shared_data / name)
        ids = tok.encode_batch(lines)
        assert tok.decode_batch(ids) == lines, name
        byte_pieces += sum(tok.sp.is_byte(i) for seq in ids for i in seq)
    # Lossless also where the training split (Multi30k) lacks a character: those fell back to bytes.
    assert byte_pieces > 0


@pytest.mark.integration
def test_decode_stops_at_eos_and_drops_pad_and_bos(tokenizer_dir: Path) -> None:
    tok = Tokenizer(tokenizer_dir)
    text = "Zwei Männer stehen am Herd und bereiten Essen zu."
    ids = tok.encode(text)
    hypothesis = [tok.bos_id, *ids, tok.eos_id, *tok.encode("garbage after eos"), tok.pad_id]
    assert tok.decode(hypothesis) == text
    padded = np.full((2, len(ids) + 3), tok.pad_id, dtype=np.int64)
    padded[0, : len(ids)] = ids
    padded[1, :3] = [tok.bos_id, ids[0], tok.eos_id]
    assert tok.decode_batch(padded) == [text, tok.decode(ids[:1])]


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.integration
def test_vocabulary_too_large_says_what_to_change(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as err:
        train_tokenizer(corpus, TokenizerConfig(vocab_size=200_000), tmp_path)
    msg = str(err.value)
    assert "tokenizer.vocab_size=200000 is too large" in msg and "train.parquet" in msg
    limit = int(msg.split("at most ")[1].split()[0])
    assert 4000 < limit < 200_000 and f"--set tokenizer.vocab_size={limit}" in msg
    assert not [p for p in (tmp_path / "tokenizer").iterdir()]  # nothing half-written left behind


@pytest.mark.integration
def test_vocabulary_too_small_says_what_to_change(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer.vocab_size=100 is too small.*at least \d+"):
        train_tokenizer(corpus, TokenizerConfig(vocab_size=100), tmp_path)


@pytest.mark.integration
def test_replaced_or_damaged_model_is_refused(corpus: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    other = train_tokenizer(corpus, SMALL.model_copy(update={"vocab_size": 3000}), tmp_path / "other")
    copy = shutil.copytree(tokenizer_dir, tmp_path / "copy")
    shutil.copyfile(other / "spm.model", copy / "spm.model")
    with pytest.raises(TokenizerError, match=rf"{copy / 'spm.model'}: sha256 .* differs .*re-run train_tokenizer"):
        Tokenizer(copy)
    (copy / "spm.model").unlink()
    with pytest.raises(TokenizerError, match=rf"{copy / 'spm.model'}: missing"):
        Tokenizer(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(TokenizerError, match="not a finished tokenizer folder"):
        Tokenizer(copy)


def test_word_classes_of_unknown_words() -> None:
    cases = {"refinancing": "<unk:low:ing>", "Ohio-based": "<unk:cap-:ed>", "8.5": "<unk:num>", "IBM": "<unk:caps>",
             "A": "<unk:cap>", "-LRB-": "<unk:sym->", ",": "<unk:sym>", "Quickly": "<unk:cap:ly>", "is": "<unk:low>",
             "mr": "<unk:low>", "": "<unk:sym>"}
    assert {w: word_class(w) for w in cases} == cases
    assert len(set(word_classes())) == len(word_classes()) and set(cases.values()) <= set(word_classes())
