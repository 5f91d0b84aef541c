"""GPU benchmark: our training step and beam search on one CUDA device, against the paper's 8 x P100 speed.

Training. For each preset (``--presets``, the configs ``wmt14-en-de-<preset>``) and each ``--max-tokens``
(default: the config's ``train.max_tokens``, several micro-batches per update, and ``train.update_tokens``, one,
which a GPU's memory allows), one update is exactly what the trainer runs on one GPU:
:class:`pipeline.train.TrainStep` (our Transformer, label-smoothed loss, Adam + the paper's schedule, in
``train.precision``) accumulating ``round(train.update_tokens / train.max_tokens)`` micro-batches of synthetic
pairs of the paper's shape (:func:`synthetic_updates`), then ``apply``; an update holds ~25,000 target tokens, the
paper's batch. ``--warmup`` updates are untimed; then ``--steps`` updates run twice. The first pass meets every
batch shape for the first time, and eager CUDA pays a one-off host cost per new shape, so it is reported only as
"1st pass s/update". The second pass over the same updates is the measurement, the steady state of a long run whose
batch shapes recur: back to back between two ``torch.cuda.synchronize`` calls, per-update times from CUDA events.

Reported per variant: target (and source) tokens/s, updates/s, s/update, model TFLOP/s from
:meth:`model.Transformer.flops_per_token` applied to the batch-average sentence lengths (the trainer's MFU
formula), MFU against :func:`pipeline.train.metrics.peak_flops` (dense bf16 peak by GPU name), peak
``torch.cuda.max_memory_allocated``; and, per preset, the paper's speed: base 100k steps in 12 h, big 300k steps
in 3.5 days, on 8 P100 with ~25,000 source + ~25,000 target tokens per step.

Decoding. :func:`model.decoding.beam_search` and, beside it on the same model and sources,
:func:`model.static_decoding.static_beam_search` (``decode.search=static``: its step replayed as a CUDA graph)
and CTranslate2's CUDA beam search over the same weights (the export's mapping, synthetic pieces), with the
config's beam (4) and length penalty (0.6) on the ``--decode-preset`` model (random weights), ``--decode-batch``
synthetic source sentences of ``--decode-src-len`` +-5 tokens per call, output forced to ``--decode-out-len``
tokens + eos, in fp32 and bf16 (:func:`pipeline.inference.decoding_model`, the bf16 copy that
``decode.precision=bf16`` uses). Sentences/s over ``--decode-calls`` timed calls after one warm-up call.

bench/profile_gpu.py profiles the same updates and calls (the synthetic batches, models and searches here). Needs
a CUDA device (it exits with a message otherwise); not part of the tests or CI.

    python -m bench.bench_gpu                                  # base and big, eager
    python -m bench.bench_gpu --presets base big --steps 30 --out bench/results/gpu_h100.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from bench.harness import write_record
from model import Transformer
from model.decoding import beam_search
from model.static_decoding import static_beam_search
from pipeline.config import RunConfig, load_config
from pipeline.shards import token_batches
from pipeline.train import Batch, TrainStep, accumulation_steps, setup
from pipeline.train.metrics import peak_flops, peak_memory_mb

# The paper (section 5.2): base 100k steps in 12 hours, big 300k steps in 3.5 days, on one machine with 8 P100s;
# each step ~25,000 source + ~25,000 target tokens.
PAPER = {"base": {"steps": 100_000, "hours": 12.0}, "big": {"steps": 300_000, "hours": 3.5 * 24}}
PAPER_TOKENS_PER_STEP = 25_000


def preset_config(preset: str, overrides: Sequence[str] = ()) -> RunConfig:
    """A preset's config: ``wmt14-en-de-<preset>``, or for ``tiny`` the CPU default's, ``multi30k-cpu``."""
    return load_config("multi30k-cpu" if preset == "tiny" else f"wmt14-en-de-{preset}", list(overrides))


def micro_batch_sizes(cfg: RunConfig) -> list[int]:
    """The default ``--max-tokens``: the config's micro-batch, then the whole update as one."""
    return sorted({cfg.train.micro_batch_tokens(1), cfg.train.update_tokens})


