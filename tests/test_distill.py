"""Sequence-level knowledge distillation (pipeline/distill.py): the teachers' translations as training targets,
the filters and their counts, n-best selection, the cache identity, resuming after kill -9, the CLI.

Everything runs on a toy corpus written here (121 word-for-word pairs) and teachers that are random tiny
Transformers over its tokenizer: the machinery, not translation quality. The filters are checked end to end with a
stand-in teacher of known behaviour.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import pipeline.distill as distill_module
from model import Transformer, TransformerConfig
from pipeline.checkpoint import CHECKPOINT_FORMAT, CheckpointError
from pipeline.cli import _print_corpus, main
from pipeline.config import ConfigError, DistillConfig, RunConfig, load_config
from pipeline.data import prepare_corpus, read_manifest
from pipeline.distill import (RULES, DistillError, distill_corpus, distill_from_translations, distilled_fingerprint,
                              failure, select_hypothesis, teacher_tokenizer, write_translations)
from pipeline.support.fsutil import MANIFEST, sha256_file
from pipeline.inference import load_models, translate, translate_nbest
from pipeline.tokenize import Tokenizer, train_tokenizer
from pipeline.workdir import build_inputs
from tests.conftest import kill_when_stuck

REPO = Path(__file__).resolve().parents[1]
EN = "a man woman dog cat red blue big small runs walks sees eats the green house car tree bike street".split()
DE = "ein mann frau hund katze rot blau groß klein läuft geht sieht isst das grün haus auto baum rad straße".split()
TRAIN_ROWS = 121  # 120 generated pairs and one too long for the teachers' positions
POSITIONS = 64
# The toy run: multi30k-cpu's settings over the toy corpus; strings, so that the CLI gets the same with --set.
TOY = ["data.train=[{name: toy, format: text, path: toy/train}]",
       "data.dev={name: toy-dev, format: text, path: toy/dev}",
       "data.test=[{name: toy-test, format: text, path: toy/test}]",
       "tokenizer.vocab_size=120", "tokenizer.byte_fallback=false", "tokenizer.num_workers=1",
       # greedy and short: a random teacher rarely ends a sentence by itself (min_len 2: nor at once)
       "distill.decode.beam_size=1", "distill.decode.max_len_a=0.0", "distill.decode.max_len_b=6",
       "distill.decode.min_len=2",
       # one chunk: decoded in the batches translate() makes of all the sources, so both give the same targets
       "distill.chunk_sentences=128"]
CHUNK = 32  # the chunk size of the kill -9 test: four chunks


def toy_config(root: Path, work: Path, *overrides: str) -> RunConfig:
    return load_config("multi30k-cpu", [("data.root", str(root)), ("work_dir", str(work)), *TOY, *overrides])


def write_toy_data(root: Path) -> None:
    """Word-for-word En-De pairs of 3 to 9 words: train, dev and test; the last training pair has 80 words."""
    rng = random.Random(0)
    for split, n in (("train", TRAIN_ROWS - 1), ("dev", 20), ("test", 20)):
        pairs = []
        for _ in range(n):
            words = [rng.randrange(len(EN)) for _ in range(rng.randint(3, 9))]
            pairs.append((" ".join(EN[i] for i in words), " ".join(DE[i] for i in words)))
        if split == "train":
            pairs.append((" ".join(EN[i % len(EN)] for i in range(80)), " ".join(DE[i % len(DE)] for i in range(80))))
        for lang, side in (("en", 0), ("de", 1)):
            path = root / "toy" / f"{split}.{lang}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(p[side] + "\n" for p in pairs), encoding="utf-8")


def write_teacher(path: Path, tokenizer: Tokenizer, seed: int, tokenizer_sha256: str | None = None) -> Path:
    """A random tiny Transformer saved as a checkpoint trained with ``tokenizer`` (or the one of the sha256)."""
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(tokenizer.vocab_size, tokenizer.pad_id, encoder_layers=1,
                                          decoder_layers=1, d_model=32,
                                          d_ff=64, n_heads=2, max_positions=POSITIONS))
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_dict(), "model": model.state_dict(),
                "tokenizer_sha256": tokenizer_sha256 or tokenizer.sha256}, path)
    return path


class Toy:
    """The toy corpus with its tokenizer and two teachers, in one work dir."""

    def __init__(self, folder: Path):
        self.root, self.work = folder / "data", folder / "work"
        write_toy_data(self.root)
        self.cfg = toy_config(self.root, self.work)
        self.distill = self.cfg.distill
        self.corpus = prepare_corpus(self.cfg.data, self.work)
        self.tokenizer_dir = train_tokenizer(self.corpus, self.cfg.tokenizer, self.work)
        self.tokenizer = Tokenizer(self.tokenizer_dir)
        self.teachers = [write_teacher(folder / f"teacher{seed}.pt", self.tokenizer, seed) for seed in (0, 1)]

    def sources(self) -> tuple[list[str], list[str]]:
        table = pq.read_table(self.corpus / "train.parquet", columns=["src", "tgt"])
        return table.column("src").to_pylist(), table.column("tgt").to_pylist()


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Toy:
    return Toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def distilled(toy: Toy) -> Path:
    """The toy corpus distilled by the first teacher (the toy's config: best of 1)."""
    return distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill, toy.work)


