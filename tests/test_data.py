"""The data stage on real shared files and on small files written here: sources, cleaning, bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig, load_config
from pipeline.data import DataError, corpus_fingerprint, prepare_corpus, read_manifest
from tests.conftest import TWO_TESTS

REPO = Path(__file__).resolve().parents[1]

EN = ["A dog runs.", "Two  cats sleep on a mat.", "The sun is bright today.", "A man reads a book.", "Hello"]
DE = ["Ein Hund rennt.", "Zwei Katzen schlafen auf einer Matte.", "Die Sonne scheint heute hell.",
      "Ein Mann liest ein Buch.", "Hallo"]


def data_cfg(root: Path, train: list[dict], dev: dict | None = None, test: list[dict] | None = None,
             **cleaning) -> DataConfig:
    dev = dev or {"name": "dev", "format": "text", "path": "dev"}
    return DataConfig.model_validate({"root": str(root), "train": train, "dev": dev, "test": test or [],
                                      "cleaning": cleaning})


def write_pair(root: Path, prefix: str, en: list[str], de: list[str], gz: bool = False) -> None:
    for lang, lines in (("en", en), ("de", de)):
        path = root / f"{prefix}.{lang}" if not gz else root / f"{prefix}.{lang}.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(line + "\n" for line in lines).encode()
        path.write_bytes(gzip.compress(data, mtime=0) if gz else data)


def rows(corpus: Path, split: str) -> list[dict]:
    return pq.read_table(corpus / f"{split}.parquet").to_pylist()


def pairs(corpus: Path, split: str = "train") -> list[tuple[str, str]]:
    return [(r["src"], r["tgt"]) for r in rows(corpus, split)]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "data"
    write_pair(r, "dev", ["Dev sentence one.", "Dev two."], ["Dev Satz eins.", "Dev zwei."])
    return r


def assert_nothing_written(work: Path) -> None:
    corpus = work / "corpus"
    assert not corpus.exists() or not any(corpus.iterdir()), list(corpus.iterdir())


# ------------------------------------------------------------------------------------------ real shared data


@pytest.mark.integration
def test_multi30k_default_config_on_shared_data(shared_data: Path, tmp_path: Path) -> None:
    assert [t.name for t in load_config("multi30k-cpu").data.test] == ["test2016"]  # in domain only (issue 53)
    cfg = load_config("multi30k-cpu", [("data.root", str(shared_data)), TWO_TESTS])
    corpus = prepare_corpus(cfg.data, tmp_path)
    m = read_manifest(corpus)
    train = m["splits"]["train"]
    assert train["cleaning"]["read"] == 29_000 and train["origins"]["multi30k"]["read"] == 29_000
    assert train["rows"] == train["cleaning"]["kept"] == 29_000 - sum(train["cleaning"]["removed"].values())
    assert [r["rule"] for r in train["cleaning"]["rules"]] == ["empty", "too_short", "too_long", "ratio",
                                                                "contaminated", "duplicate"]
    assert {k: s["rows"] for k, s in m["splits"].items() if k != "train"} == {
        "dev": 1014, "test.test2016": 1000, "test.newstest2014": 3003}
    # Eval sets keep the reference exactly as distributed, for scoring.
    raw = (shared_data / "wmt14-en-de" / "newstest2014.de").read_text(encoding="utf-8").splitlines()
    assert [r["tgt_raw"] for r in rows(corpus, "test.newstest2014")] == raw
    assert m["inputs"]["train"][0]["files"]["multi30k/train.en"] == (
        "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6")
    # Multi30k's train.de has leading/trailing and double spaces (its README): they are normalised away.
    assert all(s == " ".join(s.split()) and t == " ".join(t.split()) for s, t in pairs(corpus))
    assert train["cleaning"]["normalized"]["whitespace_changed"] > 40


@pytest.mark.integration
def test_multi30k_en_fr_config_reads_the_french_side(shared_data: Path, tmp_path: Path) -> None:
    """multi30k-en-fr-cpu's data stage: the 29,000 English captions of Multi30k with their French translations
    (train.fr, ../shared/data/multi30k/README.md), dev val and test test2016, no newstest."""
    cfg = load_config("multi30k-en-fr-cpu", data_root=shared_data)
    corpus = prepare_corpus(cfg.data, tmp_path)
    m = read_manifest(corpus)
    assert (m["src_lang"], m["tgt_lang"]) == ("en", "fr")
    train = m["splits"]["train"]
    assert train["cleaning"]["read"] == 29_000 and train["origins"]["multi30k"]["read"] == 29_000
    assert {k: s["rows"] for k, s in m["splits"].items() if k != "train"} == {"dev": 1014, "test.test2016": 1000}
    assert m["inputs"]["train"][0]["files"]["multi30k/train.fr"] == (
        "5925a3c18f1587b6b54b87743106e6e8ab93618edb6f65d19eac0621f853a10d")
    assert pairs(corpus)[0] == ("Two young, White males are outside near many bushes.",
                                "Deux jeunes hommes blancs sont dehors près de buissons.")
    raw = (shared_data / "multi30k" / "test2016.fr").read_text(encoding="utf-8").splitlines()
    assert [r["tgt_raw"] for r in rows(corpus, "test.test2016")] == raw


@pytest.mark.integration
def test_sgm_extraction_equals_the_plain_text_test_set(shared_data: Path, tmp_path: Path) -> None:
    sgm = {"name": "nt14", "format": "sgm", "files": {"en": "wmt14-en-de/sgm/newstest2014-deen-src.en.sgm",
                                                       "de": "wmt14-en-de/sgm/newstest2014-deen-ref.de.sgm"}}
    cfg = data_cfg(shared_data, [{"name": "m", "format": "text", "path": "multi30k/test2016"}], dev=sgm)
    got = rows(prepare_corpus(cfg, tmp_path), "dev")
    en = (shared_data / "wmt14-en-de/newstest2014.en").read_text(encoding="utf-8").splitlines()
    de = (shared_data / "wmt14-en-de/newstest2014.de").read_text(encoding="utf-8").splitlines()
    assert [r["src"] for r in got] == en and [r["tgt_raw"] for r in got] == de and len(got) == 3003


@pytest.mark.integration
def test_concatenated_training_sources_are_tagged_and_decontaminated(shared_data: Path, tmp_path: Path) -> None:
    train = [{"name": "multi30k", "format": "text", "path": "multi30k/train"},
             {"name": "nt2012", "format": "text", "path": "wmt-en-de-older-newstest/newstest2012"},
             {"name": "leak", "format": "text", "path": "multi30k/test2016"}]  # a test set fed in as training data
    cfg = data_cfg(shared_data, train, dev={"name": "nt13", "format": "text", "path": "wmt14-en-de/newstest2013"},
                   test=[{"name": "test2016", "format": "text", "path": "multi30k/test2016"}], max_ratio=9.0)
    corpus = prepare_corpus(cfg, tmp_path)
    train_rows = rows(corpus, "train")
    origins = read_manifest(corpus)["splits"]["train"]["origins"]
    assert origins["nt2012"]["read"] == 3003 and origins["leak"] == {"read": 1000, "kept": 0}
    assert read_manifest(corpus)["splits"]["train"]["cleaning"]["removed"]["contaminated"] >= 1000
    assert [r["origin"] for r in train_rows][:1] == ["multi30k"] and {r["origin"] for r in train_rows} == {
        "multi30k", "nt2012"}
    first_2012 = next(r for r in train_rows if r["origin"] == "nt2012")
    assert first_2012["line"] == 1


# ------------------------------------------------------------------------------------------- source formats


def test_text_gz_and_files_mapping(root: Path, tmp_path: Path) -> None:
    write_pair(root, "gz/train", EN, DE, gz=True)
    write_pair(root, "plain/x", EN, DE)
    a = prepare_corpus(data_cfg(root, [{"name": "g", "format": "text", "path": "gz/train"}]), tmp_path / "a")
    b = prepare_corpus(data_cfg(root, [{"name": "g", "format": "text",
                                        "files": {"en": "plain/x.en", "de": "plain/x.de"}}]), tmp_path / "b")
    assert pairs(a) == pairs(b) == [(" ".join(e.split()), d) for e, d in zip(EN, DE)]


def test_progress_counts_training_pairs_ahead_or_else_sources(root: Path, tmp_path: Path) -> None:
    """The data stage tells its progress as (pairs read, pairs in the training sources), counted ahead in text
    (gzipped too, a last line without its newline too), TSV and Parquet sources; when a source cannot be counted
    ahead (an Arrow stream) it tells (sources read, sources) instead. A finished corpus reads nothing."""
    write_pair(root, "gz/train", EN, DE, gz=True)
    (root / "nonl.en").write_text("A cat.\nA hat.", encoding="utf-8")
    (root / "nonl.de").write_text("Eine Katze.\nEin Hut.", encoding="utf-8")
    (root / "c.tsv").write_text("".join(f"{d}\t{e}\n" for e, d in zip(EN, DE)), encoding="utf-8")
    pq.write_table(pa.table({"en": EN, "de": DE}), root / "p.parquet")
    table = pa.table({"en": EN, "de": DE})
    with pa.ipc.new_stream(root / "s.arrow", table.schema) as w:
        w.write_table(table)
    counted = [{"name": "g", "format": "text", "path": "gz/train"}, {"name": "n", "format": "text", "path": "nonl"},
               {"name": "t", "format": "tsv", "path": "c.tsv", "columns": ["de", "en"]},
               {"name": "p", "format": "parquet", "path": "p.parquet"}]
    heard: list[tuple[int, int]] = []
    cfg = data_cfg(root, counted)
    corpus = prepare_corpus(cfg, tmp_path / "a", progress=lambda done, total: heard.append((done, total)))
    assert heard == [(5, 17), (7, 17), (12, 17), (17, 17)]
    heard.clear()
    assert prepare_corpus(cfg, tmp_path / "a", progress=lambda done, total: heard.append((done, total))) == corpus
    assert heard == []
    uncounted = [counted[0], {"name": "s", "format": "arrow", "path": "s.arrow"}]
    prepare_corpus(data_cfg(root, uncounted), tmp_path / "b", progress=lambda done, total: heard.append((done, total)))
    assert heard == [(1, 2), (2, 2)]


def test_tsv_columns_pick_the_languages(root: Path, tmp_path: Path) -> None:
    (root / "c.tsv").write_text("".join(f"{d}\t{e}\n" for e, d in zip(EN, DE)), encoding="utf-8")
    corpus = prepare_corpus(data_cfg(root, [{"name": "t", "format": "tsv", "path": "c.tsv", "columns": ["de", "en"]}]),
                            tmp_path)
    assert pairs(corpus)[0] == ("A dog runs.", "Ein Hund rennt.")


def test_direction_de_en_swaps_sides(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE)
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}]).model_copy(
        update={"src_lang": "de", "tgt_lang": "en"})
    assert pairs(prepare_corpus(cfg, tmp_path))[0] == ("Ein Hund rennt.", "A dog runs.")


def test_parquet_by_language_columns_struct_and_fields(root: Path, tmp_path: Path) -> None:
    (root / "pq").mkdir()
    pq.write_table(pa.table({"en": EN[:2], "de": DE[:2]}), root / "pq" / "part-0.parquet")
    pq.write_table(pa.table({"en": EN[2:], "de": DE[2:]}), root / "pq" / "part-1.parquet")
    pq.write_table(pa.table({"translation": [{"de": d, "en": e} for e, d in zip(EN, DE)]}), root / "hub.parquet")
    pq.write_table(pa.table({"source": EN, "target": DE}), root / "named.parquet")
    expected = [(" ".join(e.split()), d) for e, d in zip(EN, DE)]
    for i, spec in enumerate([{"path": "pq"}, {"path": "hub.parquet"},
                              {"path": "named.parquet", "fields": {"en": "source", "de": "target"}}]):
        corpus = prepare_corpus(data_cfg(root, [{"name": "p", "format": "parquet", **spec}]), tmp_path / str(i))
        assert pairs(corpus) == expected, spec
    assert [r["line"] for r in rows(corpus, "train")] == [1, 2, 3, 4, 5]


def test_arrow_ipc_file_and_stream(root: Path, tmp_path: Path) -> None:
    table = pa.table({"en": EN, "de": DE})
    with pa.ipc.new_file(root / "f.arrow", table.schema) as w:
        w.write_table(table)
    with pa.ipc.new_stream(root / "s.arrow", table.schema) as w:  # the format of a datasets cache shard
        w.write_table(table)
    got = [pairs(prepare_corpus(data_cfg(root, [{"name": "a", "format": "arrow", "path": f}]), tmp_path / f))
           for f in ("f.arrow", "s.arrow")]
    assert got[0] == got[1] and len(got[0]) == 5


def test_datasets_save_to_disk_folder(root: Path, tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"translation": [{"en": e, "de": d}
                                                                                   for e, d in zip(EN, DE)]})})
    dd.save_to_disk(str(root / "dd"))
    corpus = prepare_corpus(data_cfg(root, [{"name": "h", "format": "hf_disk", "path": "dd", "split": "train"}]),
                            tmp_path)
    assert pairs(corpus)[2] == ("The sun is bright today.", "Die Sonne scheint heute hell.")
    assert read_manifest(corpus)["inputs"]["train"][0]["fingerprint"]
    with pytest.raises(DataError, match=r"has splits \['train'\]; set data.train\[0\].split"):
        prepare_corpus(data_cfg(root, [{"name": "h", "format": "hf_disk", "path": "dd", "split": "nope"}]), tmp_path)


def _run_python(code: str, env: dict[str, str], timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


HUB_PROBE = """
    import time
    from pathlib import Path
    from pipeline.config import DataConfig
    from pipeline.data import DataError, prepare_corpus
    cfg = DataConfig.model_validate({{"root": {root!r}, "train": [{spec}],
                                     "dev": {{"name": "dev", "format": "text", "path": "dev"}}}})
    t = time.perf_counter()
    try:
        out = prepare_corpus(cfg, Path({work!r}))
        print("OK", out)
    except DataError as e:
        print("ERR", round(time.perf_counter() - t, 1), e)
