"""Judge finished evaluations against a base: the pooled paired bootstrap over sentences, seeds paired by position.

    .venv/bin/python -m bench.compare_evals --base RUN1/averaged/eval-<hash>[,RUN2/...] \
        --arm LABEL=RUN/averaged/eval-<hash>[,...] [--arm ...] [--splits dev,test.ptb-sample-test] \
        [--metric f1] [--candidates N] [--out results.json]

Each folder is what ``python -m pipeline evaluate`` (or ``run``) wrote: ``<split>.hyp`` beside ``<split>.gold``
(parsing, ``--metric f1``: EVALB F1) or ``<split>.ref`` (translation: ``sacrebleu``, ``chrf``), and
``scores.json``. A system given several folders is one run per seed; the base's and each arm's are paired by
position, and every pair must hold the same references. The verdict is the sweep's own
(:func:`pipeline.sweep.verdict.paired_verdict`): significant below alpha / ``--candidates`` (Bonferroni; default:
the arms given here), on dev for choosing, on test sets for reporting. The record keeps every run's outputs, so a
later seed pools with them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.harness import write_record
from pipeline.promotion import references_suffix
from pipeline.sweep.verdict import bonferroni, paired_verdict, read_outputs


def scores(folder: Path) -> dict:
    """The corpus scores per split ``scores.json`` holds (the keys the evaluation logged, e.g. ``f1``)."""
    path = folder / "scores.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; give the evaluation folder a `pipeline evaluate` run wrote")
    return json.loads(path.read_text(encoding="utf-8"))["splits"]


def run(folder: Path, splits: list[str], metric: str) -> tuple[dict, dict[str, list[str]]]:
    """One run's score and outputs per split (its record), and its references per split, each file read once;
    SystemExit names what is missing."""
    corpus = scores(folder)
    out: dict = {"eval_dir": str(folder)}
    refs = {}
    for split in splits:
        if metric not in corpus.get(split, {}):
            raise SystemExit(f"{folder / 'scores.json'}: no {metric!r} for split {split!r} (splits: {sorted(corpus)})")
        try:
            hyp, refs[split] = read_outputs(folder, split, metric)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        out[split] = {"score": float(corpus[split][metric]), "hyp": hyp}
    return out, refs


def system(text: str) -> list[Path]:
    """One system's evaluation folders, one per seed, comma-separated."""
    return [Path(p) for p in text.split(",") if p]


def compare(base: list[Path], arms: dict[str, list[Path]], splits: list[str], metric: str, alpha: float,
            candidates: int, resamples: int) -> dict:
    """Every arm against the base on every split; the verdicts and each run's outputs and scores."""
    for label, folders in arms.items():
        if len(folders) != len(base):
            raise SystemExit(f"--arm {label}: {len(folders)} folders against the base's {len(base)}: give one per "
                             "seed, in the base's order")
    read = {label: [run(f, splits, metric) for f in folders] for label, folders in {"base": base, **arms}.items()}
    runs = {label: [out for out, _ in rs] for label, rs in read.items()}
    refs = read["base"][0][1]
    for split in splits:
        if any(r[split] != refs[split] for rs in read.values() for _, r in rs):
            raise SystemExit(f"split {split}: the folders hold different references "
                             f"({split}.{references_suffix(metric)}); compare evaluations of the same data")
    threshold = bonferroni(alpha, candidates)
    record: dict = {"metric": metric, "threshold": threshold, "runs": runs, "verdicts": []}
    seeds = list(range(1, len(base) + 1))
    for label in arms:
        for split in splits:
            base_runs, arm_runs = (([r[split]["score"] for r in runs[name]], [r[split]["hyp"] for r in runs[name]])
                                   for name in ("base", label))
            verdict = paired_verdict(label, split, seeds, base_runs, arm_runs, refs[split], metric, threshold,
                                     resamples)
            record["verdicts"].append(verdict.as_dict())
            c = verdict.comparison
            print(f"{label:14s} {split:24s} base {c.champion:6.2f}  arm {c.challenger:6.2f}  delta {c.delta:+6.2f} "
                  f"[{c.ci_low:+.2f}, {c.ci_high:+.2f}]  p {c.p_value:.4f} (threshold {threshold:.4f}): "
                  f"{verdict.verdict}")
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=system, required=True, help="the base's evaluation folders, one per seed")
    p.add_argument("--arm", action="append", required=True, metavar="LABEL=FOLDERS",
                   help="an arm's evaluation folders, one per seed in the base's order; give it again per arm")
    p.add_argument("--splits", default="dev", help="comma-separated splits (dev, test.<name>)")
    p.add_argument("--metric", default="f1", choices=("f1", "sacrebleu", "chrf"))
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--candidates", type=int, help="arms of the study the threshold divides alpha by (default: "
                                                  "the arms given)")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = p.parse_args()
    arms = {}
    for given in args.arm:
        label, sep, folders = given.partition("=")
        if not sep or not label or label == "base" or label in arms:
            raise SystemExit(f"--arm {given!r}: give LABEL=FOLDERS with a label of its own (not 'base')")
        arms[label] = system(folders)
    record = compare(args.base, arms, [s for s in args.splits.split(",") if s], args.metric, args.alpha,
                     args.candidates or len(arms), args.resamples)
    write_record(args.out, record, threads=None, args=args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