def rows(corpus: Path, split: str = "train") -> list[dict]:
    return pq.read_table(corpus / f"{split}.parquet").to_pylist()


def expected_rows(toy: Toy, teachers: list[Path], distill: DistillConfig) -> tuple[list[tuple], dict]:
    """What distillation must give, computed here with translate(): (origin, line, src, hyp) of the kept pairs and
    each rule's count. Hypotheses are normalised as every corpus sentence is (whitespace runs collapsed)."""
    model = load_models(teachers, "cpu", toy.tokenizer)
    hyps = [" ".join(h.split()) for h in translate(model, toy.tokenizer, toy.sources()[0], distill.decode)]
    kept, removed = [], dict.fromkeys(RULES, 0)
    for row, hyp in zip(rows(toy.corpus), hyps):
        if rule := failure(row["src"], hyp, distill):
            removed[rule] += 1
        else:
            kept.append((row["origin"], row["line"], row["src"], hyp))
    return kept, removed


# ------------------------------------------------------------------------------------------ unit: the rules


def test_each_filter_removes_exactly_its_failures() -> None:
    cfg = DistillConfig(max_ratio=3.0)
    assert failure("a dog runs", "", cfg) == "empty"
    assert failure("a dog runs", "a dog runs", cfg) == "copy"
    assert failure("a dog runs", "a dog runs", cfg.model_copy(update={"drop_copies": False})) is None
    assert failure("two dogs", "ein zwei drei vier fünf sechs sieben", cfg) == "ratio"  # 7 > 3 * 2 words
    assert failure("two dogs", "ein zwei drei vier fünf sechs", cfg) is None  # 6 = 3 * 2: within
    assert failure("one two three four five six seven", "zwei hunde", cfg) == "ratio"  # the other way round
    assert failure("a dog runs", "ein hund rennt", cfg) is None
    assert failure("", "", cfg) == "empty"  # the first rule that applies counts, once


def test_each_rule_counts_and_removes_exactly_its_failures_end_to_end(toy: Toy, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """A stand-in teacher of known behaviour, by the source's first word: "a" -> nothing, "the" -> the source
    itself, "dog" -> ten times the source, otherwise its word-for-word translation (a good one; the teacher
    writes it with extra spaces, which normalisation removes)."""
    def answer(src: str) -> str:
        first = src.split()[0]
        return {"a": "", "the": src, "dog": " ".join([src] * 10)}.get(first, " ".join(DE[EN.index(w)]
                                                                                      for w in src.split()))

    def teacher(model, tokenizer, sentences, decode, progress=None, **kwargs) -> list[list[str]]:
        progress(len(sentences))
        return [[f" {answer(s).replace(' ', '  ')} "] for s in sentences]

    monkeypatch.setattr(distill_module, "translate_nbest", teacher)
    sources = toy.sources()[0]
    expected = {"empty": sum(s.split()[0] == "a" for s in sources), "copy": sum(s.split()[0] == "the" for s in sources),
                "ratio": sum(s.split()[0] == "dog" for s in sources)}
    assert all(expected.values())
    out = distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill, tmp_path)
    entry = read_manifest(out)["distillation"]
    assert entry["removed"] == expected and entry["kept"] == TRAIN_ROWS - sum(expected.values())
    assert [(r["src"], r["tgt"]) for r in rows(out)] == [(s, answer(s)) for s in sources
                                                          if s.split()[0] not in ("a", "the", "dog")]
    # copies kept when asked
    keep_copies = toy.distill.model_copy(update={"drop_copies": False})
    entry = read_manifest(distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, keep_copies,
                                         tmp_path))["distillation"]
    assert entry["removed"] == {**expected, "copy": 0}


def test_select_best_keeps_the_first_and_chrf_the_closest_to_the_reference() -> None:
    nbest = ["a dog stood there", "the cat sat on the mat", "the cat sat"]
    assert select_hypothesis(nbest, "the cat sat on the mat", "best") == "a dog stood there"
    assert select_hypothesis(nbest, "the cat sat on the mat", "chrf") == "the cat sat on the mat"
    assert select_hypothesis(nbest, "the cat sat down", "chrf") == "the cat sat"
    assert select_hypothesis(["xyz", "qqq"], "abc", "chrf") == "xyz"  # a tie (chrF 0 both): the teachers' order
    assert select_hypothesis(["only one"], "abc", "chrf") == "only one"