"""


def _hub_layout_repo(folder: Path) -> Path:
    """A dataset repository laid out as hub repo wmt/wmt14 is (config de-en, Parquet train split), in ``folder``."""
    repo = folder / "wmt14"
    (repo / "de-en").mkdir(parents=True)
    pq.write_table(pa.table({"translation": [{"de": d, "en": e} for e, d in zip(EN, DE)]}),
                   repo / "de-en" / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text(textwrap.dedent("""\
        ---
        configs:
        - config_name: de-en
          data_files:
          - split: train
            path: de-en/train-*
        ---
        """))
    return repo


@pytest.mark.integration
def test_hub_loader_reads_a_hub_dataset_from_the_cache(root: Path, tmp_path: Path) -> None:
    """The real `datasets.load_dataset` code path for hub id wmt/wmt14, offline, served from the datasets cache
    (filled here by loading a hub-layout copy, then filed under the hub id's cache name, as a download would)."""
    repo, hf = _hub_layout_repo(tmp_path), tmp_path / "hf"
    fill = f"import datasets; datasets.load_dataset({str(repo)!r}, 'de-en', split='train')"
    assert _run_python(fill, {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf)}).returncode == 0
    (hf / "datasets" / "wmt14").rename(hf / "datasets" / "wmt___wmt14")
    spec = {"name": "wmt14", "format": "hub", "dataset": "wmt/wmt14", "subset": "de-en", "split": "train"}
    res = _run_python(HUB_PROBE.format(root=str(root), spec=spec, work=str(tmp_path / "w")),
                      {"HF_HUB_OFFLINE": "1", "HF_HOME": str(hf)})
    assert res.stdout.startswith("OK"), res.stdout + res.stderr
    corpus = Path(res.stdout.split()[1])
    assert pairs(corpus)[0] == ("A dog runs.", "Ein Hund rennt.")
    assert read_manifest(corpus)["inputs"]["train"][0]["location"]["dataset"] == "wmt/wmt14"


