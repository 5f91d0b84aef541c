"""Choose the beam size and length penalty on dev: a grid of (beam, alpha) decoded over one split.

    .venv/bin/python -m bench.tune_decode --checkpoint RUN/averaged/last3.pt --tokenizer WORK/tokenizer/<fp> \
        --corpus WORK/corpus/<fp> [--split dev] [--beams 1,4,8] [--alphas 0,0.6,1.0] [--out results.json]

``alpha`` is decode.length_penalty; the other decoding settings are the run's. Only dev is for choosing (every
choice on dev, test reported): a test split is refused unless --report-test says the grid is reported, not tuned
on. Prints sacreBLEU and chrF per point with the decoding speed, writes JSON, names the best point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.harness import timed, write_record
from pipeline.checkpoint import load_checkpoint
from pipeline.config import DecodeConfig
from pipeline.data import read_manifest
from pipeline.evalsets import read_split
from pipeline.inference import load_model, translate
from pipeline.tokenize import Tokenizer
from pipeline.translation.bleu import score_translations


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--split", default="dev")
    p.add_argument("--beams", default="1,4,8")
    p.add_argument("--alphas", default="0,0.6,1.0")
    p.add_argument("--report-test", action="store_true", help="allow a test split (reporting, not choosing)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.split != "dev" and not args.report_test:
        sys.exit(f"error: {args.split} is not dev: choices are made on dev only (--report-test to report a grid)")
    corpus = read_manifest(args.corpus)
    src, refs = read_split(args.corpus, corpus, args.split)
    model, tokenizer = load_model(args.checkpoint), Tokenizer(args.tokenizer)
    # the run's own decoding settings (batching, precision, max length) with the grid's beam and penalty
    base = DecodeConfig.model_validate(load_checkpoint(args.checkpoint)["config"]["decode"])
    rows = []
    for beam in (int(b) for b in floats(args.beams)):
        for alpha in floats(args.alphas) if beam > 1 else [0.0]:  # greedy has no length penalty
            decode = base.model_copy(update={"beam_size": beam, "length_penalty": alpha})
            hyps, seconds = timed(translate, model, tokenizer, src, decode)
            scores = score_translations(hyps, refs, corpus["tgt_lang"])
            rows.append({"beam": beam, "alpha": alpha, "sacrebleu": scores["sacrebleu"]["score"],
                         "chrf": scores["chrf"]["score"], "sentences_per_s": round(len(src) / seconds, 1)})
            r = rows[-1]
            print(f"beam {beam:>2} alpha {alpha:<4} sacreBLEU {r['sacrebleu']:6.2f} chrF {r['chrf']:6.2f} "
                  f"({r['sentences_per_s']} sentences/s)", flush=True)
    best = max(rows, key=lambda r: r["sacrebleu"])
    print(f"best on {args.split}: beam {best['beam']}, alpha {best['alpha']}: {best['sacrebleu']:.2f}")
    write_record(args.out, {"checkpoint": str(args.checkpoint), "split": args.split, "sentences": len(src),
                            "grid": rows, "best": best}, None, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
