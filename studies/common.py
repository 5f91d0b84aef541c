"""What the studies share: their arms as data (``studies/<study>.yaml``), one record per finished run
(:class:`StudyRecord`, every study's, read back by :func:`read_record` whatever format wrote it), the references
they are scored on, and the verdict of every arm against the baseline over paired seeds, by the sweeps' own code
(:func:`pipeline.sweep.verdict.paired_verdict`: the pooled paired bootstrap, significant below alpha / the number
of arms compared, Bonferroni)."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from bench.harness import REPO, machine
from pipeline.average import averaged_path
from pipeline.config import RunConfig, resolve_config
from pipeline.data import read_manifest
from pipeline.evalsets import read_split
from pipeline.evaluate import eval_dir
from pipeline.support.fsutil import write_text
from pipeline.support.provenance import short_commit
from pipeline.sweep.verdict import bonferroni, paired_verdict
from pipeline.workdir import build_corpus, build_inputs, run_dir

HERE = Path(__file__).resolve().parent
ALPHA = 0.05
TEST = "test.test2016"
SPLITS = ("dev", TEST)  # dev chooses, test2016 is reported


def load_arms(study: str) -> dict[str, Any]:
    """``studies/<study>.yaml``, read; a file that is missing or not a mapping is refused, naming it."""
    path = HERE / f"{study}.yaml"
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise SystemExit(f"{path}: cannot read the study's arms ({e})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping of the study's settings and arms")
    return data


def pipeline(*args: str) -> None:
    """One ``python -m pipeline`` command, its output on this terminal; a failure stops the study."""
    cmd = [sys.executable, "-m", "pipeline", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def flags(config: str, work_dir: Path, overrides: list[str], data_root: str | None = None) -> list[str]:
    """The flags of a ``python -m pipeline run`` or ``evaluate`` of ``config`` with ``overrides`` (each a --set)."""
    out = ["--config", config, "--work-dir", str(work_dir), *(["--data-root", data_root] if data_root else [])]
    return out + [a for o in overrides for a in ("--set", o)]


def resolve(config: str, work_dir: Path, overrides: list[str], data_root: str | None = None) -> RunConfig:
    """The config those flags (:func:`flags`) run: "key=value" overrides read as --set reads them."""
    return resolve_config(config, [("work_dir", str(work_dir)), *overrides], data_root=data_root)


def chosen_checkpoint(cfg: RunConfig) -> Path:
    """The averaged checkpoint that a finished ``python -m pipeline run`` of ``cfg`` chose (its inputs are found
    again: a no-op)."""
    return averaged_path(cfg, run_dir(cfg, build_inputs(cfg).shards))


class Scored(BaseModel):
    """One model's evaluation: its scores per split and metric (``scores["dev"]["sacrebleu"]``) and the outputs
    they are the scores of (one line per reference segment, what the paired bootstrap reads)."""

    model_config = ConfigDict(extra="forbid")
    scores: dict[str, dict[str, float]]
    outputs: dict[str, list[str]]

    def score(self, split: str, metric: str = "sacrebleu") -> float:
        return self.scores[split][metric]


class StudyRecord(Scored):
    """One finished run of a study: the study, arm and seed, the config and overrides it trained with, its
    evaluation (:class:`Scored`, with its config's search) and the same model decoded with each other search
    (``searches``), what the run was (``run``: updates, training seconds, the checkpoint chosen and scored,
    schedule), the machine it ran on (the harness's provenance header, :func:`bench.harness.machine`), the
    commit and the date. A record outlives its run folder: commit it."""

    study: str
    arm: str
    seed: int
    config: str
    overrides: list[str] = []
    searches: dict[str, Scored] = {}
    run: dict[str, Any] = {}
    machine: dict[str, Any]
    commit: str
    date: str | None = None  # records written before this schema have none

    def row(self) -> dict[str, Any]:
        """The run as one flat row: seed, ``<split>.<metric>`` (``test2016.chrf``) and the run's own fields."""
        return {"seed": self.seed, **flat_scores(self.scores), **self.run}


def flat_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{split.removeprefix('test.')}.{metric}": v for split, m in scores.items() for metric, v in m.items()}


def evaluation(cfg: RunConfig, checkpoint: Path) -> Scored:
    """What ``python -m pipeline evaluate`` (or the run's own evaluation) of ``checkpoint`` under ``cfg`` wrote:
    its scores and outputs of dev and test2016."""
    folder = eval_dir(cfg, checkpoint)
    splits = json.loads((folder / "scores.json").read_text(encoding="utf-8"))["splits"]
    return Scored(scores={s: {m: v["score"] for m, v in splits[s].items() if isinstance(v, dict) and "score" in v}
                          for s in SPLITS},
                  outputs={s: (folder / f"{s}.hyp").read_text(encoding="utf-8").splitlines() for s in SPLITS})


def run_record(study: str, arm: str, seed: int, config: str, overrides: list[str], cfg: RunConfig, checkpoint: Path,
               searches: dict[str, Scored] | None = None, **run: Any) -> StudyRecord:
    """The record of a finished run whose chosen (averaged) checkpoint is ``checkpoint``
    (``<run>/averaged/<choice>/<file>.pt``): its evaluation and its train_summary.json's updates, seconds and
    schedule."""
    summary = json.loads((checkpoint.parents[2] / "train_summary.json").read_text(encoding="utf-8"))
    run = {"updates": summary["steps"], "train_seconds": round(summary["train_seconds"], 1),
           "schedule": summary.get("schedule"), "checkpoint": str(checkpoint), **run}
    return StudyRecord(study=study, arm=arm, seed=seed, config=config, overrides=overrides, searches=searches or {},
                       run=run, machine=machine(None), commit=short_commit(), date=datetime.date.today().isoformat(),
                       **evaluation(cfg, checkpoint).model_dump())


def write_study_record(record: StudyRecord, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, record.model_dump_json() + "\n")
    return path


def read_record(path: Path, study: str | None = None, arm: str | None = None) -> StudyRecord:
    """The record at ``path`` (:func:`as_record`)."""
    return as_record(json.loads(Path(path).read_text(encoding="utf-8")), study, arm)


def as_record(r: dict[str, Any], study: str | None = None, arm: str | None = None) -> StudyRecord:
    """A :class:`StudyRecord`, or a record written before it (schedule_at_compute's, the distillation study's, or
    a record of the default job end to end, ``ops/default_e2e.py``) read into it; ``study`` and ``arm`` name what
    an end-to-end record stands for."""
    if "study" in r:
        return StudyRecord.model_validate(r)
    old = {"machine": r["machine"] if isinstance(r["machine"], dict) else {"cpu": r["machine"], "cpus": r["cpus"]},
           "commit": r["commit"], "config": r.get("config", "multi30k-cpu"), "overrides": r.get("overrides") or []}
    if "train_summary" in r:  # ops/default_e2e.py: one run of a config, its seed the config's
        summary = r["train_summary"]
        return StudyRecord(study=study or "default_e2e", arm=arm or "default", **old,
                           seed=resolve_config(r["config"], old["overrides"]).train.seed, scores=r["scores"],
                           outputs={"dev": r["outputs"]["dev"], TEST: r["outputs"]["test2016"]},
                           run={"updates": summary["steps"], "train_seconds": round(summary["train_seconds"])})
    row = r.get("run", r)  # the distillation study's row, or schedule_at_compute's record itself
    scores = lambda row: {"dev": {"sacrebleu": row["dev.sacrebleu"]},  # noqa: E731
                          TEST: {"sacrebleu": row["test2016.sacrebleu"], "chrf": row["test2016.chrf"]}}
    run = {k: row[k] for k in ("updates", "train_seconds", "schedule", "chosen_checkpoint", "checkpoint",
                               "final_dev_nll") if k in row}
    if "train_hours" in row:
        run["train_seconds"] = round(row["train_hours"] * 3600)
    searches = {name: Scored(scores=scores(s["run"]), outputs=s["outputs"]) for name, s in r.get("searches", {}).items()
                if s}
    return StudyRecord(study="distill" if "pair" in r else "schedule_at_compute", arm=r["arm"], seed=row["seed"],
                       **old, scores=scores(row), outputs=r["outputs"], searches=searches, run=run)


def references(cfg: RunConfig) -> dict[str, list[str]]:
    """The human references of dev and test2016 as the evaluation scores them (raw), from the corpus ``cfg``'s
    data stage prepares (a no-op when it is there)."""
    corpus = build_corpus(cfg)
    return {split: read_split(corpus, read_manifest(corpus), split)[1] for split in SPLITS}


def runs_machine(records: list[StudyRecord]) -> dict[str, Any]:
    """The machine the runs ran on: theirs when they agree on the CPU, else the CPUs named together."""
    cpus = sorted({r.machine["cpu"] for r in records})
    return records[0].machine if len(cpus) == 1 else {"cpu": "; ".join(cpus),
                                                      "cpus": max(r.machine.get("cpus") or 0 for r in records)}


def verdicts(claims: list[tuple[str, str, str]], runs: dict[str, list[Scored]], refs: dict[str, list[str]],
             seeds: list[int], alpha: float = ALPHA) -> list[dict]:
    """Each claim (base arm, arm, what it says) on dev and test2016: ``runs[arm]`` holds each seed's evaluation,
    in the seeds' order. One record per claim and split: the pooled scores compared, delta with its 95% interval,
    p, the Bonferroni threshold over the claims, the verdict, and both arms' per-seed sacreBLEU mean and spread."""
    threshold = bonferroni(alpha, len(claims))
    out = []
    for base, arm, claim in claims:
        for split in SPLITS:
            side = lambda a: ([r.score(split) for r in runs[a]], [r.outputs[split] for r in runs[a]])  # noqa: E731
            v = paired_verdict(arm, split, seeds, side(base), side(arm), refs[split], "sacrebleu", threshold)
            c = v.comparison
            out.append({"claim": claim, "set": split, "base": c.champion, "system": c.challenger, "delta": c.delta,
                        "ci95": [c.ci_low, c.ci_high], "p": c.p_value, "threshold": round(threshold, 4),
                        "verdict": v.verdict, "test": c.signature,
                        "seed_means": {"base": [round(v.base_mean, 2), round(v.base_std, 2)],
                                       "system": [round(v.mean, 2), round(v.std, 2)]}})
    return out
