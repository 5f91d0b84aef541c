"""What a sweep concludes: the leaderboard of its trials, each confirmed candidate against the base over paired
seeds (seed mean and spread, a pooled paired bootstrap, Bonferroni-corrected), and the winner as a config file.

Choices are made on dev only; test sets are compared the same way and reported, never chosen on.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml

from pipeline.config import RunConfig, apply_overrides, deep_merge
from pipeline.support.fsutil import write_text
from pipeline.promotion import Comparison, pooled_bootstrap, references_suffix
from pipeline.sweep.config import SweepConfig, expand
from pipeline.sweep import optuna_adapter
from pipeline.sweep.search import Arm, point


def leaderboard(study: optuna.Study) -> list[dict[str, Any]]:
    """One row per trial, best dev score first (then pruned, failed and running ones): its values, state, dev
    score, updates made, last reported dev NLL per sentence and training seconds, its run, the trial it
    repeats (``duplicate_of``: a point drawn twice is recorded, not run, again) and why it failed or was withdrawn
    (``note``)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        last = max(t.intermediate_values, default=None)
        rows.append({"trial": t.number, "state": t.state.name, "value": t.value if t.state.name == "COMPLETE" else None,
                     # a withdrawn one was never asked
                     "params": point(study, t) if t.params else optuna_adapter.enqueued_params(t) or {},
                     "base": bool(t.user_attrs.get("base")), "steps": t.user_attrs.get("steps"),
                     "note": t.user_attrs.get("withdrawn") or t.user_attrs.get("run_state"),
                     "dev_sentence_nll": -t.intermediate_values[last] if last is not None else None,
                     "train_seconds": last, "run_id": t.user_attrs.get("run_id"),
                     "duplicate_of": t.user_attrs.get("duplicate_of")})
    return sorted(rows, key=lambda r: (r["value"] is None, -(r["value"] or 0.0), r["trial"]))


@dataclass(frozen=True)
class Verdict:
    """One candidate against the base on one split, over the seeds both completed."""

    label: str
    split: str
    seeds: list[int]
    base_mean: float
    base_std: float
    mean: float
    std: float
    comparison: Comparison  # pooled paired bootstrap over the seeds' outputs
    threshold: float  # alpha / number of candidates (Bonferroni)
    verdict: str  # better | worse | no significant difference

    def as_dict(self) -> dict:
        return {**asdict(self), "comparison": asdict(self.comparison)}


def read_outputs(eval_dir: Path, split: str, metric: str) -> tuple[list[str], list[str]]:
    """The outputs on ``split`` an evaluation folder holds and the references ``metric`` scores them against (a
    parser's gold trees), a line per sentence; FileNotFoundError names a missing file."""
    files = [eval_dir / f"{split}.{kind}" for kind in ("hyp", references_suffix(metric))]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no such file; give an evaluation folder `pipeline evaluate` wrote for "
                                    f"split {split!r}")
    return tuple(f.read_text(encoding="utf-8").split("\n")[:-1] for f in files)


def judge(sweep: SweepConfig, candidates: list[Arm], split: str, score_name: str, metric: str) -> list[Verdict]:
    """Each non-base arm against the base on ``split`` (``dev``, ``test.test2016``): per-seed scores
    (``score_name``, e.g. ``multi30k-val.sacrebleu``, ``ptb-sample-dev.f1``) as mean and standard deviation, and
    the pooled paired bootstrap of ``metric`` (``sacrebleu``, ``chrf``, or ``f1``: EVALB F1 over sentences against
    the gold trees) over the seeds both completed; significant at ``confirm.alpha`` / (candidates)."""
    base, others = candidates[0], candidates[1:]
    threshold = bonferroni(sweep.confirm.alpha, len(others))
    out = []
    for arm in others:
        seeds = sorted(s for s in sweep.confirm.seeds if arm.outcomes.get(s) and base.outcomes.get(s)
                       and arm.outcomes[s].state == base.outcomes[s].state == "COMPLETED")
        if not seeds:
            continue
        outputs = {name: [read_outputs(a.outcomes[s].outputs, split, metric) for s in seeds]
                   for name, a in (("base", base), ("arm", arm))}
        scores = {name: [a.outcomes[s].metrics[score_name] for s in seeds]
                  for name, a in (("base", base), ("arm", arm))}
        out.append(paired_verdict(arm.label, split, seeds, (scores["base"], [h for h, _ in outputs["base"]]),
                                  (scores["arm"], [h for h, _ in outputs["arm"]]), outputs["base"][0][1], metric,
                                  threshold, sweep.confirm.resamples))
    return out


def bonferroni(alpha: float, candidates: int) -> float:
    """The significance threshold of each of ``candidates`` comparisons against one base: alpha / candidates."""
    return alpha / max(candidates, 1)


