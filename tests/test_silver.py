"""Semi-supervised parsing (pipeline/silver.py): unlabelled English as treebank words, checked against dev and
test; the teachers' silver trees kept by the rule confident beside every gold tree; resumable and cached by
content; and a tiny run end to end (a parser trained as the teacher, a student on gold and silver trees)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import silver as silver_module
from pipeline.config import ConfigError, load_config
from pipeline.data import DataError, prepare_corpus, read_manifest
from pipeline.distill import confident
from pipeline.inference import load_models
from pipeline.parsing.evaluate import parse
from pipeline.parsing.trees import repair
from pipeline.silver import RULES, overlap_key, prepare_unlabelled, silver_corpus
from pipeline.support.fsutil import sha256_file
from pipeline.tokenize import Tokenizer, train_tokenizer
from tests.test_distill import write_teacher

REPO = Path(__file__).resolve().parents[1]
PTB = "ptb-sample/combined"
# A few sample files: train wsj_0001-0009, dev wsj_0010, test wsj_0011 (as the tiny parsing run of test_parsing)
SPLITS = ["data.train=[{name: ptb-sample-train, format: ptb, path: ptb-sample/combined, include: ['wsj_000?.mrg']}]",
          "data.dev.include=['wsj_0010.mrg']",
          "data.test=[{name: ptb-sample-test, format: ptb, path: ptb-sample/combined, include: ['wsj_0011.mrg']}]",
          "tokenizer.vocab_size=600"]
# greedy, and little room beyond a tree's shortest form: the constraint still makes every output a tree
DECODE = ["distill.decode.beam_size=1", "distill.decode.max_len_b=10", "distill.chunk_sentences=8"]
NEWS = ["Food: Where European inflation slipped up", "The skyward zoom in food prices is the dominant force.",
        'He said, "Don\'t (yet)."', "Prices rose 3/4 of a point.", "", "Markets fell sharply on Monday.",
        "The company, which was founded in 1990, reported a loss.", "Markets fell sharply on Monday.",
        "Analysts expected more.", "Oil prices climbed to a record high.", "Shares of the bank dropped.",
        "It was the third quarterly loss in a row.", "Officials declined to comment.",
        "The euro gained against the dollar.", "Investors remained cautious.", "Sales grew in Asia.",
        "Unemployment fell to its lowest level in years.", "The central bank left rates unchanged.",
        "Exports slowed.", "The report will be published next week."]


class Semi:
    """A parsing corpus of a few sample files, its tokenizer, a random teacher and unlabelled news, in one root."""

    def __init__(self, shared: Path, folder: Path):
        self.root, self.work = folder / "data", folder / "work"
        (self.root / PTB).mkdir(parents=True)
        for name in [f"wsj_000{i}.mrg" for i in range(1, 10)] + ["wsj_0010.mrg", "wsj_0011.mrg"]:
            shutil.copyfile(shared / PTB / name, self.root / PTB / name)
        self.news = self.root / "news" / "a.en"
        self.news.parent.mkdir()
        self.news.write_text("".join(line + "\n" for line in NEWS), encoding="utf-8")
        self.cfg = load_config("ptb-sample-semi-cpu", [("data.root", str(self.root)), ("work_dir", str(self.work)),
                                                       *SPLITS, *DECODE, "distill.unlabelled=[news/a.en]"])
        self.corpus = prepare_corpus(self.cfg.data, self.work)
        self.tokenizer_dir = train_tokenizer(self.corpus, self.cfg.tokenizer, self.work)
        self.tokenizer = Tokenizer(self.tokenizer_dir)
        self.teacher = write_teacher(folder / "teacher.pt", self.tokenizer, 0)

    def unlabelled(self, files: list[str] | None = None) -> Path:
        return prepare_unlabelled(files or self.cfg.distill.unlabelled, self.root, self.corpus, self.work)

    def silver(self, work: Path | None = None, **distill) -> Path:
        return silver_corpus(self.corpus, [self.teacher], self.tokenizer_dir,
                             self.cfg.distill.model_copy(update=distill), self.unlabelled(), work or self.work)


@pytest.fixture(scope="module")
def semi(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Semi:
    return Semi(shared_data, tmp_path_factory.mktemp("semi"))


def rows(folder: Path, split: str = "train") -> list[dict]:
    return pq.read_table(folder / f"{split}.parquet").to_pylist()


# ------------------------------------------------------------------------------------------------ the rule


def test_confident_keeps_the_most_confident_fraction_ties_in_corpus_order() -> None:
    scores = [-1.0, -0.2, -3.0, -0.2, -0.5]
    assert confident(scores, 0.4) == ([False, True, False, True, False], -0.2)
    assert confident(scores, 0.5) == ([False, True, False, True, True], -0.5)  # ceil(2.5): three
    assert confident(scores, 0.2) == ([False, True, False, False, False], -0.2)  # the tie goes to the first
    assert confident(scores, 1.0) == ([True] * 5, -3.0)
    assert confident([], 0.5) == ([], None)


def test_the_semi_config_names_the_news_sentences_and_its_rule() -> None:
    cfg = load_config("ptb-sample-semi-cpu")
    assert cfg.task == "parsing" and cfg.distill.keep_original and cfg.distill.keep_fraction == 0.5
    assert cfg.distill.unlabelled[-1] == "wmt14-en-de/newstest2013.en" and len(cfg.distill.unlabelled) == 7
    assert cfg.distill.decode.tree_constraint and cfg.distill.decode.length_penalty == cfg.decode.length_penalty
    with pytest.raises(ConfigError, match="parse unlabelled sentences"):
        load_config("ptb-sample-cpu", ["distill.teachers=[t.pt]"])
    with pytest.raises(ConfigError, match="keep_original: true"):
        load_config("ptb-sample-semi-cpu", ["distill.keep_original=false"])
    with pytest.raises(ConfigError, match="nbest: 1 and select: best"):
        load_config("ptb-sample-semi-cpu", ["distill.nbest=2", "distill.decode.beam_size=4"])
    with pytest.raises(ConfigError, match="is for task parsing"):
        load_config("multi30k-cpu", ["distill.unlabelled=[news/a.en]"])


def test_parse_wsj_refuses_unlabelled_text_without_teachers_and_a_teacher_of_another_task(monkeypatch) -> None:
    """Refused while resolving the configs, before any stage or teacher run (the flow's body, without Prefect)."""
    from flows.parsing import parse_wsj

    monkeypatch.delenv("AIAYN_DATA_ROOT", raising=False)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)
    with pytest.raises(ConfigError, match="no teachers to parse them: pass -p teacher_configs"):
        parse_wsj.fn(config="ptb-sample-semi-cpu")
    with pytest.raises(ConfigError, match="has no distill.unlabelled"):
        parse_wsj.fn(config="ptb-sample-cpu", teacher_configs=["ptb-sample-cpu"])
    with pytest.raises(ValueError, match=r"config 'multi30k-cpu' has \{'task': 'translation'.*parse-wsj "
                                         r"\(teacher_configs\) needs"):
        parse_wsj.fn(config="ptb-sample-semi-cpu", teacher_configs=["multi30k-cpu"])


