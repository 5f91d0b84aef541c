"""Our trainer and beam search against fairseq (and CTranslate2), side by side on this CPU, data and model size.

``train``: target tokens/s and peak RSS of ``python -m pipeline.train`` (fp32, the paper's precision, and bf16,
``train.precision=bf16``: a bf16 working copy of the model with fp32 weights and Adam) against ``fairseq-train`` on
the same Multi30k training pairs, encoded with OUR sentencepiece model (fairseq binarizes the very same piece ids
with an 8,000-entry dictionary), the same architecture (post-norm, sinusoidal positions, shared embeddings;
``SIZES``: fp32-recipe is the model and batches the tiny preset's ``recipes.fp32`` trains on CPUs without bf16),
the same batching rule (``MAX_TOKENS`` of max(src, tgt) + 1 per batch, length-bucketed), Adam (0.9, 0.98, 1e-9),
label smoothing 0.1, dropout 0.1 and the same learning rate schedule (fairseq's inverse_sqrt with ``--lr (d_model
* warmup)^-0.5`` and a warm-up from 0 is the paper's formula; fairseq's update k uses the rate our update k - 1
does). Each run is a fresh process for a fixed number of updates, the implementations alternating
(:func:`bench.harness.rotations`); throughput is taken over the updates after ``--skip`` (start-up and allocator
warm-up excluded) from each trainer's own interval logs: tokens of those updates / their wall time. Peak RSS is the
child's (``os.wait4``). The loss at equal update counts is reported for every run (fairseq logs base-2 bits;
converted to nats). fairseq logs its wall clock in whole seconds, so its "best interval" means little unless the
intervals are long, and at a fast shape the timed span must be long (``--updates 160 --skip 20 --log-every 20``).

``decode``: sentences/s, target tokens/s and peak RSS of beam 4 and greedy on the 1,000 sentences of Multi30k
test2016, batch 64, against ``fairseq-generate`` and CTranslate2 (converted from the fairseq checkpoint), on
equal tiny models. Output length is forced (``--min-len``/``--max-len-b`` in fairseq,
``decode.min_len``/``decode.max_len_b`` here, ``min/max_decoding_length`` in CTranslate2) so that every
implementation runs the same number of decoder steps whatever its weights; tokens/s counts the generated tokens,
eos included. Ours decodes through :func:`pipeline.inference.translate` (tokenization and detokenization
included), in fp32 and with ``decode.precision=bf16`` (a bf16 copy of the model, no autocast); fairseq and
CTranslate2 (both fp32) read pre-tokenized ids.

Peer environment (outside the repo; fairseq pins numpy < 2; pip warns about torchaudio, which is not used)::

    python3 -m venv /work/peers/fairseq-venv
    /work/peers/fairseq-venv/bin/pip install torch==2.13.0   # the CPU build on this machine's disk (see env notes)
    /work/peers/fairseq-venv/bin/pip install fairseq-fixed==0.12.3.1 "numpy<2"
    /work/peers/fairseq-venv/bin/pip install ctranslate2==4.8.5

Run (the record goes to bench/results/vs_fairseq_<command>[_<sizes>]_t<threads>[_<tag>].json)::

    python -m bench.bench_vs_fairseq train --sizes tiny base
    python -m bench.bench_vs_fairseq train --sizes tiny --updates 200 --skip 20 --repeats 1   # longer loss curve
    python -m bench.bench_vs_fairseq decode
    python -m bench.bench_vs_fairseq train --sizes tiny --tag epyc-no-amx   # results of another CPU beside these
    git worktree add /tmp/aiayn-before REV   # before and after a change: REV's trainer interleaved with this one's
    python -m bench.bench_vs_fairseq train --baseline /tmp/aiayn-before --tag before-after
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import bench_model
from bench.bench_train import build, multi30k_flags
from bench.harness import (REPO, RESULTS, child_command, emit, median, print_table, rotations, run_child, timed,
                           write_record)
from pipeline.data import read_manifest
from pipeline.shards import ShardDataset, read_shard_manifest
from pipeline.speed import cpu_name

# the presets' model sections (bench_model.SIZES); fp32-recipe: the tiny preset's recipes.fp32
SIZES = {**bench_model.SIZES, "fp32-recipe": dict(encoder_layers=3, decoder_layers=3, d_model=128, d_ff=512, n_heads=4)}
MAX_TOKENS = {"tiny": 4096, "base": 4096, "fp32-recipe": 2048}  # tokens per batch (= per update), both trainers
WARMUP = 1000  # the tiny preset's warm-up, used for both sizes so that the loss curves are comparable
TEST_SPLIT = "test.test2016"


# ------------------------------------------------------------------------------------------------ data


def prepare(data_root: str, work_dir: Path, venv: Path) -> dict[str, Path]:
    """Our corpus, tokenizer and shards (the multi30k-cpu config; cached), and the same piece ids binarized for
    fairseq with a dictionary whose index of every non-special piece equals our id."""
    inputs = build(data_root, work_dir)
    shards = inputs.shards
    manifest = read_shard_manifest(shards)
    fs_dir = work_dir / "fairseq" / manifest["fingerprint"][:16]
    if not (fs_dir / "bin" / "dict.en.txt").is_file():
        text = fs_dir / "text"
        text.mkdir(parents=True, exist_ok=True)
        vocab = manifest["tokenizer"]["vocab_size"]
        # fairseq's dictionary starts with <s> <pad> </s> <unk> (indices 0-3, our bos/pad/eos/unk); listing our
        # ids 4.. in order gives each piece fairseq index == our id, and the same 8,000 entries in all.
        (text / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(4, vocab)))
        for split, name in (("train", "train"), ("dev", "valid"), (TEST_SPLIT, "test")):
            ds = ShardDataset(shards, split, verify=False)
            for side, lang in (("src", "en"), ("tgt", "de")):
                with open(text / f"{name}.{lang}", "w") as f:
                    f.writelines(" ".join(map(str, ds.ids(i, side).tolist())) + "\n" for i in range(len(ds)))
        subprocess.run([str(venv / "bin" / "fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
                        "--trainpref", text / "train", "--validpref", text / "valid", "--testpref", text / "test",
                        "--srcdict", text / "dict.txt", "--joined-dictionary", "--destdir", fs_dir / "bin",
                        "--workers", "2"], check=True, capture_output=True)
    return {"corpus": inputs.corpus, "tokenizer": inputs.tokenizer, "shards": shards, "fairseq_data": fs_dir / "bin"}


# ------------------------------------------------------------------------------------------------ running


# --isa avx2: the vector code paths of a CPU with AVX2 only, on one that has AVX-512 too (torch's ATen kernels,
# oneDNN and MKL each cap the instructions they dispatch to), for every implementation alike. It reproduces the
# instructions, not that CPU's clock, caches or memory: a proxy for the AVX2 class until one of its CPUs runs it.
ISA_LIMITS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def child_env(threads: int, isa: str | None = None) -> dict:
    # fairseq takes torch's default (OMP_NUM_THREADS); our trainer splits the cores unless told
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               AIAYN_CPU_THREADS=str(threads), **ISA_LIMITS.get(isa or "", {}))
    env.pop("PYTHONPATH", None)
    return env


def ours_train_cmd(paths: dict, size: str, precision: str, updates: int, log_every: int, out: Path,
                   data_root: str, repo: Path = REPO) -> list:
    """Our trainer's command for one run; ``repo``: the checkout whose code runs (``python -m`` imports the
    working directory's packages first, so a baseline checkout runs its own code with this interpreter)."""
    sets = {f"model.{k}": v for k, v in SIZES[size].items()} | {
        "train.max_steps": updates, "train.max_minutes": "null", "train.warmup_steps": WARMUP,
        "train.max_tokens": MAX_TOKENS[size], "train.update_tokens": MAX_TOKENS[size],
        "train.log_every_steps": log_every,
        "train.dev_every_steps": 10**9, "train.checkpoint_every_steps": 10**9,
        "train.checkpoint_every_minutes": 10**6, "train.dev_max_sentences": 64, "train.precision": precision,
        "train.seed": 1}
    # python -m pipeline.train reads a resolved config: resolve it with the CLI, as a user would.
    config = Path(out).with_suffix(".yaml")
    subprocess.run([sys.executable, "-m", "pipeline", "config", "--config", "multi30k-cpu", "--data-root", data_root,
                    *[a for k, v in sets.items() for a in ("-s", f"{k}={v}")], "--out", str(config)], check=True,
                   cwd=repo, env=child_env(1), stdout=subprocess.DEVNULL)
    return [sys.executable, "-m", "pipeline.train", "--config", str(config), "--shards", paths["shards"], "--out", out]


