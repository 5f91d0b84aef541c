"""What a training run measures at intervals: the log interval's loss, throughput and MFU (:class:`IntervalMeter`),
and the dev loss every ``train.dev_every_steps`` updates (:class:`DevInterval`).

Throughput counts training time only: the seconds spent on dev loss and checkpoints inside an interval
(:meth:`IntervalMeter.paused`) are left out. MFU is the model's FLOPs per token (times the objective's passes per
batch) over the peak of this process's device: a GPU's datasheet figure, or on a CPU the best matrix product
measured at the model's own shapes (:func:`flops_peak`), beside the CPU's nominal peak where its class is known.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator

import numpy as np
import torch

from pipeline.config import RunConfig
from pipeline.support.hardware import nominal_cpu_peak
from pipeline.shards import ShardDataset

from .distributed import DistInfo, all_reduce_sum
from .metrics import matmul_roofline, peak_flops, peak_memory_mb, perplexity
from .step import TrainStep, Update, dev_loss

log = logging.getLogger("aiayn.train")


def flops_peak(cfg: RunConfig, info: DistInfo, bf16: bool, vocab: int) -> tuple[float | None, str | None]:
    """The peak FLOP/s that MFU is logged against, per process, and where it comes from: a GPU's dense bf16
    datasheet figure; on a CPU, the best ``torch.mm`` measured here (:func:`matmul_roofline`, repeated) at the
    model's own product shapes (a micro-batch's tokens through the feed-forward layers and the output projection) in
    the training precision, with this process's threads (the other ranks of the node wait meanwhile)."""
    if info.device.type == "cuda":
        peak = peak_flops(info.device)
        return peak, f"datasheet dense bf16, {torch.cuda.get_device_name(info.device)}" if peak else None
    m, d, d_ff = cfg.train.micro_batch_tokens(info.world_size), cfg.model.d_model, cfg.model.d_ff
    dtype = torch.bfloat16 if bf16 else torch.float32
    roof = matmul_roofline([(m, d, d_ff), (m, d_ff, d), (m, d, vocab)], dtype)
    shape = max(roof, key=roof.get)
    return roof[shape], (f"measured torch.mm {shape} {str(dtype).removeprefix('torch.')} (best of "
                         f"{', '.join(roof)}), {torch.get_num_threads()} threads")


class IntervalMeter:
    """The sums of the updates since the last log row, and the row they make (:meth:`metrics`).

    The peaks MFU is measured against are taken once, at construction, on rank 0 (the only one that logs)."""

    def __init__(self, cfg: RunConfig, info: DistInfo, step_fn: TrainStep, vocab: int):
        self.info, self.model, self.passes = info, step_fn.model, step_fn.objective.passes
        self.peak, self.peak_source = flops_peak(cfg, info, step_fn.bf16, vocab) if info.is_main else (None, None)
        self.nominal, self.nominal_source = (nominal_cpu_peak(step_fn.precision, torch.get_num_threads())
                                             if info.is_main and info.device.type == "cpu" else (None, None))
        self.sums = torch.zeros(2, dtype=torch.float64, device=info.device)  # loss, nll (this rank)
        self.counts = torch.zeros(3, dtype=torch.float64, device=info.device)  # global tgt, src, sentences
        self.steps = 0
        self.reset()

    def params(self) -> dict:
        """The peaks, for the run's parameters."""
        return {"mfu_peak_tflops": self.peak / 1e12 if self.peak else None, "mfu_peak_source": self.peak_source,
                "mfu_nominal_peak_tflops": self.nominal / 1e12 if self.nominal else None,
                "mfu_nominal_peak_source": self.nominal_source}

    def reset(self) -> None:
        """Start the next interval (after its row is logged: the sinks' time is no training either)."""
        self.sums.zero_()
        self.counts.zero_()
        self.steps, self.paused_s, self.start = 0, 0.0, time.monotonic()

    def add(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """One update made: :meth:`TrainStep.accumulate`'s sums and counts."""
        self.steps += 1
        self.sums += sums
        self.counts += counts

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is not training (dev loss, checkpoints)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.paused_s += time.monotonic() - started

    def metrics(self, update: Update, skipped: int, epoch: int, tgt_tokens: float) -> dict[str, float]:
        """The interval's row, ending at ``update`` (every rank calls it: the loss sums are all-reduced)."""
        info = self.info
        loss, nll = all_reduce_sum(self.sums, info).tolist()
        n_tgt, n_src, n_sent = self.counts.tolist()
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        seconds = max(time.monotonic() - self.start - self.paused_s, 1e-9)
        metrics = {"loss": loss / n_tgt, "nll": nll / n_tgt, "ppl": perplexity(nll / n_tgt), "lr": update.lr,
                   "grad_norm": update.grad_norm, "skipped_updates": skipped, "src_tokens_per_s": n_src / seconds,
                   "tgt_tokens_per_s": n_tgt / seconds,
                   "step_time_s": seconds / self.steps, "peak_memory_mb": peak_memory_mb(info.device),
                   "epoch": epoch, "tgt_tokens": tgt_tokens}
        if self.peak:
            achieved = (self.model.flops_per_token(n_src / n_sent, n_tgt / n_sent) * n_tgt * self.passes / seconds
                        / info.world_size)
            if achieved > self.peak:  # the start-up measurement was no peak: never report MFU above 1
                log.warning("achieved %.3g FLOP/s per process, above the measured peak %.3g (%s): the peak is "
                            "raised to it", achieved, self.peak, self.peak_source)
                self.peak = achieved
            metrics |= {"mfu": achieved / self.peak, "mfu_peak_tflops": self.peak / 1e12}
            if self.nominal:
                metrics["mfu_nominal"] = achieved / self.nominal
        return metrics


class DevInterval:
    """Dev loss every ``train.dev_every_steps`` updates (:meth:`maybe`) and at the run's end (:meth:`final`),
    logged with the seconds trained; :attr:`last` is the latest (what checkpoints and the summary record).
    ``last``: the dev loss the run resumed with, measured at ``step``."""

    def __init__(self, cfg: RunConfig, step_fn: TrainStep, ds: ShardDataset, batches: list[np.ndarray],
                 log_metrics: Callable[[dict], None], trained_seconds: Callable[[], float], last: dict | None,
                 step: int):
        self.every, self.step_fn, self.ds, self.batches = cfg.train.dev_every_steps, step_fn, ds, batches
        self.log_metrics, self.trained_seconds = log_metrics, trained_seconds
        self.last, self.step = last, step if last else -1

    def measure(self, step: int) -> None:
        self.last, self.step = dev_loss(self.step_fn, self.ds, self.batches), step
        self.log_metrics({**self.last, "train_seconds": self.trained_seconds()})

    def maybe(self, step: int) -> None:
        """After update ``step``: the dev loss, when its interval is due."""
        if step % self.every == 0:
            self.measure(step)

    def final(self, step: int) -> None:
        """At the run's end: the dev loss of the last weights, unless already measured."""
        if self.step != step:
            self.measure(step)
