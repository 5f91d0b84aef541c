"""What a vocabulary shortlist (pipeline/shortlist.py, export.shortlist) buys in decoding speed and costs in BLEU,
for one trained model's int8 CTranslate2 export, side by side in one run.

Variants: the config's beam search and greedy search (beam 1), each with the whole vocabulary and with a map of
each ``--shortlists`` size (``--frequent`` always-candidates), all decoded by our engine
(:class:`pipeline.engines.CTranslate2Engine`, ``--threads``). For each: sacreBLEU and chrF on dev and test2016;
test2016 sentences/s, the median of ``--repeats`` timed passes taken in turn over the variants (after one warm-up
pass each), and its ratio to the baseline (the config's beam, whole vocabulary); the paired bootstrap of each
against that baseline, and, with ``--default-record`` (a record under bench/results/distill_study/: the default's
outputs), against the default's own translations. Peak memory: the process's maximum resident set. Run it on an
idle machine.

    python -m bench.bench_shortlist --config multi30k-student-tiny --work-dir /work/study --checkpoint <last20.pt> \\
        --default-record bench/results/distill_study/en-de/original-seed1.json --out bench/results/shortlist.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

from bench.harness import median, peak_rss_mb, ratio, timed, write_record
from pipeline.config import resolve_config
from pipeline.data import read_manifest
from pipeline.engines import VMAP_FILE, CTranslate2Engine
from pipeline.evalsets import read_split
from pipeline.export import export_checkpoint
from pipeline.support.fsutil import disk_mb
from pipeline.promotion import pooled_bootstrap
from pipeline.shortlist import write_vocabulary_map
from pipeline.tokenize import Tokenizer
from pipeline.workdir import build_inputs

SPLITS = {"dev": "dev", "test2016": "test.test2016"}  # our name: the corpus's split key


def comparison(baseline: list[str], system: list[str], refs: list[str]) -> dict:
    c = pooled_bootstrap("sacrebleu", [baseline], [system], refs)
    return {"delta": c.delta, "ci95": [c.ci_low, c.ci_high], "p": round(c.p_value, 4)}


def vmap_stats(path: Path) -> dict:
    """A vocabulary map's source pieces, their mean number of candidates, and its always-candidates."""
    always, *rules = path.read_text(encoding="utf-8").splitlines()
    sizes = [len(r.split("\t")[1].split(" ")) for r in rules]
    return {"source_pieces": len(rules), "mean_candidates": round(statistics.mean(sizes), 2),
            "always": len(always.split("\t")[1].split(" "))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="multi30k-student-tiny")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work-dir", type=Path, required=True, help="where the config's corpus and tokenizer are")
    p.add_argument("--checkpoint", type=Path, required=True, help="the trained model (e.g. its averaged last<N>.pt)")
    p.add_argument("--shortlists", type=int, nargs="+", default=[10, 20, 50], help="candidates per source piece")
    p.add_argument("--frequent", type=int, default=100, help="always-candidates: the most frequent target pieces")
    p.add_argument("--threads", type=int, default=0, help="the engine's threads (0: every core this process may use)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--default-record", type=Path, default=None,
                   help="a record under bench/results/distill_study/ whose dev and test2016 outputs are the default's")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    cfg = resolve_config(args.config, [("work_dir", str(args.work_dir.resolve())), *args.set])
    inputs = build_inputs(cfg)
    tok = Tokenizer(inputs.tokenizer)
    manifest = read_manifest(inputs.corpus)
    data = {name: read_split(inputs.corpus, manifest, key) for name, key in SPLITS.items()}
    searches = {f"beam{cfg.decode.beam_size}": cfg.decode, "greedy": cfg.decode.model_copy(update={"beam_size": 1})}

    with tempfile.TemporaryDirectory(prefix="shortlist-") as tmp:
        exports = {0: export_checkpoint(args.checkpoint, inputs.tokenizer, "int8", Path(tmp) / "whole",
                                        decode=cfg.decode)}
        for k in args.shortlists:
            vmap = write_vocabulary_map(inputs.corpus, manifest["splits"]["train"]["file"], tok, k, args.frequent,
                                        Path(tmp) / f"vmap-{k}.txt")
            exports[k] = export_checkpoint(args.checkpoint, inputs.tokenizer, "int8", Path(tmp) / f"map{k}",
                                           decode=cfg.decode, shortlist={"file": vmap, "top_k": k,
                                                                         "frequent": args.frequent})
        variants = {f"{s}/{'whole' if k == 0 else f'map{k}'}": (CTranslate2Engine(e, tok, args.threads, bool(k)), d)
                    for s, d in searches.items() for k, e in exports.items()}
        baseline = f"beam{cfg.decode.beam_size}/whole"
        rows: dict[str, dict] = {}
        for name, (engine, decode) in variants.items():  # outputs, and the warm-up pass
            rows[name] = {"outputs": {split: [n[0] for n in engine.translate(src, decode)]
                                      for split, (src, _) in data.items()}, "seconds": []}
        sources = data["test2016"][0]
        for _ in range(args.repeats):
            for name, (engine, decode) in variants.items():
                rows[name]["seconds"].append(timed(engine.translate, sources, decode)[1])
        vmap = {k: vmap_stats(e / VMAP_FILE) for k, e in exports.items() if k}
        sizes = {k: round(disk_mb(e), 2) for k, e in exports.items()}

    default = json.loads(args.default_record.read_text(encoding="utf-8")) if args.default_record else None
    base_speed = len(sources) / median(rows[baseline]["seconds"])
    result_rows = []
    for name, row in rows.items():
        speed = len(sources) / median(row["seconds"])
        out = {"variant": name, "test2016_sentences_per_s": round(speed, 1),
               "speed_vs_baseline": ratio(speed, base_speed)}
        for split, (_, refs) in data.items():
            hyps = row["outputs"][split]
            out[f"{split}.sacrebleu"] = round(BLEU().corpus_score(hyps, [refs]).score, 2)
            out[f"{split}.chrf"] = round(CHRF().corpus_score(hyps, [refs]).score, 2)
            if name != baseline:
                out[f"{split}.vs_baseline"] = comparison(rows[baseline]["outputs"][split], hyps, refs)
            if default:
                out[f"{split}.vs_default"] = comparison(default["outputs"][SPLITS[split]], hyps, refs)
        result_rows.append(out)
    result = {"checkpoint": str(args.checkpoint),
              "config": args.config, "overrides": args.set, "frequent": args.frequent, "repeats": args.repeats,
              "baseline": baseline, "default_record": str(args.default_record) if default else None,
              "default": default and {k: default["run"][k] for k in ("dev.sacrebleu", "test2016.sacrebleu")},
              "vmap": vmap, "export_mb": sizes,
              "peak_rss_mb": round(peak_rss_mb(), 1), "rows": result_rows}
    write_record(args.out, result, args.threads, args)
    for r in result_rows:
        print(f"{r['variant']:>16}  {r['test2016_sentences_per_s']:7.1f} sent/s  x{r['speed_vs_baseline']:.2f}  "
              f"dev {r['dev.sacrebleu']:.2f}  test2016 {r['test2016.sacrebleu']:.2f}")


if __name__ == "__main__":
    main()
