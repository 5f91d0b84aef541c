"""Distillation: a teacher ensemble, its distilled corpus, and students trained on the original against the
distilled data (paired seeds), each with its quality, decoding speed and size, on one machine.

Every step is a ``python -m pipeline`` command on this machine (no orchestrator), and every stage output is
content-addressed in ``--work-dir``, so the study resumes where it stopped: run the same command again (a finished
run is reused). Phases, in order (``all`` runs the first four in turn):

- ``teachers``: ``--teachers`` runs of the pair's teachers' config (the current default), seeds 1..k;
- ``distill``: their ensemble translates the training sources (``python -m pipeline distill``);
- ``students``: for each seed of ``--seeds``, each arm of ``studies/distill.yaml``: the student preset on the
  original data and on the distilled data, (En-De) the deep-encoder shallow-decoder student on the distilled data,
  and with ``--translations`` the student on what a GPU teacher translated (``gpu-distilled``,
  bench/gpu_teacher.py) and on those translations and the human references together (``gpu-mixed``). The student
  preset is the default's model and recipe, so on the original data it is the teacher run of the same seed (one run
  folder, trained once). Each finished run leaves a record in ``--records`` (its scores and its dev and test2016
  outputs): commit them, since the run folders live only as long as the machine;
- ``measure``: every arm's dev and test2016 scores per seed, each against the original arm by the pooled paired
  bootstrap over the seeds on dev (the choosing set) and on test2016 (reported); the teacher ensemble's and one
  teacher's scores; for seed 1 of each arm, decoding speed on test2016 (sentences/s, PyTorch fp32 and the int8
  CTranslate2 export, 1 and 2 threads) and size on disk. Written to ``--out`` and printed (JSON);
- ``quality``: the quality half of ``measure`` from the records alone, for a study whose runs are gone or not all
  on one machine;
- ``ledger``: the results-ledger entry of a ``measure`` or ``quality`` result (``--out``), printed as YAML.

Every run trains a fixed number of updates (``--max-steps``, by default what the default reaches in its 30 minutes
on the EPYC, ledger L23) instead of the configs' clock, so that what a run learns does not depend on the machine or
on a busy moment, and a study can be split over sessions on different CPUs. Run ``measure`` on an otherwise idle
machine: it measures speeds.

    python -m studies.distill all --work-dir runs/distill-study --out bench/results/distill_study.json
    python -m studies.distill all --pair en-fr --work-dir runs/distill-study --out bench/results/distill_fr.json
    python -m studies.distill quality --out bench/results/distill_quality_en-de.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from sacrebleu.metrics import BLEU
import torch
import yaml

from bench.harness import REPO, write_record
from pipeline.speed import cpu_features
from pipeline.config import RunConfig
from pipeline.data import read_manifest
from pipeline.engines import CTranslate2Engine
from pipeline.evalsets import read_split
from pipeline.export import export_checkpoint
from pipeline.support.fsutil import disk_mb
from pipeline.inference import load_model, load_models, translate
from pipeline.tokenize import Tokenizer
from pipeline.support.provenance import short_commit
from pipeline.workdir import build_inputs
from studies.common import (TEST, Scored, StudyRecord, chosen_checkpoint, evaluation, flags, flat_scores, load_arms,
                            pipeline, read_record, references, resolve, run_record, runs_machine, verdicts,
                            write_study_record)

# Per language pair: the teachers' config (the current default) and each student arm's config
PAIRS = {pair: (spec["teachers"], spec["arms"]) for pair, spec in load_arms("distill")["pairs"].items()}
GPU_ARM = "gpu-distilled"  # the student on a GPU teacher's translations (--translations)
MIXED_ARM = "gpu-mixed"  # the student on those translations and the human references together
GPU_ARMS = (GPU_ARM, MIXED_ARM)
# Each student arm is measured with its config's search and greedy (a distilled student is often decoded greedily:
# Kim & Rush 2016); the teachers with their config's.
SEARCHES = {"beam": [], "greedy": ["decode.beam_size=1"]}


class Study:
    """The study's configs and where their outputs are, for one work dir and data root."""

    def __init__(self, args: argparse.Namespace):
        self.work, self.data_root = args.work_dir.resolve(), args.data_root
        self.k, self.seeds = args.teachers, args.seeds
        self.teacher_config, students = PAIRS[args.pair]
        unknown = set(args.arms or []) - set(students)
        if unknown:
            raise SystemExit(f"--arms: {sorted(unknown)} are not arms of {args.pair}; its arms: {sorted(students)}")
        self.translations = args.translations and args.translations.resolve()
        if set(GPU_ARMS) & set(args.arms or []) and not self.translations:
            raise SystemExit(f"--arms {' '.join(GPU_ARMS)}: need --translations, the folder bench/gpu_teacher.py "
                             "brought back")
        self.configs = students  # every arm's config (the distill phase needs the distilled arm's)
        # every arm by default; the GPU teacher's only with its translations
        self.students = {a: c for a, c in students.items()
                         if (a in args.arms if args.arms else a not in GPU_ARMS or self.translations)}
        self.pair, self.records = args.pair, [r.resolve() for r in args.records]
        self.budget = [f"train.max_steps={args.max_steps}", "train.max_minutes=null"]

    def flags(self, config: str, overrides: list[str]) -> list[str]:
        return flags(config, self.work, overrides, self.data_root)

    def config(self, config: str, overrides: list[str]) -> RunConfig:
        return resolve(config, self.work, overrides, self.data_root)

    def averaged(self, config: str, overrides: list[str]) -> Path:
        """The averaged checkpoint of a finished ``python -m pipeline run`` of ``config`` with ``overrides``."""
        return chosen_checkpoint(self.config(config, overrides))

    def teacher_overrides(self, seed: int) -> list[str]:
        return [f"train.seed={seed}", *self.budget]

    def teachers(self) -> list[Path]:
        return [self.averaged(self.teacher_config, self.teacher_overrides(s)) for s in range(1, self.k + 1)]

    def arm_overrides(self, arm: str, seed: int) -> list[str]:
        # each distilled arm names its targets, whatever the student preset's default
        mixed = f"distill.keep_original={str(arm == MIXED_ARM).lower()}"
        if arm in GPU_ARMS:  # translations made on a GPU (bench/gpu_teacher.py), filtered here
            return ["distill.teachers=[]", f"distill.translations={self.translations}", f"train.seed={seed}",
                    mixed, *self.budget]
        teachers = "[]" if arm == "original" else "[" + ", ".join(map(str, self.teachers())) + "]"
        return [f"distill.teachers={teachers}", f"train.seed={seed}", *([] if arm == "original" else [mixed]),
                *self.budget]


