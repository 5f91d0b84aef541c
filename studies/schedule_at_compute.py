"""Learning-rate schedules and recipes compared at a fixed compute, with paired seeds, on any CPU.

A slow machine's 30 minutes are a number of updates of 4,096 target tokens, and a budget of updates reproduces them
on any machine: each arm trains ``--updates`` updates of the embedded default (``multi30k-cpu``, its clock off),
seeds paired, and is chosen and scored as the default is (N on dev, dev and test2016 with the config's beam search;
no newstest2014, no export). Arms are override sets, data in ``studies/schedule_at_compute.yaml``; its ``baseline``
(``paper``) is the one the others face. Each finished run leaves a record under ``--records`` (scores, dev and
test2016 outputs, the schedule it trained with, machine, commit): commit them as they come, since run folders live
only as long as the machine. ``compare`` reads the records alone: every arm against ``--baseline`` (``paper``) by
the paired bootstrap pooled over the seeds, on dev (the choosing set) and test2016 (reported), each significant
below 0.05 / the number of arms compared (Bonferroni; the sweeps' verdict, ``studies.common``).

    python -m studies.schedule_at_compute runs --updates 780 --seeds 1 2 --work-dir /work/sched
    python -m studies.schedule_at_compute compare --updates 780 --seeds 1 2 --out bench/results/schedule_780.json
    python -m studies.schedule_at_compute runs --updates 4400 --speed bf16 --seeds 1 --arms budget slim   # a bf16 CPU
    python -m studies.schedule_at_compute compare --updates 4400 --seeds 1 --arms default slim --baseline default
    python -m studies.schedule_at_compute runs --tokens 3 --seeds 1 --arms narrow-lr2    # a budget of target tokens
    python -m studies.schedule_at_compute compare --updates 2267 --seeds 1 --arms default cool --baseline default \
        --default-records bench/results/default_e2e/multi30k-cpu_epyc-zen4_2026-11-28.json   # a Zen 4's own 30 min
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.harness import REPO, write_record
from studies.common import (StudyRecord, chosen_checkpoint, flags, load_arms, pipeline, read_record, references,
                            resolve, run_record, runs_machine, verdicts, write_study_record)

DEFAULT = "default"  # compare only: the default's own runs at the bf16 CPUs' compute (see load_record)
STUDY = load_arms("schedule_at_compute")
CONFIG = STUDY["config"]
ARMS = list(STUDY["arms"])


def arm_overrides(arm: str) -> list[str]:
    """An arm's overrides: its shared sets (``use``) in order, then its own."""
    spec = STUDY["arms"][arm]
    return [*(o for name in spec.get("use", []) for o in STUDY["shared"][name]), *spec.get("overrides", [])]


def arm_steps(arm: str, updates: int, speed: str = "fp32", tokens: float | None = None) -> int:
    """The updates ``arm`` trains in the time of ``updates`` updates of 4,096 target tokens of the preset's shape
    on a CPU that trains in ``speed`` (fp32 or bf16); with ``tokens`` (millions of target tokens, the time-to-target
    table's measure, which needs no throughput), the updates of the arm's update size that make them (nominally)."""
    size = next((int(o.split("=")[1]) for o in arm_overrides(arm) if o.startswith("train.update_tokens=")), 4096)
    if tokens is not None:
        return round(tokens * 1e6 / size)
    measured = STUDY["arms"][arm].get("speed", {})
    if speed not in measured:
        raise SystemExit(f"studies/schedule_at_compute.yaml: arm {arm!r} has no measured {speed} speed; measure it "
                         f"first (python -m bench.bench_train --precision {speed}) and add it to the arm")
    return round(updates * 4096 / size * measured[speed])


# test2016 only: newstest2014 (news, out of the captions' domain) is the default's slowest evaluation and decides
# nothing here
TESTS = "data.test=[{name: test2016, format: text, path: multi30k/test2016}]"