# ------------------------------------------------------------------------------- the distilled corpus


def test_targets_are_the_teachers_translations_and_dev_test_are_unchanged(toy: Toy, distilled: Path) -> None:
    kept, removed = expected_rows(toy, toy.teachers[:1], toy.distill)
    assert [(r["origin"], r["line"], r["src"], r["tgt"]) for r in rows(distilled)] == kept
    assert all(r["split"] == "train" and r["tgt_raw"] is None for r in rows(distilled))
    assert 0 < len(kept) < TRAIN_ROWS

    source, manifest = read_manifest(toy.corpus), read_manifest(distilled)
    for key in ("dev", "test.toy-test"):
        assert manifest["splits"][key] == source["splits"][key]
        assert sha256_file(distilled / f"{key}.parquet") == sha256_file(toy.corpus / f"{key}.parquet")
    train = manifest["splits"]["train"]
    assert train["rows"] == len(kept) and train["sha256"] == sha256_file(distilled / "train.parquet")
    assert train["origins"] == {"toy": {"read": TRAIN_ROWS, "kept": len(kept)}}
    assert train["cleaning"] == source["splits"]["train"]["cleaning"]  # what the data stage did, still true
    assert {k: v for k, v in manifest.items() if k not in ("fingerprint", "splits", "distillation")} == {
        k: v for k, v in source.items() if k not in ("fingerprint", "splits")}
    assert distilled == toy.work.resolve() / "distilled" / manifest["fingerprint"][:16]
    assert manifest["fingerprint"] == distilled_fingerprint(toy.corpus, toy.teachers[:1], toy.distill)

    entry = manifest["distillation"]
    remaining, rules = TRAIN_ROWS, []
    for rule in RULES:
        remaining -= removed[rule]
        rules.append({"rule": rule, "removed": removed[rule], "remaining": remaining})
    assert entry == {
        "format": "aiayn-distill/1", "code": entry["code"],
        "source_corpus": {"fingerprint": source["fingerprint"], "path": str(toy.corpus.resolve())},
        "teachers": [{"path": str(toy.teachers[0].resolve()), "sha256": sha256_file(toy.teachers[0])}],
        "engine": "torch", "decode": toy.distill.decode.model_dump(mode="json"), "nbest": 1, "select": "best",
        "max_ratio": 3.0, "drop_copies": True, "keep_original": False, "read": TRAIN_ROWS, "rules": rules,
        "kept": len(kept), "removed": removed, "references": 0,
        "truncated": 1,  # the 80-word pair, longer than the teachers' 64 positions
    }
    assert not [p for p in distilled.parent.iterdir() if p.name.endswith(".partial")]  # removed once done


def test_an_ensemble_of_two_teachers_distills_with_their_joint_translations(toy: Toy, distilled: Path) -> None:
    out = distill_corpus(toy.corpus, toy.teachers, toy.tokenizer_dir, toy.distill, toy.work)
    kept, _ = expected_rows(toy, toy.teachers, toy.distill)
    assert out != distilled and [(r["origin"], r["line"], r["src"], r["tgt"]) for r in rows(out)] == kept
    assert [t["sha256"] for t in read_manifest(out)["distillation"]["teachers"]] == [
        sha256_file(t) for t in toy.teachers]


def test_chrf_selection_keeps_the_nbest_hypothesis_closest_to_the_reference(toy: Toy) -> None:
    decode = toy.distill.decode.model_copy(update={"beam_size": 3})
    distill = toy.distill.model_copy(update={"decode": decode, "nbest": 3, "select": "chrf", "max_ratio": 100.0})
    out = distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, distill, toy.work)
    sources, references = toy.sources()
    nbest = [[" ".join(h.split()) for h in hyps]  # normalised, see expected_rows
             for hyps in translate_nbest(load_models(toy.teachers[:1], "cpu", toy.tokenizer), toy.tokenizer, sources,
                                         decode, nbest=3)]
    chosen = [select_hypothesis(hyps, ref, "chrf") for hyps, ref in zip(nbest, references)]
    assert [r["tgt"] for r in rows(out)] == [h for h in chosen if h]  # max_ratio 100: only empty ones go
    assert any(c != hyps[0] for c, hyps in zip(chosen, nbest))  # chrF chose otherwise than the beam somewhere


