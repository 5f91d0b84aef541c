"""A training run's learning curve on dev: the dev NLL the trainer logged at every dev evaluation, and dev
sacreBLEU of checkpoints along the run (and of the averaged models the run chose among), decoded with the run's
own decoding settings.

    .venv/bin/python -m bench.learning_curve --run WORK/train/<run> --tokenizer WORK/tokenizer/<fp> \
        --corpus WORK/corpus/<fp> [--every 500] --out bench/results/learning_curve_<tag>.json

A checkpoint is decoded when its step is a multiple of --every (and the last one); keep enough checkpoints for
that (``train.keep_last_checkpoints``). Each point holds the target tokens and training seconds the run had spent
by then, and ``time_to_target`` the first decoded checkpoint at or above ``--target`` dev sacreBLEU (the nanoGPT
speedrun's measure: its resolution is --every); ``--stop-at-target`` skips the checkpoints between that one and the
last. The JSON is what the docs' learning-curve plot draws (ledger entry's ``files``). Dev only: nothing here is
chosen on a test set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from bench.harness import write_record
from pipeline.checkpoint import load_checkpoint, read_index
from pipeline.config import DecodeConfig
from pipeline.data import read_manifest
from pipeline.evalsets import read_split
from pipeline.inference import load_model, translate
from pipeline.tokenize import Tokenizer
from pipeline.translation.bleu import score_translations


def dev_curve(metrics: Path) -> list[dict]:
    """The dev rows of a run's metrics.jsonl: step, dev NLL per token and per sentence."""
    rows = {}
    for line in metrics.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        m = row.get("metrics", row)
        if "dev_nll" in m and "step" in row:
            rows[int(row["step"])] = {"step": int(row["step"]), "dev_nll": round(m["dev_nll"], 4),
                                      "dev_sentence_nll": round(m["dev_sentence_nll"], 3),
                                      "train_seconds": round(m.get("train_seconds", 0.0), 1)}
    return [rows[s] for s in sorted(rows)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="the run folder (checkpoints/, metrics.jsonl)")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--every", type=int, default=500, help="decode checkpoints whose step is a multiple of this")
    p.add_argument("--target", type=float, default=38.0, help="dev sacreBLEU of time_to_target")
    p.add_argument("--stop-at-target", action="store_true",
                   help="once a checkpoint reaches --target, decode only the last one after it")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    corpus = read_manifest(args.corpus)
    src, refs = read_split(args.corpus, corpus, "dev")
    tokenizer = Tokenizer(args.tokenizer)
    entries = read_index(args.run / "checkpoints")
    last = max(e["step"] for e in entries)
    picked = [e for e in entries if e["step"] % args.every == 0 or e["step"] == last]
    points, reached = [], None
    for e in sorted(picked, key=lambda e: e["step"]):
        if reached and args.stop_at_target and e["step"] != last:
            continue
        path = args.run / "checkpoints" / e["file"]
        state = load_checkpoint(path)
        decode = DecodeConfig.model_validate(state["config"]["decode"])
        start = time.perf_counter()
        hyps = translate(load_model(path), tokenizer, src, decode)
        scores = score_translations(hyps, refs, corpus["tgt_lang"])
        points.append({"step": e["step"], "dev_sacrebleu": round(scores["sacrebleu"]["score"], 2),
                       "tgt_tokens": int(state["totals"][0]), "train_seconds": round(state["train_seconds"], 1),
                       "seconds": round(time.perf_counter() - start, 1)})
        print(f"step {e['step']:>6}: dev sacreBLEU {points[-1]['dev_sacrebleu']:.2f}", flush=True)
        if reached is None and points[-1]["dev_sacrebleu"] >= args.target:
            reached = {k: points[-1][k] for k in ("step", "tgt_tokens", "train_seconds", "dev_sacrebleu")}
    choice = sorted((args.run / "averaged").glob("choose-*/choice.json"))
    averaged = json.loads(choice[-1].read_text()) if choice else None
    out = {"run": args.run.name, "decode": decode.model_dump(mode="json"), "dev_sentences": len(src),
           "dev_curve": dev_curve(args.run / "metrics.jsonl"), "checkpoints": points, "averaged": averaged,
           "time_to_target": {"target": args.target, "every": args.every, "first": reached}}
    write_record(args.out, out, None, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
