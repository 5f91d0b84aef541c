"""Where a GPU training update and a beam-search call spend the GPU's own time (issue 42, "profile first").

Training: for each preset (``--presets``, the configs ``wmt14-en-de-<preset>``), the update bench/bench_gpu.py
times (our :class:`pipeline.train.TrainStep`: forward, label-smoothed loss, backward, Adam and the schedule, bf16
autocast) on the same synthetic WMT-shaped batches (:func:`bench_gpu.synthetic_updates`), with each
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
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


from bench.bench_gpu import synthetic_updates
from bench.harness import write_record
from model import Transformer
from model.decoding import beam_search
from model.static_decoding import static_beam_search
from pipeline.config import RunConfig, load_config
from pipeline.train import Batch, TrainStep, setup

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


def profile_train(cfg: RunConfig, preset: str, max_tokens: int, args: argparse.Namespace, device: torch.device) -> dict:
    """``--warmup`` then ``--updates`` profiled updates of TrainStep at ``max_tokens`` per micro-batch."""
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_tokens": max_tokens})})
    info = setup()
    groups = synthetic_updates(cfg, max_tokens, args.warmup + args.updates, args)
    torch.manual_seed(0)
    model = Transformer(cfg.model.architecture(cfg.tokenizer.vocab_size, cfg.tokenizer.special.pad)).to(device)
    step_fn = TrainStep(model, cfg, info, cfg.tokenizer.special.pad)

    def update(group) -> None:
        micro = [Batch(s.to(device, non_blocking=True), ti.to(device, non_blocking=True),
                       to.to(device, non_blocking=True), n_src, n_tgt) for s, ti, to, n_src, n_tgt in group]
        sums, counts = step_fn.accumulate(micro)
        step_fn.apply(sums, counts)

    for group in groups[: args.warmup]:
        update(group)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    timed = groups[args.warmup:]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for group in timed:
            update(group)
        _sync(device)
        wall = (time.perf_counter() - t0) / len(timed)
    table = device_table(prof, device.type, len(timed))
    n_tgt = sum(b[4] for g in timed for b in g) / len(timed)
    row = {"what": "train", "preset": preset, "precision": cfg.train.precision, "max_tokens": max_tokens,
           "accumulation": len(timed[0]), "tgt_tokens_per_update": n_tgt, "wall_s": wall,
           "busy_share": table["busy_s"] / wall, **table}
    step_fn = model = groups = None  # free the device memory for the next variant (update() closes over them)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_decode(preset: str, search: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One warm-up and one profiled beam-search call (the config's beam and alpha, output length forced) with the
    ``search`` (``decode.search``: dynamic, or static with its step replayed as a CUDA graph on the GPU)."""
    from pipeline.inference import decoding_model  # sacremoses etc.: only decoding needs them

    cfg = load_config(f"wmt14-en-de-{preset}") if preset != "tiny" else load_config("multi30k-cpu")
    sp, d = cfg.tokenizer.special, cfg.decode
    torch.manual_seed(0)
    base = Transformer(cfg.model.architecture(cfg.tokenizer.vocab_size, sp.pad)).to(device).eval()
    model = decoding_model(base, "bf16" if device.type == "cuda" else "fp32")
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(args.decode_src_len - 5, args.decode_src_len + 6, (args.decode_batch,), generator=gen)
    src = torch.full((args.decode_batch, int(lens.max()) + 1), sp.pad, dtype=torch.long)  # (batch, src_len)
    for i, n in enumerate(lens.tolist()):
        src[i, :n] = torch.randint(4, cfg.tokenizer.vocab_size, (n,), generator=gen)
        src[i, n] = sp.eos
    src = src.to(device)
    out_len = args.decode_out_len + 1

    run = static_beam_search if search == "static" else beam_search

    def call() -> None:
        run(model, src, bos_id=sp.bos, eos_id=sp.eos, beam_size=d.beam_size, alpha=d.length_penalty,
            max_len_a=0.0, max_len_b=out_len, min_len=out_len)

    call()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        call()
        _sync(device)
        wall = time.perf_counter() - t0
    table = device_table(prof, device.type, out_len)  # per decoding step
    return {"what": "decode", "preset": preset, "search": search, "beam": d.beam_size, "batch": args.decode_batch,
            "out_len": out_len,
            "wall_s": wall, "sentences_per_s": args.decode_batch / wall, "step_wall_s": wall / out_len,
            "busy_share": table["busy_s"] * out_len / wall, **table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--presets", nargs="+", default=["base", "big"])
    p.add_argument("--max-tokens", type=int, nargs="+", help="micro-batch sizes (default: the config's, then its "
                                                              "update_tokens)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--updates", type=int, default=5, help="profiled updates per variant")
    p.add_argument("--min-len", type=int, default=10, help="shortest synthetic source sentence (tokens)")
    p.add_argument("--max-len", type=int, default=60, help="longest synthetic source sentence (tokens)")
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--decode-preset", default="base")
    p.add_argument("--decode-batch", type=int, default=128)
    p.add_argument("--decode-src-len", type=int, default=25)
    p.add_argument("--decode-out-len", type=int, default=25)
    p.add_argument("--out", type=Path, help="write the record (JSON) here")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run it on the GPU machine, or --device cpu for a dry run")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    res: dict = {"device": device.type, "rows": []}
    for preset in args.presets:
        cfg = load_config(f"wmt14-en-de-{preset}") if preset != "tiny" else load_config("multi30k-cpu")
        if device.type == "cuda":
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": "bf16"})})
        for max_tokens in args.max_tokens or sorted({cfg.train.micro_batch_tokens(1), cfg.train.update_tokens}):
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