def fairseq_train_cmd(venv: Path, paths: dict, size: str, updates: int, log_every: int, save_dir: Path | None) -> list:
    s = SIZES[size]
    peak_lr = (s["d_model"] * WARMUP) ** -0.5  # the paper's schedule: lr(step) = d^-0.5 min(step^-0.5, step w^-1.5)
    arch = []
    for side, layers in (("encoder", s["encoder_layers"]), ("decoder", s["decoder_layers"])):
        arch += [f"--{side}-layers", layers, f"--{side}-embed-dim", s["d_model"], f"--{side}-ffn-embed-dim",
                 s["d_ff"], f"--{side}-attention-heads", s["n_heads"]]
    save = ["--save-dir", save_dir, "--no-epoch-checkpoints"] if save_dir else ["--no-save"]
    return [venv / "bin" / "fairseq-train", paths["fairseq_data"], "--arch", "transformer", *arch,
            "--share-all-embeddings", "--dropout", "0.1", "--attention-dropout", "0", "--activation-dropout", "0",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-9", "--lr", peak_lr,
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", WARMUP, "--warmup-init-lr", 0,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", MAX_TOKENS[size], "--required-batch-size-multiple", 1, "--max-update", updates,
            "--max-source-positions", 1024, "--max-target-positions", 1024, "--cpu", "--seed", 1,
            "--num-workers", 0, "--disable-validation", "--log-format", "json", "--log-interval", log_every,
            *save]


