"""The parser's study on the sweep: its file (fixed arms of parse-wsj/ptb-sample-cpu), the verdict on EVALB F1
over sentences against gold trees (the real scorer), and the sweep flow of each task (unit tier)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, RunConfig, load_config, outside_run_identity
from pipeline.parsing.evalb import score_files
from pipeline.sweep.config import base_point, check_space, expand, load_sweep, resolve_base
from pipeline.sweep.search import Arm, Outcome
from pipeline.sweep.verdict import judge, winner, write_winner

REPO = Path(__file__).resolve().parents[1]

# Gold trees as the parsing evaluation writes them (root stripped), each with one wrong parse of the same words.
GOLD_AND_WRONG = [
    ("(S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))",
     "(S (NP (DT The) (NN cat) (VBD sat)) (PP (IN on) (NP (DT the) (NN mat))) (. .))"),
    ("(S (NP (NNP John)) (VP (VBZ likes) (NP (JJ green) (NNS apples))) (. .))",
     "(S (NP (NNP John)) (VP (VBZ likes) (ADJP (JJ green)) (NP (NNS apples))) (. .))"),
    ("(S (NP (PRP She)) (VP (VBD gave) (NP (PRP him)) (NP (DT a) (NN book))) (. .))",
     "(S (NP (PRP She)) (VP (VBD gave) (NP (NP (PRP him)) (NP (DT a) (NN book)))) (. .))"),
    ("(S (NP (DT The) (NNS prices)) (VP (VBD rose) (ADVP (RB sharply)) (PP (IN in) (NP (NNP March)))) (. .))",
     "(S (NP (DT The) (NNS prices)) (VP (VBD rose) (ADVP (RB sharply) (PP (IN in) (NP (NNP March))))) (. .))"),
]
SENTENCES = 60


def test_the_parser_study_is_fixed_arms_of_the_parse_deployment_on_dev_f1():
    """configs/sweeps/ptb-sample-cpu.yaml loads and validates: trials of parse-wsj/ptb-sample-cpu (a deployment of
    prefect.yaml, run by sweep-parse/ptb-sample-cpu), the base and its arms only, each a valid config, chosen on
    the dev EVALB F1 the evaluation logs; the averaging arm shares the base's training folder."""
    sweep = load_sweep("ptb-sample-cpu")
    assert sweep.fixed_arms and sweep.trials == 1 + len(sweep.enqueue) and sweep.confirm.seeds == [1, 2, 3]
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    deployments = {(d["entrypoint"], d["name"]): d for d in spec["deployments"]}
    trial = deployments[("flows/parsing.py:parse_wsj", "ptb-sample-cpu")]
    assert sweep.deployment == "parse-wsj/ptb-sample-cpu" and trial["parameters"]["config"] == sweep.base
    assert deployments[("flows/sweep.py:sweep_parse", "ptb-sample-cpu")]["parameters"] == {"sweep": sweep.name}
    base = resolve_base(sweep)
    assert base.task == "parsing" and f"{base.data.dev.name}.{base.promotion_metric}" == "ptb-sample-dev.f1"
    point = base_point(sweep, base)
    assert point == {"model.dropout": 0.1, "model.attention_dropout": 0.0, "model.activation_dropout": 0.0,
                     "train.warmup_steps": 1000, "averaging": "last3"}  # the preset as it ships
    check_space(sweep, point)  # every value and every arm makes a valid parsing config
    points = [{**point, **arm} for arm in sweep.enqueue]
    assert point not in points and len({tuple(sorted(p.items())) for p in points}) == len(points)

    def training(params: dict, seed: int) -> str:  # the training folder's identity (pipeline.workdir.run_dir)
        cfg = load_config(sweep.base, {**expand(sweep, params), "train.seed": seed})
        return cfg.section_hash("data", "tokenizer", "model", "train", exclude=outside_run_identity(RunConfig))

    averaging = next(p for p in points if p["averaging"] == "dev")
    assert load_config(sweep.base, expand(sweep, averaging)).average.choose_from
    assert all(training(averaging, s) == training(point, s) for s in sweep.confirm.seeds)
    assert training(point, 1) != training(point, 2)  # seeds are runs of their own


