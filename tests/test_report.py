"""The run report's markdown (pipeline.report), built from hand-written stage files in tmp_path: no servers,
no shared data, no Prefect."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from pipeline.average import CHOICE
from pipeline.config import RunConfig, load_config
from pipeline.promotion import Comparison, Decision, Guard
from pipeline.report import _scores_rows, evidence_rows, render_report, score_rows

BLEU_SIG = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.0"
CHRF_SIG = "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.4.0"
PAIRED_SIG = "nrefs:1|bs:1000|seed:12345|case:mixed|eff:no|tok:13a|smooth:exp|version:2.4.0"
URL = "http://127.0.0.1:5000/#/experiments/1/runs/abc123"


def write(path: Path, obj: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def corpus_manifest() -> dict:
    """The fields of a corpus manifest.json (pipeline/data/corpus.py) the report reads."""
    rules = [("empty", 1), ("too_short", 2), ("too_long", 30), ("ratio", 4), ("contaminated", 5), ("duplicate", 1200)]
    standing, rows = 31_242, []
    for rule, removed in rules:
        standing -= removed
        rows.append({"rule": rule, "removed": removed, "remaining": standing})
    return {"src_lang": "en", "tgt_lang": "de", "splits": {
        "dev": {"role": "dev", "name": "multi30k-val", "file": "dev.parquet", "rows": 1014},
        "test.flickr2016": {"role": "test", "name": "flickr2016", "file": "test.flickr2016.parquet", "rows": 1000},
        "train": {"role": "train", "file": "train.parquet", "rows": standing,
                  "cleaning": {"read": 31_242, "rules": rows, "kept": standing}},
    }, "inputs": {"train": [{"name": "multi30k", "bom_stripped": ["multi30k/train.en"]}, {"name": "extra"}],
                  "dev": [{"name": "multi30k-val", "bom_stripped": []}]}}


def shards_manifest() -> dict:
    """The fields of a shards manifest.json (pipeline/shards.py) the report reads."""
    side = lambda tokens, mean, unk: {"tokens": tokens, "mean_len": mean, "unk_rate": unk}  # noqa: E731
    return {"tokenizer": {"vocab_size": 8000, "model_type": "bpe"},
            "splits": {"train": {"rows": 30_000, "src": side(412_345, 13.7448, 0.00012),
                                 "tgt": side(398_765, 13.2922, 0.0)}}}


def train_summary(final_dev: dict | None = None) -> dict:
    """The fields of train_summary.json (pipeline/train/trainer.py) the report reads."""
    return {"steps": 12_345, "epoch": 3, "stopped_by": "max_steps", "world_size": 2, "wall_seconds": 754.2,
            "tokens": {"src": 1_000_000, "tgt": 1_234_567, "sentences": 50_000},
            "final_dev": {"dev_loss": 2.3456, "dev_ppl": 10.44} if final_dev is None else final_dev}


def translation_scores() -> dict:
    """A translation scores.json (pipeline/translation/evaluate.py): named scores with what and signature, plain
    counts."""
    def split(name: str, bleu: float, chrf: float) -> dict:
        return {"name": name,
                "sacrebleu": {"score": bleu, "signature": BLEU_SIG,
                              "what": "detokenized BLEU, sacreBLEU 13a tokenizer, mixed case"},
                "chrf": {"score": chrf, "signature": CHRF_SIG, "what": "sacreBLEU chrF2"},
                "sentences": 1000, "truncated_sources": 0}
    return {"checkpoint": {"path": "x.pt", "sha256": "0" * 64},
            "splits": {"dev": split("multi30k-val", 35.123, 60.5),
                       "test.flickr2016": split("flickr2016", 33.456, 59.25)}}


def parsing_scores() -> dict:
    """A parsing scores.json (pipeline/parsing/evaluate.py): plain float scores next to counts and nested dicts."""
    return {"task": "parsing", "splits": {"test.wsj23": {
        "name": "wsj-23", "sentences": 2416, "precision": 91.87, "recall": 90.59, "f1": 91.2288, "exact_match": 40.12,
        "repaired_rate": 0.0125, "repairs": {"sentences": 30, "unbalanced": 12},
        "evalb": {"labeled": {"all": {"f1": 91.2288}}, "params": "COLLINS.prm"}, "truncated_sources": 0}}}


def stage_files(tmp_path: Path, scores: dict | None = None, choice: dict | None = None,
                final_dev: dict | None = None) -> dict[str, tuple[Path, bool]]:
    """The stage outputs as the flow passes them (name -> (path, reused from cache)), in the flow's order."""
    corpus, tokenizer, shards = tmp_path / "corpus-aaa", tmp_path / "tokenizer-bbb", tmp_path / "shards-ccc"
    run = tmp_path / "runs" / "ddd"
    write(corpus / "manifest.json", corpus_manifest())
    write(shards / "manifest.json", shards_manifest())
    write(run / "train_summary.json", train_summary(final_dev))
    averaged = run / "average" / "eee" / "last5.pt"
    averaged.parent.mkdir(parents=True)
    if choice is not None:
        write(averaged.parent / CHOICE, choice)
    evaluated = write(tmp_path / "eval" / "fff" / "scores.json", translation_scores() if scores is None else scores)
    return {"data": (corpus, True), "tokenizer": (tokenizer, True), "shards": (shards, True), "train": (run, False),
            "average": (averaged, False), "evaluate": (evaluated, False)}