def test_a_hub_source_naming_a_local_path_is_refused(tmp_path: Path) -> None:
    repo = _hub_layout_repo(tmp_path)
    for dataset in (str(repo), "../wmt14", "wmt14/train.py"):
        spec = {"name": "h", "format": "hub", "dataset": dataset, "split": "train"}
        with pytest.raises(ValueError, match=rf"dataset {re.escape(repr(dataset))} is not a Hugging Face hub id"):
            DataConfig.model_validate({"train": [spec], "dev": spec})


@pytest.mark.parametrize("offline", ["1", ""])
@pytest.mark.integration
def test_a_hub_id_that_is_also_a_local_folder_is_not_read(root: Path, tmp_path: Path, offline: str) -> None:
    """`load_dataset("wmt14")` would read ./wmt14 from the working directory, outside data.root: refused before
    anything is read, whether or not the hub is reachable."""
    _hub_layout_repo(tmp_path)
    spec = {"name": "wmt14", "format": "hub", "dataset": "wmt14", "subset": "de-en", "split": "train"}
    env = {"HF_HUB_OFFLINE": offline, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    res = _run_python(HUB_PROBE.format(root=str(root), spec=spec, work=str(tmp_path / "w")), env, cwd=tmp_path)
    assert res.stdout.startswith("ERR"), res.stdout + res.stderr
    assert (f"data.train[0].dataset = 'wmt14' is also a path from the working directory ({tmp_path / 'wmt14'}): "
            "the datasets library would read it, outside data.root, instead of the hub") in res.stdout
    assert_nothing_written(tmp_path / "w")
    assert not (tmp_path / "hf" / "datasets").exists()  # nothing was loaded


@pytest.mark.parametrize("offline", ["1", ""])
@pytest.mark.integration
def test_hub_unreachable_fails_fast_naming_the_local_alternative(root: Path, tmp_path: Path, offline: str) -> None:
    spec = {"name": "wmt14", "format": "hub", "dataset": "wmt/wmt14", "subset": "de-en", "split": "train"}
    # An endpoint nobody listens on stands for "no internet" wherever the test runs.
    env = {"HF_HUB_OFFLINE": offline, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    t = time.perf_counter()
    res = _run_python(HUB_PROBE.format(root=str(root), spec=spec, work=str(tmp_path / "w")), env)
    assert time.perf_counter() - t < 60
    assert res.stdout.startswith("ERR"), res.stdout + res.stderr
    seconds = float(res.stdout.split()[1])
    assert seconds < 10, res.stdout
    assert "format: text" in res.stdout and "wmt/wmt14" in res.stdout
    assert ("HF_HUB_OFFLINE is set" in res.stdout) == bool(offline)
    assert_nothing_written(tmp_path / "w")


# ---------------------------------------------------------------------------------------------- cleaning


def test_each_cleaning_rule_is_applied_and_counted(root: Path, tmp_path: Path) -> None:
    nfd = unicodedata.normalize("NFD", "Schöne Grüße")
    train_en = ["Good morning", "  spaced   out  ", "", "one two three four five six", "yes", "Dev two.",
                "Good morning", "Fine words", "\u00e9t\u00e9"]
    train_de = [nfd, "weit weg", "leer", "eins", "ja ja ja ja ja", "Dev zwei.", nfd, "Gute Worte", "Sommer"]
    write_pair(root, "train", train_en, train_de)
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}], max_words=5, max_ratio=3.0)
    corpus = prepare_corpus(cfg, tmp_path)
    report = read_manifest(corpus)["splits"]["train"]["cleaning"]
    assert report["removed"] == {"empty": 1, "too_short": 0, "too_long": 1, "ratio": 1, "contaminated": 1,
                                 "duplicate": 1}
    assert [r["remaining"] for r in report["rules"]] == [8, 8, 7, 6, 5, 4]
    assert report["normalized"] == {"nfc_changed": 2, "whitespace_changed": 1}
    assert pairs(corpus) == [("Good morning", "Schöne Grüße"), ("spaced out", "weit weg"),
                             ("Fine words", "Gute Worte"), ("été", "Sommer")]
    assert [r["line"] for r in rows(corpus, "train")] == [1, 2, 8, 9]


