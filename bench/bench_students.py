"""What a student architecture costs to serve, apart from what it learned: decoding speed and size of each config's
model against the current default's, on one machine (the goal: an int8 student at 2x the default's CTranslate2 int8
sentences/s).

A trained model's speed also depends on how long its outputs are, which its training decides. Here every output
is forced to the same length (``decode.min_len`` = ``max_len_b``; CTranslate2's ``min/max_decoding_length``): the
test2016 references' mean length in the model's subwords, so each model does the same decoding work and
sentences/s compares architectures. Each config's model is trained for a few updates (``--updates``) through
``python -m pipeline train``: forced lengths make the speed independent of the weights, the updates only keep them
from being degenerate. Per config: parameters, size on disk (float32 weights; the int8 CTranslate2 export folder),
and test2016 sentences/s with PyTorch fp32 and the int8 export, the config's beam search and greedy, 1 and 2
threads, each measured ``--repeats`` times with the configs' order rotated between repeats (the median is
reported). A student's quality is the distillation study's (studies/distill.py); this measures only speed and
size. Run it on an otherwise idle machine: a second busy process on 2 cores slows a run several times over.

    python -m bench.bench_students --out bench/results/students_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch

from bench.harness import REPO, median, ratio, rotations, timed, write_record
from pipeline.config import RunConfig, resolve_config
from pipeline.data import read_manifest
from pipeline.engines import CTranslate2Engine
from pipeline.evalsets import read_split
from pipeline.export import export_checkpoint
from pipeline.support.fsutil import disk_mb
from pipeline.inference import load_model, translate
from pipeline.speed import cpu_features
from pipeline.tokenize import Tokenizer
from pipeline.support.provenance import short_commit
from pipeline.workdir import build_inputs, run_dir

TEST = "test.test2016"
# Each architecture by its layers (encoder+decoder): the default, the deep-shallow student preset, and one decoder
# layer under each of their encoders; every one on the original data (its teachers are not needed to time it).
CONFIGS = {"default 3+3": ("multi30k-cpu", []),
           "deep-shallow 6+2": ("multi30k-student-deep-shallow", ["distill.teachers=[]"]),
           "deep-shallow 6+1": ("multi30k-student-deep-shallow", ["distill.teachers=[]", "model.decoder_layers=1"]),
           "shallow 3+1": ("multi30k-cpu", ["model.decoder_layers=1"])}


def prepare(name: str, config: str, overrides: list[str], work: Path, updates: int) -> dict:
    """Train ``config`` for ``updates`` updates (once: a finished run is reused), write its float32 weights and its
    int8 CTranslate2 export; return the paths and the model's size."""
    sets = [*overrides, f"train.max_steps={updates}", "train.max_minutes=null"]
    flags = ["--config", config, "--work-dir", str(work), *[a for s in sets for a in ("--set", s)]]
    cfg: RunConfig = resolve_config(config, [("work_dir", str(work)), *sets])  # "key=value" as --set reads them
    inputs = build_inputs(cfg)
    checkpoints = run_dir(cfg, inputs.shards) / "checkpoints"
    if not sorted(checkpoints.glob("ckpt-*.pt")):
        subprocess.run([sys.executable, "-m", "pipeline", "train", *flags], cwd=REPO, check=True)
    checkpoint = sorted(checkpoints.glob("ckpt-*.pt"))[-1]
    model = load_model(checkpoint)
    slug = name.replace(" ", "-").replace("+", "_")
    weights = work / "students-cost" / f"{slug}.pt"
    weights.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), weights)  # the weights alone, as an averaged checkpoint holds them
    export = work / "students-cost" / f"{slug}-int8"
    if not (export / "model.bin").is_file():
        export_checkpoint(checkpoint, inputs.tokenizer, "int8", export, cfg.export.batch_sentences, cfg.decode)
    return {"config": config, "overrides": overrides, "cfg": cfg, "checkpoint": checkpoint,
            "tokenizer": inputs.tokenizer, "corpus": inputs.corpus, "export": export,
            "model": {"encoder_layers": cfg.model.encoder_layers, "decoder_layers": cfg.model.decoder_layers,
                      "d_model": cfg.model.d_model, "d_ff": cfg.model.d_ff, "heads": cfg.model.n_heads,
                      "norm": cfg.model.norm},
            "updates": int(checkpoint.stem.split("-")[1]), "parameters": model.num_parameters(),
            "size_mb.float32": disk_mb(weights), "size_mb.int8_export": disk_mb(export)}


