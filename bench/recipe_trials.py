"""The table of recipe trials for the 30-minute CPU default: each trial's updates, dev and test sacreBLEU, and its
difference from the baseline trial on dev and test2016 with sacreBLEU's paired bootstrap.

    .venv/bin/python bench/recipe_trials.py --trial baseline=RUN_A/averaged/eval-last3-xxxx \
        --trial dropout0.3=RUN_B/averaged/eval-last3-yyyy [--baseline baseline] [--out bench/results/recipe.json]

Each ``--trial NAME=EVAL_DIR`` is an evaluation folder (``scores.json`` with ``dev.hyp``/``dev.ref`` and
``test.test2016.hyp``/``.ref``); the run folder above it gives the updates and the changed settings (its
``config.yaml`` against the baseline's). Choices are made on dev; test2016 is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.promotion import paired_bootstrap  # noqa: E402

SPLITS = {"dev": "dev", "test2016": "test.test2016"}


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_of(eval_dir: Path) -> Path:
    """The training run folder of an evaluation folder (``<run>/averaged/[choose-.../]eval-...``): the nearest
    folder above it with a ``train_summary.json``."""
    for folder in eval_dir.parents:
        if (folder / "train_summary.json").is_file():
            return folder
    raise SystemExit(f"error: no training run folder (train_summary.json) above {eval_dir}")


def trial(name: str, eval_dir: Path) -> dict:
    scores = json.loads((eval_dir / "scores.json").read_text(encoding="utf-8"))
    summary = json.loads((run_of(eval_dir) / "train_summary.json").read_text(encoding="utf-8"))
    return {"name": name, "eval_dir": str(eval_dir), "checkpoint": Path(scores["checkpoint"]["path"]).name,
            "updates": summary["steps"], "epochs": summary["epoch"],
            **{f"{label}.sacrebleu": scores["splits"][key]["sacrebleu"]["score"] for label, key in SPLITS.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trial", action="append", required=True, metavar="NAME=EVAL_DIR")
    p.add_argument("--baseline", help="the trial the others are tested against (default: the first)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    dirs = dict(t.rsplit("=", 1) for t in args.trial)  # names may hold "=", paths do not
    dirs = {k: Path(v).resolve() for k, v in dirs.items()}
    base_name = args.baseline or next(iter(dirs))
    base_dir = dirs[base_name]
    base_cfg = flat(yaml.safe_load((run_of(base_dir) / "config.yaml").read_text(encoding="utf-8")))
    rows = []
    for name, eval_dir in dirs.items():
        row = trial(name, eval_dir)
        cfg = flat(yaml.safe_load((run_of(eval_dir) / "config.yaml").read_text(encoding="utf-8")))
        row["changed"] = {k: v for k, v in cfg.items() if base_cfg.get(k) != v and k not in ("work_dir", "data.root")}
        if name != base_name:
            for label, key in SPLITS.items():
                refs = lines(base_dir / f"{key}.ref")
                c = paired_bootstrap("sacrebleu", lines(base_dir / f"{key}.hyp"), lines(eval_dir / f"{key}.hyp"),
                                     refs)
                row[f"{label}.vs_baseline"] = {"delta": c.delta, "ci95": [c.ci_low, c.ci_high], "p": c.p_value}
        rows.append(row)
    print(f"| trial | updates | dev sacreBLEU | vs {base_name} (p) | test2016 | vs {base_name} (p) | changed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs = {label: (f"{r[f'{label}.vs_baseline']['delta']:+.2f} ({r[f'{label}.vs_baseline']['p']:.3f})"
                      if f"{label}.vs_baseline" in r else "") for label in SPLITS}
        changed = ", ".join(f"{k}={v}" for k, v in r["changed"].items()) or "(baseline)"
        print(f"| {r['name']} | {r['updates']} | {r['dev.sacrebleu']:.2f} | {vs['dev']} | "
              f"{r['test2016.sacrebleu']:.2f} | {vs['test2016']} | {changed} |")
    if args.out:
        args.out.write_text(json.dumps({"baseline": base_name, "trials": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