def test_batch_normalisation_equals_one_text_at_a_time() -> None:
    """The data stage normalises a batch at once (an ASCII check, one regular expression over the batch); it gives
    the texts and counts of str.split() and unicodedata one text at a time, for every space Python knows."""
    import sys
    from collections import Counter

    from pipeline.config import CleaningConfig
    from pipeline.data.clean import _OTHER_SPACES, Normalizer

    assert _OTHER_SPACES == "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace() and c != 0x20)
    below = [chr(c) for c in range(0x300)]  # what the NFC shortcut takes as normalised whatever surrounds it
    assert all(unicodedata.combining(c) == 0 and unicodedata.is_normalized("NFC", x + c) for c in below for x in below)
    nfd = unicodedata.normalize("NFD", "Grüße")
    texts = ["plain ascii", "", " lead", "trail ", "two  spaces", "Grüße", nfd, f"{nfd}  x", "a\nb", "x\u200by", "",
             *(f"a{c}b" for c in _OTHER_SPACES), *(f"{c}" for c in _OTHER_SPACES), "\u212b ok", "ok \u00a0"]
    for cfg in (CleaningConfig(), CleaningConfig(nfc=False), CleaningConfig(normalize_whitespace=False)):
        one, batch = Counter(), Counter()
        expected = [Normalizer(cfg, one)(t) for t in texts]
        assert Normalizer(cfg, batch).array(pa.array(texts)).to_pylist() == expected
        assert batch == one and one["nfc_changed"] + one["whitespace_changed"] > 0
        assert Normalizer(cfg, Counter()).array(pa.array(texts).slice(3, 5)).to_pylist() == expected[3:8]


def test_text_read_a_block_at_a_time_keeps_lines_ends_and_errors(root: Path, tmp_path: Path, monkeypatch) -> None:
    """Text sources are decoded and split a block of bytes at a time: with blocks of a few bytes, a line that
    spans blocks, a character cut by a block's end, CRLF ends, a byte order mark and a last line without its
    newline read as whole lines, and a bad byte or a missing line is still placed exactly."""
    from pipeline.data.sources import lines

    monkeypatch.setattr(lines, "_BLOCK_BYTES", 7)
    en = ["A dog runs.", "Grüße aus Köln, ein längerer Satz über zwei Blöcke.", "x y", "Ünïcödé ende"]
    de = ["Ein Hund rennt.", "Greetings from Cologne.", "u v", "last one"]
    (root / "b.en").write_bytes(BOM + "\r\n".join(en).encode() + b"\r\n")
    (root / "b.de").write_bytes("\n".join(de).encode())  # no newline after the last line
    corpus = prepare_corpus(data_cfg(root, [{"name": "b", "format": "text", "path": "b"}], max_ratio=9.0),
                            tmp_path / "a")
    assert pairs(corpus) == list(zip(en, de)) and [r["line"] for r in rows(corpus, "train")] == [1, 2, 3, 4]
    (root / "b.de").write_bytes("\n".join(de[:3]).encode() + b"\n\xfcber\n")
    with pytest.raises(DataError, match=r"b\.de: line 4: invalid UTF-8 at byte offset 44 \(byte 0xfc\)"):
        prepare_corpus(data_cfg(root, [{"name": "b", "format": "text", "path": "b"}]), tmp_path / "b")
    (root / "b.de").write_bytes("\n".join(de[:2]).encode())
    with pytest.raises(DataError, match=r"b\.en has 4 lines but .*b\.de has 2: .*first unmatched line 3"):
        prepare_corpus(data_cfg(root, [{"name": "b", "format": "text", "path": "b"}]), tmp_path / "c")