# ------------------------------------------------------------------------------------------- unlabelled text


@pytest.mark.integration
def test_unlabelled_sentences_are_treebank_words_without_blanks_or_repeats(semi: Semi) -> None:
    folder = semi.unlabelled()
    got = rows(folder)
    assert got[2]["src"] == "He said , `` Do n't -LRB- yet -RRB- . ''" and got[3]["src"].endswith("3\\/4 of a point .")
    assert [r["line"] for r in got] == [n for n in range(1, len(NEWS) + 1) if n not in (5, 8)]  # blank, repeat
    source = json.loads((folder / "manifest.json").read_text())["sources"][0]
    assert source == {"path": "news/a.en", "sha256": sha256_file(semi.news), "lines": len(NEWS), "blank": 1,
                      "repeated": 1}
    assert semi.unlabelled() == folder  # reused by content


@pytest.mark.integration
def test_an_unlabelled_file_holding_a_dev_or_test_sentence_is_refused_naming_file_and_line(semi: Semi) -> None:
    words = rows(semi.corpus, "test.ptb-sample-test")[0]["src"].split()
    raw = " ".join(words).replace(" ,", ",").replace(" .", ".").replace("``", '"').replace("''", '"')
    assert raw != " ".join(words) and overlap_key(words) == overlap_key(raw.split())
    leaky = semi.root / "news" / "leaky.en"
    leaky.write_text(f"{NEWS[0]}\n{NEWS[1]}\n{raw}\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{leaky}: line 3 is the test\.ptb-sample-test sentence 1 of "
                                        r"ptb-sample-test \(distill\.unlabelled\[1\]\)"):
        semi.unlabelled(["news/a.en", "news/leaky.en"])
    assert not list((semi.work / "unlabelled").glob(".*tmp*"))  # nothing half-written is left


