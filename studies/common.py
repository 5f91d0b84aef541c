"""What the studies share: their arms as data (``studies/<study>.yaml``) and the verdict of every arm against the
baseline over paired seeds, by the sweeps' own code (:func:`pipeline.sweep.verdict.paired_verdict`: the pooled
paired bootstrap, significant below alpha / the number of arms compared, Bonferroni)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.sweep.verdict import bonferroni, paired_verdict

HERE = Path(__file__).resolve().parent
ALPHA = 0.05


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


def verdicts(claims: list[tuple[str, str, str]], outputs: dict[str, dict[str, list[list[str]]]],
             refs: dict[str, list[str]], splits: tuple[str, ...], seeds: list[int], alpha: float = ALPHA
             ) -> list[dict]:
    """Each claim (base arm, arm, what it says) on every split: ``outputs[arm][split]`` holds each seed's outputs,
    in the seeds' order. One record per claim and split: the pooled scores compared, delta with its 95% interval,
    p, the Bonferroni threshold over the claims, and the verdict. (The per-seed means and spreads are the records'
    own: the verdict here is the pooled test's.)"""
    threshold = bonferroni(alpha, len(claims))
    unscored = [0.0] * len(seeds)  # the means and spreads the verdict would hold: not reported here
    out = []
    for base, arm, claim in claims:
        for split in splits:
            v = paired_verdict(arm, split, seeds, (unscored, outputs[base][split]), (unscored, outputs[arm][split]),
                               refs[split], "sacrebleu", threshold)
            c = v.comparison
            out.append({"claim": claim, "set": split, "base": c.champion, "system": c.challenger, "delta": c.delta,
                        "ci95": [c.ci_low, c.ci_high], "p": c.p_value, "threshold": round(threshold, 4),
                        "verdict": v.verdict, "test": c.signature})
    return out