def test_dedup_keeps_each_first_copy_across_batches_in_8_bytes_a_pair(root: Path, tmp_path: Path) -> None:
    """Exact dedup batch by batch (data.write_batch_rows pairs) keeps the same pairs as one pass over a Python set,
    within a batch and across batches, and holds each kept pair's key in 8 bytes."""
    import numpy as np

    from pipeline.data.clean import SeenKeys

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 400, 3000).astype(np.uint64)  # many repeats, within and across batches
    seen, expected, got = set(), [], []
    for k in keys.tolist():
        expected.append(k not in seen)
        seen.add(k)
    keyset = SeenKeys()
    for start in range(0, len(keys), 64):
        got += keyset.add_batch(keys[start:start + 64]).tolist()
    assert got == expected and len(keyset) == len(seen)
    assert sum(r.nbytes for r in keyset.runs) == 8 * len(seen) and len(keyset.runs) <= 6  # log2(47 batches) + 1
    assert all((np.diff(r.astype(np.int64)) > 0).all() for r in keyset.runs)  # each run sorted, no repeats

    en = [f"pair {i % 7} here" for i in range(40)]  # 7 distinct pairs, 33 later copies
    write_pair(root, "train", en, [f"Paar {i % 7} hier" for i in range(40)])
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}])
    corpus = prepare_corpus(cfg.model_copy(update={"write_batch_rows": 3}), tmp_path)
    assert read_manifest(corpus)["splits"]["train"]["cleaning"]["removed"]["duplicate"] == 33
    assert [r["line"] for r in rows(corpus, "train")] == list(range(1, 8))


@pytest.mark.parametrize("mode, removed", [("off", 0), ("pair", 1), ("source", 2), ("either", 3)])
def test_decontamination_modes(root: Path, tmp_path: Path, mode: str, removed: int) -> None:
    # dev is ("Dev sentence one." -> "Dev Satz eins."), ("Dev two." -> "Dev zwei.")
    write_pair(root, "train", ["Dev two.", "Dev sentence one.", "Other.", "Clean."],
               ["Dev zwei.", "Anders.", "Dev Satz eins.", "Sauber."])
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}], decontaminate=mode, max_ratio=9.0)
    report = read_manifest(prepare_corpus(cfg, tmp_path))["splits"]["train"]["cleaning"]
    assert report["removed"]["contaminated"] == removed


def test_eval_sets_are_never_filtered(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE)
    write_pair(root, "test", ["ok", "a b c d e f g h", "ok"], ["gut", "x", "gut"])
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}],
                   test=[{"name": "t1", "format": "text", "path": "test"}], max_words=3)
    assert len(rows(prepare_corpus(cfg, tmp_path), "test.t1")) == 3


# ------------------------------------------------------------------------------------ reruns and determinism


def test_same_input_gives_byte_identical_output_and_rerun_is_a_noop(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN * 3, DE * 3)
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}],
                   test=[{"name": "t1", "format": "text", "path": "dev"}])
    a, b = prepare_corpus(cfg, tmp_path / "a"), prepare_corpus(cfg, tmp_path / "b")
    assert a.name == b.name
    files = sorted(p.name for p in a.iterdir())
    assert files == ["dev.parquet", "manifest.json", "test.t1.parquet", "train.parquet"]
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    mtimes = {f: (a / f).stat().st_mtime_ns for f in files}
    assert prepare_corpus(cfg, tmp_path / "a") == a
    assert {f: (a / f).stat().st_mtime_ns for f in files} == mtimes
    # Changing an input's content makes a new corpus, leaving the old one in place.
    write_pair(root, "train", EN * 2, DE * 2)
    c = prepare_corpus(cfg, tmp_path / "a")
    assert c != a and (a / "manifest.json").is_file()


def test_a_killed_runs_partial_corpus_is_removed_and_the_log_says_why_it_starts_over(root: Path, tmp_path: Path,
                                                                                     caplog) -> None:
    """What a run killed mid-write (kill -9) leaves, a temporary folder named for its process, goes on the next
    run, which says it starts again and why (a Parquet file cut short cannot be continued)."""
    import logging
    import socket

    write_pair(root, "train", EN * 3, DE * 3)
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a process that has exited: the writer that was killed
    name = corpus_fingerprint(cfg)[:16]
    partial = tmp_path / "corpus" / f".{name}.tmp-{socket.gethostname()}-{dead}.x1y2"
    partial.mkdir(parents=True)
    (partial / "train.parquet").write_bytes(b"PAR1 cut short")
    with caplog.at_level(logging.INFO):
        corpus = prepare_corpus(cfg, tmp_path)
    assert not partial.exists() and corpus.name == name and (corpus / "manifest.json").is_file()
    assert any(f"corpus {name}: an interrupted run's partial output was removed; this stage starts again from the "
               "beginning: it writes each split as one Parquet file" in m for m in caplog.messages), caplog.messages


