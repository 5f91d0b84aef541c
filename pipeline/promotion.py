"""Champion promotion as a statistical decision: is the challenger truly better than the champion?

A registered version carries its *promotion set*: its hypotheses on one dev/test set, the references and
their digest (:class:`PromotionSet`, stored with the version so the champion is never decoded again). A
challenger replaces the champion only when, on the same segments,

1. its score beats the champion's by more than ``tracking.promote_margin``,
2. the difference is significant: sacreBLEU's paired bootstrap resampling (``sacrebleu.significance``, the
   Moses ``bootstrap-hypothesis-difference-significance.pl`` test; for parsing the same test over sentences on
   EVALB F1 through :class:`pipeline.parsing.evalb.EvalbF1`) gives p < ``tracking.promote_p``, and
3. no reported test set drops by more than ``tracking.guard_margin`` (chrF for translation, F1 for parsing).

Everything here is pure (hypotheses and scores in, a decision out); the registry (``pipeline.tracking``) stores
and reads the evidence, and the flow serialises decisions per registered model.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.base import Metric
from sacrebleu.significance import PairedTest

from pipeline.config import RunConfig
from pipeline.parsing.evalb import EvalbF1

log = logging.getLogger("aiayn.promotion")

# Seed of the resampling indices for the difference's confidence interval; sacreBLEU's p-value uses its own
# (SACREBLEU_SEED, default 12345, recorded in the signature).
CI_SEED = 12345


def lock_name(model: str) -> str:
    """The Prefect global concurrency limit (one slot) that serialises promotions of one registered model."""
    return f"promote-{model}"


def lines_sha256(lines: Sequence[str]) -> str:
    """Digest of a list of segments (what makes two promotion sets the same set)."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class PromotionSet:
    """A version's hypotheses on the promotion set, with the references they are scored against."""

    name: str  # the set's name in the config (``multi30k-val``, ``test2016``, ...)
    split: str  # its corpus key (``dev``, ``test.<name>``)
    metric: str  # sacrebleu | chrf | f1
    hypotheses: list[str]
    references: list[str]

    @property
    def references_sha256(self) -> str:
        return lines_sha256(self.references)

    def meta(self) -> dict:
        """What is stored beside the hypothesis and reference files."""
        return {"name": self.name, "split": self.split, "metric": self.metric, "segments": len(self.hypotheses),
                "references_sha256": self.references_sha256}


def references_suffix(metric: str) -> str:
    """The suffix of the file an evaluation folder keeps the references of one split in, beside ``<split>.hyp``,
    for the metric that scores them: ``gold`` (EVALB F1: the gold trees) or ``ref`` (translation)."""
    return "gold" if metric == "f1" else "ref"


def read_promotion_set(policy: "Policy", eval_dir: Path) -> PromotionSet:
    """A version's promotion set from its evaluation folder: ``<split>.hyp`` with ``<split>.ref`` (translation)
    or ``<split>.gold`` (parsing), line for line."""
    files = [Path(eval_dir) / f"{policy.split}.{kind}" for kind in ("hyp", references_suffix(policy.metric))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"promotion set {policy.set_name!r}: {missing} not found; the evaluation folder "
                                f"{eval_dir} has no outputs for split {policy.split!r} (re-run the evaluation: "
                                "python -m pipeline evaluate)")
    hyps, refs = (f.read_text(encoding="utf-8").split("\n")[:-1] for f in files)
    if len(hyps) != len(refs):
        raise ValueError(f"{files[0]} has {len(hyps)} lines, {files[1]} {len(refs)}: re-run the evaluation")
    return PromotionSet(policy.set_name, policy.split, policy.metric, hyps, refs)


def metric_for(name: str) -> Metric:
    """The sacreBLEU metric object of a promotion metric name (default settings, as the evaluation scores)."""
    if name == "sacrebleu":
        return BLEU()
    if name == "chrf":
        return CHRF()
    if name == "f1":
        return EvalbF1()
    raise ValueError(f"no promotion metric {name!r}: use sacrebleu, chrf or f1")


@dataclass(frozen=True)
class Comparison:
    """Challenger against champion on the same segments: scores, their difference with a 95% bootstrap
    confidence interval, and sacreBLEU's paired-bootstrap p-value (two-sided: how often a difference this large
    arises by chance)."""

    metric: str
    segments: int
    champion: float
    challenger: float
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    resamples: int
    signature: str