def choice_json(averaged_dir: str = "x") -> dict:
    """choice.json as pipeline.average.choose_last_n writes it."""
    rows = [{"n": n, "steps": [1000 * (10 - n + i + 1) for i in range(n)], "dev": dev, "sha256": "0" * 64,
             "scores": f"{averaged_dir}/dev-last{n}/scores.json"} for n, dev in ((1, 33.1), (5, 35.126), (10, 34.9))]
    return {"metric": "dev sacreBLEU", "chosen_n": 5, "checkpoint": f"{averaged_dir}/last5.pt", "candidates": rows,
            "skipped": [20], "decoding": {"beam_size": 4}}


def promoted_decision() -> dict:
    """A promotion decision with a paired test and guards: one guard failed, one on a set new to the champion."""
    comparison = Comparison(metric="sacrebleu", segments=1014, champion=34.5, challenger=35.75, delta=1.25,
                            ci_low=0.31, ci_high=2.2, p_value=0.0123, resamples=1000, signature=PAIRED_SIG)
    guards = [Guard(set="flickr2016", metric="chrf", challenger=59.25, champion=59.0),
              Guard(set="newstest2014", metric="chrf", challenger=40.0, champion=42.5),
              Guard(set="mscoco2017", metric="chrf", challenger=50.0, champion=None)]
    return Decision(decision="not promoted", version="3", reason="guard failed: newstest2014 (chrf drop 2.50 > 1.0)",
                    champion_version="2", set="multi30k-val", set_role="dev", comparison=comparison, guards=guards,
                    failed_guards=["newstest2014"]).as_dict()


@pytest.fixture(scope="module")
def cfg() -> RunConfig:
    return load_config("multi30k-cpu")


def test_header_tracking_link_and_stage_rows(tmp_path: Path, cfg: RunConfig) -> None:
    stages = stage_files(tmp_path)
    text = render_report(cfg, stages, None, URL)
    lines = text.splitlines()
    assert lines[0] == f"# {cfg.name}: {cfg.data.src_lang}->{cfg.data.tgt_lang}, preset `{cfg.preset}`"
    assert lines[0] == "# multi30k-cpu: en->de, preset `tiny`"
    assert f"Tracking run: [{URL}]({URL})" in lines
    assert "| stage | output | cache |" in lines
    for name, (path, cached) in stages.items():
        assert f"| {name} | `{path}` | {'reused' if cached else 'ran'} |" in lines, name
    assert f"| data | `{tmp_path / 'corpus-aaa'}` | reused |" in lines
    assert f"| train | `{tmp_path / 'runs' / 'ddd'}` | ran |" in lines
    # The stage table lists the stages in the order the flow ran them.
    rows = [line.split(" | ")[0][2:] for line in lines if line.startswith("| ") and "` | " in line]
    assert rows == list(stages)
    assert "Tracking run" not in render_report(cfg, stages, None, None)