def test_manifest_hashes_match_the_files(root: Path, tmp_path: Path) -> None:
    import hashlib

    write_pair(root, "train", EN, DE)
    corpus = prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}]), tmp_path)
    m = json.loads((corpus / "manifest.json").read_text())
    for split in m["splits"].values():
        assert hashlib.sha256((corpus / split["file"]).read_bytes()).hexdigest() == split["sha256"]
    assert m["inputs"]["train"][0]["files"]["train.en"] == hashlib.sha256((root / "train.en").read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ globbed sources


def copy_multi30k(shared_data: Path, root: Path, prefix: str, start: int, n: int = 200) -> None:
    """Lines [start, start + n) of the real Multi30k training pair, written as ``root/<prefix>.en`` + ``.de``."""
    en, de = ((shared_data / "multi30k" / f"train.{lang}").read_text(encoding="utf-8").splitlines()[start:start + n]
              for lang in ("en", "de"))
    write_pair(root, prefix, en, de)


@pytest.mark.integration
def test_text_glob_reads_every_prefix_in_sorted_order(shared_data: Path, root: Path, tmp_path: Path) -> None:
    copy_multi30k(shared_data, root, "m30k/train-extra", 200)  # written first: order must come from the names
    copy_multi30k(shared_data, root, "m30k/train", 0)
    cfg = data_cfg(root, [{"name": "m", "format": "text", "path": "m30k/train*"}])
    corpus = prepare_corpus(cfg, tmp_path / "glob")
    two_sources = data_cfg(root, [{"name": "m", "format": "text", "path": "m30k/train"},
                                  {"name": "m", "format": "text", "path": "m30k/train-extra"}])
    assert pairs(corpus) == pairs(prepare_corpus(two_sources, tmp_path / "explicit"))
    m = read_manifest(corpus)
    assert m["splits"]["train"]["cleaning"]["read"] == 400
    lines = [r["line"] for r in rows(corpus, "train")]
    assert lines == sorted(set(lines)) and 200 < lines[-1] <= 400  # one source: lines count on across its files
    entry = m["inputs"]["train"][0]
    assert entry["location"]["pattern"] == "m30k/train*"
    assert set(entry["files"]) == {"m30k/train.en", "m30k/train.de", "m30k/train-extra.en", "m30k/train-extra.de"}
    fingerprint = corpus_fingerprint(cfg)
    assert corpus_fingerprint(cfg) == fingerprint and prepare_corpus(cfg, tmp_path / "glob") == corpus

    copy_multi30k(shared_data, root, "m30k/train-more", 400)
    assert corpus_fingerprint(cfg) != fingerprint
    grown = prepare_corpus(cfg, tmp_path / "glob")
    assert grown != corpus and read_manifest(grown)["splits"]["train"]["cleaning"]["read"] == 600
    assert pairs(grown)[:len(pairs(corpus))] == pairs(corpus) and len(pairs(grown)) > len(pairs(corpus))


def test_tsv_glob_reads_every_matching_file_in_path_order(root: Path, tmp_path: Path) -> None:
    (root / "weekly").mkdir()
    (root / "weekly" / "2024-02.tsv").write_text("".join(f"{e}\t{d}\n" for e, d in zip(EN[2:], DE[2:])))
    (root / "weekly" / "2024-01.tsv").write_text("".join(f"{e}\t{d}\n" for e, d in zip(EN[:2], DE[:2])))
    (root / "weekly" / "notes.txt").write_text("not a match\n")
    corpus = prepare_corpus(data_cfg(root, [{"name": "w", "format": "tsv", "path": "weekly/*.tsv",
                                             "columns": ["en", "de"]}]), tmp_path)
    assert pairs(corpus) == [(" ".join(e.split()), d) for e, d in zip(EN, DE)]
    assert set(read_manifest(corpus)["inputs"]["train"][0]["files"]) == {"weekly/2024-01.tsv", "weekly/2024-02.tsv"}


def test_glob_that_matches_nothing_or_an_unpaired_file(root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data\.train\[0\]\.path = 'm30k/train\*' matches no file under data\.root "
                                        r".*looked for m30k/train\*\.en and m30k/train\*\.de"):
        prepare_corpus(data_cfg(root, [{"name": "m", "format": "text", "path": "m30k/train*"}]), tmp_path)
    with pytest.raises(DataError, match=r"data\.train\[0\]\.path = 'weekly/\*\.tsv' matches no file"):
        prepare_corpus(data_cfg(root, [{"name": "w", "format": "tsv", "path": "weekly/*.tsv",
                                        "columns": ["en", "de"]}]), tmp_path)
    write_pair(root, "m30k/train", EN, DE)
    (root / "m30k" / "train-extra.de").write_text("Hallo\n")
    with pytest.raises(DataError, match=r"'m30k/train\*' matches m30k/train-extra\.de but its partner "
                                        r"m30k/train-extra\.en \(or \.gz\) is missing"):
        prepare_corpus(data_cfg(root, [{"name": "m", "format": "text", "path": "m30k/train*"}]), tmp_path)
    assert_nothing_written(tmp_path)


def test_glob_match_that_links_outside_the_data_root_is_refused(root: Path, tmp_path: Path) -> None:
    write_pair(tmp_path, "outside", EN, DE)
    write_pair(root, "m30k/train", EN, DE)
    for lang in ("en", "de"):
        (root / "m30k" / f"train-link.{lang}").symlink_to(tmp_path / f"outside.{lang}")
    with pytest.raises(DataError, match=r"data\.train\[0\]\.path \(pattern 'm30k/train\*'\) = 'm30k/train-link\.en' "
                                        r"resolves to .*outside\.en, outside data\.root"):
        prepare_corpus(data_cfg(root, [{"name": "m", "format": "text", "path": "m30k/train*"}]), tmp_path / "w")
    (root / "weekly").mkdir()
    (root / "weekly" / "a.tsv").symlink_to(tmp_path / "outside.en")
    with pytest.raises(DataError, match=r"'weekly/\*\.tsv'\) = 'weekly/a\.tsv' resolves to .*outside data\.root"):
        prepare_corpus(data_cfg(root, [{"name": "w", "format": "tsv", "path": "weekly/*.tsv",
                                        "columns": ["en", "de"]}]), tmp_path / "w")
    assert_nothing_written(tmp_path / "w")


# ---------------------------------------------------------------------------------------------- bad input


def test_unequal_line_counts(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE[:3])
    with pytest.raises(DataError) as err:
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}]), tmp_path)
    msg = str(err.value)
    assert "train.en has 5 lines but" in msg and "train.de has 3" in msg and "line 4" in msg
    assert_nothing_written(tmp_path)


def test_invalid_utf8_names_line_and_byte_offset(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE)
    (root / "train.de").write_bytes(b"Ein Hund.\nZwei Katzen.\nGr\xfc\xdfe\n" + b"x\n" * 2)
    with pytest.raises(DataError) as err:
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}]), tmp_path)
    msg = str(err.value)
    assert "train.de: line 3: invalid UTF-8 at byte offset 25 (byte 0xfc)" in msg and "iconv" in msg
    assert_nothing_written(tmp_path)


BOM = b"\xef\xbb\xbf"