def paired_bootstrap(metric: str, champion: Sequence[str], challenger: Sequence[str], references: Sequence[str],
                     resamples: int = 1000) -> Comparison:
    """sacreBLEU's paired bootstrap resampling test of ``challenger`` against ``champion`` (the baseline), and
    the 95% percentile interval of the score difference over the same kind of resamples."""
    if not (len(champion) == len(challenger) == len(references)) or not references:
        raise ValueError(f"paired test needs equal, non-empty segment lists: champion {len(champion)}, "
                         f"challenger {len(challenger)}, references {len(references)}")
    m = metric_for(metric)
    signatures, results = PairedTest([("champion", list(champion)), ("challenger", list(challenger))], {metric: m},
                                     [list(references)], test_type="bs", n_samples=resamples)()
    key = next(k for k in results if k != "System")
    base, other = results[key]
    # The difference's interval: resample segment indices, score both systems on each resample.
    diffs = _resampled_differences(m, *(_segment_stats(m, [hyps], references) for hyps in (champion, challenger)),
                                   resamples)
    low, high = np.percentile(diffs, [2.5, 97.5])
    # sacreBLEU's bootstrap p-value is 1/(resamples+1) for two identical systems (no resample differs more than
    # the observed zero); identical outputs carry no evidence at all, so say p = 1.
    p_value = 1.0 if list(champion) == list(challenger) else float(other.p_value)
    return Comparison(metric=metric, segments=len(references), champion=round(float(base.score), 4),
                      challenger=round(float(other.score), 4), delta=round(float(other.score - base.score), 4),
                      ci_low=round(float(low), 4), ci_high=round(float(high), 4), p_value=p_value,
                      resamples=resamples, signature=str(signatures[key]))


def _segment_stats(m: Metric, runs: Sequence[Sequence[str]], references: Sequence[str]) -> np.ndarray:
    """[segments, statistics]: each segment's sufficient statistics summed over ``runs`` (several runs of one
    system, e.g. seeds, on the same segments): a corpus score over all of them is the score of the column sums."""
    return sum(np.asarray(m._extract_corpus_statistics(list(hyps), [list(references)]), dtype="float64")
               for hyps in runs)


def _resampled_differences(m: Metric, base: np.ndarray, other: np.ndarray, resamples: int) -> np.ndarray:
    """``other``'s score minus ``base``'s on each of ``resamples`` resamples of the segments (drawn as sacreBLEU's
    paired bootstrap draws them, with its default seed)."""
    idx = np.random.default_rng(CI_SEED).choice(len(base), size=(resamples, len(base)), replace=True)
    return np.array([m._compute_score_from_stats(other[i].sum(0)).score
                     - m._compute_score_from_stats(base[i].sum(0)).score for i in idx])


def pooled_bootstrap(metric: str, baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]],
                     references: Sequence[str], resamples: int = 1000) -> Comparison:
    """Paired bootstrap of ``system`` against ``baseline`` over several runs each (seeds, paired by position), on
    the same ``references``: each resample draws segments, and a drawn segment brings every run's output for it, so
    the test sees the seeds' spread and the segments' sampling together (a block bootstrap; with one run each it is
    sacreBLEU's paired bootstrap resampling, the same p-value). Scores are corpus scores over all runs' outputs;
    p is two-sided, computed as sacreBLEU computes it."""
    if len(baseline) != len(system) or not baseline:
        raise ValueError(f"pooled bootstrap needs the same number of runs per system: {len(baseline)} vs {len(system)}")
    if any(len(h) != len(references) for h in (*baseline, *system)) or not references:
        raise ValueError(f"every run needs one output per reference segment ({len(references)})")
    m = metric_for(metric)
    stats = [_segment_stats(m, runs, references) for runs in (baseline, system)]
    base_score, score = (m._compute_score_from_stats(s.sum(0)).score for s in stats)
    diffs = _resampled_differences(m, *stats, resamples)
    low, high = np.percentile(diffs, [2.5, 97.5])
    centred = np.abs(diffs) - np.abs(diffs).mean()  # sacreBLEU's statistic: |difference|, centred
    p = 1.0 if [list(h) for h in baseline] == [list(h) for h in system] else \
        float(((centred > abs(score - base_score)).sum() + 1) / (resamples + 1))
    return Comparison(metric=metric, segments=len(references) * len(baseline), champion=round(float(base_score), 4),
                      challenger=round(float(score), 4), delta=round(float(score - base_score), 4),
                      ci_low=round(float(low), 4), ci_high=round(float(high), 4), p_value=p, resamples=resamples,
                      signature=f"pooled paired bootstrap over {len(baseline)} run(s) per system, "
                                f"{resamples} resamples, seed {CI_SEED}, {m.get_signature()}")


@dataclass(frozen=True)
class Guard:
    """One reported test set: the challenger may not lose more than the guard margin on it."""

    set: str
    metric: str
    challenger: float
    champion: float | None  # None: the champion has no score on this set (a new set): nothing to compare

    def drop(self) -> float | None:
        return None if self.champion is None else round(self.champion - self.challenger, 4)