def overrides(arm: str, steps: int, seed: int, keep: int | None = None) -> list[str]:
    keeping = [f"train.keep_last_checkpoints={keep}"] if keep else []
    return [*arm_overrides(arm), "train.max_minutes=null", f"train.max_steps={steps}",
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
    pipeline("run", *flags(CONFIG, args.work_dir, sets))
    cfg = resolve(CONFIG, args.work_dir, sets)
    averaged = chosen_checkpoint(cfg)
    record = run_record("schedule_at_compute", arm, seed, CONFIG, sets, cfg, averaged)
    # the step budget is not part of a run's identity (a longer one extends the run): a finished run of this arm at
    # another budget in the same work dir would be taken for this one
    if record.run["updates"] != steps:
        raise SystemExit(f"{averaged.parents[2]} holds a run of {record.run['updates']} updates, not the {steps} asked "
                         "for: the same arm at another budget in this --work-dir; give each budget its own --work-dir")
    return write_study_record(record, record_path(args, arm, seed))


def load_record(args: argparse.Namespace, arm: str, seed: int) -> StudyRecord:
    """The record of ``arm`` and ``seed``; ``default``: the default's own run at this compute from
    ``--default-records``: a folder of the distillation study's original arm (the default's model and recipe at
    the bf16 CPUs' updates, ledger L23, ``original-seed<N>.json``, ``studies/distill.py students``), or one record of
    the default job end to end (``ops/default_e2e.py``: a machine's own 30 minutes, its seed alone)."""
    if arm != DEFAULT:
        return read_record(record_path(args, arm, seed))
    e2e = args.default_records.is_file()
    path = args.default_records if e2e else args.default_records / f"original-seed{seed}.json"
    record = read_record(path, "schedule_at_compute", DEFAULT)
    # an end-to-end record is one run: it pairs with the arms' runs of its own seed only (the same batches)
    if record.seed != seed:
        raise SystemExit(f"{path}: the default's run of train.seed {record.seed}, not {seed}: compare --seeds "
                         f"{record.seed} against it, or give --default-records a folder of original-seed<N>.json")
    return record.model_copy(update={"arm": DEFAULT, "run": {**record.run, "record": str(
        path.relative_to(REPO) if path.is_relative_to(REPO) else path)}})


def compare(args: argparse.Namespace) -> dict:
    """Every arm against ``--baseline`` from the records: per-seed scores and the pooled paired bootstrap."""
    records = {a: [load_record(args, a, s) for s in args.seeds] for a in args.arms}
    refs = references(resolve(CONFIG, args.work_dir, [TESTS]))
    rows = {a: [{**r.row(), "machine": r.machine["cpu"], "commit": r.commit} for r in rs] for a, rs in records.items()}
    keys = ("dev.sacrebleu", "test2016.sacrebleu", "test2016.chrf", "updates", "train_seconds")
    means = {a: {k: round(sum(r[k] for r in rs) / len(rs), 2) for k in keys} for a, rs in rows.items()}
    claims = [(args.baseline, arm, f"{arm} against {args.baseline}") for arm in args.arms if arm != args.baseline]
    return write_record(args.out, {"machine": runs_machine([r for rs in records.values() for r in rs]),
                                   "budget": budget(args), "seeds": args.seeds, "runs": rows, "means": means,
                                   "significance": verdicts(claims, records, refs, args.seeds)}, None, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["runs", "compare"])
    p.add_argument("--updates", type=int, default=780, help="updates per run (the compute of the class studied)")
    p.add_argument("--tokens", type=float, default=None, metavar="M",
                   help="instead of --updates' compute: the updates of each arm's train.update_tokens that make M "
                        "million target tokens, whatever its speed (the time-to-target table's budget; batches hold "
                        "a few percent fewer: the run's metrics count the real tokens)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--speed", choices=["fp32", "bf16"], default="fp32",
                   help="the class whose compute --updates measures: fp32 (AVX2 only) or bf16 (bf16 matrix units)")
    p.add_argument("--arms", nargs="+", default=ARMS, choices=[*ARMS, DEFAULT],
                   help=f"{DEFAULT} (compare only): the default's runs at the bf16 CPUs' compute (--default-records)")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                   help="runs: keep the last N checkpoints (every 100 updates) for python -m bench.learning_curve; the "
                        "choice of N averaged still takes the last 1/5/10/20")
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "schedule-at-compute")
    p.add_argument("--records", type=Path, default=REPO / "bench" / "results" / "schedule_at_compute")
    p.add_argument("--out", type=Path, default=None, help="compare: the result JSON")
    p.add_argument("--baseline", default=STUDY["baseline"], choices=[*ARMS, DEFAULT],
                   help="compare: the arm the others face")
    p.add_argument("--default-records", type=Path, default=REPO / "bench" / "results" / "distill_study" / "en-de",
                   help="compare: where the default's runs at this compute are: a folder of original-seed<N>.json "
                        "(the bf16 CPUs' compute), or an ops/default_e2e.py record (a machine's own 30 minutes, one "
                        "seed)")
    args = p.parse_args()
    args.work_dir = args.work_dir.resolve()
    if args.phase == "compare":
        compare(args)
        return
    if DEFAULT in args.arms:
        p.error(f"{DEFAULT} is not run here: its records come from studies/distill.py students --arms original")
    for seed in args.seeds:  # seed by seed: an interrupted study leaves paired arms
        for arm in args.arms:
            print(f"record: {run(args, arm, seed)}", flush=True)


if __name__ == "__main__":
    main()
