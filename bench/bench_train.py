"""Our trainer's training step against a plain PyTorch loop, side by side, on the same model and batches.

Ours: :class:`pipeline.train.TrainStep` (token-count all-reduce, loss scaling, accumulation bookkeeping, grad
clipping hook, schedule) with one micro-batch per update. Plain: forward, ``loss_sum / tokens``, backward, Adam
and LambdaLR steps. Both collate the same Multi30k batches (length-bucketed, ``--max-tokens`` per batch, ~3,800
target tokens at 4096) from the shards inside the timed step, on the tiny preset's model, with ``--threads``
threads; no DDP, no checkpoints; the two alternate in child processes (:mod:`bench.harness`). Prints target
tokens/s (median over steps), ours / plain and peak RSS.

    python -m bench.bench_train                          # tiny preset, 2 threads
    python -m bench.bench_train --steps 20 --repeats 3
    python -m bench.bench_train --precision fp32 --set model.d_model=128 --set model.d_ff=512   # another shape
    python -m bench.bench_train --precision bf16 --set tokenizer.vocab_size=4000               # another vocabulary
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.harness import (DATA, alternate, child_command, common_flags, emit, median, print_table, ratio, timed,
                           write_record)
from model import LabelSmoothedCrossEntropy, Transformer, transformer_lr_scheduler
from pipeline.config import load_config
from pipeline.shards import ShardDataset
from pipeline.train import TrainStep, make_batch, setup, usable_batches
from pipeline.workdir import Inputs, build_inputs


def build(data_root: str, work_dir: Path, overrides: Sequence[str] = ()) -> Inputs:
    """The tiny preset's corpus, tokenizer and shards (cached: a no-op when they exist), with its tokenizer as
    ``overrides`` set it (``tokenizer.vocab_size=4000``: shards of their own, fingerprinted apart)."""
    return build_inputs(load_config("multi30k-cpu", [("data.root", data_root), ("work_dir", str(work_dir)),
                                                     *overrides]))


def multi30k_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Where :func:`build` finds the data and keeps what it builds: ``--data-root``, ``--work-dir``."""
    p.add_argument("--data-root", default=str(DATA))
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/aiayn-bench"))
    return p


def child(args: argparse.Namespace) -> None:
    """Time ``args.impl`` for warm-up + steps; print one JSON line."""
    cfg = load_config("multi30k-cpu", [("data.root", args.data_root), f"train.max_tokens={args.max_tokens}",
                                       f"train.update_tokens={args.max_tokens}", f"train.precision={args.precision}",
                                       *args.set])
    info = setup()
    torch.set_num_threads(args.threads)
    ds = ShardDataset(args.shards, "train", verify=False)
    batches = usable_batches(ds, args.max_tokens, cfg.model.max_positions, seed=1, epoch=0)[: args.warmup + args.steps]
    torch.manual_seed(0)
    model = Transformer(cfg.model.architecture(ds.manifest["tokenizer"]["vocab_size"], ds.special.pad))
    if args.impl == "ours":
        trainer = TrainStep(model, cfg, info, ds.special.pad)

        def step(idx) -> int:
            b = make_batch(ds, idx, info.device)
            trainer.apply(*trainer.accumulate([b]))
            return b.n_tgt
    else:
        t = cfg.train
        criterion = LabelSmoothedCrossEntropy(t.label_smoothing, ds.special.pad)
        opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
        sched = transformer_lr_scheduler(opt, cfg.model.d_model, t.warmup_steps, t.lr_scale)

        def step(idx) -> int:
            b = make_batch(ds, idx, info.device)
            loss, _, n = criterion(model(b.src, b.tgt_in), b.tgt_out)
            (loss / n).backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            return b.n_tgt

    runs = [timed(step, idx) for idx in batches][args.warmup:]  # (target tokens, seconds) of each step
    emit({"times": [t for _, t in runs], "tokens": [n for n, _ in runs]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    multi30k_flags(common_flags(p, repeats=2))
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="ours: train.precision (fp32 on any CPU: the class without native bf16); plain is fp32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of both implementations' model, training and tokenizer (e.g. "
                        "model.d_model=128, tokenizer.vocab_size=4000)")
    p.add_argument("--impl", choices=["ours", "plain"], help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.impl:
        child(args)
        return
    shards = build(args.data_root, args.work_dir, args.set).shards
    flags = ["--shards", shards, "--data-root", args.data_root, "--max-tokens", args.max_tokens, "--threads",
             args.threads, "--precision", args.precision, "--steps", args.steps, "--warmup", args.warmup,
             *[a for o in args.set for a in ("--set", o)]]
    commands = {impl: child_command("bench.bench_train", "--impl", impl, *flags) for impl in ("ours", "plain")}
    runs = alternate(commands, args.repeats)
    summary = {}
    for impl, rs in runs.items():
        times, tokens = [t for r in rs for t in r["times"]], [n for r in rs for n in r["tokens"]]
        # tokens/s of the median step: robust to a noisy neighbour on a shared machine
        summary[impl] = {"tgt_tokens_per_s": median([n / t for n, t in zip(tokens, times)]),
                         "mean_tgt_tokens_per_batch": statistics.mean(tokens), "median_step_s": median(times),
                         "peak_rss_mb": max(r["peak_rss_mb"] for r in rs)}
    ours_over_plain = ratio(summary["ours"]["tgt_tokens_per_s"], summary["plain"]["tgt_tokens_per_s"])
    shape = "".join(f" {o}" for o in args.set)
    print(f"tiny preset{shape}, {args.threads} threads, max_tokens {args.max_tokens}, "
          f"precision {args.precision} (ours), {args.steps} steps x {args.repeats}")
    print_table(["impl", "tgt tok/s", "tok/batch", "step s", "peak RSS MB"],
                [[impl, f"{s['tgt_tokens_per_s']:.0f}", f"{s['mean_tgt_tokens_per_batch']:.0f}",
                  f"{s['median_step_s']:.3f}", f"{s['peak_rss_mb']:.0f}"] for impl, s in summary.items()])
    print(f"ours / plain: {ours_over_plain:.3f}")
    write_record(args.out, {**summary, "ratio": ours_over_plain}, args.threads, args)


if __name__ == "__main__":
    main()
