"""The CTranslate2 export against our PyTorch model on a corpus split: how often they agree, and at what BLEU.

For a checkpoint, its tokenizer and a corpus folder (the data stage's), each ``--quantizations`` export
(:func:`pipeline.export.export_checkpoint`) decodes the split (``dev`` by default) through
:class:`pipeline.engines.CTranslate2Engine`, and our fp32 model through :func:`pipeline.inference.translate`,
with the same settings, for each search:

- ``greedy``: beam 1, alpha 0;
- ``beam4-alpha0``: beam 4 without length penalty, where both searches rank by log P alone;
- ``beam4-alpha<a>``: beam 4 with the config's alpha (0.6): ours divides by the paper's GNMT penalty
  ``((5 + |Y|) / 6) ** a``, CTranslate2 by ``|Y| ** a``, so this row measures what that difference costs.

Reported: the share of sentences decoded to exactly the same text, sacreBLEU of both against the references,
the difference with sacreBLEU's paired bootstrap (export against ours), each engine's wall time for the
split on ``--threads`` threads (ours first, then the export, run after run on an idle machine), each model's
size (our weights in float32; each export folder on disk) and the CPU.

    python -m bench.bench_export --checkpoint RUN/averaged/last5.pt --tokenizer WORK/tokenizer/<fp> \\
        --corpus WORK/corpus/<fp> --out bench/results/export_parity.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch

from bench.harness import common_flags, print_table, timed, write_record
from pipeline.config import load_config
from pipeline.data import read_manifest
from pipeline.engines import CTranslate2Engine
from pipeline.export import export_checkpoint
from pipeline.inference import load_model, translate
from pipeline.promotion import paired_bootstrap
from pipeline.speed import cpu_name
from pipeline.support.fsutil import disk_mb
from pipeline.tokenize import Tokenizer


def _measure(args: argparse.Namespace, src: list[str], refs: list[str], searches: dict, work: Path
             ) -> tuple[dict, list[dict]]:
    """Each search with our decoder and each export (written under ``work``): sizes (MB) and one row per pair."""
    model, tokenizer = load_model(args.checkpoint), Tokenizer(args.tokenizer)
    engines = {q: CTranslate2Engine(export_checkpoint(args.checkpoint, args.tokenizer, q, work / q), tokenizer,
                                    args.threads) for q in args.quantizations}
    sizes_mb = {"pytorch fp32": round(sum(p.numel() * 4 for p in model.parameters()) / 2**20, 2),
                **{q: disk_mb(work / q) for q in args.quantizations}}
    rows = []
    for search, dec in searches.items():
        ours, ours_s = timed(translate, model, tokenizer, src, dec)
        for q, engine in engines.items():
            theirs, theirs_s = timed(lambda: [n[0] for n in engine.translate(src, dec)])
            c = paired_bootstrap("sacrebleu", ours, theirs, refs)
            rows.append({"search": search, "quantization": q, "sentences": len(src),
                         "identical": round(sum(a == b for a, b in zip(ours, theirs)) / len(src), 4),
                         "ours_bleu": c.champion, "export_bleu": c.challenger, "delta": c.delta,
                         "ci95": [c.ci_low, c.ci_high], "p_value": c.p_value, "ours_s": round(ours_s, 2),
                         "export_s": round(theirs_s, 2), "speedup": round(ours_s / theirs_s, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return sizes_mb, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--tokenizer", required=True, type=Path)
    p.add_argument("--corpus", required=True, type=Path)
    p.add_argument("--split", default="dev")
    p.add_argument("--config", default="multi30k-cpu", help="its decode section (alpha, lengths, batch)")
    p.add_argument("--quantizations", nargs="+", default=["float32", "int8"])
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    common_flags(p, repeats=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    table = pq.read_table(args.corpus / read_manifest(args.corpus)["splits"][args.split]["file"],
                          columns=["src", "tgt_raw"])
    src, refs = table.column("src").to_pylist()[: args.limit], table.column("tgt_raw").to_pylist()[: args.limit]
    decode = load_config(args.config).decode
    searches = {"greedy": decode.model_copy(update={"beam_size": 1, "length_penalty": 0.0}),
                "beam4-alpha0": decode.model_copy(update={"beam_size": 4, "length_penalty": 0.0}),
                f"beam4-alpha{decode.length_penalty}": decode.model_copy(update={"beam_size": 4})}
    with tempfile.TemporaryDirectory(prefix="aiayn-bench-export-") as work:
        sizes_mb, rows = _measure(args, src, refs, searches, Path(work))
    print(f"\n{args.split}: {len(src)} sentences, {args.threads} threads, {cpu_name()}, {args.checkpoint}")
    print(f"sizes (MB): {sizes_mb}\n")
    print_table(["search", "export", "identical", "ours sacreBLEU", "export sacreBLEU", "delta (95% CI)", "p", "ours s",
                 "export s", "speed-up"],
                [[r["search"], r["quantization"], f"{r['identical']:.1%}", f"{r['ours_bleu']:.2f}",
                  f"{r['export_bleu']:.2f}", f"{r['delta']:+.2f} [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]",
                  f"{r['p_value']:.3f}", r["ours_s"], r["export_s"], f"{r['speedup']}x"] for r in rows])
    write_record(args.out, {"checkpoint": str(args.checkpoint), "split": args.split, "sizes_mb": sizes_mb,
                            "rows": rows}, args.threads, args)


if __name__ == "__main__":
    main()