def test_a_byte_order_mark_opening_a_file_is_dropped_and_counted(root: Path, tmp_path: Path) -> None:
    """Editors on Windows open UTF-8 files with a byte order mark; it is no part of the first sentence, in every
    line-based format, and the manifest names the files it was dropped from."""
    for name, data in [("t.en", "\n".join(EN)), ("t.de", "\n".join(DE)), ("c.tsv", f"{EN[0]}\t{DE[0]}\n"),
                       ("s.en.sgm", SGM), ("s.de.sgm", SGM.replace("A dog runs.", "Ein Hund rennt.")),
                       ("t.mrg", "(S (NP (DT A) (NN dog)) (VP (VBZ runs)))\n")]:
        (root / name).write_bytes(BOM + data.encode())
    write_pair(root, "plain", EN[1:2], DE[1:2])
    train = [{"name": "t", "format": "text", "path": "t"}, {"name": "p", "format": "text", "path": "plain"},
             {"name": "c", "format": "tsv", "path": "c.tsv", "columns": ["en", "de"]}]
    sgm = {"name": "s", "format": "sgm", "files": {"en": "s.en.sgm", "de": "s.de.sgm"}}
    corpus = prepare_corpus(data_cfg(root, train, test=[sgm], decontaminate="off", dedup=False), tmp_path)
    got = pairs(corpus)
    assert got[0] == (EN[0], DE[0]) and got[-1] == (EN[0], DE[0]) and not any("\ufeff" in s + t for s, t in got)
    assert pairs(corpus, "test.s") == [(EN[0], DE[0])]
    inputs = read_manifest(corpus)["inputs"]
    assert [e["bom_stripped"] for e in inputs["train"]] == [["t.en", "t.de"], [], ["c.tsv"]]
    assert inputs["test"][0]["bom_stripped"] == ["s.en.sgm", "s.de.sgm"]
    assert corpus_fingerprint(data_cfg(root, train, test=[sgm], decontaminate="off", dedup=False)) == \
        read_manifest(corpus)["fingerprint"]  # what is learnt while reading is no part of the cache key

    ptb = {"name": "t", "format": "ptb", "path": "t.mrg"}
    tree = prepare_corpus(DataConfig.model_validate({
        "root": str(root), "src_lang": "en", "tgt_lang": "tree", "train": [ptb], "dev": {**ptb, "name": "d"},
        "cleaning": {"max_ratio": 100, "decontaminate": "off"}}), tmp_path / "ptb")
    assert pairs(tree)[0][0] == "A dog runs" and read_manifest(tree)["inputs"]["train"][0]["bom_stripped"] == ["t.mrg"]


def test_a_bad_byte_after_a_byte_order_mark_is_placed_in_the_file(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE)
    (root / "train.de").write_bytes(BOM + b"Gr\xfc\xdfe\n" + b"x\n" * 4)
    with pytest.raises(DataError, match=r"train\.de: line 1: invalid UTF-8 at byte offset 5 \(byte 0xfc\)"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}]), tmp_path)


def test_missing_and_empty_files(root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"file not found: .*nope\.en"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "nope"}]), tmp_path)
    write_pair(root, "empty", [], [])
    with pytest.raises(DataError, match=r"file is empty: .*empty\.en"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "empty"}]), tmp_path)
    assert_nothing_written(tmp_path)


def test_unknown_format_is_refused_at_config_load() -> None:
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"data\.train\.0\.format: Input should be 'text', 'tsv'"):
        load_config("multi30k-cpu", ["data.train=[{name: x, format: xml, path: p}]"])


def test_file_that_is_not_the_declared_format(root: Path, tmp_path: Path) -> None:
    (root / "fake.parquet").write_text("this is not parquet\n")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable Parquet file"):
        prepare_corpus(data_cfg(root, [{"name": "p", "format": "parquet", "path": "fake.parquet"}]), tmp_path)
    (root / "fake.arrow").write_text("nor arrow\n")
    with pytest.raises(DataError, match=r"fake\.arrow: not an Arrow IPC file or stream"):
        prepare_corpus(data_cfg(root, [{"name": "p", "format": "arrow", "path": "fake.arrow"}]), tmp_path)
    assert_nothing_written(tmp_path)


def test_gzipped_treebank_is_refused_saying_to_decompress_it(root: Path, tmp_path: Path) -> None:
    (root / "t.mrg.gz").write_bytes(gzip.compress(b"(S (NP (DT A) (NN dog)) (VP (VBZ runs)))\n"))
    with pytest.raises(DataError, match=r"t\.mrg\.gz: format ptb reads plain-text tree files, not gzip; decompress "
                                        r"it \(gunzip -k t\.mrg\.gz\)"):
        prepare_corpus(data_cfg(root, [{"name": "p", "format": "ptb", "path": "t.mrg.gz"}]), tmp_path)
    assert_nothing_written(tmp_path)


def test_paths_outside_the_data_root_are_refused(root: Path, tmp_path: Path) -> None:
    write_pair(tmp_path, "outside", EN, DE)
    with pytest.raises(DataError, match=r"data\.train\[0\]\.path = '\.\./outside'.*outside data\.root"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "../outside"}]), tmp_path / "w")
    (root / "link.en").symlink_to(tmp_path / "outside.en")
    with pytest.raises(DataError, match=r"files\.en = 'link\.en'.*outside data\.root"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text",
                                        "files": {"en": "link.en", "de": "dev.de"}}]), tmp_path / "w")
    with pytest.raises(DataError, match=r"data\.root .* not a folder"):
        prepare_corpus(data_cfg(tmp_path / "absent", [{"name": "t", "format": "text", "path": "x"}]), tmp_path / "w")
    assert_nothing_written(tmp_path / "w")


SGM = ('<srcset setid="t" srclang="any">\n<doc sysid="ref" docid="d1" genre="news" origlang="en">\n'
       '<seg id="1">A dog runs.</seg>\n</doc>\n</srcset>\n')