def _dev_outputs(folder: Path, correct: float, seed: int) -> tuple[Path, list[str]]:
    """An evaluation folder of a parser: ``dev.gold`` and ``dev.hyp``, each sentence parsed right with
    probability ``correct`` (else its wrong parse); no ``dev.ref``, which only translation writes."""
    rng = random.Random(seed)
    pairs = [GOLD_AND_WRONG[i % len(GOLD_AND_WRONG)] for i in range(SENTENCES)]
    hyps = [gold if rng.random() < correct else wrong for gold, wrong in pairs]
    folder.mkdir(parents=True)
    (folder / "dev.gold").write_text("".join(g + "\n" for g, _ in pairs), encoding="utf-8")
    (folder / "dev.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return folder, hyps


def test_two_parsing_arms_are_judged_on_evalb_f1_pooled_over_seeds_and_the_winner_is_a_preset(tmp_path):
    """The verdict of the parser's study: each arm against the base on dev by the pooled paired bootstrap of EVALB
    F1 over sentences (against the gold trees, the real scorer), at alpha / 2 for two arms; the pooled score is
    EVALB's F1 of all seeds' parses together, and the winner's preset loads as the base with its values."""
    sweep = load_sweep("ptb-sample-cpu")
    base_cfg = resolve_base(sweep)
    point = base_point(sweep, base_cfg)
    combined, dropout = sweep.enqueue[-1], sweep.enqueue[0]
    arms_ = [Arm("base", point, None, None), Arm("trial-5", {**point, **combined}, 5, None),
             Arm("trial-1", {**point, **dropout}, 1, None)]
    pooled: dict[str, tuple[list[str], list[str]]] = {}
    for arm, correct in zip(arms_, (0.4, 0.9, 0.4)):
        for seed in sweep.confirm.seeds:
            folder, hyps = _dev_outputs(tmp_path / f"{arm.label}-{seed}", correct, 100 * (arm.trial or 0) + seed)
            gold, hyp = folder / "dev.gold", folder / "dev.hyp"
            arm.outcomes[seed] = Outcome("COMPLETED", {"ptb-sample-dev.f1": score_files(gold, hyp)["all"].f1},
                                         folder, 3000)
            golds, tests = pooled.setdefault(arm.label, ([], []))
            golds += gold.read_text(encoding="utf-8").splitlines()
            tests += hyps
    verdicts = judge(sweep, arms_, "dev", "ptb-sample-dev.f1", "f1")
    assert [v.label for v in verdicts] == ["trial-5", "trial-1"]
    assert all(v.threshold == pytest.approx(0.025) and v.seeds == [1, 2, 3] for v in verdicts)  # Bonferroni
    clear, tie = verdicts
    assert clear.verdict == "better" and clear.comparison.p_value < 0.025 and clear.mean > clear.base_mean
    assert tie.verdict == "no significant difference" and tie.comparison.p_value >= 0.025
    assert clear.comparison.metric == "f1" and clear.comparison.segments == 3 * SENTENCES
    # the pooled scores are EVALB's F1 over every seed's parses at once
    for label, score in (("base", clear.comparison.champion), ("trial-5", clear.comparison.challenger)):
        golds, tests = pooled[label]
        (tmp_path / f"{label}.gold").write_text("".join(g + "\n" for g in golds), encoding="utf-8")
        (tmp_path / f"{label}.hyp").write_text("".join(t + "\n" for t in tests), encoding="utf-8")
        assert score == pytest.approx(score_files(tmp_path / f"{label}.gold", tmp_path / f"{label}.hyp")["all"].f1,
                                      abs=0.01)
    chosen = winner(arms_, verdicts)
    assert chosen.label == "trial-5"
    path = write_winner(sweep, chosen, verdicts, [], tmp_path / "winner.yaml", base_cfg)
    assert "pooled f1 +" in path.read_text(encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.model.dropout, cfg.model.attention_dropout, cfg.model.activation_dropout) == (0.2, 0.1, 0.1)
    assert cfg.average.choose_from == [1, 3, 5, 10, 20] and cfg.task == "parsing" and cfg.train.max_minutes == 30


def test_each_sweep_flow_refuses_a_base_of_the_other_task_naming_the_flow_to_run(monkeypatch):
    """sweep-translation studies translation configs and sweep-parse parsing ones: the other task's base is refused
    in one line naming the sweep file and the flow that runs it, before the study or any run exists."""
    import flows.sweep as module

    started = []
    monkeypatch.setattr(module, "get_run_logger", lambda: None)
    monkeypatch.setattr(module, "DeploymentRunner", lambda *a: started.append(a))
    monkeypatch.setattr(module, "open_study", lambda *a: started.append(a))
    for flow, sweep, task, other in ((module.sweep_translation, "ptb-sample-cpu", "parsing", "sweep-parse"),
                                     (module.sweep_parse, "multi30k-cpu", "translation", "sweep-translation")):
        path = REPO / "configs" / "sweeps" / f"{sweep}.yaml"
        with pytest.raises(ConfigError, match=re.escape(f"{path}: base ") + f".* is a {task} config and flow "
                           f"{flow.name} studies .*: run the sweep with {other}$"):
            flow.fn(sweep)
    assert not started
