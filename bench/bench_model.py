"""Training-step throughput of our Transformer against ``torch.nn.Transformer``, side by side.

One step = forward, label-smoothed loss, backward, Adam update, on the same synthetic batch (~3,800 target
tokens, sentence lengths within +-``--len-spread`` of ``--mean-len`` as a length-bucketed batcher gives) with
the same sizes and thread count, the two implementations alternating in child processes (:mod:`bench.harness`).
Prints target tokens/s from the median step time, ours / torch, and peak RSS per process.

    python -m bench.bench_model                                   # tiny, 2 threads
    python -m bench.bench_model --sizes tiny base --steps 4 --warmup 1 --out model_step.json
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.harness import alternate, child_command, common_flags, emit, median, print_table, ratio, write_record
from model import LabelSmoothedCrossEntropy, Transformer, TransformerConfig

PAD, BOS, EOS = 0, 2, 3
SIZES = {  # the presets' model sections (configs/presets/tiny.yaml, base.yaml)
    "tiny": dict(encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, n_heads=4),
    "base": dict(encoder_layers=6, decoder_layers=6, d_model=512, d_ff=2048, n_heads=8),
}


def make_batch(target_tokens: int, mean_len: int, spread: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Right-padded (src, tgt_in, tgt_out); sentence lengths in [mean_len - spread, mean_len + spread]."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, round(target_tokens / (mean_len + 1)))  # +1: EOS
    src_len = torch.randint(mean_len - spread, mean_len + spread + 1, (n,), generator=gen).tolist()
    tgt_len = torch.randint(mean_len - spread, mean_len + spread + 1, (n,), generator=gen).tolist()
    src = torch.full((n, max(src_len)), PAD)
    tgt_in = torch.full((n, max(tgt_len) + 1), PAD)
    tgt_out = torch.full((n, max(tgt_len) + 1), PAD)
    for i in range(n):
        src[i, : src_len[i]] = torch.randint(4, vocab, (src_len[i],), generator=gen)
        words = torch.randint(4, vocab, (tgt_len[i],), generator=gen)
        tgt_in[i, : tgt_len[i] + 1] = torch.cat([torch.tensor([BOS]), words])
        tgt_out[i, : tgt_len[i] + 1] = torch.cat([words, torch.tensor([EOS])])
    return src, tgt_in, tgt_out


class TorchTransformer(nn.Module):
    """Baseline: shared scaled embeddings + sinusoids around ``nn.Transformer`` (post-norm, batch_first)."""

    def __init__(self, vocab: int, encoder_layers: int, decoder_layers: int, d_model: int, d_ff: int, n_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        position = torch.arange(1024)[:, None] * torch.exp(torch.arange(0, d_model, 2) * (-math.log(1e4) / d_model))
        self.register_buffer("pe", torch.cat([position.sin(), position.cos()], dim=1), persistent=False)
        self.transformer = nn.Transformer(
            d_model, n_heads, encoder_layers, decoder_layers, d_ff, dropout=0.1, batch_first=True
        )
        self.scale = math.sqrt(d_model)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        src_x = F.dropout(self.embed(src) * self.scale + self.pe[: src.size(1)], 0.1, self.training)
        tgt_x = F.dropout(self.embed(tgt_in) * self.scale + self.pe[: tgt_in.size(1)], 0.1, self.training)
        causal = torch.ones(tgt_in.size(1), tgt_in.size(1), dtype=torch.bool).triu(1)  # True = masked, as the masks
        h = self.transformer(
            src_x, tgt_x, tgt_mask=causal, src_key_padding_mask=src.eq(PAD),
            tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src.eq(PAD), tgt_is_causal=True,
        )  # fmt: skip
        return F.linear(h, self.embed.weight)


def worker(args: argparse.Namespace) -> None:
    """Build one implementation, take warm-up + timed steps, and emit their seconds."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    src, tgt_in, tgt_out = make_batch(args.tokens, args.mean_len, args.len_spread, args.vocab)
    n_tokens = int(tgt_out.ne(PAD).sum())
    if args.worker == "ours":
        model = Transformer(TransformerConfig(args.vocab, PAD, **SIZES[args.size]))
        criterion = LabelSmoothedCrossEntropy(0.1, PAD)

        def loss_fn() -> torch.Tensor:
            return criterion(model(src, tgt_in), tgt_out)[0]
    else:
        model = TorchTransformer(args.vocab, **SIZES[args.size])

        def loss_fn() -> torch.Tensor:
            logits = model(src, tgt_in)
            return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, label_smoothing=0.1,
                                   reduction="sum")  # fmt: skip
    model.train()
    adam = {"loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[args.adam]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, **adam)
    seconds = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        (loss_fn() / n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    emit({"params": sum(p.numel() for p in model.parameters()), "batch": [*src.shape, tgt_in.size(1)],
          "target_tokens": n_tokens, "seconds": seconds[args.warmup:]})


def run_pair(args: argparse.Namespace, size: str) -> dict[str, dict]:
    """Both implementations, alternating over the repeats: per implementation its figures."""
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("tokens", "mean_len", "len_spread", "vocab", "threads", "adam", "warmup", "steps")]  # fmt: skip
    commands = {impl: child_command("bench.bench_model", f"--worker={impl}", f"--size={size}", *common)
                for impl in ("ours", "torch")}
    runs = alternate(commands, args.repeats)
    out = {}
    for impl, rs in runs.items():
        seconds = [t for r in rs for t in r["seconds"]]
        out[impl] = {**{k: rs[0][k] for k in ("params", "batch", "target_tokens")}, "seconds": seconds,
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                     "tok_per_s": rs[0]["target_tokens"] / median(seconds)}
    out["ours"]["ours_over_torch"] = ratio(out["ours"]["tok_per_s"], out["torch"]["tok_per_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_flags(parser, repeats=2)
    parser.add_argument("--sizes", nargs="+", default=["tiny"], choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per implementation and repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, in each child")
    parser.add_argument("--tokens", type=int, default=3800, help="target tokens per batch (approximate)")
    parser.add_argument("--mean-len", type=int, default=16, help="mean sentence length in tokens")
    parser.add_argument("--len-spread", type=int, default=2, help="lengths vary by at most this much")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--adam", choices=["loop", "foreach", "fused"], default="fused")
    parser.add_argument("--worker", choices=["ours", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    print(f"torch {torch.__version__}, {args.threads} threads, vocab {args.vocab}, Adam {args.adam}, "
          f"{args.repeats} x ({args.warmup} + {args.steps}) steps each, alternating; tok/s from the median step")
    results = {size: run_pair(args, size) for size in args.sizes}
    print_table(["size", "impl", "params", "batch (n, src, tgt)", "tgt tokens", "tgt tok/s", "ours/torch",
                 "peak RSS MB"],
                [[size, impl, f"{r['params']:,}", tuple(r["batch"]), f"{r['target_tokens']:,}",
                  f"{r['tok_per_s']:,.0f}", f"{r.get('ours_over_torch', 1.0):.2f}", f"{r['peak_rss_mb']:,.0f}"]
                 for size, rows in results.items() for impl, r in rows.items()])
    write_record(args.out, {"sizes": results}, args.threads, args)


if __name__ == "__main__":
    main()
