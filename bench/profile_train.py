"""Where a training update's time goes, next to what this CPU's matrix units deliver at the model's own shapes.

For each preset (``tiny``: the CPU default; ``base``: the paper's base layers at the shards' 8,000-word vocabulary)
and precision (fp32; bf16 as ``train.precision: bf16`` runs it on a CPU: a bf16 working copy, fp32 weights),
``--warmup`` updates of our :class:`pipeline.train.TrainStep` run unprofiled, then ``--updates`` updates under
``torch.profiler``, each one micro-batch of ``--max-tokens`` tokens of real Multi30k shards (the tiny preset's).
Printed per variant:

- the share of the update's self CPU time per category of operator (matrix products, attention, the loss,
  element-wise arithmetic, casts and copies, layer norm, dropout, embeddings, the optimizer, the rest) and the
  heaviest operators;
- achieved FLOP/s, by the model's documented count (``Transformer.flops_per_token``: 6 x weights per token plus
  attention) over the measured update time, against the matmul roofline measured in the same run:
  ``torch.mm`` at the model's shapes (tokens x d_model -> d_ff, d_ff -> d_model, d_model -> vocab) in the same
  precision. Their ratio, the model FLOPs utilisation against this machine's own peak, is the headline.

    python -m bench.profile_train                               # tiny and base, fp32 and bf16, 2 threads
    python -m bench.profile_train --presets tiny --precisions bf16 --updates 5 --out profile.json
    python -m bench.profile_train --presets tiny --precisions fp32 --max-tokens 2048 --set recipe=fp32
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_train import build, multi30k_flags
from bench.harness import print_table, timed, write_record
from model import Transformer
from pipeline.config import load_config
from pipeline.shards import ShardDataset
from pipeline.train import TrainStep, make_batch, setup, usable_batches
from pipeline.train.metrics import matmul_roofline

PRESETS = {"tiny": "multi30k-cpu", "base": "wmt14-en-de-base"}
# Operator name fragments -> category, first match wins (names as torch.profiler reports them).
CATEGORIES = [
    ("loss", ("SmoothedCrossEntropy", "log_softmax", "gather", "scatter_add")),
    ("attention", ("scaled_dot_product", "_flash_attention", "softmax")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                "mkldnn")),
    ("optimizer", ("_foreach", "adam", "Optimizer", "clip_grad")),
    ("layer norm", ("layer_norm",)),
    ("dropout", ("dropout", "bernoulli", "aten::random_")),
    ("embedding", ("embedding",)),
    ("casts and copies", ("aten::to", "_to_copy", "copy_", "clone", "contiguous")),
    ("element-wise", ("aten::add", "aten::mul", "aten::div", "aten::sub", "relu", "threshold", "where",
                      "masked_fill", "aten::exp", "aten::sum", "aten::fill_", "zero_", "aten::neg", "sqrt")),
]


def category(name: str) -> str:
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def profile_variant(preset: str, precision: str, shards: Path, args: argparse.Namespace) -> dict:
    cfg = load_config(PRESETS[preset], [f"train.max_tokens={args.max_tokens}", f"train.update_tokens={args.max_tokens}",
                                        f"train.precision={precision}", *args.set])
    info = setup()
    torch.set_num_threads(args.threads)
    ds = ShardDataset(shards, "train", verify=False)
    vocab = ds.manifest["tokenizer"]["vocab_size"]
    batches = usable_batches(ds, args.max_tokens, cfg.model.max_positions, seed=1, epoch=0)
    batches = batches[: args.warmup + args.updates]
    torch.manual_seed(0)
    model = Transformer(cfg.model.architecture(vocab, ds.special.pad))
    step = TrainStep(model, cfg, info, ds.special.pad)

    def update(idx) -> tuple[int, int, int]:
        b = make_batch(ds, idx, info.device)
        step.apply(*step.accumulate([b]))
        return b.n_src, b.n_tgt, len(b.src)

    for idx in batches[: args.warmup]:
        update(idx)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runs = [timed(update, idx) for idx in batches[args.warmup:]]  # ((sources, targets, sentences), seconds)
    counts, times = [c for c, _ in runs], [t for _, t in runs]
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in ops)
    shares: dict[str, float] = defaultdict(float)
    for e in ops:
        shares[category(e.key)] += e.self_cpu_time_total / total
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[: args.top]
    n_src, n_tgt, n_sent = (sum(c[i] for c in counts) for i in range(3))
    flops = model.flops_per_token(n_src / n_sent, n_tgt / n_sent) * n_tgt  # the profiled updates' FLOPs
    seconds = sum(times)
    d, d_ff, m = cfg.model.d_model, cfg.model.d_ff, args.max_tokens
    roof = {shape: flops_s / 1e9 for shape, flops_s in matmul_roofline(
        [(m, d, d_ff), (m, d_ff, d), (m, d, vocab)], torch.bfloat16 if precision == "bf16" else torch.float32).items()}
    achieved = flops / seconds / 1e9
    return {"preset": preset, "precision": precision, "params": model.num_parameters(), "vocab": vocab,
            "updates": len(times), "median_update_s": statistics.median(times),
            "tgt_tokens_per_s": n_tgt / seconds, "achieved_gflops": achieved,
            "roofline_gflops": roof, "mfu_vs_roofline": achieved / max(roof.values()),
            "shares": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "top_ops": [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in top]}


def main() -> None:
    p = multi30k_flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--presets", nargs="+", default=["tiny", "base"], choices=sorted(PRESETS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of every variant, e.g. recipe=fp32 (the fp32 CPUs' model) or "
                        "tokenizer.vocab_size=4000 (its own shards)")
    p.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = p.parse_args()
    shards = build(args.data_root, args.work_dir, args.set).shards
    rows = [profile_variant(preset, precision, shards, args)
            for preset in args.presets for precision in args.precisions]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    print(f"{args.threads} threads, {args.max_tokens} tokens per update, {args.updates} profiled updates each\n")
    print_table(["variant", "update s", "tgt tok/s", "achieved GFLOP/s", "matmul roofline GFLOP/s", "MFU vs roofline",
                 *cats],
                [[f"{r['preset']} {r['precision']}", f"{r['median_update_s']:.2f}", f"{r['tgt_tokens_per_s']:,.0f}",
                  f"{r['achieved_gflops']:,.0f}",
                  f"{min(r['roofline_gflops'].values()):,.0f}-{max(r['roofline_gflops'].values()):,.0f}",
                  f"{r['mfu_vs_roofline']:.1%}", *(f"{r['shares'].get(c, 0):.1%}" for c in cats)] for r in rows])
    for r in rows:
        print(f"\n{r['preset']} {r['precision']}: heaviest operators (share of self CPU time, calls)")
        for op in r["top_ops"]:
            print(f"  {op['share']:6.1%}  {op['calls']:>6}  {op['op']}")
    write_record(args.out, {"rows": rows}, args.threads, args)


if __name__ == "__main__":
    main()
