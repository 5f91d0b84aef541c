"""Token shards on the real shared data: determinism, format, zero-copy reader, batching, bad input."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import SpecialIds, TokenizerConfig
from pipeline.support.fsutil import sha256_file
from pipeline.shards import (CHUNK_ROWS, ShardDataset, ShardError, build_shards, read_shard_manifest, shard_schema,
                             token_batches, train_splits)
from pipeline.tokenize import Tokenizer, train_tokenizer
from tests.conftest import REPO_ROOT, kill_when_stuck
from tests.test_tokenize import multi30k_corpus

# 20k rows per shard: Multi30k's 28,997 training pairs span two shards, the first of two record batches.
CFG = TokenizerConfig(vocab_size=4000, shard_rows=20_000, num_workers=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def corpus(shared_data: Path, work: Path) -> Path:
    return multi30k_corpus(shared_data, work)


@pytest.fixture(scope="module")
def tok(corpus: Path, work: Path) -> Tokenizer:
    return Tokenizer(train_tokenizer(corpus, CFG, work))


@pytest.fixture(scope="module")
def shards(corpus: Path, tok: Tokenizer, work: Path) -> Path:
    return build_shards(corpus, tok.dir, CFG, work)


@pytest.fixture(scope="module")
def train(shards: Path, tok: Tokenizer) -> ShardDataset:
    return ShardDataset(shards, "train", tokenizer=tok)


def corpus_texts(corpus: Path, split: str) -> tuple[list[str], list[str]]:
    table = pq.read_table(corpus / f"{split}.parquet", columns=["src", "tgt"])
    return table.column("src").to_pylist(), table.column("tgt").to_pylist()


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------ reruns and determinism


@pytest.mark.integration
def test_byte_identical_whatever_the_workers_and_a_rerun_is_a_noop(corpus: Path, tok: Tokenizer, shards: Path,
                                                                   work: Path, tmp_path: Path) -> None:
    heard: list[tuple[int, int]] = []
    one = build_shards(corpus, tok.dir, CFG.model_copy(update={"num_workers": 1}), tmp_path,
                       progress=lambda done, total: heard.append((done, total)))
    assert one.name == shards.name
    assert files(one) == files(shards)
    # progress: pairs encoded of every split's, rising to all of them
    rows = sum(s["rows"] for s in json.loads((corpus / "manifest.json").read_text())["splits"].values())
    assert heard[-1] == (rows, rows) and [d for d, _ in heard] == sorted({d for d, _ in heard}) and len(heard) > 2
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}
    heard.clear()
    assert build_shards(corpus, tok.dir, CFG, work, progress=lambda done, total: heard.append((done, total))) == shards
    assert heard == []  # a re-run encodes nothing
    assert {p.name: p.stat().st_mtime_ns for p in shards.iterdir()} == mtimes
    other = build_shards(corpus, tok.dir, CFG.model_copy(update={"shard_rows": 50_000}), tmp_path)
    assert other.name != shards.name


KILLED = """
import sys, time
from pathlib import Path
from pipeline.config import TokenizerConfig
from pipeline.shards import build_shards

corpus, tokenizer, work, stuck, cfg, after = sys.argv[1:]

def progress(done, total):
    if done > int(after):  # a chunk of the fourth training shard is written: wait here to be killed
        Path(stuck).touch()
        time.sleep(600)