def _outside_source(fmt: str, root: Path, out: Path) -> tuple[dict, str, str, Path]:
    """A ``fmt`` source under ``root`` one of whose files is a symlink to a valid file in ``out`` (outside
    data.root), or for ``hf_disk-state``, whose state.json names one there: (spec, field, name, outside file)."""
    import datasets

    def link(name: str, target: Path) -> tuple[str, Path]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
        return name, target

    table = pa.table({"en": EN, "de": DE})
    pq.write_table(table, out / "o.parquet")
    with pa.ipc.new_file(out / "o.arrow", table.schema) as w:
        w.write_table(table)
    write_pair(out, "o", EN, DE)
    (out / "o.tsv").write_text("".join(f"{e}\t{d}\n" for e, d in zip(EN, DE)))
    (out / "o.sgm").write_text(SGM)
    (out / "o.mrg").write_text("(S (NP (DT A) (NN dog)) (VP (VBZ runs)))\n")
    (root / "in").mkdir()
    pq.write_table(table, root / "in" / "a.parquet")
    with pa.ipc.new_file(root / "in" / "a.arrow", table.schema) as w:
        w.write_table(table)
    (root / "in" / "a.mrg").write_text("(S (NP (DT A) (NN cat)) (VP (VBZ sleeps)))\n")
    if fmt == "text":
        link("lnk/t.de", out / "o.de")
        return {"path": "lnk/t"}, "path (prefix 'lnk/t')", *link("lnk/t.en", out / "o.en")
    if fmt == "tsv":
        return {"path": "t.tsv", "columns": ["en", "de"]}, "path", *link("t.tsv", out / "o.tsv")
    if fmt == "sgm":
        (root / "ref.sgm").write_text(SGM)
        return {"files": {"en": "src.sgm", "de": "ref.sgm"}}, "files.en", *link("src.sgm", out / "o.sgm")
    if fmt in ("parquet", "arrow"):
        return {"path": f"x.{fmt}"}, "path", *link(f"x.{fmt}", out / f"o.{fmt}")
    if fmt in ("parquet-folder", "arrow-folder"):
        ext = fmt.split("-")[0]
        return {"path": "in"}, "path (folder 'in')", *link(f"in/b.{ext}", out / f"o.{ext}")
    if fmt == "ptb":
        return {"path": "t.mrg"}, "path", *link("t.mrg", out / "o.mrg")
    if fmt == "ptb-include":
        return {"path": "in", "include": ["*.mrg"]}, "include (pattern '*.mrg')", *link("in/b.mrg", out / "o.mrg")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"en": EN, "de": DE})})
    dd.save_to_disk(str(root / "dd"))
    data = "dd/train/data-00000-of-00001.arrow"
    (root / data).rename(out / "data.arrow")
    spec = {"path": "dd", "split": "train"}
    if fmt == "hf_disk":
        return spec, "path (folder 'dd')", *link(data, out / "data.arrow")
    state = json.loads((root / "dd/train/state.json").read_text())  # names its data files relative to its folder
    escape = os.path.relpath(out / "data.arrow", root / "dd/train")
    state["_data_files"] = [{"filename": escape}]
    (root / "dd/train/state.json").write_text(json.dumps(state))
    return spec, "path (data file named in dd/train/state.json)", f"dd/train/{escape}", out / "data.arrow"


@pytest.mark.parametrize("fmt", ["text", "tsv", "sgm", "parquet", "parquet-folder", "arrow", "arrow-folder",
                                 "hf_disk", "hf_disk-state", "ptb", "ptb-include"])
def test_every_format_refuses_a_file_that_links_outside_the_data_root(root: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "outside"
    out.mkdir()
    spec, field, name, target = _outside_source(fmt, root, out)
    source = {"name": "s", "format": fmt.split("-")[0], **spec}
    with pytest.raises(DataError) as err:
        prepare_corpus(data_cfg(root, [source]), tmp_path / "w")
    assert str(err.value).startswith(f"data.train[0].{field} = {name!r} resolves to {target.resolve()}, outside "
                                     f"data.root ({root.resolve()}); move the files under data.root"), str(err.value)
    assert_nothing_written(tmp_path / "w")


def test_corpus_empty_after_cleaning(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", ["one two three"] * 3, ["eins zwei drei"] * 3)
    with pytest.raises(DataError) as err:
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}], max_words=2), tmp_path)
    assert "training split is empty after cleaning" in str(err.value) and "'too_long': 3" in str(err.value)
    assert_nothing_written(tmp_path)


def test_tsv_line_with_wrong_field_count(root: Path, tmp_path: Path) -> None:
    (root / "c.tsv").write_text("a\tb\nc\td\te\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"c\.tsv: line 2: expected 2 tab-separated fields \(en,de\), found 3"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "tsv", "path": "c.tsv", "columns": ["en", "de"]}]),
                       tmp_path)


@pytest.mark.integration
def test_sgm_with_mismatched_segments(shared_data: Path, tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    src = (shared_data / "wmt14-en-de/sgm/newstest2014-deen-src.en.sgm").read_text(encoding="utf-8")
    (root / "src.sgm").write_text(src, encoding="utf-8")
    (root / "ref.sgm").write_text(src.replace('<seg id="1">', '<seg id="9999">', 1), encoding="utf-8")
    write_pair(root, "train", EN, DE)
    dev = {"name": "nt", "format": "sgm", "files": {"en": "src.sgm", "de": "ref.sgm"}}
    with pytest.raises(DataError, match="hold different segments"):
        prepare_corpus(data_cfg(root, [{"name": "t", "format": "text", "path": "train"}], dev=dev), tmp_path / "w")


def test_failure_midway_leaves_earlier_output_intact(root: Path, tmp_path: Path) -> None:
    write_pair(root, "train", EN, DE)
    cfg = data_cfg(root, [{"name": "t", "format": "text", "path": "train"}])
    good = prepare_corpus(cfg, tmp_path)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    (root / "train.de").write_bytes(b"x\n" * 4 + b"\xff\n")  # same line count, bad byte on the last line
    with pytest.raises(DataError, match="line 5"):
        prepare_corpus(cfg, tmp_path)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == [good.name]


# ------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.integration
def test_cli_prepare_data_and_clear_errors(shared_data: Path, tmp_path: Path) -> None:
    env = {**os.environ, "AIAYN_DATA_ROOT": str(shared_data)}
    res = subprocess.run([sys.executable, "-m", "pipeline", "prepare-data", "--work-dir", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "train" in res.stdout and "read 29,000" in res.stdout
    res = subprocess.run([sys.executable, "-m", "pipeline", "prepare-data", "--work-dir", str(tmp_path),
                          "--set", "model.n_heads=7"], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert res.returncode == 2 and "must be divisible by n_heads (7)" in res.stderr
    res = subprocess.run([sys.executable, "-m", "pipeline", "prepare-data", "--data-root", str(tmp_path / "nope")],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert res.returncode == 2 and "not a folder" in res.stderr and "Traceback" not in res.stderr