def test_data_tokenizer_and_training_sections(tmp_path: Path, cfg: RunConfig) -> None:
    text = render_report(cfg, stage_files(tmp_path), None, None)
    lines = text.splitlines()
    assert "| split | name | pairs |" in lines
    assert "| dev | multi30k-val | 1,014 |" in lines
    assert "| test.flickr2016 | flickr2016 | 1,000 |" in lines
    assert "| train |  | 30,000 |" in lines  # the training split has no name
    assert ("Training pairs read 31,242, kept 30,000; removed by rule: empty 1, too_short 2, too_long 30, ratio 4, "
            "contaminated 5, duplicate 1,200") in lines
    assert "A UTF-8 byte order mark opening 1 file(s) was dropped: `multi30k/train.en`." in lines
    assert ("Vocabulary 8000; training split 412,345 source / 398,765 target tokens, mean length 13.7 / 13.3, "
            "unknown rate 0.0120% / 0.0000%.") in lines
    assert ("12,345 updates, 3 epochs, stopped by `max_steps` after 12.6 min on 2 process(es); 1,234,567 target "
            "tokens this invocation; final dev loss 2.346, ppl 10.44.") in lines
    sections = [line for line in lines if line.startswith("## ")]
    assert sections == ["## Stages", "## Data", "## Tokenizer", "## Training", "## Scores"]


def test_training_names_the_machine_precision_and_recipe(tmp_path: Path, cfg: RunConfig) -> None:
    stages = stage_files(tmp_path)
    run = stages["train"][0]
    summary = json.loads((run / "train_summary.json").read_text())
    write(run / "train_summary.json", {**summary, "machine": "CPU class avx2", "precision": "fp32", "recipe": "fp32"})
    assert ("Machine: CPU class avx2, trained in fp32; compute recipe `fp32` (the config's `recipes.fp32`, applied "
            "over its YAML files).") in render_report(cfg, stages, None, None).splitlines()
    write(run / "train_summary.json", {**summary, "machine": "CPU class amx", "precision": "bf16", "recipe": "none"})
    assert "Machine: CPU class amx, trained in bf16; compute recipe `none`." in render_report(
        cfg, stages, None, None).splitlines()


def test_training_without_final_dev(tmp_path: Path, cfg: RunConfig) -> None:
    lines = render_report(cfg, stage_files(tmp_path, final_dev={}), None, None).splitlines()
    assert ("12,345 updates, 3 epochs, stopped by `max_steps` after 12.6 min on 2 process(es); 1,234,567 target "
            "tokens this invocation.") in lines
    assert not any("final dev loss" in line for line in lines)


def test_translation_scores_rows_escape_signature_pipes(tmp_path: Path, cfg: RunConfig) -> None:
    rows = _scores_rows(translation_scores())
    escaped_bleu, escaped_chrf = BLEU_SIG.replace("|", "\\|"), CHRF_SIG.replace("|", "\\|")
    assert rows == [
        f"| dev (multi30k-val) | sacrebleu | **35.12** | detokenized BLEU, sacreBLEU 13a tokenizer, mixed case "
        f"`{escaped_bleu}` |",
        f"| dev (multi30k-val) | chrf | **60.50** | sacreBLEU chrF2 `{escaped_chrf}` |",
        f"| test.flickr2016 (flickr2016) | sacrebleu | **33.46** | detokenized BLEU, sacreBLEU 13a tokenizer, mixed "
        f"case `{escaped_bleu}` |",
        f"| test.flickr2016 (flickr2016) | chrf | **59.25** | sacreBLEU chrF2 `{escaped_chrf}` |",
    ]  # name, sentences and truncated_sources are no scores
    for row in rows:  # every row has exactly four cells: no unescaped | left
        assert len(row.replace("\\|", "").split("|")) == 6, row
    text = render_report(cfg, stage_files(tmp_path), None, None)
    assert "| split | score | value | what |\n|---|---|---|---|\n" + "\n".join(rows) + "\n" in text