def ours_intervals(out: Path) -> list[dict]:
    """(update, tokens, seconds, loss nats) per log interval, from our metrics.jsonl."""
    rows, prev_tokens = [], 0.0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "tgt_tokens_per_s" in m:
            tokens = m["tgt_tokens"] - prev_tokens
            prev_tokens = m["tgt_tokens"]
            rows.append({"update": m["step"], "tokens": tokens, "seconds": tokens / m["tgt_tokens_per_s"],
                         "loss": m["loss"]})
    return rows


def fairseq_intervals(log: Path, log_every: int) -> list[dict]:
    """The same from fairseq-train's json ``train_inner`` lines (loss in bits -> nats; wall = seconds since start)."""
    rows, prev_wall = [], None
    for line in log.read_text().splitlines():
        i = line.find("{")
        if "train_inner" not in line or i < 0:
            continue
        m = json.loads(line[i:])
        wall = float(m["wall"])
        if prev_wall is not None:
            rows.append({"update": int(m["num_updates"]), "tokens": float(m["wpb"]) * log_every,
                         "seconds": wall - prev_wall, "loss": float(m["loss"]) * math.log(2)})
        prev_wall = wall
    return rows


def summarize(rows: list[dict], skip: int) -> dict:
    """Throughput over the timed updates, and over the fastest log interval: other work on the shared cores
    comes and goes within minutes, and the fastest interval is the closest to an unloaded machine."""
    timed = [r for r in rows if r["update"] > skip]
    tokens, seconds = sum(r["tokens"] for r in timed), sum(r["seconds"] for r in timed)
    last = rows[-1]["update"] if rows else skip
    return {"tgt_tokens_per_s": tokens / seconds if seconds else float("nan"),
            "best_interval_tgt_tokens_per_s": max(r["tokens"] / r["seconds"] for r in timed),
            "tgt_tokens_per_update": tokens / max(1, last - skip), "timed_updates": f"{skip + 1}-{last}",
            "loss_curve": {r["update"]: round(r["loss"], 4) for r in rows}}