def phase_teachers(study: Study) -> None:
    for seed in range(1, study.k + 1):
        pipeline("run", *study.flags(study.teacher_config, study.teacher_overrides(seed)))


def phase_distill(study: Study) -> None:
    pipeline("distill", *study.flags(study.configs["distilled"], []),
             *[a for t in study.teachers() for a in ("--teacher", str(t))])


def phase_students(study: Study) -> None:
    for seed in study.seeds:  # seed by seed: an interrupted study leaves paired arms
        for arm, config in study.students.items():
            pipeline("run", *study.flags(config, study.arm_overrides(arm, seed)))
            save_record(study, arm, seed)


def record_path(study: Study, arm: str, seed: int) -> Path:
    """Where a run's record is: in the first ``--records`` folder that holds it (arms trained in different
    sessions may keep their records apart), else where the students phase writes it, in the first folder."""
    paths = [r / study.pair / f"{arm}-seed{seed}.json" for r in study.records]
    return next((q for q in paths if q.is_file()), paths[0])


def save_record(study: Study, arm: str, seed: int) -> Path:
    """One finished run's record under ``--records`` (:class:`studies.common.StudyRecord`: commit it), with the
    same model decoded with each other search of ``SEARCHES`` (greedy). Run again on a finished run, it decodes
    what an older record lacks. A study whose machine is lost keeps every run it finished (the ``quality`` phase
    reads the records)."""
    config, overrides = study.students[arm], study.arm_overrides(arm, seed)
    averaged = study.averaged(config, overrides)
    searches = {}
    for search, extra in SEARCHES.items():
        if extra:  # the chosen model decoded again with this search (the run evaluated with its config's)
            pipeline("evaluate", *study.flags(config, [*overrides, *extra]), "--checkpoint", str(averaged))
            searches[search] = evaluation(study.config(config, [*overrides, *extra]), averaged)
    record = run_record("distill", arm, seed, config, overrides, study.config(config, overrides), averaged, searches,
                        pair=study.pair)
    return write_study_record(record, record_path(study, arm, seed))