def test_named_score_without_signature_or_what() -> None:
    scores = {"splits": {"dev": {"name": "d", "bleu": {"score": 12.345}}}}
    assert _scores_rows(scores) == ["| dev (d) | bleu | **12.35** |  |"]


def test_parsing_scores_plain_floats(tmp_path: Path) -> None:
    cfg = load_config("ptb-sample-cpu")
    rows = _scores_rows(parsing_scores())
    assert rows == ["| test.wsj23 (wsj-23) | precision | 91.87 | |", "| test.wsj23 (wsj-23) | recall | 90.59 | |",
                    "| test.wsj23 (wsj-23) | f1 | 91.23 | |", "| test.wsj23 (wsj-23) | exact_match | 40.12 | |",
                    "| test.wsj23 (wsj-23) | repaired_rate | 0.0125 | |"]  # ints and nested dicts are skipped
    text = render_report(cfg, stage_files(tmp_path, scores=parsing_scores()), None, None)
    assert text.splitlines()[0] == f"# {cfg.name}: {cfg.data.src_lang}->{cfg.data.tgt_lang}, preset `{cfg.preset}`"
    assert "\n".join(rows) in text and "sacrebleu" not in text


def test_averaging_table_when_choice_exists(tmp_path: Path, cfg: RunConfig) -> None:
    text = render_report(cfg, stage_files(tmp_path, choice=choice_json()), None, None)
    lines = text.splitlines()
    assert "## Averaging" in lines and "N chosen on dev sacreBLEU: **5**." in lines
    table = lines[lines.index("| N | steps | dev |"):]
    assert table[1:5] == ["|---|---|---|", "| 1 | 10000-10000 | 33.10 |", "| 5 | 6000-10000 | 35.13 |",
                          "| 10 | 1000-10000 | 34.90 |"]
    assert lines.index("## Training") < lines.index("## Averaging") < lines.index("## Scores")


def test_no_averaging_section_without_choice(tmp_path: Path, cfg: RunConfig) -> None:
    stages = stage_files(tmp_path)
    # choice.json is looked for beside the averaged checkpoint, not elsewhere in the run.
    write(stages["train"][0] / CHOICE, choice_json())
    text = render_report(cfg, stages, None, None)
    assert "## Averaging" not in text and "| N | steps | dev |" not in text


def test_registry_section_and_evidence_rows(tmp_path: Path, cfg: RunConfig) -> None:
    decision = promoted_decision()
    assert evidence_rows(decision) == [
        ("promotion set", "multi30k-val (dev set, 1014 segments)"),
        ("sacrebleu", "35.75 (champion version 2: 34.50)"),
        ("delta", "+1.25"),
        ("95% CI of delta", "[+0.31, +2.20]"),
        ("p-value (paired bootstrap)", "0.0123"),
        ("test", PAIRED_SIG),
        ("guard flickr2016 chrf", "59.00 -> 59.25"),
        ("guard newstest2014 chrf", "42.50 -> 40.00 **failed**"),
        ("guard mscoco2017 chrf", "new set"),
    ]
    lines = render_report(cfg, stage_files(tmp_path), decision, URL).splitlines()
    assert lines[lines.index("## Registry") + 2] == ("Version 3: **not promoted**. guard failed: newstest2014 "
                                                     "(chrf drop 2.50 > 1.0)")
    table = lines[lines.index("| evidence | value |"):]
    assert table[1] == "|---|---|"
    assert f"| test | {PAIRED_SIG.replace('|', chr(92) + '|')} |" in table  # the signature's | escaped
    assert "| guard newstest2014 chrf | 42.50 -> 40.00 **failed** |" in table
    assert "| guard mscoco2017 chrf | new set |" in table
    assert "| guard flickr2016 chrf | 59.00 -> 59.25 |" in table
    assert "| p-value (paired bootstrap) | 0.0123 |" in table
    assert lines.index("## Scores") < lines.index("## Registry")


@pytest.mark.parametrize("verdict, text", [("promoted", "promoted to **champion**"),
                                           ("not promoted", "**not promoted**"), ("no decision", "no decision")])