def cmd_train(args: argparse.Namespace, paths: dict) -> dict:
    impls = [f"ours-{p}" for p in args.precisions] + ["fairseq"]
    if args.baseline:  # the same trainer at an earlier commit, interleaved with the rest: before and after
        impls += [f"baseline-{p}" for p in args.precisions]
    env = child_env(args.threads, args.isa)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-fairseq-") as tmp:
        for size in args.sizes:
            runs = results[size] = {impl: [] for impl in impls}
            for rep, impl in rotations(impls, args.repeats):
                out, log = Path(tmp) / f"{size}-{impl}-{rep}", Path(tmp) / f"{size}-{impl}-{rep}.log"
                repo = args.baseline if impl.startswith("baseline") else REPO
                if impl == "fairseq":
                    cmd = fairseq_train_cmd(args.venv, paths, size, args.updates, args.log_every, None)
                else:
                    cmd = ours_train_cmd(paths, size, impl.split("-")[1], args.updates, args.log_every, out,
                                         args.data_root, repo)
                child = run_child(impl, cmd, log, env, repo)
                rows = fairseq_intervals(log, args.log_every) if impl == "fairseq" else ours_intervals(out)
                # CPU time is far less sensitive to other work on the cores than wall time, but includes
                # start-up (imports, data loading): a whole-process figure, for 1-thread runs
                run = {"repeat": rep, **summarize(rows, args.skip), "peak_rss_mb": round(child.peak_rss_mb),
                       "process_wall_s": round(child.wall_s, 1), "process_cpu_s": round(child.cpu_s, 1),
                       "all_tgt_tokens_per_process_cpu_s": sum(r["tokens"] for r in rows) / child.cpu_s}
                runs[impl].append(run)
                print(f"  {size} {impl:<12} repeat {rep}: {run['tgt_tokens_per_s']:7.0f} tgt tok/s "
                      f"(best interval {run['best_interval_tgt_tokens_per_s']:5.0f}), "
                      f"{run['tgt_tokens_per_update']:5.0f} tok/update, peak RSS {child.peak_rss_mb:6.0f} MB, "
                      f"{child.wall_s:5.0f} s, {run['all_tgt_tokens_per_process_cpu_s']:5.0f} tok per process "
                      "CPU-s", flush=True)
    return results


def print_train(results: dict, args: argparse.Namespace) -> None:
    print(f"\nTraining: {args.updates} updates per run, tokens/s over updates {args.skip + 1}-{args.updates}, "
          f"{args.threads} threads, max_tokens {', '.join(f'{s} {MAX_TOKENS[s]}' for s in args.sizes)}, "
          f"{args.repeats} runs each (A B C interleaved)\n")
    rows = []
    for size, runs in results.items():
        fs = median([r["tgt_tokens_per_s"] for r in runs["fairseq"]])
        fs_best = max(r["best_interval_tgt_tokens_per_s"] for r in runs["fairseq"])
        for impl, rs in runs.items():
            med = median([r["tgt_tokens_per_s"] for r in rs])
            best = max(r["best_interval_tgt_tokens_per_s"] for r in rs)
            rows.append([size, impl, ", ".join(f"{r['tgt_tokens_per_s']:,.0f}" for r in rs), f"{med:,.0f}",
                         f"{med / fs:.2f}", ", ".join(f"{r['best_interval_tgt_tokens_per_s']:,.0f}" for r in rs),
                         f"{best / fs_best:.2f}", f"{statistics.mean(r['tgt_tokens_per_update'] for r in rs):,.0f}",
                         f"{max(r['peak_rss_mb'] for r in rs):,}"])
    print_table(["size", "implementation", "tgt tok/s per run", "median", "ours / fairseq", "best interval per run",
                 "best / fairseq best", "tok/update", "peak RSS MB"], rows)
    print("\nLabel-smoothed training loss (nats per target token, mean over each log interval; first run of each):\n")
    for size, runs in results.items():
        updates = sorted(set.intersection(*(set(rs[0]["loss_curve"]) for rs in runs.values())))
        print_table([f"{size}: update", *runs],
                    [[u, *(f"{rs[0]['loss_curve'][u]:.3f}" for rs in runs.values())] for u in updates])
        print()
    if args.baseline:
        print(f"Before and after: ours at this checkout over ours at {args.baseline} "
              f"({args.baseline_commit}), median tgt tok/s:\n")
        for size, runs in results.items():
            for p in args.precisions:
                now, before = (median([r["tgt_tokens_per_s"] for r in runs[f"{who}-{p}"]])
                               for who in ("ours", "baseline"))
                print(f"- {size} {p}: {now / before:.3f}")


