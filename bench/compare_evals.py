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
from pipeline.sweep.verdict import bonferroni, paired_verdict


def lines(path: Path) -> list[str]:
    """The lines of one output or reference file (one per sentence), or SystemExit naming the file."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; give the evaluation folder a `pipeline evaluate` run wrote")
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def score(folder: Path, split: str, metric: str) -> float:
    """The corpus score ``scores.json`` holds for ``split`` (the key the evaluation logged, e.g. ``f1``)."""
    scores = json.loads((folder / "scores.json").read_text(encoding="utf-8"))["splits"]
    if split not in scores or metric not in scores[split]:
        raise SystemExit(f"{folder / 'scores.json'}: no {metric!r} for split {split!r} (splits: {sorted(scores)})")
    return float(scores[split][metric])


def system(text: str) -> list[Path]:
    """One system's evaluation folders, one per seed, comma-separated."""
    return [Path(p) for p in text.split(",") if p]


def compare(base: list[Path], arms: dict[str, list[Path]], splits: list[str], metric: str, alpha: float,
            candidates: int, resamples: int) -> dict:
    """Every arm against the base on every split; the verdicts and each run's outputs and scores."""
    threshold = bonferroni(alpha, candidates)
    suffix = references_suffix(metric)
    record: dict = {"metric": metric, "threshold": threshold, "runs": {}, "verdicts": []}
    for label, folders in {"base": base, **arms}.items():
        record["runs"][label] = [{"eval_dir": str(f), **{split: {"score": score(f, split, metric),
                                                                 "hyp": lines(f / f"{split}.hyp")}
                                                         for split in splits}} for f in folders]
    for label, folders in arms.items():
        if len(folders) != len(base):
            raise SystemExit(f"--arm {label}: {len(folders)} folders against the base's {len(base)}: give one per "
                             "seed, in the base's order")
        for split in splits:
            refs = [lines(f / f"{split}.{suffix}") for f in (*base, *folders)]
            if any(r != refs[0] for r in refs):
                raise SystemExit(f"split {split}: the folders hold different references ({split}.{suffix}); "
                                 "compare evaluations of the same data")
            base_runs, arm_runs = (([r[split]["score"] for r in record["runs"][name]],
                                    [r[split]["hyp"] for r in record["runs"][name]]) for name in ("base", label))
            verdict = paired_verdict(label, split, list(range(1, len(base) + 1)), base_runs, arm_runs, refs[0],
                                     metric, threshold, resamples)
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