def mean_length(tokenizer: Path, corpus: Path) -> int:
    """The test2016 references' mean length in ``tokenizer``'s subwords, eos not counted (rounded)."""
    table = pq.read_table(corpus / read_manifest(corpus)["splits"][TEST]["file"], columns=["tgt"])
    rows = Tokenizer(tokenizer).encode_batch(table.column("tgt").to_pylist())
    return round(statistics.mean(len(r) for r in rows))


def sources(corpus: Path) -> list[str]:
    return read_split(corpus, read_manifest(corpus), TEST)[0]


def sentences_per_s(decode, sentences: list[str]) -> float:
    """Sentences/s of ``decode(sentences)`` after one warm-up batch."""
    decode(sentences[:32])
    return round(len(sentences) / timed(decode, sentences)[1], 2)


def measure(m: dict, sentences: list[str], length: int, threads: int) -> dict:
    """Sentences/s of one model with PyTorch fp32 and its int8 export, its config's search and greedy, every output
    forced to ``length`` subwords."""
    forced = {"max_len_a": 0.0, "max_len_b": length + 1, "min_len": length + 1}
    searches = {"beam": m["cfg"].decode.model_copy(update=forced),
                "greedy": m["cfg"].decode.model_copy(update=forced | {"beam_size": 1})}
    torch.set_num_threads(threads)
    tok = Tokenizer(m["tokenizer"])
    model = load_model(m["checkpoint"], tokenizer=tok)
    engine = CTranslate2Engine(m["export"], tok, threads)
    out = {}
    for search, decode in searches.items():
        out[f"pytorch_fp32.{search}"] = sentences_per_s(lambda s: translate(model, tok, s, decode), sentences)
        out[f"ct2_int8.{search}"] = sentences_per_s(lambda s: engine.translate(s, decode), sentences)
    return out


SPEEDS = [f"{engine}.{search}.threads{t}" for search in ("beam", "greedy") for engine in ("pytorch_fp32", "ct2_int8")
          for t in (1, 2)]


