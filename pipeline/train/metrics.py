"""Metrics: one small sink interface, a JSONL file sink and a console sink; memory and FLOPs helpers.

Only rank 0 logs. Another backend (e.g. MLflow) plugs in by implementing :class:`MetricsSink`.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from pipeline.support.fsutil import write_text

log = logging.getLogger("aiayn.train")

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, from the vendors' data sheets (SXM parts).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


@runtime_checkable
class MetricsSink(Protocol):
    """Where the trainer sends run parameters (once) and metrics (per logged step)."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: ``{"params": {...}}`` once per (re)start, then
    ``{"step": s, "time": unix, **metrics}``.

    ``resume_step``: the step training (re)starts from. Rows of later steps, logged by an interrupted run before its
    last checkpoint was superseded, are dropped (as is a half-written last line), so each step appears once.
    """

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            self._truncate(resume_step)
        self._f = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues the same file

    def _truncate(self, resume_step: int) -> None:
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                dropped += 1
                continue
            if isinstance(row, dict) and row.get("step", 0) > resume_step:
                dropped += 1
            else:
                kept.append(line + "\n")
        if dropped:
            write_text(self.path, "".join(kept))
            log.info("%s: dropped %d row(s) past step %d, which this run trains again", self.path, dropped,
                     resume_step)

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"params": params})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "time": round(time.time(), 3), **metrics})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, sort_keys=True) + "\n")
        self._f.flush()  # a crash loses at most the line being written

    def close(self) -> None:
        self._f.close()


def _fmt(key: str, value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{key}={int(value)}"
    return f"{key}={value:.4g}"


class ConsoleSink:
    """A tqdm progress bar over the steps when stderr is a terminal, plain log lines otherwise."""

    def __init__(self, total_steps: int, start_step: int = 0):
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self._step = start_step

    def log_params(self, params: dict[str, Any]) -> None:
        keys = ("world_size", "accumulation_steps", "num_parameters", "device", "machine", "precision",
                "recipe_applied")
        log.info("training: %s", ", ".join(f"{k}={params[k]}" for k in keys if k in params))
        if "precision_reason" in params:
            log.info("precision %s: %s", params["precision"], params["precision_reason"])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._step)
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items() if k in ("loss", "ppl", "lr", "dev_ppl")})
        else:
            log.info("step %d: %s", step, " ".join(_fmt(k, v) for k, v in metrics.items()))
        self._step = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: ``torch.cuda.max_memory_allocated`` on GPU, the process's peak RSS on CPU (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s if it is in :data:`PEAK_BF16_FLOPS`, else None (MFU is skipped)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def matmul_roofline(shapes: Sequence[tuple[int, int, int]], dtype: torch.dtype,
                    seconds_per_shape: float = 0.3, min_repeats: int = 5) -> dict[str, float]:
    """FLOP/s of ``torch.mm`` of (m x k) by (k x n) in ``dtype`` on the CPU with this process's threads, per shape
    (``"MxKxN"``): the best of repeated calls after two warm-up calls, repeated for ``seconds_per_shape`` and at
    least ``min_repeats`` times. What a CPU's MFU is measured against where no datasheet applies (its matrix units
    run at very different speeds in fp32 and bf16, and per shape). A single timed call is no peak: the first calls
    build the kernel (oneDNN's primitive) and a busy moment at start-up slows one call."""
    out = {}
    for m, k, n in shapes:
        # Constant operands: the speed does not depend on the values, and the RNG streams of training stay untouched.
        a, b = torch.full((m, k), 0.5, dtype=dtype), torch.full((k, n), 0.25, dtype=dtype)
        torch.mm(a, b)
        torch.mm(a, b)
        best, spent, calls = math.inf, 0.0, 0
        while calls < min_repeats or spent < seconds_per_shape:
            t0 = time.perf_counter()
            torch.mm(a, b)
            took = time.perf_counter() - t0
            best, spent, calls = min(best, took), spent + took, calls + 1
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / best
    return out


def perplexity(nll_per_token: float) -> float:
    """exp(nll), capped so that an early, huge loss logs as a large number rather than inf."""
    return math.exp(min(nll_per_token, 50.0))