def paired_verdict(label: str, split: str, seeds: list[int], base: tuple[list[float], list[list[str]]],
                   arm: tuple[list[float], list[list[str]]], references: list[str], metric: str, threshold: float,
                   resamples: int = 1000) -> Verdict:
    """One arm against the base on ``split`` over paired ``seeds``: ``base`` and ``arm`` are (each seed's score,
    each seed's outputs) in the seeds' order; the pooled paired bootstrap of ``metric`` on ``references`` decides,
    significant below ``threshold`` (:func:`bonferroni`)."""
    comparison = pooled_bootstrap(metric, base[1], arm[1], references, resamples)
    significant = comparison.p_value < threshold
    verdict = ("better" if comparison.delta > 0 else "worse") if significant else "no significant difference"
    return Verdict(label, split, seeds, statistics.fmean(base[0]), _std(base[0]), statistics.fmean(arm[0]),
                   _std(arm[0]), comparison, threshold, verdict)


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def winner(candidates: list[Arm], dev: list[Verdict]) -> Arm:
    """The candidate significantly better than the base on dev with the largest difference; else the base."""
    better = [v for v in dev if v.verdict == "better"]
    if not better:
        return candidates[0]
    best = max(better, key=lambda v: v.comparison.delta)
    return next(a for a in candidates if a.label == best.label)


def write_winner(sweep: SweepConfig, arm: Arm, dev: list[Verdict], tests: list[Verdict], path: Path,
                 base: RunConfig) -> Path:
    """The winner as a preset YAML: ``extends`` the base config, sets the winning values, and says in comments
    what it was chosen on (dev, seeds, difference, p against the Bonferroni threshold) and what the tests
    reported. The base winning writes a file that changes nothing and says why.

    The trials ran as the resolved ``base`` with the winning values over it, its compute recipe included: the
    preset sets that recipe's settings and the winning values itself, with ``recipe: none``, so that it trains what
    was measured on every machine (a recipe that applied again would override the winning values)."""
    mine = [v for v in (*dev, *tests) if v.label == arm.label]
    lines = [f"# Written by sweep {sweep.name}: {arm.label}" + (" (no candidate beat the base on dev)"
                                                                if arm.label == "base" else "")]
    for v in mine:
        c = v.comparison
        lines.append(f"# {v.split}: {v.mean:.2f} +- {v.std:.2f} over seeds {v.seeds} against the base's "
                     f"{v.base_mean:.2f} +- {v.base_std:.2f}; pooled {c.metric} {c.delta:+.2f} "
                     f"[{c.ci_low:+.2f}, {c.ci_high:+.2f}], p = {c.p_value:.4f} (threshold {v.threshold:.4f}): "
                     f"{v.verdict}" + ("" if v.split == "dev" else " (reported, not chosen on)"))
    tree: dict[str, Any] = {"extends": [sweep.base], "name": base.name}
    if arm.label != "base":
        recipe = base.recipes.get(base.recipe_applied or "none", {})
        tree = {**tree, "name": f"{base.name}-{sweep.name}", "recipe": "none",
                **deep_merge(recipe, apply_overrides({}, expand(sweep, arm.params, fixed=False)))}
    write_text(path, "\n".join(lines) + "\n" + yaml.safe_dump(tree, sort_keys=False))
    return path


def markdown(sweep: SweepConfig, rows: list[dict], dev: list[Verdict], tests: list[Verdict], chosen: Arm | None,
             objective: str) -> str:
    """The sweep's report: the leaderboard and the confirmation table (``chosen`` None: not confirmed yet)."""
    keys = list(sweep.space)
    out = [f"# Sweep {sweep.name}", "", f"Trials of `{sweep.base}` on `{sweep.deployment}`, chosen on {objective}.",
           "", "| trial | state | " + " | ".join(keys) + f" | {objective} | updates | dev NLL/sentence | s |",
           "|---|---|" + "---|" * (len(keys) + 4)]
    for r in rows:
        twin = f" (= {r['duplicate_of']})" if r.get("duplicate_of") is not None else ""
        state = f"{r['state']} ({r['note']})" if r.get("note") else r["state"]
        out.append(f"| {r['trial']}{' (base)' if r['base'] else ''}{twin} | {state} | "
                   + " | ".join(_value(r["params"].get(k, "")) for k in keys)
                   + f" | {_f(r['value'])} | {r['steps'] or ''} | {_f(r['dev_sentence_nll'], '.3f')} | "
                     f"{r['train_seconds'] if r['train_seconds'] is not None else ''} |")
    if chosen is None:
        return "\n".join([*out, "", "Confirmation: not run yet (this run searched only); a run of the sweep with "
                                     "confirm on goes on from these trials.", ""])
    out += ["", f"Confirmation: seeds {sweep.confirm.seeds}, pooled paired bootstrap "
                f"({sweep.confirm.resamples} resamples), Bonferroni over the candidates.", "",
            "| candidate | split | seeds | mean +- std | base mean +- std | delta [95% CI] | p | threshold | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for v in (*dev, *tests):
        c = v.comparison
        out.append(f"| {v.label} | {v.split} | {len(v.seeds)} | {v.mean:.2f} +- {v.std:.2f} | {v.base_mean:.2f} +- "
                   f"{v.base_std:.2f} | {c.delta:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}] | {c.p_value:.4f} | "
                   f"{v.threshold:.4f} | {v.verdict} |")
    out += ["", f"**Winner: {chosen.label}**" + (f" ({chosen.params})" if chosen.label != "base" else
                                                  ": no candidate was significantly better on dev")]
    return "\n".join(out) + "\n"


def _value(value: Any) -> str:
    """A searched value as a reader writes it: 0.15, not Optuna's stepped 0.15000000000000002."""
    return format(value, ".10g") if isinstance(value, float) else str(value)


def _f(value: float | None, fmt: str = ".2f") -> str:
    return "" if value is None else format(value, fmt)