def row(record: StudyRecord, search: Scored | None = None) -> dict:
    """A run's row in a result: seed, scores (``search``'s, else its config's search's), updates, hours."""
    return {**record.row(), **flat_scores((search or record).scores),
            "train_hours": round(record.run["train_seconds"] / 3600, 2)}


def speed(cfg: RunConfig, checkpoints: list[Path], tokenizer: Path, sources: list[str], threads: int,
          export: Path | None) -> dict:
    """Sentences/s on ``sources`` with PyTorch fp32 (an ensemble for several checkpoints) and, for one model, its
    int8 CTranslate2 export; one warm-up batch first, ``threads`` threads each."""
    torch.set_num_threads(threads)
    tok = Tokenizer(tokenizer)
    model = load_models(checkpoints, tokenizer=tok)
    translate(model, tok, sources[:32], cfg.decode)
    start = time.perf_counter()
    translate(model, tok, sources, cfg.decode)
    out = {"pytorch_fp32": round(len(sources) / (time.perf_counter() - start), 2)}
    if export is not None:
        engine = CTranslate2Engine(export, tok, threads)
        engine.translate(sources[:32], cfg.decode)
        start = time.perf_counter()
        hypotheses = [n[0] for n in engine.translate(sources, cfg.decode)]
        out["ct2_int8"] = round(len(sources) / (time.perf_counter() - start), 2)
        out["ct2_int8_hypotheses"] = hypotheses
    return out


def phase_measure(study: Study, out: Path | None) -> dict:
    teachers = study.teachers()
    tcfg = study.config(study.teacher_config, study.teacher_overrides(1))
    inputs = build_inputs(tcfg)
    corpus, tokenizer = inputs.corpus, inputs.tokenizer
    sources = read_split(corpus, read_manifest(corpus), TEST)[0]
    # the teacher ensemble, evaluated as one model (the CLI writes scores.json beside its first member)
    pipeline("evaluate", *study.flags(study.teacher_config, study.teacher_overrides(1)),
             *[a for t in teachers for a in ("--checkpoint", str(t))])
    result: dict = {"seeds": study.seeds, "teachers": {}, "arms": {}}
    # one teacher is its own ensemble: measured once
    named = {"teacher-1": teachers[:1]} | ({f"teacher-ensemble-{len(teachers)}": teachers} if len(teachers) > 1 else {})
    for name, members in named.items():
        result["teachers"][name] = {
            **flat_scores(evaluation(tcfg, members).scores),
            "size_mb.float32": round(sum(disk_mb(m) for m in members), 2),
            **{f"speed.{k}.threads{t}": v for t in (1, 2)
               for k, v in speed(tcfg, members, tokenizer, sources, t, None).items()}}
    refs = references(tcfg)
    runs: dict[str, list[StudyRecord]] = {}  # "<arm>" (the config's search) and "<arm>.greedy": per seed
    for arm, config in study.students.items():
        result["arms"][arm] = {"config": config}
        for search, extra in SEARCHES.items():
            key = arm if search == "beam" else f"{arm}.{search}"
            runs[key] = []
            for seed in study.seeds:
                overrides = [*study.arm_overrides(arm, seed), *extra]
                # the model the run chose (with its config's search), decoded here with this one
                averaged = study.averaged(config, study.arm_overrides(arm, seed))
                if extra:  # the run evaluated with its config's search; this one is decoded here
                    pipeline("evaluate", *study.flags(config, overrides), "--checkpoint", str(averaged))
                runs[key].append(run_record("distill", arm, seed, config, overrides, study.config(config, overrides),
                                            averaged))
            cfg = study.config(config, [*study.arm_overrides(arm, study.seeds[0]), *extra])
            averaged = Path(runs[key][0].run["checkpoint"])
            export = study.work / "exports" / f"{key}-seed{study.seeds[0]}-int8"  # kept beside the runs it measures
            student_tokenizer = build_inputs(cfg).tokenizer
            export_checkpoint(averaged, student_tokenizer, "int8", export, cfg.export.batch_sentences, cfg.decode)
            measured = {t: speed(cfg, [averaged], student_tokenizer, sources, t, export) for t in (1, 2)}
            result["arms"][arm][search] = {
                "decode": cfg.decode.model_dump(include={"beam_size", "length_penalty"}),
                "runs": [row(r) for r in runs[key]],
                "parameters": load_model(averaged).num_parameters(), "size_mb.float32": disk_mb(averaged),
                "size_mb.int8_export": disk_mb(export),
                # the int8 export's own translations of test2016 (seed 1), scored as the evaluation scores
                "test2016.sacrebleu.ct2_int8": round(BLEU().corpus_score(
                    measured[2].pop("ct2_int8_hypotheses"), [refs[TEST]]).score, 2),
                **{f"speed.{k}.threads{t}": v for t, m in measured.items() for k, v in m.items()
                   if not k.endswith("hypotheses")}}
    result["significance"] = significance(runs, refs)
    return write(result, out)