# ------------------------------------------------------------------------------------------- the silver corpus


@pytest.mark.integration
def test_the_corpus_is_every_gold_tree_then_the_confident_silver_trees_with_lineage(semi: Semi) -> None:
    out = semi.silver()
    unlabelled = rows(semi.unlabelled())
    sentences = [r["src"] for r in unlabelled]
    confidence: list[float] = []
    model = load_models([semi.teacher], "cpu", semi.tokenizer)
    _, parsed = parse(model, semi.tokenizer, sentences, semi.cfg.distill.decode, leaves="words",
                      confidence=confidence)
    assert not any(fixed.needed for _, fixed in parsed)  # the constraint: every output a tree
    kept, threshold = confident(confidence, semi.cfg.distill.keep_fraction)
    gold, got = rows(semi.corpus), rows(out)
    assert got[:len(gold)] == gold
    silver = got[len(gold):]
    assert [(r["origin"], r["line"], r["src"]) for r in silver] == [
        (u["origin"], u["line"], u["src"]) for u, keep in zip(unlabelled, kept) if keep]
    assert len(silver) == math.ceil(len(sentences) / 2)
    for row in silver:  # a tree over exactly the sentence's words, as the gold targets are written
        assert not repair(row["tgt"], row["src"].split(), leaves="words")[1].needed
    for split in ("dev", "test.ptb-sample-test"):
        assert rows(out, split) == rows(semi.corpus, split)
    entry = read_manifest(out)["distillation"]
    assert entry["teachers"] == [{"path": str(semi.teacher.resolve()), "sha256": sha256_file(semi.teacher)}]
    assert entry["unlabelled"]["sources"][0]["sha256"] == sha256_file(semi.news)
    # the stage decodes in chunks, batched otherwise than one parse of every sentence: the same confidences up to
    # float rounding, which depends on the batch's shape and the CPU's kernels
    assert entry["rule"] == {"name": "confident", "keep_fraction": 0.5, "threshold": pytest.approx(threshold, rel=1e-6)}
    assert (entry["read"], entry["kept"], entry["references"]) == (len(sentences), len(silver), len(gold))
    assert [r["rule"] for r in entry["rules"]] == list(RULES) and entry["removed"]["unconfident"] == len(
        sentences) - len(silver)


@pytest.mark.integration
def test_a_rerun_is_reused_and_other_content_or_rule_gives_another_corpus(semi: Semi, monkeypatch) -> None:
    out = semi.silver()
    monkeypatch.setattr(silver_module, "parse", None)  # any decoding would fail
    assert semi.silver() == out
    monkeypatch.undo()
    assert semi.silver(keep_fraction=1.0) != out
    other = semi.root / "news" / "b.en"
    other.write_text(semi.news.read_text(encoding="utf-8") + "Bonds rallied.\n", encoding="utf-8")
    assert prepare_unlabelled(["news/b.en"], semi.root, semi.corpus, semi.work) != semi.unlabelled()