# ------------------------------------------------------------------------------------------------ decoding


def ours_decode_child(args: argparse.Namespace) -> None:
    """(child) Translate the test split with our checkpoint; print one JSON line."""
    import pyarrow.parquet as pq
    import torch

    from pipeline.config import DecodeConfig
    from pipeline.inference import load_model, translate
    from pipeline.tokenize import Tokenizer

    torch.set_num_threads(args.threads)
    model = load_model(Path(args.checkpoint))
    tokenizer = Tokenizer(Path(args.tokenizer))
    corpus = Path(args.corpus)
    table = pq.read_table(corpus / read_manifest(corpus)["splits"][TEST_SPLIT]["file"], columns=["src"])
    sentences = table.column("src").to_pylist()[: args.sentences]
    decode = DecodeConfig(beam_size=args.beam, batch_sentences=args.batch, max_len_a=0.0, max_len_b=args.length + 1,
                          min_len=args.length + 1, length_penalty=0.6, precision=args.precision)
    hyps, seconds = timed(translate, model, tokenizer, sentences, decode)
    tokens = sum(len(tokenizer.encode(h)) + 1 for h in hyps)  # re-encoded detokenized output, + eos
    emit({"seconds": seconds, "sentences": len(hyps), "tokens": tokens})


# fairseq's checkpoints pickle an argparse.Namespace, which torch 2.13's default torch.load(weights_only=True)
# refuses (in fairseq-generate and in ct2-fairseq-converter); the checkpoint is the one trained by this script.
FULL_LOAD = ("import sys, torch; load = torch.load; "
             "torch.load = lambda *a, **k: load(*a, **{**k, 'weights_only': False}); ")

CT2_SCRIPT = """
import json, sys, time, ctranslate2
model, src, beam, batch, length, threads, n = sys.argv[1:8]
lines = [l.split() for l in open(src)][: int(n)]
tr = ctranslate2.Translator(model, device="cpu", inter_threads=1, intra_threads=int(threads))
start = time.perf_counter()
out = tr.translate_batch(lines, beam_size=int(beam), max_batch_size=int(batch), min_decoding_length=int(length),
                         max_decoding_length=int(length), length_penalty=0.6)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "sentences": len(out), "tokens": sum(len(o.hypotheses[0]) + 1 for o in out)}))
"""


