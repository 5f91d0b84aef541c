"""The studies' one record schema (studies/common.py) over every committed record, the verdict's per-seed means,
and the compare giving the ledger's own figures from the committed records."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import yaml

from studies import schedule_at_compute as schedule
from studies.common import SPLITS, Scored, StudyRecord, read_record, verdicts, write_study_record

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RUN_RECORDS = [*sorted(p for p in (RESULTS / "schedule_at_compute").glob("*-seed*.json")
                       if not p.name.startswith(("compare-", "dev_nll_"))),
               *sorted((RESULTS / "distill_study").rglob("*.json"))]


def test_every_committed_run_record_reads_into_the_one_schema_and_back(tmp_path):
    """Both studies' records as they were committed (each its own format then) read as StudyRecord: scores of dev
    and test2016 with one output per reference segment; a record written in the schema reads back equal."""
    assert len(RUN_RECORDS) > 30
    for path in RUN_RECORDS:
        r = read_record(path)
        assert r.study in ("schedule_at_compute", "distill") and r.machine["cpu"] and r.commit, path
        assert [len(r.outputs[s]) for s in SPLITS] == [1014, 1000], path
        assert r.score("dev") > 0 and r.score("test.test2016", "chrf") > 0 and r.run["updates"] > 0, path
    e2e = read_record(RESULTS / "default_e2e" / "multi30k-cpu_epyc-zen4_2026-11-28.json", "schedule_at_compute")
    assert (e2e.arm, e2e.seed, e2e.scores["dev"]["sacrebleu"]) == ("default", 1, 40.33)
    assert read_record(write_study_record(r, tmp_path / "r.json")) == r


def test_the_verdict_holds_each_arm_s_per_seed_mean_and_spread():
    refs = {s: [f"ein Hund läuft über die Wiese {i}" for i in range(20)] for s in SPLITS}
    worse = {s: [" ".join(line.split()[1:]) for line in v] for s, v in refs.items()}
    runs = {"base": [Scored(scores={s: {"sacrebleu": x} for s in SPLITS}, outputs=worse) for x in (30.0, 32.0)],
            "arm": [Scored(scores={s: {"sacrebleu": x} for s in SPLITS}, outputs=refs) for x in (40.0, 40.0)]}
    out = verdicts([("base", "arm", "arm against base")], runs, refs, [1, 2])
    assert [v["set"] for v in out] == list(SPLITS)
    assert out[0]["seed_means"] == {"base": [31.0, 1.41], "system": [40.0, 0.0]}
    assert out[0]["verdict"] == "better" and out[0]["threshold"] == 0.05


def _ledger(entry_id: str) -> dict:
    entries = yaml.safe_load((REPO / "docs" / "results" / "ledger.yaml").read_text(encoding="utf-8"))["entries"]
    return next(e for e in entries if e["id"] == entry_id)


def _tolerance(figure: float) -> float:
    """Half a unit of the last digit the ledger wrote."""
    text = repr(figure)
    return 0.5 * 10 ** -len(text.split(".")[1]) + 1e-12 if "." in text and "e" not in text else 1e-12


@pytest.mark.integration
@pytest.mark.parametrize("entry_id, compares", [
    ("L36", [("budget", ["budget", "mid", "narrow"], [1, 2, 3], 780), ("mid", ["mid", "narrow"], [1, 2, 3], 780)]),
    ("L58", [("default", ["default", "cool", "big", "slim-big"], [1], 2267)]),
])
def test_compare_gives_the_ledger_s_figures_from_the_committed_records(entry_id, compares, shared_data, tmp_path,
                                                                       monkeypatch):
    """``compare`` on the committed records (the schedule study's, the distillation study's original arm and a
    default job's end-to-end record, read by the one schema) gives the pooled paired-bootstrap delta and p of the
    ledger entry that cites them, within the rounding the ledger wrote."""
    monkeypatch.setenv("AIAYN_DATA_ROOT", str(shared_data))
    ours = {}
    for baseline, arms, seeds, updates in compares:
        args = argparse.Namespace(
            arms=arms, seeds=seeds, baseline=baseline, updates=updates, tokens=None, work_dir=tmp_path / "work",
            records=RESULTS / "schedule_at_compute", out=tmp_path / f"{baseline}.json",
            default_records=RESULTS / "default_e2e" / "multi30k-cpu_epyc-zen4_2026-11-28.json")
        for c in schedule.compare(args)["significance"]:
            ours[c["claim"].split()[0], baseline, c["set"]] = c
    checked = 0
    for claim in _ledger(entry_id)["significance"]:
        arm, base = claim["claim"].split()[0], claim["claim"].split(" against ")[1].split()[0]
        split = "dev" if claim["set"].startswith("dev") else "test.test2016"
        base = "default" if base == "the" else base  # L58: "against the default (L43)"
        if (arm, base, split) not in ours:
            continue  # a claim of another compare (one seed of an arm not paired here)
        c = ours[arm, base, split]
        assert math.isclose(c["delta"], claim["delta"], abs_tol=_tolerance(claim["delta"])), (claim, c)
        assert math.isclose(c["p"], claim["p"], abs_tol=_tolerance(claim["p"])), (claim, c)
        checked += 1
    assert checked == {"L36": 6, "L58": 6}[entry_id]


def test_a_record_is_a_typed_model():
    assert set(StudyRecord.model_fields) >= {"study", "arm", "seed", "config", "overrides", "scores", "outputs",
                                              "machine", "commit", "date"}