def significance(runs: dict[str, list[Scored]], refs: dict[str, list[str]]) -> list[dict]:
    """Every arm (and search) against the original arm, each arm's greedy search against its own beam search
    (what greedy costs that arm), and the mixed arm against the GPU-distilled one (what the human pairs add), by
    the paired bootstrap pooled over the seeds, on dev and test2016; ``runs[key]``: each seed's evaluation, in the
    seeds' order. None without the original arm."""
    if "original" not in runs:
        return []
    claims = [("original", k, f"{k.replace('.greedy', ' (greedy)')} against original") for k in runs
              if k != "original"]
    claims += [(arm, k, f"{arm} (greedy) against {arm} (beam)") for k in runs
               if k.endswith(".greedy") and (arm := k.removesuffix(".greedy")) != "original"]  # original's is above
    claims += [(GPU_ARM, MIXED_ARM, f"{MIXED_ARM} against {GPU_ARM}")] if {GPU_ARM, MIXED_ARM} <= set(runs) else []
    seeds = list(range(1, len(runs["original"]) + 1))  # paired by position
    return verdicts(claims, runs, refs, seeds)


def write(result: dict, out: Path | None) -> dict:
    """The result under the harness's provenance header (a quality result keeps its runs' machine), to ``out``
    (:func:`bench.harness.write_record`); printed without it."""
    record = write_record(out, result, None)
    if out is None:
        print(json.dumps(record, indent=2))
    return record


def quality_result(records: list[StudyRecord], refs: dict[str, list[str]]) -> dict:
    """The quality half of a study from its runs' records: every arm's runs in the seeds' order (greedy too where
    every seed's record holds it), and the pooled paired bootstrap against the original arm; no teachers, speed or
    size (those need the runs themselves: the ``measure`` phase). Every arm needs a record for every seed the
    original arm has."""
    by_arm: dict[str, dict[int, StudyRecord]] = {}
    for r in records:
        by_arm.setdefault(r.arm, {})[r.seed] = r
    seeds = sorted(by_arm.get("original", {}))
    unpaired = {arm: sorted(set(seeds) ^ set(runs)) for arm, runs in by_arm.items() if set(runs) != set(seeds)}
    if not seeds or unpaired:
        raise SystemExit(f"records: the original arm's seeds {seeds}; arms not paired with them (seeds "
                         f"missing or extra): {unpaired}. Train them (phase students) or pass --seeds")
    result: dict = {"machine": runs_machine(records), "seeds": seeds, "teachers": {}, "arms": {}}
    runs: dict[str, list[Scored]] = {}
    for arm, by_seed in by_arm.items():
        runs[arm] = [by_seed[s] for s in seeds]
        result["arms"][arm] = {"config": runs[arm][0].config, "beam": {"runs": [row(r) for r in runs[arm]]}}
        for search in SEARCHES:  # a search every seed's record holds (records before greedy have none)
            held = [r.searches.get(search) for r in runs[arm]]
            if all(held):
                result["arms"][arm][search] = {"runs": [row(r, h) for r, h in zip(runs[arm], held)]}
                runs[f"{arm}.{search}"] = held
    result["significance"] = significance(runs, refs)
    return result


