"""The benchmarks' harness (bench/harness.py) and the benchmarks page against the folders it lists."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

from bench import harness

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "how-to" / "benchmarks.md"


def test_arms_alternate_in_child_processes_each_with_its_own_peak_rss(tmp_path):
    """Every arm runs once per repeat, who goes first rotating; each run's result is its last line of JSON, with
    the peak RSS of that child alone: a child that holds 200 MB more reads so, the other does not."""
    script = ("import sys\nfrom bench.harness import emit\nn = int(sys.argv[1])\nblock = bytearray(n * 2**20)\n"
              "block[::4096] = b'x' * len(block[::4096])\nprint('noise')\nemit({'mb': n})\n")
    commands = {"small": [sys.executable, "-c", script, 1], "large": [sys.executable, "-c", script, 200]}
    runs = harness.alternate(commands, 2, tmp_path)
    assert [r["mb"] for r in runs["small"]] == [1, 1] and [r["mb"] for r in runs["large"]] == [200, 200]
    small, large = (max(r["peak_rss_mb"] for r in runs[a]) for a in ("small", "large"))
    assert large - small > 150, (small, large)
    assert list(harness.rotations(["a", "b", "c"], 3)) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]


def test_a_failed_child_stops_the_benchmark_with_its_log(tmp_path):
    with pytest.raises(SystemExit, match="(?s)broken failed.*no such thing"):
        harness.alternate({"broken": [sys.executable, "-c", "raise SystemExit('no such thing')"]}, 1, tmp_path)


def test_medians_ratios_and_one_record_with_its_provenance(tmp_path):
    assert harness.median([3.0, 1.0, 2.0, 100.0]) == 2.5
    assert harness.ratio(3.0, 2.0) == 1.5 and harness.ratio(1.0, 3.0, 2) == 0.33
    with pytest.raises(ValueError, match="no measurements"):
        harness.median([])
    out = tmp_path / "deep" / "record.json"
    record = harness.write_record(out, {"rows": [1]}, 2)
    on_disk = json.loads(out.read_text(encoding="utf-8"))
    assert on_disk == record and on_disk["rows"] == [1]
    assert {"machine", "torch", "python", "commit", "date"} <= set(on_disk)
    assert on_disk["machine"]["threads"] == 2 and on_disk["machine"]["cpu"]
    assert {"amx", "avx512_bf16", "isa", "cpus"} <= set(on_disk["machine"])
    assert harness.peak_rss_mb() > 10


def _modules(folder: str) -> list[str]:
    return sorted(p.stem for p in (REPO / folder).glob("*.py") if p.stem not in ("__init__", "harness"))


def test_the_benchmarks_page_names_every_benchmark_and_only_those():
    """Every module of bench/ (a benchmark, run as ``python -m``) and every slot script is
    on docs/how-to/benchmarks.md, and every one the page names exists."""
    text = PAGE.read_text(encoding="utf-8")
    named = set(re.findall(r"python -m (bench\.\w+)", text))
    named |= {f"bench.{n}" for n in re.findall(r"`bench/(\w+)\.py", text)}
    named -= {"bench.harness"}  # what they share, not a benchmark
    modules = {f"bench.{m}" for m in _modules("bench")}
    assert modules - named == set(), "modules the benchmarks page does not name"
    assert named - modules == set(), "names on the benchmarks page with no module"
    scripts = {p.name for p in (REPO / "bench").glob("*.sh")}
    assert {s for s in scripts if f"bench/{s}" not in text} == set(), "slot scripts the page does not name"
    assert set(re.findall(r"bench/(\w+\.sh)", text)) <= scripts


def test_benchmarks_import_no_private_name_of_the_project():
    """A benchmark uses what pipeline and model offer publicly: a private name it needed would break
    with any refactoring of the module that owns it."""
    private = []
    for path in (REPO / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("pipeline", "model"):
                private += [f"{path.relative_to(REPO)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("pipeline", "model"):
                    private.append(f"{path.relative_to(REPO)}: {base.id}.{node.attr}")
    assert private == []


def _evaluation(folder: Path, hyps: list[str], golds: list[str]) -> Path:
    """An evaluation folder as ``pipeline evaluate`` writes one for parsing: outputs, gold trees, scores (the
    share of right trees stands for the F1: the verdict reads the trees)."""
    folder.mkdir(parents=True)
    (folder / "dev.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    (folder / "dev.gold").write_text("".join(g + "\n" for g in golds), encoding="utf-8")
    scores = {"splits": {"dev": {"f1": 100 * sum(h == g for h, g in zip(hyps, golds)) / len(golds)}}}
    (folder / "scores.json").write_text(json.dumps(scores), encoding="utf-8")
    return folder


def test_compare_evals_judges_arms_against_the_base_over_paired_seeds(tmp_path, monkeypatch, capsys):
    """bench.compare_evals: an arm with every tree right against a base with half of them flat is better on the
    pooled paired bootstrap; the same outputs are no difference; an arm with other seeds' count, or other
    references, is refused naming what to give."""
    from bench import compare_evals

    gold = "(S (NP (DT the) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))))"
    flat = "(S (DT the) (NN cat) (VBD sat) (IN on) (DT the) (NN mat))"
    golds = [gold] * 40
    base = [_evaluation(tmp_path / f"base{s}", [gold, flat] * 20, golds) for s in (1, 2)]
    good = [_evaluation(tmp_path / f"good{s}", golds, golds) for s in (1, 2)]
    same = [_evaluation(tmp_path / f"same{s}", [gold, flat] * 20, golds) for s in (1, 2)]
    out = tmp_path / "record.json"
    argv = ["compare_evals", "--base", ",".join(map(str, base)), "--arm", "good=" + ",".join(map(str, good)),
            "--arm", "same=" + ",".join(map(str, same)), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert compare_evals.main() == 0
    record = json.loads(out.read_text())
    verdicts = {v["label"]: v for v in record["verdicts"]}
    assert verdicts["good"]["verdict"] == "better" and verdicts["good"]["seeds"] == [1, 2]
    assert verdicts["good"]["comparison"]["delta"] > 0 and record["threshold"] == 0.025
    assert verdicts["same"]["verdict"] == "no significant difference"
    assert verdicts["same"]["comparison"]["p_value"] == 1.0
    assert record["runs"]["good"][1]["dev"]["hyp"] == golds and "machine" in record

    monkeypatch.setattr(sys, "argv", ["compare_evals", "--base", ",".join(map(str, base)), "--arm", f"one={good[0]}"])
    with pytest.raises(SystemExit, match="1 folders against the base's 2: give one per seed"):
        compare_evals.main()
    other = _evaluation(tmp_path / "other", [gold] * 40, [flat] * 40)
    monkeypatch.setattr(sys, "argv", ["compare_evals", "--base", str(base[0]), "--arm", f"x={other}"])
    with pytest.raises(SystemExit, match="split dev: the folders hold different references"):
        compare_evals.main()