def test_a_rerun_reuses_the_folder_without_decoding(toy: Toy, distilled: Path, monkeypatch) -> None:
    before = (distilled / MANIFEST).stat().st_mtime_ns
    monkeypatch.setattr(distill_module, "translate_nbest", None)  # any decoding would fail
    monkeypatch.setattr(distill_module, "load_models", None)
    again = distill_corpus(toy.corpus, [Path(os.path.relpath(toy.teachers[0]))], toy.tokenizer_dir,
                           toy.distill.model_copy(update={"chunk_sentences": 7, "teachers": ["x.pt"]}), toy.work)
    assert again == distilled and (distilled / MANIFEST).stat().st_mtime_ns == before


def test_the_fingerprint_follows_teachers_decoding_and_selection_only(toy: Toy, tmp_path: Path) -> None:
    a, b = toy.teachers
    copy_of_a = tmp_path / "elsewhere.pt"
    copy_of_a.write_bytes(a.read_bytes())
    cfg = toy.distill

    def fp(files: list[Path], **update) -> str:
        return distilled_fingerprint(toy.corpus, files, cfg.model_copy(update=update))

    base = fp([a])
    assert fp([copy_of_a]) == base  # by content, not path
    assert fp([a], chunk_sentences=1, teachers=[str(copy_of_a)]) == base
    assert fp([a, b]) == fp([b, a]) != base  # an ensemble is symmetric
    changed = [fp([b]), fp([a], nbest=2, select="chrf"), fp([a], nbest=2),
               fp([a], decode=cfg.decode.model_copy(update={"beam_size": 3})),
               fp([a], decode=cfg.decode.model_copy(update={"precision": "bf16"})),
               fp([a], max_ratio=2.0), fp([a], drop_copies=False), fp([a], keep_original=True)]
    assert len({base, *changed}) == len(changed) + 1


def test_keep_original_puts_each_human_pair_before_its_teachers_pair(toy: Toy, distilled: Path, tmp_path: Path,
                                                                     capsys) -> None:
    mixed = toy.distill.model_copy(update={"keep_original": True})
    out = distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, mixed, tmp_path)
    kept, removed = expected_rows(toy, toy.teachers[:1], toy.distill)
    teachers = {(origin, line): pair for origin, line, *pair in kept}
    expected = []
    for r in rows(toy.corpus):
        expected.append((r["origin"], r["line"], r["src"], r["tgt"]))
        if (r["origin"], r["line"]) in teachers:
            expected.append((r["origin"], r["line"], *teachers[r["origin"], r["line"]]))
    assert [(r["origin"], r["line"], r["src"], r["tgt"]) for r in rows(out)] == expected
    manifest = read_manifest(out)
    assert manifest["fingerprint"] != read_manifest(distilled)["fingerprint"]
    assert manifest["splits"]["train"]["rows"] == TRAIN_ROWS + len(kept)
    assert manifest["splits"]["train"]["origins"] == {"toy": {"read": TRAIN_ROWS, "kept": len(kept),
                                                              "references": TRAIN_ROWS}}
    entry = manifest["distillation"]
    assert (entry["keep_original"], entry["kept"], entry["references"], entry["removed"]) == (
        True, len(kept), TRAIN_ROWS, removed)
    _print_corpus(out)  # what `python -m pipeline distill` prints
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"    {TRAIN_ROWS:,} human pairs kept beside them (distill.keep_original)")
    # human pairs alone are no distillation: teachers whose every translation fails are still refused
    with pytest.raises(DistillError, match="no teacher translation was kept"):
        distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir,
                       mixed.model_copy(update={"max_ratio": 0.01}), tmp_path)


def test_an_empty_result_names_the_counts_and_a_relaxed_rerun_decodes_nothing_again(toy: Toy, tmp_path: Path,
                                                                                    monkeypatch) -> None:
    strict = toy.distill.model_copy(update={"max_ratio": 0.01})  # no output is within 1/100 of its source
    with pytest.raises(DistillError) as e:
        distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, strict, tmp_path)
    _, removed = expected_rows(toy, toy.teachers[:1], strict)
    assert str(e.value) == (
        f"no teacher translation was kept: the teachers' translations of all {TRAIN_ROWS} training sources "
        f"were dropped (empty: {removed['empty']}, copy: {removed['copy']}, ratio: {removed['ratio']}); raise "
        "distill.max_ratio or set distill.drop_copies: false, or check that the teachers translate en->de "
        "(distill.teachers)")
    assert [p.name for p in (tmp_path / "distilled").iterdir() if not p.name.startswith(".")] == []
    # the filters run on decoded chunks, which stay: relaxing them decodes nothing again
    monkeypatch.setattr(distill_module, "translate_nbest", None)
    out = distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill, tmp_path)
    assert read_manifest(out)["distillation"]["kept"] > 0


def test_progress_counts_every_source_once(toy: Toy, tmp_path: Path) -> None:
    heard: list[tuple[int, int]] = []
    distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill, tmp_path,
                   progress=lambda done, total: heard.append((done, total)))
    assert heard[0] == (0, TRAIN_ROWS) and heard[-1] == (TRAIN_ROWS, TRAIN_ROWS)
    assert [d for d, _ in heard] == sorted(d for d, _ in heard)