build_shards(Path(corpus), Path(tokenizer), TokenizerConfig.model_validate_json(cfg), Path(work), progress=progress)
"""


@pytest.mark.integration
def test_kill_9_during_encoding_resumes_with_the_first_shard_not_finished(corpus: Path, tok: Tokenizer,
                                                                         tmp_path: Path, caplog) -> None:
    cfg = CFG.model_copy(update={"shard_rows": 5_000, "num_workers": 1})  # train: 6 shards of one chunk each
    splits = json.loads((corpus / "manifest.json").read_text())["splits"]
    before_train = sum(s["rows"] for k, s in splits.items() if k != "train")  # splits are encoded in key order
    work, stuck = tmp_path / "work", tmp_path / "stuck"
    child = subprocess.Popen([sys.executable, "-c", KILLED, str(corpus), str(tok.dir), str(work), str(stuck),
                              cfg.model_dump_json(), str(before_train + 3 * 5_000)], cwd=REPO_ROOT,
                             stderr=subprocess.PIPE)
    kill_when_stuck(child, stuck, "its fourth training shard")
    partial = next((work / "shards").glob(".*.partial"))
    finished = sorted(p.name for p in partial.glob("train-*.json"))
    assert finished == ["train-00000.json", "train-00001.json", "train-00002.json"]
    inodes = {f"train-{i:05d}.arrow": (partial / f"train-{i:05d}.arrow").stat().st_ino for i in range(3)}
    with caplog.at_level(logging.INFO, logger="aiayn.shards"):
        heard: list[int] = []
        out = build_shards(corpus, tok.dir, cfg, work, progress=lambda done, total: heard.append(done))
    assert f"resuming the shard writing in {partial}: {len(splits) - 1 + 3} shards ({before_train + 15_000} of " \
           f"{before_train + splits['train']['rows']} pairs) already written" in caplog.messages
    assert heard[0] == before_train + 20_000  # the first chunk encoded is the fourth training shard's
    assert {name: (out / name).stat().st_ino for name in inodes} == inodes  # moved into place, not rewritten
    assert not partial.exists()
    whole = build_shards(corpus, tok.dir, cfg, tmp_path / "uninterrupted")
    assert whole.name == out.name and files(whole) == files(out)


@pytest.mark.integration
def test_sampled_copies_segment_the_same_pairs_otherwise_and_a_rerun_keeps_them(
        corpus: Path, tok: Tokenizer, shards: Path, work: Path, tmp_path: Path) -> None:
    cfg = CFG.model_copy(update={"sampling_alpha": 0.1, "sampled_copies": 2})
    sampled = build_shards(corpus, tok.dir, cfg, work)
    m = read_shard_manifest(sampled)
    assert m["sampling"] == {"alpha": 0.1, "copies": 2}
    assert train_splits(m) == ["train.sampled1", "train.sampled2"] and train_splits(read_shard_manifest(shards)) == [
        "train"]
    # the deterministic splits are the same bytes as without sampling: dev, test and decoding see one segmentation
    assert {k: v for k, v in files(sampled).items() if k != "manifest.json" and "sampled" not in k} == {
        k: v for k, v in files(shards).items() if k != "manifest.json"}
    src, tgt = corpus_texts(corpus, "train")
    det, one, two = (ShardDataset(sampled, k, tokenizer=tok) for k in ("train", *train_splits(m)))
    assert len(one) == len(two) == len(det) == len(src)
    for i in range(0, len(src), 997):  # the same text in other pieces
        assert (tok.decode(one.ids(i, "src")), tok.decode(two.ids(i, "tgt"))) == (src[i], tgt[i])
    assert one.tgt_len.sum() > 1.2 * det.tgt_len.sum() and not np.array_equal(one.tgt_len, two.tgt_len)
    # a folder once drawn is kept: a re-run reads the same copies
    drawn = files(sampled)
    assert build_shards(corpus, tok.dir, cfg, work) == sampled and files(sampled) == drawn


# ------------------------------------------------------------------------------------------ format, manifest


@pytest.mark.integration
def test_layout_schema_and_manifest(corpus: Path, tok: Tokenizer, shards: Path) -> None:
    m = read_shard_manifest(shards)
    assert sorted(p.name for p in shards.iterdir()) == [
        "dev-00000.arrow", "manifest.json", "test.newstest2014-00000.arrow", "test.test2016-00000.arrow",
        "train-00000.arrow", "train-00001.arrow"]
    assert m["dtype"] == "uint16" and m["tokenizer"]["sha256"] == tok.sha256
    assert m["tokenizer"]["special"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    corpus_manifest = json.loads((corpus / "manifest.json").read_text())
    for key, split in m["splits"].items():
        assert split["rows"] == corpus_manifest["splits"][key]["rows"] == sum(s["rows"] for s in split["shards"])
        for s in split["shards"]:
            assert sha256_file(shards / s["file"]) == s["sha256"] and (shards / s["file"]).stat().st_size == s["bytes"]
    train = m["splits"]["train"]
    assert [s["rows"] for s in train["shards"]] == [20_000, 8_997]
    with pa.ipc.open_file(shards / "train-00000.arrow") as f:
        assert f.schema.equals(shard_schema(np.dtype(np.uint16)), check_metadata=True)
        assert [f.get_batch(i).num_rows for i in range(f.num_record_batches)] == [CHUNK_ROWS, 20_000 - CHUNK_ROWS]
        assert f.schema.field("src").type == pa.list_(pa.uint16())
    # Statistics are those of the tokenizer's own encoding of the corpus.
    src, tgt = corpus_texts(corpus, "train")
    for side, texts in (("src", src), ("tgt", tgt)):
        lengths = np.array([len(ids) for ids in tok.encode_batch(texts)])
        st = train[side]
        assert st["tokens"] == lengths.sum() and st["max_len"] == lengths.max()
        assert st["mean_len"] == round(lengths.mean(), 4)
        assert st["unk"] == 0 and st["unk_rate"] == 0.0  # byte fallback: nothing is unknown


# ------------------------------------------------------------------------------------------------- reader


@pytest.mark.integration
def test_reader_gives_the_tokenizers_ids_as_views_into_the_files(corpus: Path, tok: Tokenizer,
                                                                  train: ShardDataset) -> None:
    src, tgt = corpus_texts(corpus, "train")
    assert len(train) == len(src) == 28_997
    src_ids, tgt_ids = tok.encode_batch(src), tok.encode_batch(tgt)
    assert train.src_len.tolist() == [len(x) for x in src_ids] and train.tgt_len.tolist() == [len(x) for x in tgt_ids]
    assert np.array_equal(train.rows, np.arange(len(src)))
    for i in range(len(train)):
        s, t = train[i]
        assert s.tolist() == src_ids[i] and t.tolist() == tgt_ids[i], i
    s, _ = train[-1]
    assert s.dtype == np.uint16 and not s.flags.owndata and not s.flags.writeable  # a view of the mapped file
    assert tok.decode(train[12_345][1]) == tgt[12_345]
    with pytest.raises(IndexError):
        train[len(train)]


@pytest.mark.integration
def test_every_split_decodes_back_to_the_corpus_text(corpus: Path, tok: Tokenizer, shards: Path) -> None:
    for key in ("dev", "test.test2016", "test.newstest2014"):
        ds = ShardDataset(shards, key, tokenizer=tok)
        src, tgt = corpus_texts(corpus, key)
        assert tok.decode_batch(ds.collate(np.arange(len(ds)), "src", eos=True)) == src, key
        assert tok.decode_batch(ds.collate(np.arange(len(ds)), "tgt", bos=True, eos=True)) == tgt, key


@pytest.mark.integration
def test_collate_pads_and_frames(train: ShardDataset) -> None:
    idx = np.array([28_996, 3, 20_000, 16_384, 7])  # across both shards and both record batches
    width = int(train.tgt_len[idx].max())
    tgt_in = train.collate(idx, "tgt", bos=True)
    tgt_out = train.collate(idx, "tgt", eos=True)
    src = train.collate(idx, "src")
    assert tgt_in.shape == tgt_out.shape == (5, width + 1) and tgt_in.dtype == np.int64
    for row, i in enumerate(idx):
        s, t = train[i]
        n = len(t)
        assert tgt_in[row, : n + 1].tolist() == [2, *t.tolist()] and (tgt_in[row, n + 1 :] == 0).all()
        assert tgt_out[row, : n + 1].tolist() == [*t.tolist(), 3] and (tgt_out[row, n + 1 :] == 0).all()
        assert src[row, : len(s)].tolist() == s.tolist() and (src[row, len(s) :] == 0).all()


@pytest.mark.integration
def test_dataset_pickles_by_path(train: ShardDataset) -> None:
    again = pickle.loads(pickle.dumps(train))
    assert len(pickle.dumps(train)) < 1000  # the path, not the data
    assert again[20_001][0].tolist() == train[20_001][0].tolist()


# ------------------------------------------------------------------------------------------------ batching


@pytest.mark.integration
def test_batches_respect_the_budget_and_cover_every_example_once(train: ShardDataset) -> None:
    sizes = train.sizes
    batches = train.batches(max_tokens=4096, seed=0)
    assert all(len(b) * sizes[b].max() <= 4096 for b in batches)
    flat = np.concatenate(batches)
    assert len(flat) == len(train) and np.array_equal(np.sort(flat), np.arange(len(train)))
    # Bucketing by length keeps padding low and batches near full.
    real = sum(int(sizes[b].sum()) for b in batches)
    padded = sum(len(b) * int(sizes[b].max()) for b in batches)
    assert real / padded > 0.97 and padded / (len(batches) * 4096) > 0.95


@pytest.mark.integration
def test_batch_order_is_fixed_by_seed_and_epoch(train: ShardDataset) -> None:
    a, b = train.batches(4096, seed=0), train.batches(4096, seed=0)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    for other in (train.batches(4096, seed=1), train.batches(4096, seed=0, epoch=1)):
        assert [x.tolist() for x in other] != [x.tolist() for x in a]
        assert sorted(np.concatenate(other).tolist()) == list(range(len(train)))


def test_token_batches_greedy_cut() -> None:
    sizes = np.array([5, 1, 3, 3, 2, 5, 4])
    batches = token_batches(sizes, max_tokens=6, seed=0)
    # ascending: 1 2 | 3 3 | 4 | 5 | 5  (a batch's cost is its longest example times its size)
    assert sorted(sorted(sizes[b].tolist()) for b in batches) == [[1, 2], [3, 3], [4], [5], [5]]
    assert token_batches(np.zeros(0, np.int32), 6, seed=0) == []
    with pytest.raises(ValueError, match=r"2 examples are longer than max_tokens=4 \(longest 5\)"):
        token_batches(sizes, max_tokens=4, seed=0)


# ---------------------------------------------------------------------------------------------- bad input


def damaged_copy(shards: Path, tmp_path: Path) -> Path:
    return shutil.copytree(shards, tmp_path / shards.name)


@pytest.mark.integration
def test_corrupt_shard_is_named(shards: Path, tmp_path: Path) -> None:
    copy = damaged_copy(shards, tmp_path)
    path = copy / "train-00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte among the token ids
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{path}: sha256 differs .*delete {copy} and re-run build_shards"):
        ShardDataset(copy, "train")
    ShardDataset(copy, "dev")  # the other splits are untouched


@pytest.mark.integration
def test_truncated_shard_is_named(shards: Path, tmp_path: Path) -> None:
    copy = damaged_copy(shards, tmp_path)
    path = copy / "train-00000.arrow"
    path.write_bytes(path.read_bytes()[:-1000])
    for verify in (True, False):  # the size check needs no hashing
        with pytest.raises(ShardError, match=rf"{path}: \d+ bytes, the shard manifest records \d+ \(truncated"):
            ShardDataset(copy, "train", verify=verify)
    # Truncated and its manifest entry rewritten to match: Arrow itself refuses it, still naming the file.
    manifest = json.loads((copy / "manifest.json").read_text())
    entry = manifest["splits"]["train"]["shards"][0]
    entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=rf"{path}: not a readable Arrow IPC file"):
        ShardDataset(copy, "train")


@pytest.mark.integration
def test_tokenizer_that_did_not_encode_the_shards_is_refused(corpus: Path, shards: Path, tmp_path: Path) -> None:
    other = Tokenizer(train_tokenizer(corpus, CFG.model_copy(update={"vocab_size": 3000}), tmp_path))
    with pytest.raises(ShardError, match=rf"{other.model_path} .* is not the tokenizer these shards were encoded"):
        ShardDataset(shards, "train", tokenizer=other)


@pytest.mark.integration
def test_config_special_ids_must_match_the_tokenizer(corpus: Path, tok: Tokenizer, tmp_path: Path) -> None:
    cfg = CFG.model_copy(update={"special": SpecialIds(pad=1, unk=0)})
    with pytest.raises(ShardError, match=r"tokenizer.special .* differs from the ids fixed in .*spm.model"):
        build_shards(corpus, tok.dir, cfg, tmp_path)


@pytest.mark.integration
def test_corpus_file_changed_after_its_manifest_is_named(corpus: Path, tok: Tokenizer, tmp_path: Path) -> None:
    copy = shutil.copytree(corpus, tmp_path / "corpus")
    with open(copy / "dev.parquet", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ShardError, match=rf"{copy / 'dev.parquet'}: sha256 .* differs .*re-run the data stage"):
        build_shards(copy, tok.dir, CFG, tmp_path / "work")
    assert not (tmp_path / "work" / "shards").exists() or not any((tmp_path / "work" / "shards").iterdir())


@pytest.mark.integration
def test_unknown_split_and_unfinished_folder(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match=r"no split 'valid'; it has \['dev', 'test.newstest2014'"):
        ShardDataset(shards, "valid")
    with pytest.raises(ShardError, match="not a finished shard folder"):
        ShardDataset(tmp_path, "train")
