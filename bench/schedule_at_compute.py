"""Issue 53: learning-rate schedules compared at a fixed compute, with paired seeds, on any CPU.

A slow machine's 30 minutes are a number of updates (an AVX2-only EPYC's: about 780 of 4,096 target tokens), and a
budget of updates reproduces them on any machine: each arm trains ``--updates`` updates of the embedded default
(``multi30k-cpu``, its clock off), seeds paired, and is chosen and scored as the default is (N on dev, dev and
test2016 with the config's beam search; no newstest2014, no export). Arms are override sets (``ARMS``); ``paper``
is the baseline. Each finished run leaves a record under ``--records`` (scores, dev and test2016 outputs, the
schedule it trained with, machine, commit): commit them as they come, since run folders live only as long as the
machine. ``compare`` reads the records alone: every arm against ``--baseline`` (``paper``) by the paired bootstrap
pooled over the seeds, on dev (the choosing set) and test2016 (reported).

    python bench/schedule_at_compute.py runs --updates 780 --seeds 1 2 --work-dir /work/sched
    python bench/schedule_at_compute.py compare --updates 780 --seeds 1 2 --out bench/results/schedule_780.json
    python bench/schedule_at_compute.py runs --updates 4400 --speed bf16 --seeds 1 --arms budget slim   # a bf16 CPU
    python bench/schedule_at_compute.py compare --updates 4400 --seeds 1 --arms default muon --baseline default
    python bench/schedule_at_compute.py runs --tokens 3 --seeds 1 --arms mid-muon    # a budget of target tokens
    python bench/schedule_at_compute.py compare --updates 2267 --seeds 1 --arms default cool --baseline default \
        --default-records bench/results/default_e2e/multi30k-cpu_epyc-zen4_2026-11-28.json   # a Zen 4's own 30 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.average import averaged_path  # noqa: E402
from pipeline.config import resolve_config  # noqa: E402
from pipeline.data import read_manifest  # noqa: E402
from pipeline.evalsets import read_split  # noqa: E402
from pipeline.evaluate import eval_dir  # noqa: E402
from pipeline.fsutil import write_text  # noqa: E402
from pipeline.promotion import pooled_bootstrap  # noqa: E402
from pipeline.speed import cpu_name  # noqa: E402
from pipeline.tracking.runs import short_commit  # noqa: E402
from pipeline.workdir import build_inputs, run_dir  # noqa: E402

CONFIG, TEST = "multi30k-cpu", "test.test2016"
DEFAULT = "default"  # compare only: the default's own runs at the bf16 CPUs' compute (see load_record)
# the paper's warm-up (train.warmup_steps, the preset's 1,000) against the warm-up fitted to the budget, and recipes
# that spend the same compute otherwise. An arm with smaller updates or a smaller model gets the updates its tokens
# buy in the time of --updates updates of 4,096 tokens of the preset's shape on a CPU of the class studied (--speed:
# fp32, an AVX2-only CPU; bf16, a CPU with bf16 matrix units), at the throughput measured for its update size and
# shape (SPEED).
MID = ["train.schedule=budget", "train.update_tokens=2048", "train.max_tokens=2048", "train.cooldown=0.3",
       "model.dropout=0.1"]
NARROW = ["model.d_model=128", "model.d_ff=512"]  # a quarter of the preset's FLOPs per token in its matmuls
ARMS = {"paper": ["train.schedule=paper"], "budget": ["train.schedule=budget"],
        "small": ["train.schedule=budget", "train.update_tokens=1024", "train.max_tokens=1024", "train.cooldown=0.3",
                  "model.dropout=0.1"],
        "mid": MID,
        # the same cool-down and dropout at the preset's update size: what the update size adds
        "big": ["train.schedule=budget", "train.cooldown=0.3", "model.dropout=0.1"],
        # mid at d_model 128, d_ff 512: more tokens for the same compute
        "narrow": [*MID, *NARROW],
        # mid in the shape of Wu et al. (ACL 2021)'s Multi30k model: d_model 128, d_ff 256, 4+4 layers
        "wu": [*MID, "model.d_model=128", "model.d_ff=256", "model.encoder_layers=4", "model.decoder_layers=4"],
        # the preset as written (the bf16 CPUs' default) at d_model 128, d_ff 512
        "slim": ["train.schedule=budget", *NARROW],
        # the preset as written with Muon for the layers' weight matrices (Adam for the rest)
        "muon": ["train.schedule=budget", "train.optimizer=muon"],
        # Muon learns faster per token (L41): room for the stronger dropout that was too slow with Adam (L14)
        "muon-d3": ["train.schedule=budget", "train.optimizer=muon", "model.dropout=0.3"],
        # the time-to-target table's levers on narrow (--tokens): Muon, learning faster per token (L41); twice the
        # peak learning rate, which a short budget may bear where a long one did not (L14 at x1.5)
        "narrow-muon": [*MID, *NARROW, "train.optimizer=muon"],
        "narrow-lr2": [*MID, *NARROW, "train.lr_scale=2"],
        # Muon at the preset's width (more learnt per token than narrow?) and with a tenth of the budget as warm-up
        # (the speedrun's Muon runs have none): more updates at the peak
        "mid-muon": [*MID, "train.optimizer=muon"],
        "narrow-muon-w10": [*MID, *NARROW, "train.optimizer=muon", "train.budget_warmup=0.1"],
        # the preset with half its vocabulary: 29,000 training pairs leave many of 8,000 pieces rare, and smaller
        # vocabularies served low-resource NMT better (Sennrich and Zhang, 2019; Gowda and May, 2020); the
        # pre-softmax layer's FLOPs per token halve too
        "v4k": ["train.schedule=budget", "tokenizer.vocab_size=4000"],
        # and twice it: fewer pieces per sentence, more FLOPs per piece in the pre-softmax layer
        "v16k": ["train.schedule=budget", "tokenizer.vocab_size=16000"],
        # the budget schedule with a linear cool-down to 0 over its last 30 percent (the fp32 recipe's, L34) at the
        # preset's model and dropout: where a bf16 CPU buys half the updates of L23's (the Zen 4 of L43, 2,267)
        "cool": ["train.schedule=budget", "train.cooldown=0.3"],
        # big at slim's width: a narrower model's tokens for the same compute, as at an fp32 CPU's (narrow, L36)
        "slim-big": ["train.schedule=budget", "train.cooldown=0.3", "model.dropout=0.1", *NARROW],
        # the nanoGPT speedrun's architecture levers on the preset: zero-initialised output projections alone (no
        # cost per token), and with QK-norm and ReLU squared (export.engine none: CTranslate2 runs neither)
        "zinit": ["train.schedule=budget", "model.zero_init_output=true"],
        "speedrun": ["train.schedule=budget", "model.zero_init_output=true", "model.qk_norm=true",
                     "model.activation=relu2"],
        # zinit learns faster early and ties at the end (L59): at an fp32 CPU's compute, on its recipe (narrow)
        "narrow-zinit": [*MID, *NARROW, "model.zero_init_output=true"]}
# target tokens/s of our training against the preset's shape at updates of 4,096 tokens, side by side in one run
# (bench/bench_train.py --precision P): fp32 by update size, bench/results/train_speed_by_update_fp32_xeon-amx_2026-
# 11-27.json, and by shape (at 2,048, the lower of two rounds), bench/results/train_speed_by_shape_fp32_xeon-amx_2026-
# 11-28.json; bf16 by shape, bench/results/train_speed_by_shape_bf16_xeon-amx_2026-11-28.json, and by optimizer,
# bench/results/train_speed_by_optimizer_bf16_epyc-zen4_2026-11-28.json; fp32 by optimizer at narrow's shape (Muon
# 0.955 of Adam), bench/results/train_speed_by_optimizer_fp32-narrow_epyc-zen4_2026-11-28.json; bf16 by vocabulary
# size, bench/results/train_speed_by_vocab_bf16_epyc-zen4_2026-11-29.json (v4k at 1.0: at most its compute, fewer
# FLOPs per piece); cool and big train the preset's shape at its update size (1.0); slim-big's width at 2.0 on the
# Zen 4 whose compute it studies (2.04-2.34x, bench/results/train_speed_by_shape_bf16_epyc-zen4_2026-11-29.json; the
# AMX Xeon's 1.5 is slim's); zinit and narrow-zinit change the initialisation only (1.0, narrow's 2.0); speedrun
# (QK-norm and ReLU squared) 0.945 of the preset on the Zen 4, the mean of three alternating rounds (0.90-0.97),
# bench/results/train_speed_speedrun_bf16_epyc-zen4_2026-11-29.json. An arm without a measured speed is refused.
SPEED = {"fp32": {"paper": 1.0, "budget": 1.0, "big": 1.0, "mid": 1.0, "small": 0.81, "narrow": 2.0, "wu": 1.74,
                  "narrow-muon": 1.91, "narrow-zinit": 2.0},
         "bf16": {"paper": 1.0, "budget": 1.0, "slim": 1.5, "muon": 0.81, "muon-d3": 0.81,
                  "v4k": 1.0, "v16k": 0.805, "cool": 1.0, "big": 1.0,
                  "slim-big": 2.0, "zinit": 1.0, "speedrun": 0.945}}


def arm_steps(arm: str, updates: int, speed: str = "fp32", tokens: float | None = None) -> int:
    """The updates ``arm`` trains in the time of ``updates`` updates of 4,096 target tokens of the preset's shape
    on a CPU that trains in ``speed`` (fp32 or bf16); with ``tokens`` (millions of target tokens, the time-to-target
    table's measure, which needs no throughput), the updates of the arm's update size that make them (nominally)."""
    size = next((int(o.split("=")[1]) for o in ARMS[arm] if o.startswith("train.update_tokens=")), 4096)
    if tokens is not None:
        return round(tokens * 1e6 / size)
    if arm not in SPEED[speed]:
        raise SystemExit(f"arm {arm!r} has no measured {speed} throughput (SPEED[{speed!r}]); measure it first "
                         f"(bench/bench_train.py --precision {speed})")
    return round(updates * 4096 / size * SPEED[speed][arm])


# test2016 only: newstest2014 (news, out of the captions' domain) is the default's slowest evaluation and decides
# nothing here
TESTS = "data.test=[{name: test2016, format: text, path: multi30k/test2016}]"


def overrides(arm: str, steps: int, seed: int, keep: int | None = None) -> list[str]:
    keeping = [f"train.keep_last_checkpoints={keep}"] if keep else []
    return [*ARMS[arm], "train.max_minutes=null", f"train.max_steps={steps}",
            f"train.seed={seed}", "export.engine=none", TESTS, *keeping]


def budget(args: argparse.Namespace) -> str:
    """The budget's tag in record names: u<updates> (a class's compute) or t<millions>M (target tokens)."""
    return f"t{args.tokens:g}M" if args.tokens is not None else f"u{args.updates}"


def record_path(args: argparse.Namespace, arm: str, seed: int) -> Path:
    return args.records / f"{arm}-{budget(args)}-seed{seed}.json"


def run(args: argparse.Namespace, arm: str, seed: int) -> Path:
    """Train, choose and score one arm and seed (a finished run is reused), and write its record."""
    steps = arm_steps(arm, args.updates, args.speed, args.tokens)
    sets = overrides(arm, steps, seed, args.keep_checkpoints)
    cmd = [sys.executable, "-m", "pipeline", "run", "--config", CONFIG, "--work-dir", str(args.work_dir),
           *[a for o in sets for a in ("--set", o)]]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    cfg = resolve_config(CONFIG, [("work_dir", str(args.work_dir)), *sets])
    run_folder = run_dir(cfg, build_inputs(cfg).shards)
    averaged = averaged_path(cfg, run_folder)
    scores = eval_dir(cfg, averaged) / "scores.json"
    splits = json.loads(scores.read_text(encoding="utf-8"))["splits"]
    summary = json.loads((run_folder / "train_summary.json").read_text(encoding="utf-8"))
    # the step budget is not part of a run's identity (a longer one extends the run): a finished run of this arm at
    # another budget in the same work dir would be taken for this one
    if summary["steps"] != steps:
        raise SystemExit(f"{run_folder} holds a run of {summary['steps']} updates, not the {steps} asked for: the same "
                         "arm at another budget in this --work-dir; give each budget its own --work-dir")
    record = {"arm": arm, "seed": seed, "updates": summary["steps"], "overrides": sets, "machine": cpu_name(),
              "cpus": os.cpu_count(), "commit": short_commit(), "schedule": summary["schedule"],
              "train_seconds": summary["train_seconds"], "chosen_checkpoint": averaged.name,
              "dev.sacrebleu": splits["dev"]["sacrebleu"]["score"],
              "test2016.sacrebleu": splits[TEST]["sacrebleu"]["score"], "test2016.chrf": splits[TEST]["chrf"]["score"],
              "final_dev_nll": (summary.get("final_dev") or {}).get("dev_nll"),
              "outputs": {s: (scores.parent / f"{s}.hyp").read_text(encoding="utf-8").splitlines()
                          for s in ("dev", TEST)}}
    path = record_path(args, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(record, ensure_ascii=False) + "\n")
    return path


def load_record(args: argparse.Namespace, arm: str, seed: int) -> dict:
    """The record of ``arm`` and ``seed``; ``default``: the default's own run at this compute, in this study's keys,
    from ``--default-records``: a folder of the distillation study's original arm (the default's model and recipe at
    the bf16 CPUs' 4,400 updates, ``original-seed<N>.json``, ``bench/distill_study.py students``), or one record of
    the default job end to end (``bench/default_e2e.py``: a machine's own 30 minutes, its seed alone)."""
    if arm != DEFAULT:
        return json.loads(record_path(args, arm, seed).read_text(encoding="utf-8"))
    e2e = args.default_records.is_file()
    path = args.default_records if e2e else args.default_records / f"original-seed{seed}.json"
    r = json.loads(path.read_text(encoding="utf-8"))
    where = {"arm": DEFAULT, "seed": seed, "record": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else
             str(path), "machine": r["machine"], "commit": r["commit"]}
    if e2e:
        # one run: it pairs with the arms' runs of its own seed only (the same batches)
        ran = resolve_config(r["config"], r.get("overrides") or []).train.seed
        if ran != seed:
            raise SystemExit(f"{path}: the default's run of train.seed {ran}, not {seed}: compare --seeds {ran} "
                             "against it, or give --default-records a folder of original-seed<N>.json")
        summary, scores = r["train_summary"], r["scores"]
        return {**where, "updates": summary["steps"], "train_seconds": round(summary["train_seconds"]),
                "dev.sacrebleu": scores["dev"]["sacrebleu"], "test2016.sacrebleu": scores[TEST]["sacrebleu"],
                "test2016.chrf": scores[TEST]["chrf"], "outputs": {"dev": r["outputs"]["dev"],
                                                                   TEST: r["outputs"]["test2016"]}}
    run = r["run"]
    return {**where, "updates": run["updates"], "train_seconds": round(run["train_hours"] * 3600),
            "dev.sacrebleu": run["dev.sacrebleu"], "test2016.sacrebleu": run["test2016.sacrebleu"],
            "test2016.chrf": run["test2016.chrf"], "outputs": r["outputs"]}


def compare(args: argparse.Namespace) -> dict:
    """Every arm against ``--baseline`` from the records: per-seed scores and the pooled paired bootstrap."""
    records = {(a, s): load_record(args, a, s) for a in args.arms for s in args.seeds}
    cfg = resolve_config(CONFIG, [("work_dir", str(args.work_dir)), TESTS])
    corpus = build_inputs(cfg).corpus
    refs = {split: read_split(corpus, read_manifest(corpus), split)[1] for split in ("dev", TEST)}
    out = {"budget": budget(args), "seeds": args.seeds,
           "machine": "; ".join(sorted({r["machine"] for r in records.values()})),
           "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in records.values()], "significance": []}
    keys = ("dev.sacrebleu", "test2016.sacrebleu", "test2016.chrf", "updates", "train_seconds")
    out["means"] = {arm: {k: round(sum(records[arm, s][k] for s in args.seeds) / len(args.seeds), 2) for k in keys}
                    for arm in args.arms}
    base = args.baseline
    for arm in args.arms:
        if arm == base:
            continue
        for split in ("dev", TEST):
            c = pooled_bootstrap("sacrebleu", [records[base, s]["outputs"][split] for s in args.seeds],
                                 [records[arm, s]["outputs"][split] for s in args.seeds], refs[split])
            out["significance"].append({"claim": f"{arm} against {base}", "set": split, "base": c.champion,
                                        "system": c.challenger, "delta": c.delta, "ci95": [c.ci_low, c.ci_high],
                                        "p": c.p_value, "test": c.signature})
    print(json.dumps(out, indent=2))
    if args.out:
        write_text(args.out, json.dumps(out, indent=2) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["runs", "compare"])
    p.add_argument("--updates", type=int, default=780, help="updates per run (the compute of the class studied)")
    p.add_argument("--tokens", type=float, default=None, metavar="M",
                   help="instead of --updates' compute: the updates of each arm's train.update_tokens that make M "
                        "million target tokens, whatever its speed (the time-to-target table's budget; batches hold "
                        "a few percent fewer: the run's metrics count the real tokens)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--speed", choices=list(SPEED), default="fp32",
                   help="the class whose compute --updates measures: fp32 (AVX2 only) or bf16 (bf16 matrix units)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=[*ARMS, DEFAULT],
                   help=f"{DEFAULT} (compare only): the default's runs at 4,400 updates, from --default-records")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                   help="runs: keep the last N checkpoints (every 100 updates) for bench/learning_curve.py; the "
                        "choice of N averaged still takes the last 1/5/10/20")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "schedule-at-compute")
    p.add_argument("--records", type=Path, default=REPO / "bench" / "results" / "schedule_at_compute")
    p.add_argument("--out", type=Path, default=None, help="compare: the result JSON")
    p.add_argument("--baseline", default="paper", choices=[*ARMS, DEFAULT], help="compare: the arm the others face")
    p.add_argument("--default-records", type=Path, default=REPO / "bench" / "results" / "distill_study" / "en-de",
                   help="compare: where the default's runs at this compute are: a folder of original-seed<N>.json "
                        "(4,400 updates), or a bench/default_e2e.py record (a machine's own 30 minutes, one seed)")
    args = p.parse_args()
    args.work_dir = args.work_dir.resolve()
    if args.phase == "compare":
        compare(args)
        return
    if DEFAULT in args.arms:
        p.error(f"{DEFAULT} is not run here: its records come from bench/distill_study.py students --arms original")
    for seed in args.seeds:  # seed by seed: an interrupted study leaves paired arms
        for arm in args.arms:
            print(f"record: {run(args, arm, seed)}", flush=True)


if __name__ == "__main__":
    main()