def synthetic_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of the synthetic updates and the decoding call (this script's and bench/profile_gpu.py's)."""
    p.add_argument("--warmup", type=int, default=3, help="untimed updates first (eager)")
    p.add_argument("--max-tokens", type=int, nargs="+",
                   help="train.max_tokens values to run (default: the config's, and train.update_tokens)")
    p.add_argument("--min-len", type=int, default=10, help="shortest synthetic source sentence (tokens)")
    p.add_argument("--max-len", type=int, default=60, help="longest synthetic source sentence (tokens)")
    p.add_argument("--no-decode", action="store_true", help="skip the decoding benchmark")
    p.add_argument("--decode-preset", default="base", choices=["tiny", "base", "big"])
    p.add_argument("--decode-batch", type=int, default=128)
    p.add_argument("--decode-src-len", type=int, default=25, help="mean source length (+-5)")
    p.add_argument("--decode-out-len", type=int, default=25, help="forced output length, eos not counted")
    return p


def random_model(cfg: RunConfig, device: torch.device) -> Transformer:
    """The config's model with random weights, the same for every variant (seed 0), on ``device``."""
    torch.manual_seed(0)
    return Transformer(cfg.model.architecture(cfg.tokenizer.vocab_size, cfg.tokenizer.special.pad)).to(device)


# ---------------------------------------------------------------------------------------------- batches


def synthetic_updates(cfg: RunConfig, max_tokens: int, updates: int, args: argparse.Namespace
                      ) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]]]:
    """``updates`` groups of ``accumulation_steps`` CPU micro-batches (src, tgt_in, tgt_out, n_src, n_tgt), cut by
    :func:`token_batches` (our length-bucketed batcher: padded batches of at most ``max_tokens`` = sentences x
    longest pair) from synthetic pairs: random ids of the shared vocabulary (``tokenizer.vocab_size``), source
    lengths uniform in ``--min-len``..``--max-len``, target length the source's times U(0.8, 1.25), each side
    framed with bos/eos as :func:`pipeline.train.make_batch` does."""
    accum = accumulation_steps(cfg.train.update_tokens, max_tokens, 1)
    sp, vocab = cfg.tokenizer.special, cfg.tokenizer.vocab_size
    rng = np.random.default_rng(0)
    mean_size = (args.min_len + args.max_len) / 2 * 1.1 + 1
    n_pairs = int(updates * accum * max_tokens / mean_size * 1.5) + 1000  # enough pairs for the batches needed
    src_len = rng.integers(args.min_len, args.max_len + 1, n_pairs)  # [N]
    tgt_len = np.maximum(1, np.rint(src_len * rng.uniform(0.8, 1.25, n_pairs))).astype(np.int64)  # [N]
    sizes = np.maximum(src_len, tgt_len) + 1  # what a pair costs in a padded batch (ShardDataset.sizes)
    batches = token_batches(sizes, max_tokens, seed=1, epoch=0)
    if len(batches) < updates * accum:
        raise RuntimeError(f"only {len(batches)} batches of max_tokens={max_tokens} for {updates} x {accum}")

    def side(lengths: np.ndarray, bos: bool, eos: bool, ids: list[np.ndarray]) -> torch.Tensor:
        out = np.full((len(lengths), int(lengths.max()) + bos + eos), sp.pad, dtype=np.int64)  # [B, W]
        for row, (n, tok) in enumerate(zip(lengths, ids)):
            out[row, bos : bos + n] = tok
            if eos:
                out[row, bos + n] = sp.eos
        if bos:
            out[:, 0] = sp.bos
        return torch.from_numpy(out)

    groups = []
    for u in range(updates):
        group = []
        for idx in batches[u * accum : (u + 1) * accum]:
            s_len, t_len = src_len[idx], tgt_len[idx]
            s_ids = [rng.integers(4, vocab, n) for n in s_len]
            t_ids = [rng.integers(4, vocab, n) for n in t_len]
            group.append((side(s_len, False, True, s_ids), side(t_len, True, False, t_ids),
                          side(t_len, False, True, t_ids), int(s_len.sum()) + len(idx), int(t_len.sum()) + len(idx)))
        groups.append(group)
    return groups


def train_update(cfg: RunConfig, max_tokens: int, updates: int, args: argparse.Namespace, device: torch.device
                 ) -> tuple[Transformer, Callable, list]:
    """Our TrainStep on ``device`` and ``updates`` synthetic updates for it (:func:`synthetic_updates`): the model,
    ``update(group)`` (one update; its loss sums) and the updates."""
    info = setup()
    groups = synthetic_updates(cfg, max_tokens, updates, args)
    model = random_model(cfg, device)
    step_fn = TrainStep(model, cfg, info, cfg.tokenizer.special.pad)

    def update(group) -> torch.Tensor:
        micro = [Batch(s.to(device, non_blocking=True), ti.to(device, non_blocking=True),
                       to.to(device, non_blocking=True), n_src, n_tgt) for s, ti, to, n_src, n_tgt in group]
        sums, counts = step_fn.accumulate(micro)
        step_fn.apply(sums, counts)
        return sums

    return model, update, groups


