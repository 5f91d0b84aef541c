"""A teacher much stronger than the tiny student, trained on a lent GPU in one device call, whose translations of
the training sources come back as text for the student that trains on the CPU.

In one call, each step bounded by the call's clock:

1. ``--teachers`` runs of ``--config`` (default ``multi30k-teacher-gpu``: the paper's base width), seeds 1..k, train
   side by side on the one GPU, each with ``--set`` and its own ``--teacher-set`` overrides, so that one call can
   screen several recipes (``python -m pipeline run`` each: training on the config's clock, N chosen on dev,
   dev and test sets scored; no export);
2. their ensemble is scored too, and the teacher that translates (the best single run or the ensemble) is chosen on
   dev (Multi30k val), never on test2016;
3. it translates every training source (:func:`pipeline.distill.write_translations`, with the distill settings of
   ``--student-config``, decoded as ``--distill-set`` says: static beam search in bf16 on the GPU).

What comes back under ``--out`` (4 files; the device tool brings back at most 8 of 16 MiB, two folders deep):
``translations/translations.txt`` and ``translations/manifest.json`` (the translations folder, with the teachers'
lineage: file sha256, config, commit), ``teacher.json`` (every teacher's and the ensemble's scores, updates and
choice, the chosen teacher's dev and test2016 outputs, the GPU, the timings) and ``gpu_teacher.log``. Weights stay
on the GPU machine. The student then trains here on the translations (``distill.translations``), e.g.:

    python -m pipeline run --config multi30k-student-tiny --set 'distill.teachers=[]' \
        --set distill.translations=<out>/translations

bench/gpu_teacher.sh prepares and makes the device call, with ``--device-call``: the run then fails when what it
would bring back exceeds the device tool's limits (a rehearsal on the CPU with a small teacher, ``--set``
overrides, checks that beforehand). On a GPU machine of one's own there is no such limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import REPO, write_record
from pipeline.average import averaged_path
from pipeline.config import RunConfig, resolve_config
from pipeline.distill import write_translations
from pipeline.evaluate import eval_dir
from pipeline.inference import decode_device
from pipeline.speed import cpu_name
from pipeline.workdir import build_inputs, run_dir

TEST = "test.test2016"
LIMIT_FILES, LIMIT_MB = 8, 16  # what the device tool brings back


def log(msg: str) -> None:
    print(f"[gpu_teacher {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pipeline_args(config: str, args: argparse.Namespace, overrides: list[str]) -> list[str]:
    out = ["--config", config, "--work-dir", str(args.work_dir)]
    out += ["--data-root", args.data_root] if args.data_root else []
    return out + [a for o in overrides for a in ("--set", o)]


def resolved(config: str, args: argparse.Namespace, overrides: list[str]) -> RunConfig:
    return resolve_config(config, [("work_dir", str(args.work_dir)), *overrides], data_root=args.data_root)


def scores_of(scores_json: Path) -> dict:
    """Each split's sacreBLEU and chrF from an evaluation's scores.json."""
    splits = json.loads(scores_json.read_text(encoding="utf-8"))["splits"]
    return {k: {"sacrebleu": s["sacrebleu"]["score"], "chrf": s["chrf"]["score"]} for k, s in splits.items()}


def train_teachers(args: argparse.Namespace, deadline: float) -> list[dict]:
    """Every teacher run side by side (one process each, sharing the GPU); the finished ones' rows."""
    procs = []
    env = dict(os.environ)
    if torch.cuda.is_available():  # the runs share the host's cores: each takes its share for its CPU threads
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.teachers))
    for seed in range(1, args.teachers + 1):
        overrides = [*args.set, *args.teacher_set.get(seed, []), f"train.seed={seed}"]
        logfile = open(args.work_dir / f"teacher-{seed}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, "-m", "pipeline", "run", *pipeline_args(args.config, args, overrides)]
        log(" ".join(cmd))
        procs.append((seed, overrides, logfile, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logfile,
                                                                  stderr=subprocess.STDOUT)))
    rows = []
    for seed, overrides, logfile, proc in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed at the deadline"
        logfile.close()
        if rc != 0:
            log(f"teacher seed {seed}: {rc}; its log's end:\n" + tail(args.work_dir / f"teacher-{seed}.log", 30))
            continue
        cfg = resolved(args.config, args, overrides)
        run = run_dir(cfg, build_inputs(cfg).shards)
        averaged = averaged_path(cfg, run)
        summary = json.loads((run / "train_summary.json").read_text(encoding="utf-8"))
        choice = averaged.parent / "choice.json"
        rows.append({"seed": seed, "overrides": args.teacher_set.get(seed, []), "checkpoint": str(averaged),
                     "updates": summary["steps"],
                     "train_seconds": round(summary["train_seconds"], 1), "tgt_tokens": summary["tokens"]["tgt"],
                     "chosen_n": json.loads(choice.read_text())["chosen_n"] if choice.is_file() else None,
                     "scores": scores_of(eval_dir(cfg, averaged) / "scores.json")})
        log(f"teacher seed {seed}: {rows[-1]['updates']} updates, dev {rows[-1]['scores']['dev']['sacrebleu']:.2f}")
    return rows