def phase_quality(study: Study, out: Path | None) -> dict:
    paths = [record_path(study, arm, seed) for arm in study.students for seed in study.seeds]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no record of {len(missing)} runs: {missing}; the students phase writes one per run")
    refs = references(study.config(study.teacher_config, study.teacher_overrides(1)))
    return write(quality_result([read_record(p) for p in paths], refs), out)


def ledger_entry(result: dict, pair: str, entry_id: str, commit: str, command: str, date: str) -> dict:
    """The results-ledger entry (docs/results/ledger.yaml) of a ``measure`` result: per-seed scores of every arm,
    the teachers (with their cost), speed and size per arm, and the pooled paired-bootstrap claims, each figure as
    measured (nothing retyped). A ``quality`` result (from the runs' records) gives the per-seed scores, the
    original arm's cost and the claims only."""
    teachers, machine = result["teachers"], result["machine"]
    if not isinstance(machine, dict):  # a result written before the harness's header
        machine = {"cpu": machine, "cpus": result["cpus"]}
    # (arm, search, its measurements) for every arm and search: the arm's config's search and greedy
    arms = [(arm, search, m) for arm, a in result["arms"].items() for search, m in a.items() if search != "config"]
    measured = all("parameters" in m for _, _, m in arms)  # the measure phase's; a quality result has none
    costs = result["arms"]["original"]["beam"]["runs"]  # the teachers' runs (each of the original arm's seeds)
    per_seed = [[arm, search, r["seed"], r["dev.sacrebleu"], r["test2016.sacrebleu"], r["test2016.chrf"],
                 r["train_hours"]] for arm, search, m in arms for r in m["runs"]]
    speed_cols = ["speed.pytorch_fp32.threads1", "speed.pytorch_fp32.threads2", "speed.ct2_int8.threads1",
                  "speed.ct2_int8.threads2"]
    serving = [[name, "beam", None, t["test2016.sacrebleu"], t["size_mb.float32"], None, None,
                *(t.get(c) for c in speed_cols)] for name, t in teachers.items()]
    serving += [[arm, search, m["parameters"], m["runs"][0]["test2016.sacrebleu"], m["size_mb.float32"],
                 m["size_mb.int8_export"], m["test2016.sacrebleu.ct2_int8"], *(m.get(c) for c in speed_cols)]
                for arm, search, m in arms if measured]
    mean = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
    figures = {f"{arm}.{search}.{k}.mean": mean([r[k] for r in m["runs"]]) for arm, search, m in arms
               for k in ("dev.sacrebleu", "test2016.sacrebleu")}
    figures |= {f"{name}.{k}": t[k] for name, t in teachers.items() for k in ("dev.sacrebleu", "test2016.sacrebleu")}
    figures |= {"original.runs": len(costs), "original.updates_each": costs[0]["updates"],
                "original.train_hours_total": round(sum(c["train_hours"] for c in costs), 2)}
    what = ("studies/distill.py: a teacher ensemble of the current default's runs (seeds 1..k, a fixed number of "
            "updates each; the original arm's runs are those teachers), its translations of the training sources as "
            "the distilled corpus, and each student arm trained on paired seeds; dev and test2016 scored by "
            "sacreBLEU; every arm against original by the paired bootstrap pooled over the seeds")
    what += ("; decoding speed on test2016 (PyTorch fp32, CTranslate2 int8; 1 and 2 threads) and size on disk for "
             "seed 1 of each arm; each arm with its config's beam search and greedy." if measured else
             "; each run with its config's beam search (and greedy, where every record holds it), from the runs' "
             "records (the quality phase): no teacher ensemble scores, speed or size.")
    tables = [{"name": "distill_per_seed",
               "caption": "Every run and search (beam: its config's; greedy: beam 1): dev and test2016 sacreBLEU, "
                          "test2016 chrF, training hours",
               "columns": ["arm", "search", "seed", "dev_sacrebleu", "test2016_sacrebleu", "test2016_chrf",
                           "train_hours"],
               "rows": per_seed}]
    if serving:
        tables.append({"name": "distill_serving",
                       "caption": "The teachers and seed 1 of each arm and search: parameters, test2016 sacreBLEU "
                                  "(PyTorch), size, the int8 export's test2016 sacreBLEU, and test2016 decoding speed "
                                  "(sentences/s)",
                       "columns": ["model", "search", "parameters", "test2016_sacrebleu", "float32_mb",
                                   "int8_export_mb", "int8_test2016_sacrebleu", "pytorch_fp32_1t", "pytorch_fp32_2t",
                                   "ct2_int8_1t", "ct2_int8_2t"],
                       "rows": serving})
    return {
        "id": entry_id, "topic": "distillation", "date": date,
        "title": f"Distillation on Multi30k {pair}: students on the teachers' translations "
                 "against the original data",
        "what": what, "machine": {"cpu": machine["cpu"], **cpu_features(machine["cpu"]), "threads": machine["cpus"]},
        "commit": commit, "command": command, "figures": figures, "tables": tables,
        "significance": [{"claim": c["claim"], "set": c["set"], "delta": c["delta"], "ci95": c["ci95"], "p": c["p"],
                          "test": c["test"]} for c in result["significance"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=["teachers", "distill", "students", "measure", "quality", "all", "ledger"])
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "distill-study")
    p.add_argument("--data-root", default=None, help="default: the configs' data.root (or AIAYN_DATA_ROOT)")
    p.add_argument("--pair", default="en-de", choices=sorted(PAIRS), help="language pair")
    p.add_argument("--teachers", type=int, default=3, help="teacher runs (seeds 1..k) in the ensemble")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="paired student seeds")
    p.add_argument("--arms", nargs="+", default=None,
                   help="students and measure: only these arms (default: every arm of the pair); a study split "
                        "over sessions trains and measures a part at a time")
    p.add_argument("--translations", type=Path, default=None,
                   help=f"the {' and '.join(GPU_ARMS)} arms' training targets: a translations folder made on a GPU "
                        "(bench/gpu_teacher.py)")
    p.add_argument("--max-steps", type=int, default=4400, help="updates per run (every arm and teacher)")
    p.add_argument("--out", type=Path, default=None,
                   help="measure, quality: the result JSON; ledger: read from here")
    p.add_argument("--records", type=Path, nargs="+", default=[REPO / "bench" / "results" / "distill_study"],
                   help="one file per finished run (students writes, quality reads): <records>/<pair>/<arm>-seed<S>"
                        ".json; commit them. Several folders: each record is read from the first that holds it, "
                        "and written to the first")
    p.add_argument("--ledger-id", help="ledger: the entry's id (the next free one in docs/results/ledger.yaml)")
    p.add_argument("--commit", default=None, help="ledger: the commit the study ran at (default: HEAD)")
    p.add_argument("--command", default=None,
                   help="ledger: the command it ran (default: this script's all or quality)")
    args = p.parse_args()
    if args.phase == "ledger":  # reads a measure or quality result; trains nothing
        if not (args.ledger_id and args.out):
            p.error("ledger needs --ledger-id and --out (the measure phase's result)")
        result = json.loads(args.out.read_text(encoding="utf-8"))
        phase = "all" if result["teachers"] else "quality"  # a quality result has no teachers
        command = args.command or f"python -m studies.distill {phase} --pair {args.pair} --out {args.out}"
        entry = ledger_entry(result, args.pair, args.ledger_id, args.commit or short_commit(), command,
                             datetime.date.today().isoformat())
        print(yaml.safe_dump([entry], sort_keys=False, allow_unicode=True, width=120))
        return
    study = Study(args)
    phases = {"teachers": phase_teachers, "distill": phase_distill, "students": phase_students,
              "measure": lambda s: phase_measure(s, args.out), "quality": lambda s: phase_quality(s, args.out)}
    for name in ["teachers", "distill", "students", "measure"] if args.phase == "all" else [args.phase]:
        phases[name](study)


if __name__ == "__main__":
    main()