# ------------------------------------------------------------------------------------------ refusals


def test_a_teacher_of_another_tokenizer_is_refused_before_decoding(toy: Toy, tmp_path: Path, monkeypatch) -> None:
    other = write_teacher(tmp_path / "other.pt", toy.tokenizer, 0, tokenizer_sha256="f" * 64)
    monkeypatch.setattr(distill_module, "translate_nbest", None)
    with pytest.raises(CheckpointError, match=f"^{other} was trained with tokenizer sha256 ffffffffffffffff"):
        distill_corpus(toy.corpus, [toy.teachers[0], other], toy.tokenizer_dir, toy.distill, tmp_path)
    assert not (tmp_path / "distilled").exists()

    with pytest.raises(DistillError) as e:
        teacher_tokenizer([other], toy.work)
    assert str(e.value) == (
        f"no tokenizer under {toy.work.resolve() / 'tokenizer'} is the one {other} was trained with (sha256 "
        "ffffffffffffffff...): distill in the work dir the teachers were trained in (--work-dir, work_dir), or "
        f"copy their tokenizer folder (<their work dir>/tokenizer/<fingerprint>/) into "
        f"{toy.work.resolve() / 'tokenizer'}")
    with pytest.raises(DistillError, match="^the teachers were trained with different tokenizers "):
        teacher_tokenizer([toy.teachers[0], other], toy.work)
    assert teacher_tokenizer(toy.teachers, toy.work) == toy.tokenizer_dir