def teacher_sets(items: list[str], teachers: int) -> dict[int, list[str]]:
    """``SEED:KEY=VALUE`` items as each seed's overrides; a seed outside 1..teachers is refused."""
    out: dict[int, list[str]] = {}
    for item in items:
        seed, sep, override = item.partition(":")
        if not sep or not seed.isdigit() or not 1 <= int(seed) <= teachers or "=" not in override:
            raise SystemExit(f"--teacher-set {item!r}: expected SEED:KEY=VALUE with SEED in 1..{teachers}")
        out.setdefault(int(seed), []).append(override)
    return out


def tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="multi30k-teacher-gpu", help="the teachers' config")
    p.add_argument("--student-config", default="multi30k-student-tiny",
                   help="whose distill settings (beam, length penalty, nbest, select) the teacher translates with")
    p.add_argument("--teachers", type=int, default=3, help="teacher runs (seeds 1..k), trained side by side")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of every teacher run (e.g. train.max_minutes=3, or a small model to rehearse)")
    p.add_argument("--teacher-set", action="append", default=[], metavar="SEED:KEY=VALUE",
                   help="an override of one teacher run (e.g. 2:train.rdrop_alpha=1): a screen of recipes in one call")
    p.add_argument("--distill-set", action="append",
                   default=["decode.search=static", "decode.precision=bf16", "decode.batch_sentences=256"],
                   metavar="KEY=VALUE", help="overrides of the translating run's distill section")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-teacher"))
    p.add_argument("--data-root", default=None, help="default: the configs' data.root (or AIAYN_DATA_ROOT)")
    p.add_argument("--out", type=Path, required=True, help="what comes back (4 files)")
    p.add_argument("--commit", default=os.environ.get("AIAYN_COMMIT"), help="the commit this runs at (recorded)")
    p.add_argument("--device-call", action="store_true",
                   help="fail when what --out holds exceeds what the device tool brings back (bench/gpu_teacher.sh)")
    p.add_argument("--budget-s", type=float, default=480, help="the whole call's seconds; training stops in time")
    args = p.parse_args()
    args.teacher_set = teacher_sets(args.teacher_set, args.teachers)
    started = time.time()
    deadline = started + args.budget_s
    args.work_dir = args.work_dir.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = decode_device()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    log(f"device {gpu or cpu_name()}, torch {torch.__version__}, Python {platform.python_version()}")

    timings = {}
    t = time.time()
    first = resolved(args.config, args, [*args.set, "train.seed=1"])
    inputs = build_inputs(first)  # once, before the runs start side by side (each then finds it done)
    timings["inputs_s"] = round(time.time() - t, 1)

    t = time.time()
    # the translations need time after training (timings.translations_s); the runs' own clocks end before this
    rows = train_teachers(args, deadline - 90)
    timings["teachers_s"] = round(time.time() - t, 1)
    if not rows:
        raise SystemExit("no teacher finished; see the logs above")

    candidates = {f"teacher-{r['seed']}": ([Path(r["checkpoint"])], r["scores"]) for r in rows}
    ensemble = None
    if len(rows) > 1:
        t = time.time()
        members = [Path(r["checkpoint"]) for r in rows]
        subprocess.run([sys.executable, "-m", "pipeline", "evaluate", *pipeline_args(args.config, args, args.set),
                        *[a for m in members for a in ("--checkpoint", str(m))]], cwd=REPO, check=True)
        ensemble = f"ensemble-{len(rows)}"
        candidates[ensemble] = (members, scores_of(eval_dir(first, members) / "scores.json"))
        timings["ensemble_eval_s"] = round(time.time() - t, 1)
    chosen = max(candidates, key=lambda k: candidates[k][1]["dev"]["sacrebleu"])  # on dev only
    members, chosen_scores = candidates[chosen]
    log(f"chosen on dev: {chosen} (dev {chosen_scores['dev']['sacrebleu']:.2f})")

    t = time.time()
    student = resolved(args.student_config, args, ["distill.teachers=[]",
                                                   *[f"distill.{o}" for o in args.distill_set]])
    per_teacher = {str(k): v for k, v in args.teacher_set.items()}
    lineage = {"commit": args.commit, "device": gpu or cpu_name(), "torch": torch.__version__,
               "teacher_config": args.config, "teacher_overrides": args.set,
               "teacher_sets": per_teacher, "chosen": chosen,
               "chosen_on": "dev sacreBLEU", "scores": chosen_scores}
    translations = write_translations(inputs.corpus, members, inputs.tokenizer, student.distill,
                                      args.out / "translations", args.work_dir, device=device, lineage=lineage)
    timings["translations_s"] = round(time.time() - t, 1)
    sources = json.loads((translations / "manifest.json").read_text())["rows"]
    timings["translations_sentences_per_s"] = round(sources / max(timings["translations_s"], 1e-9), 1)

    evaluated = eval_dir(first, members)
    result = {"commit": args.commit, "config": args.config, "overrides": args.set,
              "teacher_sets": per_teacher, "teachers": rows,
              "ensemble": {"name": ensemble, "scores": candidates[ensemble][1]} if ensemble else None,
              "chosen": chosen, "chosen_scores": chosen_scores,
              "outputs": {split: (evaluated / f"{split}.hyp").read_text(encoding="utf-8").splitlines()
                          for split in ("dev", TEST)},
              "distill": student.distill.model_dump(mode="json", include={"decode", "nbest", "select"}),
              "corpus_fingerprint": json.loads((inputs.corpus / "manifest.json").read_text())["fingerprint"],
              "timings": {**timings, "total_s": round(time.time() - started, 1)}}
    write_record(args.out / "teacher.json", result, None, args)  # the GPU in its machine header
    (args.out / "gpu_teacher.log").write_text(
        "\n\n".join(f"== teacher-{s} ==\n" + tail(args.work_dir / f"teacher-{s}.log", 60)
                    for s in range(1, args.teachers + 1)) + "\n", encoding="utf-8")
    files = [f for f in args.out.rglob("*") if f.is_file()]
    too_big = [f"{f} ({f.stat().st_size / 2**20:.1f} MiB)" for f in files if f.stat().st_size > LIMIT_MB * 2**20]
    if args.device_call and (len(files) > LIMIT_FILES or too_big):
        raise SystemExit(f"the bring-back exceeds the device tool's limits: {len(files)} files (max {LIMIT_FILES}), "
                         f"over {LIMIT_MB} MiB: {too_big}")
    log(f"done in {time.time() - started:.0f} s: {len(files)} files, "
        f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB under {args.out}; chosen {chosen}: "
        + ", ".join(f"{k} {v['sacrebleu']:.2f}" for k, v in chosen_scores.items()))


if __name__ == "__main__":
    main()