def ledger_entry(result: dict, entry_id: str, commit: str, command: str, date: str) -> dict:
    """The results-ledger entry (docs/results/ledger.yaml) of a result: per architecture its size and the median
    sentences/s of every engine, search and thread count (table ``student_cost``), and each one's speed against the
    default's int8 export with beam search (figures), each as measured (nothing retyped)."""
    models, cpu = result["models"], result["machine"]["cpu"]
    base = models[result["baseline"]]["median"]["ct2_int8.beam.threads2"]
    rows = [[name, m["model"]["encoder_layers"], m["model"]["decoder_layers"], m["model"]["norm"], m["parameters"],
             m["updates"], m["size_mb.float32"], m["size_mb.int8_export"], *(m["median"][k] for k in SPEEDS)]
            for name, m in models.items()]
    slug = lambda name: name.replace(" ", "_").replace("+", "_").replace("-", "_")  # noqa: E731
    figures = {f"{slug(name)}.{k}.vs_default_int8_beam": round(m["median"][k] / base, 2)
               for name, m in models.items() for k in ("ct2_int8.beam.threads2", "ct2_int8.greedy.threads2")}
    return {
        "id": entry_id, "topic": "distillation", "date": date,
        "title": "What a student architecture gains in decoding speed and size, apart from its training "
                 "(Multi30k En-De test2016, outputs of one forced length)",
        "what": (f"bench/bench_students.py: each architecture's config after a few updates, every output forced to "
                 f"{result['forced_length']} subwords (the test2016 references' mean), {result['sentences']} test2016 "
                 "sentences decoded with PyTorch fp32 and the int8 CTranslate2 export, the config's beam search and "
                 f"greedy, 1 and 2 threads, {result['repeats']} interleaved repeats (medians); size on disk of the "
                 "float32 weights and of the int8 export folder. Speed and size only: a student's quality is the "
                 "distillation study's."),
        "machine": {"cpu": cpu, **cpu_features(cpu), "threads": result["machine"]["cpus"]},
        "commit": commit, "command": command, "figures": figures,
        "tables": [{"name": "student_cost",
                    "caption": "Per architecture (encoder+decoder layers): parameters, the updates it had, size on "
                               "disk (MB), and median test2016 sentences/s per engine, search and threads",
                    "columns": ["architecture", "encoder_layers", "decoder_layers", "norm", "parameters", "updates",
                                "float32_mb", "int8_export_mb",
                                *(k.replace(".threads", "_").replace(".", "_") + "t" for k in SPEEDS)],
                    "rows": rows}],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "students-cost")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=sorted(CONFIGS),
                   help="architectures to time (quoted: 'deep-shallow 6+1'); the default is always timed too")
    p.add_argument("--updates", type=int, default=20,
                   help="updates of each model before it is timed (a run found in --work-dir is taken as it is)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", type=Path, default=None, help="the result JSON (--ledger: read from here)")
    p.add_argument("--ledger", metavar="ID", help="print the ledger entry ID of the result in --out; measure nothing")
    p.add_argument("--commit", default=None, help="--ledger: the commit it ran at (default: HEAD)")
    p.add_argument("--command", default=None, help="--ledger: the command it ran (default: this script's, --out)")
    args = p.parse_args()
    if args.ledger:
        if not args.out:
            p.error("--ledger needs --out (a result of this script)")
        import datetime

        import yaml

        commit = args.commit or short_commit()
        command = args.command or f"python -m bench.bench_students --out {args.out}"
        entry = ledger_entry(json.loads(args.out.read_text(encoding="utf-8")), args.ledger, commit, command,
                             datetime.date.today().isoformat())
        entry["files"] = [str(args.out)]
        print(yaml.safe_dump([entry], sort_keys=False, allow_unicode=True, width=120))
        return
    work = args.work_dir.resolve()
    base = next(iter(CONFIGS))  # every ratio is against the default, so it is always measured, first
    args.configs = [base, *(c for c in args.configs if c != base)]
    models = {n: prepare(n, *CONFIGS[n], work, args.updates) for n in args.configs}
    first = models[base]
    lengths = {mean_length(m["tokenizer"], m["corpus"]) for m in models.values()}
    if len(lengths) > 1:  # the configs share their tokenizer; a different one would make the lengths unequal
        raise SystemExit(f"the configs' tokenizers give the references different mean lengths {sorted(lengths)}")
    length, sentences = lengths.pop(), sources(first["corpus"])
    runs: dict[str, dict[str, list[float]]] = {n: {} for n in models}
    for rep, name in rotations(args.configs, args.repeats):
        for threads in args.threads:
            for key, value in measure(models[name], sentences, length, threads).items():
                runs[name].setdefault(f"{key}.threads{threads}", []).append(value)
                print(f"repeat {rep} {name:<17} {key:<20} {threads} thread(s): {value:8.2f} sentences/s", flush=True)
    result = {"sentences": len(sentences), "forced_length": length,
              "repeats": args.repeats, "baseline": base, "models": {}}
    base_runs = runs[base]
    for name, m in models.items():
        medians = {k: median(v) for k, v in runs[name].items()}
        result["models"][name] = {
            "config": m["config"], "overrides": m["overrides"], "model": m["model"], "updates": m["updates"],
            "parameters": m["parameters"], "size_mb.float32": m["size_mb.float32"],
            "size_mb.int8_export": m["size_mb.int8_export"], "sentences_per_s": runs[name],
            "median": medians, "vs_baseline": {k: ratio(v, median(base_runs[k]), 2) for k, v in medians.items()}}
    write_record(args.out, result, None, args)


if __name__ == "__main__":
    main()