def test_a_teacher_of_another_language_pair_or_named_twice_is_refused_before_decoding(toy: Toy, tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """An En-Fr checkpoint given to an En-De corpus would write French targets under an En-De name; a copy of a
    teacher at a second path would weigh one model twice in the ensemble."""
    french = write_teacher(tmp_path / "fr.pt", toy.tokenizer, 0)
    state = torch.load(french, weights_only=True)
    torch.save({**state, "config": {"data": {"src_lang": "en", "tgt_lang": "fr"}}}, french)
    monkeypatch.setattr(distill_module, "translate_nbest", None)  # nothing may be decoded
    with pytest.raises(CheckpointError, match=f"^{french} was trained for en->fr, but the corpus .* is en->de"):
        distill_corpus(toy.corpus, [french], toy.tokenizer_dir, toy.distill, tmp_path)
    with pytest.raises(CheckpointError, match="trained for en->fr"):
        load_models([french], "cpu", toy.tokenizer, pair=(("en", "de"), "config x"))
    copy = tmp_path / "copy.pt"
    copy.write_bytes(toy.teachers[0].read_bytes())
    with pytest.raises(CheckpointError, match=f"^ensemble members {toy.teachers[0]} and {copy} are one model"):
        distill_corpus(toy.corpus, [toy.teachers[0], copy], toy.tokenizer_dir, toy.distill, tmp_path)
    assert not (tmp_path / "distilled").exists()
    # settings that cannot work are refused with the config, before anything runs
    for bad in ("distill.max_ratio=0.5", "distill.decode.beam_size=1000"):
        with pytest.raises(ConfigError, match=bad.split("=")[0].replace(".", r"\.")):
            toy_config(toy.root, tmp_path, bad)


def test_one_model_twice_is_refused_by_translate_and_evaluate_as_distill_refuses_it(toy: Toy, tmp_path: Path,
                                                                                      capsys) -> None:
    """An ensemble of one model twice, by path or by a byte-identical copy, would weigh it twice: every command that
    decodes an ensemble refuses it with distillation's one line, before decoding (no output at all)."""
    copy = tmp_path / "copy.pt"
    copy.write_bytes(toy.teachers[0].read_bytes())
    (tmp_path / "in.txt").write_text("a man runs\n", encoding="utf-8")
    first = toy.teachers[0]
    args = ["translate", "--data-root", str(toy.root), "--work-dir", str(tmp_path / "work"),
            *(f"--set={s}" for s in TOY), "--tokenizer", str(toy.tokenizer_dir), "--input", str(tmp_path / "in.txt"),
            "--checkpoint", str(first)]
    for second in (first, copy):
        with pytest.raises(CheckpointError) as refused:
            distill_corpus(toy.corpus, [first, second], toy.tokenizer_dir, toy.distill, tmp_path / "work")
        line = str(refused.value)
        assert line == (f"ensemble members {first} and {second} are one model (sha256 {sha256_file(first)[:16]}...: "
                        "the same file, or a copy of it): an ensemble member counts once; name each model once")
        assert main([*args, "--checkpoint", str(second)]) == 2
        assert capsys.readouterr() == ("", f"error: {line}\n")
        with pytest.raises(CheckpointError) as evaluated:  # what evaluate and averaging's choice on dev load with
            load_models([first, second], "cpu", toy.tokenizer)
        assert str(evaluated.value) == line
    assert main([*args, "--checkpoint", str(toy.teachers[1])]) == 0  # two models: an ensemble
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_one_teacher_decodes_through_its_ctranslate2_export(toy: Toy, distilled: Path, tmp_path: Path,
                                                             caplog) -> None:
    """The export translates the training sources (several times faster on a CPU than our engine); its
    translations are the targets, the corpus is another one than our engine's, and an ensemble is refused."""
    from pipeline.engines import CTranslate2Engine
    from pipeline.export import export_checkpoint

    export = export_checkpoint(toy.teachers[0], toy.tokenizer_dir, "float32", tmp_path / "export")
    with caplog.at_level(logging.INFO, logger="aiayn.distill"):
        out = distill_corpus(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill, tmp_path, export=export)
    assert "decoded (ctranslate2)" in caplog.text
    engine = CTranslate2Engine(export, toy.tokenizer)
    hyps = [" ".join(n[0].split()) for n in engine.translate(toy.sources()[0], toy.distill.decode)]
    kept = [(r["origin"], r["line"], r["src"], h) for r, h in zip(rows(toy.corpus), hyps)
            if failure(r["src"], h, toy.distill) is None]
    assert [(r["origin"], r["line"], r["src"], r["tgt"]) for r in rows(out)] == kept
    entry = read_manifest(out)["distillation"]
    assert entry["engine"] == {"ctranslate2": str(export.resolve()), "sha256": sha256_file(export / "model.bin")}
    assert out != distilled  # the same teacher through our engine is another corpus
    with pytest.raises(DistillError, match="decodes one teacher, and 2 were given"):
        distill_corpus(toy.corpus, toy.teachers, toy.tokenizer_dir, toy.distill, tmp_path, export=export)


def test_missing_teachers_and_a_corpus_without_training_split_are_refused(toy: Toy, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pt"
    with pytest.raises(DistillError, match=f"^teacher {missing}: not found; distill.teachers \\(or --teacher\\) "):
        distill_corpus(toy.corpus, [missing], toy.tokenizer_dir, toy.distill, tmp_path)
    with pytest.raises(DistillError, match="^no teachers to distill from"):
        distilled_fingerprint(toy.corpus, [], toy.distill)
    no_train = tmp_path / "no-train"
    no_train.mkdir()
    manifest = read_manifest(toy.corpus)
    del manifest["splits"]["train"]
    (no_train / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DistillError, match=f"^{no_train}: no training split \\(it has \\['dev', 'test.toy-test'\\]\\)"):
        distill_corpus(no_train, toy.teachers[:1], toy.tokenizer_dir, toy.distill, tmp_path)


def test_the_cli_refuses_bad_teachers_and_no_teachers_before_the_data_stage(toy: Toy, tmp_path: Path,
                                                                                   capsys) -> None:
    args = ["distill", "--data-root", str(toy.root), "--work-dir", str(tmp_path), *(f"--set={s}" for s in TOY)]
    assert main([*args, "--teacher", str(toy.teachers[0]), "--teacher", "models:/transformer-en-de@champion"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: distill.teachers ['models:/transformer-en-de@champion']: a registered model is resolved through the "
        "tracking server, which only the distill-translation flow does; run that flow, or name the teachers' "
        "checkpoint files (.pt) here")
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == (
        "error: distill needs teachers: --teacher CHECKPOINT.pt (again for each further member of an ensemble) or "
        "distill.teachers in the config")
    assert main([*args, "--teacher", "teacher.bin"]) == 2
    assert "teacher 'teacher.bin' is neither a registered version" in capsys.readouterr().err
    assert main([*args, "--teacher", str(tmp_path / "none.pt")]) == 2
    assert capsys.readouterr().err.startswith(f"error: teacher {tmp_path / 'none.pt'}: not found; ")
    assert list(tmp_path.iterdir()) == []  # nothing read or written


# ---------------------------------------------------------------------- processes (integration tier)


CHILD = """
import sys, time
from pathlib import Path
from pipeline.config import load_resolved
from pipeline.distill import distill_corpus

corpus, teacher, tokenizer, work, stuck, config = map(Path, sys.argv[1:])
distill = load_resolved(config).distill
chunk = distill.chunk_sentences

def progress(done, total):
    if done > 2 * chunk:  # the third chunk is decoded, not yet written: wait here to be killed
        stuck.touch()
        time.sleep(600)

distill_corpus(corpus, [teacher], tokenizer, distill, work, progress=progress)
"""


@pytest.mark.integration
def test_kill_9_during_decoding_resumes_with_the_first_chunk_not_on_disk(toy: Toy, tmp_path: Path, caplog,
                                                                        monkeypatch) -> None:
    from pipeline.config import write_resolved

    cfg = toy_config(toy.root, toy.work, f"distill.chunk_sentences={CHUNK}")
    config = write_resolved(cfg, tmp_path / "config.yaml")
    work, stuck, teacher = tmp_path / "work", tmp_path / "stuck", toy.teachers[0]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(toy.corpus), str(teacher), str(toy.tokenizer_dir),
                              str(work), str(stuck), str(config)], cwd=REPO, stderr=subprocess.PIPE)
    kill_when_stuck(child, stuck, "its third chunk")
    partial = next((work / "distilled").glob(".*.partial"))
    chunks = sorted(partial.glob("chunk-*.parquet"))
    assert [c.name for c in chunks] == ["chunk-000000.parquet", "chunk-000001.parquet"]
    stamps = {c: c.stat().st_mtime_ns for c in chunks}

    decoded: list[int] = []  # sources per translate_nbest call of the rerun
    real = distill_module.translate_nbest
    monkeypatch.setattr(distill_module, "translate_nbest",
                        lambda model, tok, sentences, *a, **k: decoded.append(len(sentences)) or real(
                            model, tok, sentences, *a, **k))
    heard: list[int] = []

    def progress(done: int, total: int) -> None:
        heard.append(done)
        assert {c: c.stat().st_mtime_ns for c in chunks} == stamps  # the finished chunks stay as they were

    with caplog.at_level(logging.INFO, logger="aiayn.distill"):
        out = distill_corpus(toy.corpus, [teacher], toy.tokenizer_dir, cfg.distill, work, progress=progress)
    assert decoded == [CHUNK, TRAIN_ROWS - 3 * CHUNK] and heard[0] == 2 * CHUNK and heard[-1] == TRAIN_ROWS
    assert f"resuming the distillation in {partial}: 2 of 4 chunks ({2 * CHUNK} of {TRAIN_ROWS} sources) already " \
           "decoded" in caplog.messages
    assert not partial.exists()

    whole = distill_corpus(toy.corpus, [teacher], toy.tokenizer_dir, cfg.distill, tmp_path / "uninterrupted")
    assert whole.name == out.name
    for name in ("train.parquet", MANIFEST):
        assert (whole / name).read_bytes() == (out / name).read_bytes()


@pytest.mark.integration
def test_the_cli_distills_and_a_run_trains_on_the_distilled_corpus(toy: Toy, distilled: Path, tmp_path: Path) -> None:
    teacher = toy.teachers[0]
    res = subprocess.run([sys.executable, "-m", "pipeline", "distill", "--data-root", str(toy.root), "--work-dir",
                          str(toy.work), *(f"--set={s}" for s in TOY), "--teacher", str(teacher)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    entry = read_manifest(distilled)["distillation"]
    lines = res.stdout.splitlines()
    assert lines[0] == f"corpus: {distilled}"  # the folder of the same teacher and settings, reused
    at = lines.index(f"  train distillation (1 teacher, select best of 1): read {TRAIN_ROWS:,}, kept "
                     f"{entry['kept']:,}")
    assert lines[at + 1:] == [
        *(f"    {r['rule']:<14} removed {r['removed']:>9,}   remaining {r['remaining']:>9,}" for r in entry["rules"]),
        "    1 source(s) cut to the teachers' positions"]

    # the whole pipeline's inputs (the CLI's run, torchrun's ranks): tokenizer and shards of the distilled corpus
    cfg = toy_config(toy.root, toy.work, f"distill.teachers=[{teacher}]")
    inputs = build_inputs(cfg)
    assert inputs.corpus == distilled and build_inputs(cfg) == inputs  # a no-op the second time
    tokenizer = json.loads((inputs.tokenizer / MANIFEST).read_text())
    shards = json.loads((inputs.shards / MANIFEST).read_text())
    assert tokenizer["train"]["sha256"] == sha256_file(distilled / "train.parquet")
    assert shards["corpus"]["fingerprint"] == read_manifest(distilled)["fingerprint"]
    assert shards["splits"]["train"]["rows"] == entry["kept"]


# ------------------------------------------------------------------------- translations made elsewhere


@pytest.fixture(scope="module")
def translations(toy: Toy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first teacher's translations of the toy's training sources, as a machine with the teacher (a GPU) writes
    them for one without it."""
    gpu = tmp_path_factory.mktemp("gpu")
    return write_translations(toy.corpus, toy.teachers[:1], toy.tokenizer_dir, toy.distill,
                              gpu / "out" / "translations", gpu / "work", lineage={"commit": "abc1234"})


def test_translations_made_elsewhere_give_the_corpus_the_teachers_would(toy: Toy, distilled: Path,
                                                                        translations: Path, tmp_path: Path) -> None:
    """Decoding on one machine and filtering on another gives the distilled corpus of decoding here, row for row,
    with the teachers' lineage (sha256, config) carried from the machine that had them."""
    made = json.loads((translations / MANIFEST).read_text())
    lines = (translations / "translations.txt").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) - 1 == TRAIN_ROWS == made["rows"]  # one line per source, before filters
    assert made["sha256"] == sha256_file(translations / "translations.txt")
    assert made["source_corpus"]["fingerprint"] == read_manifest(toy.corpus)["fingerprint"]
    assert [t["sha256"] for t in made["teachers"]] == [sha256_file(toy.teachers[0])]
    assert made["teachers"][0]["model_config"]["d_model"] == 32 and made["lineage"] == {"commit": "abc1234"}
    assert made["truncated"] == 1 and sorted(p.name for p in translations.parent.iterdir()) == ["translations"]
    assert sorted(p.name for p in translations.iterdir()) == [MANIFEST, "translations.txt"]  # what travels

    out = distill_from_translations(toy.corpus, translations, toy.distill, tmp_path)
    assert rows(out) == rows(distilled)
    here, there = read_manifest(distilled)["distillation"], read_manifest(out)["distillation"]
    for key in ("read", "rules", "kept", "removed", "truncated", "decode", "nbest", "select", "max_ratio"):
        assert there[key] == here[key], key
    assert [t["sha256"] for t in there["teachers"]] == [t["sha256"] for t in here["teachers"]]
    assert there["translations"] == {"path": str(translations.resolve()), "sha256": made["sha256"],
                                     "lineage": {"commit": "abc1234"}}
    assert distill_from_translations(toy.corpus, translations, toy.distill, tmp_path) == out  # reused
    # the filters run here: relaxing one gives another corpus from the same translations
    relaxed = distill_from_translations(toy.corpus, translations, toy.distill.model_copy(update={"max_ratio": 100.0}),
                                        tmp_path)
    assert relaxed != out and read_manifest(relaxed)["distillation"]["removed"]["ratio"] == 0

    # the CLI's road: distill.translations in the config, the teachers emptied
    cfg = toy_config(toy.root, tmp_path, f"distill.translations={translations}")
    assert build_inputs(cfg).corpus == out


def test_translations_that_do_not_fit_the_corpus_are_refused_naming_the_file(toy: Toy, translations: Path,
                                                                             tmp_path: Path) -> None:
    def copy(edit) -> Path:
        folder = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        manifest = json.loads((translations / MANIFEST).read_text())
        text = (translations / "translations.txt").read_text(encoding="utf-8")
        manifest, text = edit(manifest, text)
        (folder / "translations.txt").write_text(text, encoding="utf-8")
        (folder / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
        return folder

    def refused(folder: Path, *words: str) -> None:
        with pytest.raises(DistillError) as e:
            distill_from_translations(toy.corpus, folder, toy.distill, tmp_path / "work")
        assert all(w in str(e.value) for w in words), str(e.value)
        assert not (tmp_path / "work" / "distilled").is_dir() or not any(
            (p / MANIFEST).is_file() for p in (tmp_path / "work" / "distilled").iterdir())

    def resealed(manifest: dict, text: str) -> tuple[dict, str]:  # the manifest's sha256 made to match the text
        import hashlib
        return {**manifest, "sha256": hashlib.sha256(text.encode()).hexdigest()}, text

    refused(copy(lambda m, t: (m, t.replace("\n", "\nx ", 1))), "translations.txt", "changed since it was written")
    refused(copy(lambda m, t: resealed(m, t.split("\n", 1)[1])), "translations.txt", f"{TRAIN_ROWS:,} training")
    other = {"fingerprint": "f" * 64, "sources_sha256": "0" * 64}
    refused(copy(lambda m, t: ({**m, "source_corpus": {**m["source_corpus"], **other}}, t)), MANIFEST,
            "other training sources", "corpus ffffffffffffffff")
    refused(copy(lambda m, t: ({**m, "source_corpus": {**m["source_corpus"], "tgt_lang": "fr"}}, t)),
            "translations en->fr", "en->de")
    refused(copy(lambda m, t: ({**m, "format": "something/1"}, t)), "format 'something/1'")
    refused(tmp_path / "nowhere", "nowhere", "not a folder")


def test_teachers_and_translations_are_one_or_the_other(toy: Toy, translations: Path) -> None:
    with pytest.raises(ConfigError, match="distill.teachers .* and distill.translations .* both set"):
        toy_config(toy.root, toy.root, f"distill.teachers=[{toy.teachers[0]}]",
                   f"distill.translations={translations}")