@pytest.mark.integration
def test_a_decode_killed_after_a_chunk_resumes_with_the_chunks_not_on_disk(semi: Semi, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """The decode dies (as a killed process would) while the second chunk is parsed; the rerun parses only the
    chunks after the first and gives the corpus an uninterrupted run gives."""
    whole = semi.silver(tmp_path / "whole")
    calls: list[int] = []
    real = silver_module.parse

    def dying(*args, **kwargs):
        calls.append(len(args[2]))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(silver_module, "parse", dying)
    with pytest.raises(KeyboardInterrupt):
        semi.silver(tmp_path / "resumed")
    monkeypatch.setattr(silver_module, "parse", lambda *a, **k: (calls.append(len(a[2])), real(*a, **k))[1])
    resumed = semi.silver(tmp_path / "resumed")
    sentences = len(rows(semi.unlabelled()))
    assert calls[0] == 8 and sum(calls[2:]) == sentences - 8  # the first chunk was not parsed again
    assert sha256_file(resumed / "train.parquet") == sha256_file(whole / "train.parquet")
    assert not list((tmp_path / "resumed" / "distilled").glob(".*.partial"))


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_a_teacher_trained_first_and_a_student_on_gold_and_silver_trees(shared_data: Path, tmp_path: Path,
                                                                        mlflow_server) -> None:
    """Through the CLI: a tiny parser trained a few updates is the teacher; it parses the few hundred sentences
    of newssyscomb2009; the student trains a few updates on the gold and the kept silver trees; the silver
    corpus's lineage reaches MLflow as the distill stage logs it."""
    tiny = [*SPLITS, "model.encoder_layers=1", "model.decoder_layers=1", "model.d_model=32", "model.n_heads=2",
            "model.d_ff=64", "train.max_steps=4", "train.max_tokens=2048", "train.update_tokens=2048",
            "train.warmup_steps=2", "train.checkpoint_every_steps=2", "train.dev_every_steps=1000",
            "average.last_n=2", "decode.beam_size=1", "decode.max_len_b=10"]

    def run(config: str, *sets: str) -> str:
        cmd = [sys.executable, "-m", "pipeline", "run", "--config", config, "--data-root", str(shared_data),
               "--work-dir", str(tmp_path), *[a for s in [*tiny, *sets] for a in ("--set", s)]]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    out = run("ptb-sample-cpu")
    teacher = next(line for line in out.splitlines() if line.startswith("averaged: ")).split(": ", 1)[1]
    out = run("ptb-sample-semi-cpu", f"distill.teachers=[{teacher}]", *DECODE[:2], "distill.chunk_sentences=128",
              "distill.unlabelled=[wmt-en-de-older-newstest/newssyscomb2009.en]")
    assert "EVALB F1" in out and "train distillation (1 teacher" in out
    corpus = Path(next(line for line in out.splitlines() if line.startswith("corpus: ")).split(": ", 1)[1])
    manifest = read_manifest(corpus)
    entry = manifest["distillation"]
    news = shared_data / "wmt-en-de-older-newstest" / "newssyscomb2009.en"
    assert entry["teachers"][0]["sha256"] == sha256_file(Path(teacher))
    assert entry["unlabelled"]["sources"][0]["sha256"] == sha256_file(news)
    assert entry["read"] > 400 and entry["kept"] == math.ceil((entry["read"] - entry["removed"]["ill_formed"]) / 2)
    assert manifest["splits"]["train"]["rows"] == entry["references"] + entry["kept"]
    assert list((tmp_path / "train").glob("*/averaged/*.pt"))  # the student trained and averaged too

    from mlflow import MlflowClient

    from pipeline import tracking

    experiment = tracking.connect(mlflow_server, "semi-supervised-lineage")
    run_id = MlflowClient().create_run(experiment).info.run_id
    metrics = tracking.log_distillation(run_id, corpus, [teacher])
    tags = MlflowClient().get_run(run_id).data.tags
    assert (metrics["distill.read"], metrics["distill.kept"]) == (entry["read"], entry["kept"])
    assert tags["distill.rule"] == "confident" and tags["distill.keep_fraction"] == "0.5"
    assert tags["distill.threshold"] == str(entry["rule"]["threshold"])
    assert tags["distill.unlabelled.0"] == f"wmt-en-de-older-newstest/newssyscomb2009.en sha256:{sha256_file(news)}"
    assert tags["distill.teacher_sha256.0"] == sha256_file(Path(teacher))


@pytest.mark.slow
@pytest.mark.integration
def test_the_semi_supervised_deployment_trains_its_teacher_then_its_parser_and_reuses_the_silver_trees(
        stack, shared_data: Path, tmp_path: Path) -> None:
    """``parse-wsj/ptb-sample-semi-cpu`` on the local stack, as a user runs it: the teacher config trains and
    registers as a child flow run, its version parses the unlabelled news into the silver corpus (a cached stage
    task whose digest is recorded), the parser trains on gold and silver trees and registers with the silver
    corpus's lineage; run again, the silver trees come from the cache."""
    import yaml
    from mlflow.tracking import MlflowClient

    from ops.localstack import free_port
    from pipeline.config import write_resolved

    port = free_port()
    teacher_model, parser_model = f"transformer-en-tree-teacher-{port}", f"transformer-en-tree-{port}"
    # the flat overrides a deployment takes (section.field): the dev split as a whole source
    splits = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in SPLITS) if k != "data.dev.include"}
    tiny = splits | {
        "data.dev": {"name": "ptb-sample-dev", "format": "ptb", "path": PTB, "include": ["wsj_0010.mrg"]},
        "model.encoder_layers": 1, "model.decoder_layers": 1, "model.d_model": 32, "model.n_heads": 2,
        "model.d_ff": 64, "train.max_tokens": 2048, "train.update_tokens": 2048, "train.warmup_steps": 2,
        "train.checkpoint_every_steps": 2, "train.dev_every_steps": 1000, "average.last_n": 2,
        "decode.beam_size": 1, "decode.max_len_b": 10, "tracking.experiment": "semi-deployment",
        "tracking.attention_sentences": 0}
    teacher = write_resolved(load_config("ptb-sample-cpu", {**tiny, "tracking.registered_model": teacher_model}),
                             tmp_path / "teacher.yaml")
    parser = {**tiny, **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in DECODE)},
              "distill.chunk_sentences": 128, "distill.unlabelled": ["wmt-en-de-older-newstest/newssyscomb2009.en"],
              "tracking.registered_model": parser_model}
    params = {"config": "ptb-sample-semi-cpu", "data_root": str(shared_data), "overrides": parser, "max_steps": 4,
              "teacher_configs": [str(teacher)]}
    prefect, mlflow = stack["prefect"], MlflowClient(stack["mlflow"])

    status, _, first = prefect.run_deployment("parse-wsj/ptb-sample-semi-cpu", params)
    assert status == 0, prefect.logs(first)[-4000:]
    assert prefect.task_states(first)["silver-corpus"] == "Completed"
    (version,) = mlflow.search_model_versions(f"name = '{teacher_model}'")
    label = f"{teacher_model}/{version.version}"
    exp = mlflow.get_experiment_by_name("semi-deployment")
    (parent,) = mlflow.search_runs([exp.experiment_id], f"tags.`prefect.flow_run_id` = '{first}'")
    (distill,) = mlflow.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                                         "tags.stage = 'distill'")
    tags, metrics = distill.data.tags, distill.data.metrics
    news = shared_data / "wmt-en-de-older-newstest" / "newssyscomb2009.en"
    assert tags["distill.teachers"] == label and tags["distill.rule"] == "confident" and tags["cached"] == "false"
    assert tags["distill.unlabelled.0"] == f"wmt-en-de-older-newstest/newssyscomb2009.en sha256:{sha256_file(news)}"
    assert metrics["distill.read"] > 400 and 0 < metrics["distill.kept"] < metrics["distill.read"]
    (parsed,) = mlflow.search_model_versions(f"name = '{parser_model}'")
    assert parsed.tags["distill.teachers"] == label and parsed.tags["promotion.decision"] == "promoted"

    status, _, second = prefect.run_deployment("parse-wsj/ptb-sample-semi-cpu", params)
    assert status == 0, prefect.logs(second)[-4000:]
    assert prefect.task_states(second)["silver-corpus"] == "Cached", prefect.logs(second)[-6000:]
