"""Where a GPU training update and a beam-search call spend the GPU's own time: a profile to read before choosing a
lever.

Training: for each preset (``--presets``, the configs ``wmt14-en-de-<preset>``), the update bench/bench_gpu.py
times (our :class:`pipeline.train.TrainStep`: forward, label-smoothed loss, backward, Adam and the schedule, bf16
autocast) on the same synthetic WMT-shaped batches (:func:`bench.bench_gpu.train_update`), with each
``--max-tokens`` (default: the config's micro-batch, then the whole 25,000-token update as one). ``--warmup``
updates run first (new shapes, allocator growth), then ``--updates`` updates under ``torch.profiler``.

Decoding: :func:`model.decoding.beam_search` and :func:`model.static_decoding.static_beam_search` (its step
replayed as a CUDA graph) on the ``--decode-preset`` model (random weights, bf16 copy as ``decode.precision=bf16``
decodes), ``--decode-batch`` sources, output forced to ``--decode-out-len`` tokens, one warm-up call, then one
profiled call.

Per variant, from the profiler's device events (the GPU's own time, not the host's):

- wall seconds per update (per call), and the GPU's busy share of it: the kernels' summed time over the wall time
  (what is left is the GPU waiting for the host: launches, synchronisations, Python);
- kernels launched per update (per decoding step), and their mean duration: thousands of microsecond kernels mean
  a launch-bound step, which fusion, compilation or CUDA graphs address;
- the kernels' time by category (matrix products, attention, softmax and the loss, element-wise, reductions,
  layer norm, dropout, the optimizer, copies and casts, the rest) and the heaviest kernels by name.

On a CPU (``--device cpu``, no CUDA) it profiles the host's operators instead, to check the script before a GPU
slot; its times are then host time (``device``: cpu). Writes one record (JSON) to ``--out``, under the
harness's provenance header (the GPU's name in ``machine``).

    python -m bench.profile_gpu --out bench/results/profile_gpu_h100.json
    python -m bench.profile_gpu --device cpu --presets tiny --updates 2 --max-tokens 1024   # a dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_gpu import (beam_call, micro_batch_sizes, preset_config, random_model, synthetic_flags,
                             synthetic_sources, train_update)
from bench.harness import write_record
from pipeline.config import RunConfig

# Kernel (or, on a CPU, operator) name fragments per category, first match wins; lower case.
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention", "cudnn_sdp", "bmm_softmax")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "sm80_", "sm90_", "ampere_", "hopper", "mm", "addmm", "matmul",
                "linear")),
    ("softmax and loss", ("softmax", "log_softmax", "nll", "cross_entropy", "logsumexp", "scatter", "gather")),
    ("layer norm", ("layer_norm", "layernorm")),
    ("dropout", ("dropout", "bernoulli", "philox")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lerp", "addcdiv", "addcmul", "_amp_")),
    ("copies and casts", ("copy", "memcpy", "memset", "cast", "to_copy", "cat", "index")),
    ("reductions", ("reduce", "sum", "norm", "mean", "max", "min")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "mul", "add", "sub", "div", "relu", "exp", "fill",
                      "where", "masked")),
]


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def device_table(prof, device: str, steps: int) -> dict:
    """The profiled kernels (CUDA) or top-level operators (CPU): total time, count, per category and the heaviest."""
    cuda = device == "cuda"
    rows = []
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total  # microseconds
        if t <= 0 or (cuda and e.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append((e.key, t / 1e6, e.count))
    total = sum(t for _, t, _ in rows)
    by_cat: dict[str, float] = defaultdict(float)
    for name, t, _ in rows:
        by_cat[category(name)] += t
    launches = sum(c for _, _, c in rows) if cuda else None
    heaviest = sorted(rows, key=lambda r: -r[1])[:25]
    return {"busy_s": total / steps, "launches_per_step": launches / steps if launches else None,
            "mean_kernel_us": total / launches * 1e6 if launches else None,
            "shares": {k: v / total for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])} if total else {},
            "heaviest": [{"name": n[:120], "s_per_step": t / steps, "share": t / total, "calls_per_step": c / steps}
                         for n, t, c in heaviest]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled(fn: Callable[[], None], device: torch.device, steps: int) -> tuple[float, dict]:
    """``fn()`` under torch.profiler (the GPU's kernels too, on a GPU): its wall seconds, and its
    :func:`device_table` per step (``steps`` in it)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    return wall, device_table(prof, device.type, steps)


def profile_train(cfg: RunConfig, preset: str, max_tokens: int, args: argparse.Namespace, device: torch.device) -> dict:
    """``--warmup`` then ``--updates`` profiled updates of TrainStep at ``max_tokens`` per micro-batch."""
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_tokens": max_tokens})})
    _, update, groups = train_update(cfg, max_tokens, args.warmup + args.updates, args, device)
    for group in groups[: args.warmup]:
        update(group)
    _sync(device)
    timed = groups[args.warmup:]

    def updates() -> None:
        for group in timed:
            update(group)

    wall, table = profiled(updates, device, len(timed))
    wall /= len(timed)
    n_tgt = sum(b[4] for g in timed for b in g) / len(timed)
    row = {"what": "train", "preset": preset, "precision": cfg.train.precision, "max_tokens": max_tokens,
           "accumulation": len(timed[0]), "tgt_tokens_per_update": n_tgt, "wall_s": wall,
           "busy_share": table["busy_s"] / wall, **table}
    update = groups = None  # free the device memory for the next variant (update holds the model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_decode(preset: str, search: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One warm-up and one profiled beam-search call (the config's beam and alpha, output length forced) with the
    ``search`` (``decode.search``: dynamic, or static with its step replayed as a CUDA graph on the GPU)."""
    from pipeline.inference import decoding_model  # sacremoses etc.: only decoding needs them

    cfg = preset_config(preset)
    base = random_model(cfg, device).eval()
    model = decoding_model(base, "bf16" if device.type == "cuda" else "fp32")
    src = synthetic_sources(cfg, args, torch.Generator().manual_seed(1)).to(device)
    out_len = args.decode_out_len + 1
    call = beam_call(model, search, cfg, out_len)
    call(src)
    _sync(device)
    wall, table = profiled(lambda: call(src), device, out_len)  # per decoding step
    return {"what": "decode", "preset": preset, "search": search, "beam": cfg.decode.beam_size,
            "batch": args.decode_batch, "out_len": out_len,
            "wall_s": wall, "sentences_per_s": args.decode_batch / wall, "step_wall_s": wall / out_len,
            "busy_share": table["busy_s"] * out_len / wall, **table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--presets", nargs="+", default=["base", "big"])
    p.add_argument("--updates", type=int, default=5, help="profiled updates per variant")
    synthetic_flags(p)
    p.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run it on the GPU machine, or --device cpu for a dry run")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    res: dict = {"device": device.type, "rows": []}
    for preset in args.presets:
        cfg = preset_config(preset)
        if device.type == "cuda":
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "bf16"})})
        for max_tokens in args.max_tokens or micro_batch_sizes(cfg):
            res["rows"].append(profile_train(cfg, preset, max_tokens, args, device))
            print(json.dumps({k: v for k, v in res["rows"][-1].items() if k != "heaviest"}), flush=True)
    if not args.no_decode:
        for search in ("dynamic", "static"):
            res["rows"].append(profile_decode(args.decode_preset, search, args, device))
    record = write_record(args.out, res, None, args)
    if args.out is None:
        print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
