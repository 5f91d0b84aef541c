"""Evaluation: scores named and signed, outputs per test set, the translate command, the whole `run`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.average import average_checkpoints, average_run, averaged_path, choice_dir
from pipeline.checkpoint import CheckpointError, load_checkpoint
from pipeline.config import ConfigError, DecodeConfig
from pipeline.support.fsutil import sha256_file
from pipeline.evaluate import eval_dir, evaluate_checkpoint
from pipeline.inference import load_model, load_models, translate
from pipeline.tokenize import Tokenizer
from pipeline.train import train
from pipeline.translation.bleu import compound_split_tokenize, moses_tokenize, score_translations
from pipeline.translation.evaluate import EVALUATOR, evaluate_translation
from tests.conftest import TINY, tiny_config

REPO = Path(__file__).resolve().parents[1]
FAST_DECODE = DecodeConfig(beam_size=2, max_len_a=0.5, max_len_b=4, batch_sentences=128)


@pytest.fixture(scope="module")
def averaged(shared_data, tiny_stack, tmp_path_factory) -> Path:
    cfg = tiny_config(shared_data, "train.max_steps=30", "train.checkpoint_every_steps=10", "train.lr_scale=2.0")
    run = train(cfg, tiny_stack.shards, tmp_path_factory.mktemp("run"))
    return average_checkpoints(run / "checkpoints", 2, run / "averaged" / "last2.pt")


def test_scores_are_named_signed_and_exact_on_references() -> None:
    refs = ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.", "Ein Terrier läuft über saftig-grünes Gras."]
    s = score_translations(refs, refs, "de")
    assert {k: s[k]["score"] for k in ("sacrebleu", "chrf", "tok_bleu_compound_split")} == {
        "sacrebleu": 100.0, "chrf": 100.0, "tok_bleu_compound_split": 100.0}
    assert "tok:13a" in s["sacrebleu"]["signature"] and "tok:none" in s["tok_bleu_compound_split"]["signature"]
    assert "nc:6" in s["chrf"]["signature"]
    worse = score_translations(["Ein Mann.", "Ein Hund läuft."], refs, "de")
    assert 0 < worse["sacrebleu"]["score"] < 100
    with pytest.raises(ValueError, match="1 hypotheses for 2 references"):
        score_translations(refs[:1], refs, "de")


def test_compound_splitting_follows_get_ende_bleu() -> None:
    assert compound_split_tokenize(["saftig-grünes Gras, a-b-c."], "de") == [
        "saftig ##AT##-##AT## grünes Gras , a ##AT##-##AT## b-c ."]


def test_compound_splitting_is_for_german_targets_only() -> None:
    """The paper's tokenized BLEU splits hyphenated compounds for German output (get_ende_bleu.sh); any other
    target language gets Moses-tokenized BLEU under its own name, ``tok_bleu``."""
    refs = ["Un homme en t-shirt rouge est-il là ?", "Deux chiens jouent dans la neige."]
    assert moses_tokenize(refs[:1], "fr") == ["Un homme en t-shirt rouge est-il là ?"]
    fr = score_translations(["Un homme en t-shirt bleu est-il là ?", refs[1]], refs, "fr")
    assert "tok_bleu_compound_split" not in fr and "no compound splitting" in fr["tok_bleu"]["what"]
    assert "tok:none" in fr["tok_bleu"]["signature"] and 0 < fr["tok_bleu"]["score"] < 100
    de = score_translations(["Ein Mann im rot-weißen Hemd.", "Zwei Hunde."], ["Ein Mann im rot-weißen Hemd.",
                                                                               "Zwei Hunde spielen."], "de")
    assert "tok_bleu" not in de and "compounds split" in de["tok_bleu_compound_split"]["what"]
    assert EVALUATOR.summary(fr).endswith(f"tokenized BLEU {fr['tok_bleu']['score']:6.2f}")
    assert "tokenized compound-split BLEU" in EVALUATOR.summary(de)


@pytest.mark.integration
def test_evaluate_writes_hypotheses_samples_and_scores(averaged, tiny_stack, tmp_path) -> None:
    out = evaluate_translation(averaged, tiny_stack.tokenizer, tiny_stack.corpus, FAST_DECODE, tmp_path,
                               splits=["test.test2016"])
    report = json.loads(out.read_text())
    split = report["splits"]["test.test2016"]
    assert split["name"] == "test2016" and split["sentences"] == 1000
    for key in ("sacrebleu", "chrf", "tok_bleu_compound_split"):
        assert 0 <= split[key]["score"] <= 100 and split[key]["signature"] and split[key]["what"]
    assert report["decoding"]["beam_size"] == 2 and len(report["checkpoint"]["sha256"]) == 64
    hyps = (tmp_path / "test.test2016.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 1000
    samples = (tmp_path / "test.test2016.samples.md").read_text(encoding="utf-8")
    assert samples.count("\n| ") == 20 + 1  # header + 20 rows
    # The hypotheses file is exactly what translate() produces for the corpus sources, in corpus order.
    src = pq.read_table(tiny_stack.corpus / "test.test2016.parquet").column("src").to_pylist()[:50]
    assert translate(load_model(averaged), Tokenizer(tiny_stack.tokenizer), src, FAST_DECODE) == hyps[:50]
    rows = json.loads((tmp_path / "test.test2016.samples.json").read_text(encoding="utf-8"))
    assert [(r["source"], r["hypothesis"]) for r in rows] == list(zip(src[:20], hyps[:20]))
    with pytest.raises(ValueError, match=r"no split \['test.nope'\]"):
        evaluate_translation(averaged, tiny_stack.tokenizer, tiny_stack.corpus, FAST_DECODE, tmp_path,
                             splits=["test.nope"])


@pytest.mark.integration
def test_a_finished_evaluation_is_reused_until_what_made_it_changes(averaged, tiny_stack, tmp_path) -> None:
    """Re-running a finished run decodes nothing again; other settings, or a lost output file, decode anew."""
    def evaluate(decode: DecodeConfig) -> dict:
        out = evaluate_translation(averaged, tiny_stack.tokenizer, tiny_stack.corpus, decode, tmp_path,
                                   splits=["dev"])
        return {"decoding": json.loads(out.read_text())["decoding"],
                **{f.name: f.stat().st_mtime_ns for f in (out, tmp_path / "dev.hyp")}}

    first = evaluate(FAST_DECODE)
    assert evaluate(FAST_DECODE) == first  # not written again
    greedy = evaluate(FAST_DECODE.model_copy(update={"beam_size": 1}))
    assert greedy["decoding"]["beam_size"] == 1 and greedy["dev.hyp"] != first["dev.hyp"]
    (tmp_path / "dev.hyp").unlink()
    again = evaluate(FAST_DECODE.model_copy(update={"beam_size": 1}))
    assert (tmp_path / "dev.hyp").is_file() and again["scores.json"] != greedy["scores.json"]


@pytest.mark.integration
def test_translate_command_reads_stdin(averaged, tiny_stack, shared_data) -> None:
    lines = ["A man  is riding a bike.", "Two dogs play in the snow.", "A girl\tsmiles."]
    cmd = [sys.executable, "-m", "pipeline", "translate", "--checkpoint", str(averaged), "--tokenizer",
           str(tiny_stack.tokenizer), "--set", "decode.beam_size=2", "--set", "decode.max_len_b=4"]
    res = subprocess.run(cmd, input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=REPO, timeout=300,
                         env={**os.environ, "AIAYN_DATA_ROOT": str(shared_data)})
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    decode = DecodeConfig(beam_size=2, max_len_b=4)
    normalised = ["A man is riding a bike.", "Two dogs play in the snow.", "A girl smiles."]
    assert out == translate(load_model(averaged), Tokenizer(tiny_stack.tokenizer), normalised, decode)
    res = subprocess.run([sys.executable, "-m", "pipeline", "translate"], input="x\n", capture_output=True, text=True,
                         cwd=REPO, timeout=120, env={**os.environ, "AIAYN_DATA_ROOT": str(shared_data)})
    assert res.returncode == 2 and "needs --checkpoint" in res.stderr


@pytest.mark.integration
def test_several_checkpoints_evaluate_and_translate_as_their_ensemble(averaged, tiny_stack, shared_data) -> None:
    first = averaged.parent.parent / "checkpoints" / "ckpt-00000010.pt"
    cfg = tiny_config(shared_data, "decode.beam_size=2", "decode.max_len_a=0.5", "decode.max_len_b=4")
    out = evaluate_checkpoint(cfg, [averaged, first], tiny_stack.corpus, tiny_stack.tokenizer, splits=["dev"])
    # named by the members, in any order, and by the decoding settings
    assert out.parent == eval_dir(cfg, [first, averaged]) != eval_dir(cfg, averaged)
    assert eval_dir(cfg, [averaged]) == eval_dir(cfg, averaged)  # a list of one is that one checkpoint
    assert out.parent.name.startswith("eval-ensemble2-")
    report = json.loads(out.read_text())
    assert "checkpoint" not in report and [e["path"] for e in report["ensemble"]] == [str(averaged), str(first)]
    assert report["ensemble"][1]["sha256"] == sha256_file(first)
    tokenizer = Tokenizer(tiny_stack.tokenizer)
    src = pq.read_table(tiny_stack.corpus / "dev.parquet").column("src").to_pylist()[:40]
    hyps = (out.parent / "dev.hyp").read_text(encoding="utf-8").splitlines()[:40]
    ensemble = load_models([averaged, first], tokenizer=tokenizer)
    assert translate(ensemble, tokenizer, src, cfg.decode) == hyps

    cmd = [sys.executable, "-m", "pipeline", "translate", "--tokenizer", str(tiny_stack.tokenizer),
           "--set", "decode.beam_size=2", "--set", "decode.max_len_a=0.5", "--set", "decode.max_len_b=4"]
    env = {**os.environ, "AIAYN_DATA_ROOT": str(shared_data)}
    def cli_translate(*members: Path) -> subprocess.CompletedProcess:
        return subprocess.run(cmd + [a for m in members for a in ("--checkpoint", str(m))], input="\n".join(src[:5]),
                              capture_output=True, text=True, cwd=REPO, timeout=300, env=env)

    res = cli_translate(averaged, first)
    assert res.returncode == 0 and res.stdout.splitlines() == hyps[:5], res.stderr
    res = cli_translate(averaged, averaged)  # one model twice would weigh it twice: refused, as distill refuses it
    assert res.returncode == 2 and not res.stdout and res.stderr.startswith(
        f"error: ensemble members {averaged} and {averaged} are one model"), res.stderr


@pytest.mark.integration
def test_choosing_n_on_dev_scores_every_candidate_and_keeps_the_best(averaged, tiny_stack, shared_data) -> None:
    """average.choose_from: each candidate average decoded on dev, the best kept and recorded; a re-run reuses
    the dev scores of unchanged averages; candidates beyond the checkpoints are skipped, all of them an error."""
    run = averaged.parent.parent  # 3 checkpoints: steps 10, 20, 30
    fast = ("decode.beam_size=2", "decode.max_len_a=0.5", "decode.max_len_b=4", "decode.batch_sentences=128")
    cfg = tiny_config(shared_data, "average.choose_from=[3, 1, 2, 8]", *fast)
    inputs = (tiny_stack.corpus, tiny_stack.tokenizer)
    heard: list[tuple[int, int]] = []
    chosen = average_run(cfg, run, *inputs, progress=lambda done, total: heard.append((done, total)))
    # progress over the 3 candidates' dev sentences, batch by batch, to the end
    assert heard[-1] == (3 * 1014, 3 * 1014) and {t for _, t in heard} == {3 * 1014}
    assert [d for d, _ in heard] == sorted(d for d, _ in heard) and len(heard) >= 3 * 1014 // 128
    folder = choice_dir(cfg, run)
    choice = json.loads((folder / "choice.json").read_text())
    rows = {r["n"]: r for r in choice["candidates"]}
    assert sorted(rows) == [1, 2, 3] and choice["skipped"] == [8] and choice["metric"] == "dev sacreBLEU"
    assert rows[3]["steps"] == [10, 20, 30] and rows[1]["steps"] == [30]
    for n, row in rows.items():  # each dev score is that candidate's own evaluation
        assert row["dev"] == json.loads(Path(row["scores"]).read_text())["splits"]["dev"]["sacrebleu"]["score"]
    best = max(rows.values(), key=lambda r: (r["dev"], -r["n"]))
    assert choice["chosen_n"] == best["n"] and chosen == folder / f"last{best['n']}.pt"
    assert sorted(p.name for p in folder.glob("*.pt")) == [chosen.name]  # the losers are not kept
    assert sha256_file(chosen) == best["sha256"] and averaged_path(cfg, run) == chosen
    assert load_checkpoint(chosen)["step"] == 30

    stamps = {n: Path(r["scores"]).stat().st_mtime_ns for n, r in rows.items()}
    assert average_run(cfg, run, *inputs) == chosen  # same checkpoints: the averages and their dev scores reused
    assert {n: Path(r["scores"]).stat().st_mtime_ns for n, r in rows.items()} == stamps

    with pytest.raises(CheckpointError, match=r"choose_from \[8, 9\] needs at least 8 checkpoints, only 3 exist"):
        average_run(tiny_config(shared_data, "average.choose_from=[9, 8]", *fast), run, *inputs)
    with pytest.raises(ConfigError, match="distinct positive"):
        tiny_config(shared_data, "average.choose_from=[2, 2]")


@pytest.mark.slow
def test_run_command_end_to_end_on_multi30k(shared_data, tmp_path) -> None:
    """The README's main job, shrunk: every stage from raw files to scores, then a re-run that reuses it all."""
    sets = [a for o in (*TINY, "train.max_steps=20", "train.checkpoint_every_steps=5", "average.last_n=2",
                        "decode.beam_size=1", "decode.max_len_a=0.1", "decode.max_len_b=2",
                        "decode.batch_sentences=512")
            for a in ("--set", o)]
    cmd = [sys.executable, "-m", "pipeline", "run", "--config", "multi30k-cpu", "--data-root", str(shared_data),
           "--work-dir", str(tmp_path), *sets]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    scores_line = next(line for line in res.stdout.splitlines() if line.startswith("scores: "))
    scores = json.loads(Path(scores_line.split(": ", 1)[1]).read_text())["splits"]
    assert sorted(scores) == ["dev", "test.newstest2014", "test.test2016"]
    assert "read 29,000" in res.stdout
    # progress as log lines (stderr is not a terminal here), and the serving export with its gate
    assert "evaluate: 100% (5,017 of 5,017 sentences)" in res.stderr
    assert re.search(r"gate \(int8, dev 1014 sentences\): .* (passed|refused)", res.stdout)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "corpus unchanged" in again.stderr and "tokenizer unchanged" in again.stderr
    assert "shards unchanged" in again.stderr
    # the finished evaluation is reused: not one sentence decoded again
    assert "scores.json: the same checkpoint, tokenizer" in again.stderr
    assert not re.search(r"evaluate: \d+%", again.stderr)
