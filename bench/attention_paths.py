"""The two ways our attention runs on the CPU in training, side by side: torch's fused kernel
(``F.scaled_dot_product_attention``, the flash-attention kernel for the CPU) and explicit products
(``model.attention.attention_with_weights``: two batched products, the softmax between them in float32).

Forward + backward of one attention call at training shapes: a length-bucketed batch of about ``--tokens``
tokens, every sentence ``keys`` long (the batch's padded length), ``--heads`` heads of ``--d-k``, in fp32 or
bf16, with a key padding mask (encoder self-attention and encoder-decoder attention) and causal (decoder
self-attention). The two paths alternate call by call (A B A B ...) so that other work on the cores hits both;
the median per path is printed with their ratio. ``model.attention.CPU_FP32_EXPLICIT_MAX_KEYS`` is chosen from
the fp32 rows: the longest keys at which the explicit products are still faster.

    python -m bench.attention_paths                           # fp32, 14-128 keys, 2 threads
    python -m bench.attention_paths --precisions fp32 bf16 --out bench/results/attention_paths_fp32_zen4.json
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.harness import common_flags, median, print_table, ratio, write_record
from model.attention import CPU_FP32_EXPLICIT_MAX_KEYS, attention_with_weights, causal_keep_mask
from pipeline.speed import cpu_name


def time_pair(keys: int, causal: bool, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """Median forward + backward milliseconds of each path at ``keys`` keys, and explicit / fused."""
    batch = max(1, args.tokens // keys)
    gen = torch.Generator().manual_seed(keys)
    # (batch, heads, keys, d_k) strided views of (batch, keys, heads, d_k), as the model's heads are
    q, k, v = (torch.randn(batch, keys, args.heads, args.d_k, generator=gen, dtype=dtype).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(batch, args.heads, keys, args.d_k, generator=gen, dtype=dtype)
    pad = torch.zeros(batch, keys, dtype=torch.bool)
    pad[::3, -max(1, keys // 5):] = True  # a third of the rows padded by a fifth
    keep = causal_keep_mask(keys, keys) if causal else (~pad)[:, None, None, :]

    def fused() -> None:
        if causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        out.backward(grad)

    def explicit() -> None:
        attention_with_weights(q, k, v, keep)[0].backward(grad)

    times: dict[str, list[float]] = {"fused": [], "explicit": []}
    for i in range(args.warmup + args.repeats):
        for name, fn in (("fused", fused), ("explicit", explicit)):
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    fused_ms, explicit_ms = (median(times[n]) for n in ("fused", "explicit"))
    return {"keys": keys, "batch": batch, "mask": "causal" if causal else "padding",
            "precision": "bf16" if dtype == torch.bfloat16 else "fp32", "fused_ms": round(fused_ms, 3),
            "explicit_ms": round(explicit_ms, 3), "explicit_over_fused": ratio(explicit_ms, fused_ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", nargs="+", type=int, default=[14, 26, 36, 50, 64, 80, 100, 128])
    p.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per batch (the fp32 recipe's updates)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-k", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    common_flags(p, repeats=40)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = [time_pair(keys, causal, dtypes[prec], args)
            for prec in args.precisions for keys in args.keys for causal in (False, True)]
    print(f"{cpu_name()}, {args.threads} threads, ~{args.tokens} tokens a batch, {args.heads} heads of {args.d_k}, "
          f"median of {args.repeats} forward + backward calls each (alternating); in use: explicit products for "
          f"fp32 up to {CPU_FP32_EXPLICIT_MAX_KEYS} keys, always for bf16\n")
    print_table(["precision", "keys", "batch", "mask", "fused ms", "explicit ms", "explicit / fused"],
                [[r["precision"], r["keys"], r["batch"], r["mask"], f"{r['fused_ms']:.2f}", f"{r['explicit_ms']:.2f}",
                  f"{r['explicit_over_fused']:.2f}"] for r in rows])
    write_record(args.out, {"rows": rows}, args.threads, args)


if __name__ == "__main__":
    main()