def cmd_decode(args: argparse.Namespace, paths: dict) -> dict:
    env = child_env(args.threads, args.isa)
    work = args.work_dir / "decode-models"
    work.mkdir(parents=True, exist_ok=True)
    # Equal tiny models: a few updates of each trainer (forced output lengths make the work independent of
    # the weights; the short training only gives realistic, non-degenerate weights).
    ours_ckpt = work / "ours" / "checkpoints"
    if not any(ours_ckpt.glob("ckpt-*.pt")):
        run_child("ours", ours_train_cmd(paths, "tiny", "fp32", args.train_updates, 10, work / "ours",
                                         args.data_root), work / "ours.log", env)
    checkpoint = sorted(ours_ckpt.glob("ckpt-*.pt"))[-1]
    fs_ckpt = work / "fairseq" / "checkpoint_last.pt"
    if not fs_ckpt.is_file():
        run_child("fairseq", fairseq_train_cmd(args.venv, paths, "tiny", args.train_updates, 10, work / "fairseq"),
                  work / "fairseq.log", env)
    ct2_dir = work / "ct2"
    if not (ct2_dir / "model.bin").is_file():
        subprocess.run([args.venv / "bin" / "python", "-c", FULL_LOAD + "from ctranslate2.converters.fairseq "
                        "import main; main()", "--model_path", fs_ckpt, "--data_dir",
                        paths["fairseq_data"], "--output_dir", ct2_dir, "--force"], check=True, capture_output=True)
    src_text = paths["fairseq_data"].parent / "text" / "test.en"
    (work / "ct2_bench.py").write_text(CT2_SCRIPT)

    impls = [f"ours-{p}" for p in args.precisions] + ["fairseq", "ctranslate2"]
    results: dict = {}
    for beam in args.beams:
        runs: dict[str, list] = {impl: [] for impl in impls}
        for rep, impl in rotations(impls, args.repeats):
            log = work / f"{impl}-beam{beam}-{rep}.log"
            if impl.startswith("ours"):
                cmd = child_command("bench.bench_vs_fairseq", "decode-child", "--checkpoint", checkpoint,
                                    "--tokenizer", paths["tokenizer"], "--corpus", paths["corpus"], "--beam", beam,
                                    "--batch", args.batch, "--length", args.length, "--threads", args.threads,
                                    "--sentences", args.sentences, "--precision", impl.split("-")[1])
            elif impl == "fairseq":
                # fairseq stops at max_len and then appends eos: --max-len-b L gives L tokens + eos.
                cmd = [args.venv / "bin" / "python", "-c", FULL_LOAD + "from fairseq_cli.generate import "
                       "cli_main; cli_main()", paths["fairseq_data"], "--path", fs_ckpt,
                       "--gen-subset", "test", "--beam", beam, "--batch-size", args.batch, "--max-len-a", 0,
                       "--max-len-b", args.length, "--min-len", args.length, "--lenpen", 0.6, "--cpu",
                       "--quiet", "--max-source-positions", 1024, "--max-target-positions", 1024,
                       "--num-workers", 0]
            else:
                cmd = [args.venv / "bin" / "python", work / "ct2_bench.py", ct2_dir, src_text, beam, args.batch,
                       args.length, args.threads, args.sentences]
            child = run_child(impl, cmd, log, env)
            text = child.output
            if impl == "fairseq":
                m = re.search(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s", text)
                r = {"sentences": int(m[1].replace(",", "")), "tokens": int(m[2].replace(",", "")),
                     "seconds": float(m[3])}
            else:
                r = json.loads(text.strip().splitlines()[-1])
            run = {"repeat": rep, "sentences_per_s": r["sentences"] / r["seconds"],
                   "tgt_tokens_per_s": r["tokens"] / r["seconds"],
                   "tokens_per_sentence": r["tokens"] / r["sentences"],
                   "seconds": round(r["seconds"], 2), "peak_rss_mb": round(child.peak_rss_mb)}
            runs[impl].append(run)
            print(f"  beam {beam} {impl:<12} repeat {rep}: {run['sentences_per_s']:6.1f} sent/s, "
                  f"{run['tgt_tokens_per_s']:7.0f} tok/s, {run['tokens_per_sentence']:.1f} tok/sent, "
                  f"peak RSS {child.peak_rss_mb:5.0f} MB", flush=True)
        results[f"beam{beam}"] = runs
    return results


def print_decode(results: dict, args: argparse.Namespace) -> None:
    print(f"\nDecoding: {args.sentences} sentences of Multi30k test2016, batch {args.batch}, output forced to "
          f"{args.length} tokens + eos, {args.threads} threads, {args.repeats} runs each (interleaved)\n")
    rows = []
    for beam, runs in results.items():
        fs = median([r["sentences_per_s"] for r in runs["fairseq"]])
        for impl, rs in runs.items():
            med = median([r["sentences_per_s"] for r in rs])
            rows.append([beam[4:], impl, ", ".join(f"{r['sentences_per_s']:.1f}" for r in rs), f"{med:.1f}",
                         f"{median([r['tgt_tokens_per_s'] for r in rs]):,.0f}", f"{med / fs:.2f}",
                         f"{statistics.mean(r['tokens_per_sentence'] for r in rs):.1f}",
                         f"{max(r['peak_rss_mb'] for r in rs):,}"])
    print_table(["beam", "implementation", "sentences/s per run", "median sent/s", "tgt tok/s", "ours / fairseq",
                 "tok/sent", "peak RSS MB"], rows)


# ------------------------------------------------------------------------------------------------ main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = multi30k_flags(argparse.ArgumentParser(add_help=False))
    common.add_argument("--venv", type=Path, default=Path("/work/peers/fairseq-venv"), help="fairseq's venv")
    common.add_argument("--threads", type=int, default=2)
    common.add_argument("--isa", choices=sorted(ISA_LIMITS), default=None,
                        help="cap every implementation's vector instructions (a proxy for a CPU class, see ISA_LIMITS)")
    common.add_argument("--tag", default="", help="appended to the results file's name (e.g. the CPU: epyc-no-amx)")
    common.add_argument("--repeats", type=int, default=2)
    common.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="our modes to run")
    t = sub.add_parser("train", parents=[common], help="training throughput and loss")
    t.add_argument("--sizes", nargs="+", default=["tiny", "base"], choices=sorted(SIZES))
    t.add_argument("--updates", type=int, default=40, help="updates per run")
    t.add_argument("--skip", type=int, default=10, help="updates left out of the throughput (start-up)")
    t.add_argument("--log-every", type=int, default=5, help="log interval of both trainers, in updates")
    t.add_argument("--baseline", type=Path, default=None,
                   help="a checkout of an earlier commit (git worktree add DIR REV) whose trainer runs beside ours")
    d = sub.add_parser("decode", parents=[common], help="decoding throughput")
    d.add_argument("--beams", nargs="+", type=int, default=[4, 1])
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--length", type=int, default=26, help="forced output length, eos not counted")
    d.add_argument("--sentences", type=int, default=1000)
    d.add_argument("--train-updates", type=int, default=100, help="updates of each tiny model to decode with")
    c = sub.add_parser("decode-child")  # internal: one run of ours
    for name in ("--checkpoint", "--tokenizer", "--corpus", "--precision"):
        c.add_argument(name)
    for name in ("--beam", "--batch", "--length", "--threads", "--sentences"):
        c.add_argument(name, type=int)
    args = p.parse_args()
    if args.command == "decode-child":
        ours_decode_child(args)
        return
    if args.command == "train" and args.skip % args.log_every:
        p.error("--skip must be a multiple of --log-every")
    if getattr(args, "baseline", None):
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "pipeline" / "train").is_dir():
            p.error(f"--baseline {args.baseline}: not a checkout of this project (no pipeline/train)")
        args.baseline_commit = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip() or "not a git checkout"
    paths = prepare(args.data_root, args.work_dir, args.venv)
    if args.command == "train":
        results = cmd_train(args, paths)
        capped = f", instructions capped at {args.isa} ({ISA_LIMITS[args.isa]})" if args.isa else ""
        print(f"\nCPU: {cpu_name()}{capped}")
        print_train(results, args)
    else:
        results = cmd_decode(args, paths)
        print_decode(results, args)
    meta = {"loadavg_at_end": os.getloadavg(), "isa_limits": ISA_LIMITS.get(args.isa or "", {})}
    sizes = "_" + "_".join(args.sizes) if args.command == "train" else ""
    out = RESULTS / f"vs_fairseq_{args.command}{sizes}_t{args.threads}{'_' + args.tag if args.tag else ''}.json"
    write_record(out, {**meta, "results": results}, args.threads, args)


if __name__ == "__main__":
    main()