@dataclass(frozen=True)
class Policy:
    """The promotion rule of a config (``tracking.*``)."""

    set_name: str
    split: str
    metric: str
    margin: float
    p_threshold: float
    resamples: int
    guard_metric: str
    guard_margin: float
    guard_sets: tuple[str, ...]

    @property
    def on_test_set(self) -> bool:
        return self.split != "dev"

    @classmethod
    def of(cls, cfg: RunConfig) -> "Policy":
        split = cfg.promotion_split
        name = cfg.data.dev.name if split == "dev" else split.removeprefix("test.")
        t = cfg.tracking
        return cls(set_name=name, split=split, metric=cfg.promotion_metric, margin=t.promote_margin,
                   p_threshold=t.promote_p, resamples=t.promote_resamples, guard_metric=cfg.guard_metric,
                   guard_margin=t.guard_margin, guard_sets=tuple(s.name for s in cfg.data.test))


@dataclass
class Decision:
    """What the registry does with a new version, and why; every field becomes evidence (tags, report)."""

    decision: str  # promoted | not promoted | no decision
    version: str
    reason: str
    champion_version: str | None = None
    set: str = ""
    set_role: str = ""
    comparison: Comparison | None = None
    guards: list[Guard] = field(default_factory=list)
    failed_guards: list[str] = field(default_factory=list)

    @property
    def promoted(self) -> bool:
        return self.decision == "promoted"

    def as_dict(self) -> dict:
        """JSON-able form (the flow's return value and the report's input)."""
        out = asdict(self)
        out["promoted"] = self.promoted
        out["guards"] = [{**asdict(g), "drop": g.drop()} for g in self.guards]
        return out

    def tags(self) -> dict[str, str]:
        """The evidence as ``promotion.*`` tags (version and parent run)."""
        tags = {"promotion.decision": self.decision, "promotion.reason": self.reason,
                "promotion.champion_version": self.champion_version or "none", "promotion.set": self.set,
                "promotion.set_role": self.set_role}
        c = self.comparison
        if c is not None:
            tags |= {"promotion.metric": c.metric, "promotion.score": f"{c.challenger:.4f}",
                     "promotion.champion_score": f"{c.champion:.4f}", "promotion.delta": f"{c.delta:.4f}",
                     "promotion.ci95": f"[{c.ci_low:.4f}, {c.ci_high:.4f}]", "promotion.p_value": f"{c.p_value:.4f}",
                     "promotion.resamples": str(c.resamples), "promotion.signature": c.signature}
        if self.guards:
            tags["promotion.guards"] = "; ".join(
                f"{g.set} {g.metric} {'new set' if g.drop() is None else f'drop {g.drop():.2f}'}"
                f"{' FAILED' if g.set in self.failed_guards else ''}" for g in self.guards)
        return {k: v for k, v in tags.items() if v != ""}


def guards(policy: Policy, challenger: dict[str, float], champion: dict[str, float]) -> list[Guard]:
    """The guard of every reported test set, from both versions' flat scores (``<set>.<metric>``)."""
    out = []
    for name in policy.guard_sets:
        key = f"{name}.{policy.guard_metric}"
        if key in challenger:
            out.append(Guard(name, policy.guard_metric, challenger[key], champion.get(key)))
    return out


def decide(policy: Policy, version: str, champion_version: str, comparison: Comparison,
           set_guards: list[Guard]) -> Decision:
    """The rule: margin AND significance AND no guarded test set dropping by more than the guard margin."""
    c = comparison
    role = "test" if policy.on_test_set else "dev"
    failed = [g.set for g in set_guards if g.drop() is not None and g.drop() > policy.guard_margin]
    evidence = (f"{c.metric} on {policy.set_name} ({role} set{', selecting on a TEST set' if role == 'test' else ''}"
                f", {c.segments} segments): {c.challenger:.2f} vs champion version {champion_version} "
                f"{c.champion:.2f}, delta {c.delta:+.2f} (95% CI [{c.ci_low:+.2f}, {c.ci_high:+.2f}]), "
                f"paired bootstrap p = {c.p_value:.4f}")
    if c.delta <= policy.margin:
        verdict, why = "not promoted", f"delta {c.delta:+.2f} does not exceed the margin {policy.margin}"
    elif c.p_value >= policy.p_threshold:
        verdict, why = "not promoted", f"not significant (p {c.p_value:.4f} >= {policy.p_threshold})"
    elif failed:
        drops = ", ".join(f"{g.set} {g.metric} -{g.drop():.2f}" for g in set_guards if g.set in failed)
        verdict, why = "not promoted", f"guard failed: {drops} (more than {policy.guard_margin} lost)"
    else:
        verdict, why = "promoted", (f"better by more than the margin {policy.margin}, significant "
                                    f"(p < {policy.p_threshold}), no test set drops more than {policy.guard_margin}")
    return Decision(verdict, version, f"{why}; {evidence}", champion_version, policy.set_name, role, c, set_guards,
                    failed)