def test_registry_verdicts(tmp_path: Path, cfg: RunConfig, verdict: str, text: str) -> None:
    decision = {**promoted_decision(), "decision": verdict, "reason": "because."}
    assert f"Version 3: {text}. because." in render_report(cfg, stage_files(tmp_path), decision, None).splitlines()


def test_first_model_has_registry_section_without_evidence(tmp_path: Path, cfg: RunConfig) -> None:
    decision = Decision(decision="promoted", version="1", reason="first model: no champion to beat").as_dict()
    assert evidence_rows(decision) == []
    text = render_report(cfg, stage_files(tmp_path), decision, None)
    assert "## Registry" in text and "Version 1: promoted to **champion**. first model: no champion to beat" in text
    assert "| evidence | value |" not in text


def test_no_registry_section_without_decision(tmp_path: Path, cfg: RunConfig) -> None:
    text = render_report(cfg, stage_files(tmp_path, choice=choice_json()), None, URL)
    assert "## Registry" not in text and "| evidence | value |" not in text
    assert text.rstrip().splitlines()[-1].startswith("| test.flickr2016 (flickr2016) | chrf |")


def test_pipeline_report_imports_neither_prefect_nor_mlflow() -> None:
    import pipeline.report

    tree = ast.parse(Path(pipeline.report.__file__).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in names if m.split(".")[0] in ("prefect", "mlflow")}, names
    assert not {m for m in names if m in ("pipeline.tracking",) or m.startswith("pipeline.tracking.")}, names


def gate_json(passed: bool) -> dict:
    """gate.json as pipeline.export.gate writes it."""
    return {"split": "dev", "sentences": 1014, "metric": "sacrebleu", "torch_bleu": 36.12, "export_bleu": 35.9 if
            passed else 34.0, "drop": 0.22 if passed else 2.12, "drop_ci95": [-0.1, 0.55] if passed else [1.5, 2.8],
            "p_value": 0.08 if passed else 0.001, "max_bleu_drop": 0.5, "identical": 0.873,
            "export_sentences_per_s": 260.4, "passed": passed, "quantization": "int8"}


@pytest.mark.parametrize("passed", [True, False])
def test_export_gate_section(tmp_path: Path, cfg: RunConfig, passed: bool) -> None:
    stages = stage_files(tmp_path)
    stages["export"] = (write(tmp_path / "export" / "gate.json", gate_json(passed)).parent, False)
    lines = render_report(cfg, stages, None, URL).splitlines()
    assert "## Serving export" in lines
    verdict = ("**passed**: the registered model serves with CTranslate2" if passed else
               "**refused**: the registered model serves with PyTorch")
    assert any(line.startswith(f"CTranslate2, int8 weights: {verdict}") for line in lines)
    assert "| PyTorch sacreBLEU | 36.12 |" in lines and "| identical translations | 87.3% |" in lines
    assert ("| drop (95% CI) | +0.22 [-0.10, +0.55] |" if passed else
            "| drop (95% CI) | +2.12 [+1.50, +2.80] |") in lines
    assert "## Serving export" not in render_report(cfg, stage_files(tmp_path / "other"), None, URL)


def test_score_rows_feed_the_scores_table_artifact() -> None:
    rows = score_rows(translation_scores())
    assert [(r["split"], r["set"], r["metric"], r["value"]) for r in rows] == [
        ("dev", "multi30k-val", "sacrebleu", 35.123), ("dev", "multi30k-val", "chrf", 60.5),
        ("test.flickr2016", "flickr2016", "sacrebleu", 33.456), ("test.flickr2016", "flickr2016", "chrf", 59.25)]
    assert rows[0]["signature"] == BLEU_SIG and all(r["named"] for r in rows)
    parsing = {r["metric"]: r for r in score_rows(parsing_scores())}
    assert parsing["f1"]["value"] == 91.2288 and not parsing["f1"]["named"] and parsing["f1"]["signature"] == ""
    assert "sentences" not in parsing and "repairs" not in parsing  # counts and nested dicts are not scores