def synthetic_sources(cfg: RunConfig, args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """``--decode-batch`` random sources of ``--decode-src-len`` +-5 ids, each + eos, right-padded, on the CPU:
    (batch, longest + 1)."""
    sp = cfg.tokenizer.special
    lens = torch.randint(args.decode_src_len - 5, args.decode_src_len + 6, (args.decode_batch,), generator=gen)
    src = torch.full((args.decode_batch, int(lens.max()) + 1), sp.pad, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        src[i, :n] = torch.randint(4, cfg.tokenizer.vocab_size, (n,), generator=gen)
        src[i, n] = sp.eos
    return src


def beam_call(model: torch.nn.Module, search: str, cfg: RunConfig, out_len: int) -> Callable:
    """``call(src)``: one beam search (``search``: ``decode.search``, dynamic or static) with the config's beam and
    length penalty, the output forced to ``out_len`` tokens; its hypotheses."""
    run = static_beam_search if search == "static" else beam_search
    sp, d = cfg.tokenizer.special, cfg.decode

    def call(src: torch.Tensor) -> list:
        return run(model, src, bos_id=sp.bos, eos_id=sp.eos, beam_size=d.beam_size, alpha=d.length_penalty,
                   max_len_a=0.0, max_len_b=out_len, min_len=out_len)

    return call


# --------------------------------------------------------------------------------------------- training


def bench_train(preset: str, max_tokens: int, precision: str, args: argparse.Namespace,
                lever: str | None = None) -> dict:
    """``warmup`` untimed updates of our TrainStep in ``precision`` (bf16 autocast or fp32), then ``args.steps``
    updates twice (first pass: new shapes; second pass, timed: the same shapes again); one result row. ``lever``:
    one more config override, or several joined by commas (``--levers``), measured against the same variant
    without it."""
    overrides = [f"train.max_tokens={max_tokens}", f"train.precision={precision}", *(lever.split(",") if lever else [])]
    cfg = preset_config(preset, overrides)
    dev = setup().device
    warmup = args.warmup
    model, update, groups = train_update(cfg, max_tokens, warmup + args.steps, args, dev)

    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for group in groups[:warmup]:
        update(group)
    torch.cuda.synchronize(dev)
    warmup_s = time.perf_counter() - t0

    # First pass: every update brings batch shapes not seen before (one-off per-shape costs included).
    timed = groups[warmup:]
    t0 = time.perf_counter()
    for group in timed:
        update(group)
    torch.cuda.synchronize(dev)
    first_pass_s = time.perf_counter() - t0

    # Second pass over the same updates, timed: the steady state of a long run, where shapes recur.
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in timed]
    loss = torch.zeros(2, dtype=torch.float64, device=dev)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for group, (start, end) in zip(timed, events):
        start.record()
        loss += update(group)
        end.record()
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0

    per_update = [s.elapsed_time(e) / 1000 for s, e in events]
    n_src = sum(b[3] for g in timed for b in g)
    n_tgt = sum(b[4] for g in timed for b in g)
    n_sent = sum(len(b[0]) for g in timed for b in g)
    padded = sum(b[0].numel() + b[1].numel() for g in timed for b in g)
    tgt_tok_s = n_tgt / seconds
    fpt = model.flops_per_token(n_src / n_sent, n_tgt / n_sent)  # the trainer's MFU formula
    peak = peak_flops(dev)
    row = {
        "preset": preset, "variant": "eager" + (f" + {lever}" if lever else ""),
        "precision": precision,
        "max_tokens": max_tokens,
        "accumulation": len(timed[0]), "updates": len(timed), "params": model.num_parameters(),
        "tgt_tokens_per_update": n_tgt / len(timed), "src_tokens_per_update": n_src / len(timed),
        "padding_share": 1 - (n_src + n_tgt) / padded, "mean_src_len": n_src / n_sent, "mean_tgt_len": n_tgt / n_sent,
        "updates_per_s": len(timed) / seconds, "s_per_update": seconds / len(timed),
        "update_s_median": statistics.median(per_update), "update_s_min": min(per_update),
        "update_s_max": max(per_update), "tgt_tokens_per_s": tgt_tok_s, "src_tokens_per_s": n_src / seconds,
        "flops_per_tgt_token": fpt, "tflops": fpt * tgt_tok_s / 1e12, "mfu": fpt * tgt_tok_s / peak if peak else None,
        "peak_memory_gib": peak_memory_mb(dev) / 1024, "warmup_updates": warmup, "warmup_s": warmup_s,
        "first_pass_s_per_update": first_pass_s / len(timed),
        "loss_per_token": float(loss[0]) / n_tgt,
    }
    model = update = groups = None  # free GPU memory for the next variant
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------------------------- decoding


CT2_COMPUTE = {"fp32": "float32", "bf16": "bfloat16"}  # CTranslate2's compute type for our precision names


def _ctranslate2(base: Transformer, precision: str, vocab_size: int, sp, out_dir: Path):
    """The random model as a CTranslate2 model on the GPU: :func:`pipeline.export.transformer_spec` (the export's
    own weight mapping) with synthetic pieces (``p<id>``; the specials at their ids). Returns (translator, pieces)."""
    import ctranslate2

    from pipeline.export import transformer_spec

    pieces = [f"p{i}" for i in range(vocab_size)]
    for name in ("pad", "unk", "bos", "eos"):
        pieces[getattr(sp, name)] = f"<{name}>"
    state = {"model": {k: v.detach().float().cpu() for k, v in base.state_dict().items()},
             "model_config": base.config.to_dict()}
    spec = transformer_spec(state, pieces, {k: f"<{k}>" for k in ("pad", "unk", "bos", "eos")})
    spec.validate()
    spec.optimize(quantization=CT2_COMPUTE[precision])
    spec.save(str(out_dir))
    return ctranslate2.Translator(str(out_dir), device="cuda", compute_type=CT2_COMPUTE[precision]), pieces


def bench_decode(preset: str, precision: str, search: str, args: argparse.Namespace) -> dict:
    """Sentences/s of beam search (the config's beam and length penalty) with the output length forced, with the
    ``search``: ``dynamic`` / ``static`` (``decode.search``; static replays its step as a CUDA graph), or
    ``ctranslate2`` (the same weights exported, CTranslate2's CUDA beam search; its length penalty is its own, which
    the forced length makes moot). The first call's best hypotheses are kept, as a digest, to compare searches
    (``tokens``)."""
    from pipeline.inference import decoding_model  # lazily: sacremoses etc., only the decoding part needs them

    cfg = preset_config(preset)
    dev, sp, d = setup().device, cfg.tokenizer.special, cfg.decode
    base = random_model(cfg, dev).eval()  # the same random model for every search
    gen = torch.Generator().manual_seed(1)  # and the same sources
    out_len = args.decode_out_len + 1  # eos included
    batches = [synthetic_sources(cfg, args, gen).to(dev) for _ in range(args.decode_calls + 1)]
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    if search == "ctranslate2":
        with tempfile.TemporaryDirectory(prefix="bench-gpu-ct2-") as tmp:  # the translator holds the model loaded
            translator, pieces = _ctranslate2(base, precision, cfg.tokenizer.vocab_size, sp, Path(tmp))
        base = None
        torch.cuda.empty_cache()
        ids = {p: i for i, p in enumerate(pieces)}

        def call(src: torch.Tensor) -> list[list[int]]:
            rows = [[pieces[i] for i in row if i not in (sp.pad, sp.eos)] for row in src.tolist()]  # it adds eos
            out = translator.translate_batch(rows, beam_size=d.beam_size, length_penalty=d.length_penalty,
                                             max_batch_size=len(rows), max_input_length=0,
                                             min_decoding_length=out_len - 1, max_decoding_length=out_len - 1)
            return [[ids[p] for p in r.hypotheses[0]] for r in out]
    else:
        search_call = beam_call(decoding_model(base, precision), search, cfg, out_len)

        def call(src: torch.Tensor) -> list[list[int]]:
            return [h[0].tokens for h in search_call(src)]

    call(batches[0])  # warm-up
    torch.cuda.synchronize(dev)
    times, lengths, first = [], [], None
    for src in batches[1:]:
        t0 = time.perf_counter()
        best = call(src)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        lengths += [len(tokens) + 1 for tokens in best]
        first = first or best
    n = args.decode_batch * args.decode_calls
    # the first call's best hypotheses, as a digest: equal digests, equal tokens
    digest = hashlib.sha256(json.dumps(first).encode()).hexdigest()[:16]
    row = {"preset": preset, "precision": precision, "search": search, "tokens": digest, "beam": d.beam_size,
           "alpha": d.length_penalty, "batch": args.decode_batch, "calls": args.decode_calls, "out_len": out_len,
           "forced_len_ok": all(x == out_len for x in lengths), "sentences_per_s": n / sum(times),
           "tokens_per_s": sum(lengths) / sum(times), "s_per_call_median": statistics.median(times),
           "peak_memory_gib": peak_memory_mb(dev) / 1024}
    call = search_call = base = None  # free GPU memory for the next variant (the calls hold the model)
    torch.cuda.empty_cache()
    return row


def against_paper(train: list[dict]) -> list[dict]:
    """Per preset, its fastest variant against the paper's 8 x P100: target tokens/s, seconds per update of the
    paper's ~25,000 target tokens, and the paper's training run (its step count) at our speed."""
    out = []
    for preset in dict.fromkeys(r["preset"] for r in train):
        best = max((r for r in train if r["preset"] == preset), key=lambda r: r["tgt_tokens_per_s"])
        step = PAPER[preset]["hours"] * 3600 / PAPER[preset]["steps"]  # the paper's seconds per step
        ours = PAPER_TOKENS_PER_STEP / best["tgt_tokens_per_s"]
        out.append({"preset": preset, "variant": f"{best['precision']} {best['variant']}, max_tokens "
                    f"{best['max_tokens']}", "tgt_tokens_per_s": best["tgt_tokens_per_s"], "s_per_paper_update": ours,
                    "paper_s_per_step": step, "paper_tgt_tokens_per_s": PAPER_TOKENS_PER_STEP / step,
                    "ours_over_paper": best["tgt_tokens_per_s"] * step / PAPER_TOKENS_PER_STEP,
                    "paper_run_hours": ours * PAPER[preset]["steps"] / 3600})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["base", "big"], choices=sorted(PAPER))
    p.add_argument("--steps", type=int, default=20, help="timed updates per variant")
    p.add_argument("--train-precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"],
                   help="train.precision values to run (bf16 autocast; fp32, the paper's)")
    synthetic_flags(p)
    p.add_argument("--decode-calls", type=int, default=4, help="timed beam-search calls per precision")
    p.add_argument("--levers", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="config overrides each measured as its own bf16 eager variant beside the plain one, e.g. "
                        "train.fused_output_loss=true; several joined by commas are one variant")
    p.add_argument("--out", type=Path, help="write the record (JSON) here, again after every variant")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py: no CUDA device visible (torch.cuda.is_available() is False; torch "
                 f"{torch.__version__}). This benchmark needs a GPU; it is not part of the tests or CI.")

    dev = setup().device
    peak = peak_flops(dev)
    res: dict = {"peak_tflops": peak / 1e12 if peak else None, "train": [], "decode": [], "errors": []}
    if peak is None:
        print(f"warning: no bf16 peak known for {torch.cuda.get_device_name(dev)} (pipeline/train/metrics.py "
              "PEAK_BF16_FLOPS): MFU not reported", file=sys.stderr)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)

    def attempt(kind: str, label: str, fn, *fn_args) -> None:
        t0 = time.perf_counter()
        try:
            row = fn(*fn_args)
        except Exception as e:  # one failing variant (e.g. out of memory) must not lose the others
            res["errors"].append(f"{label}: {type(e).__name__}: {e}")
            print(f"{label}: FAILED {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()
        else:
            res[kind].append(row)
            print(f"{label}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write_record(args.out, res, None, args)

    variants = [(preset, mt) for preset in args.presets
                for mt in args.max_tokens or micro_batch_sizes(preset_config(preset))]
    for preset, mt in variants:
        for precision in args.train_precisions:
            attempt("train", f"train {preset} {precision} eager max_tokens={mt}", bench_train, preset, mt,
                    precision, args)
        for lever in args.levers:  # each lever on its own, next to the bf16 eager row it changes
            attempt("train", f"train {preset} bf16 eager + {lever} max_tokens={mt}", bench_train, preset, mt,
                    "bf16", args, lever)
    if not args.no_decode:
        for precision in ("fp32", "bf16"):
            for search in ("dynamic", "static", "ctranslate2"):  # the same random model and sources: side by side
                attempt("decode", f"decode {args.decode_preset} {precision} {search}", bench_decode,
                        args.decode_preset, precision, search, args)
    res["train"].sort(key=lambda r: (args.presets.index(r["preset"]), r["max_tokens"], r["precision"], r["variant"]))
    res["against_paper"] = against_paper(res["train"])
    print(json.dumps(write_record(args.out, res, None, args)["against_paper"], indent=2))


if __name__ == "__main__":
    main()
