"""The training loop: token-budget batches, gradient accumulation, DDP, checkpoints, dev loss and metrics.

Its parts: one update (:mod:`~pipeline.train.step`, its objective :mod:`~pipeline.train.objective`), when to
checkpoint and what (:mod:`~pipeline.train.checkpointing`), what each interval measures
(:mod:`~pipeline.train.metering`); this module runs them in order.

Data order. Each epoch's batches come from :func:`pipeline.shards.token_batches` with ``(train.seed, epoch)``,
the same list on every rank. One update consumes a *group* of ``accumulation * world_size`` consecutive
batches: rank ``r`` takes batches ``r, r + world, r + 2 world, ...`` of the group, one per micro-step. A
trailing part of an epoch too short for a whole group is skipped (the next epoch reshuffles), so every update
holds the same number of batches on every rank. The checkpoint records (epoch, batch position), which with
the seed fully determines the rest of the order. With sampled copies of the training split (BPE-dropout,
``tokenizer.sampling_alpha``), epoch ``e`` reads copy ``e mod copies``: another segmentation of the same pairs.

Normalisation: the update's loss is per target token over every micro-batch of every rank
(:class:`~pipeline.train.step.TrainStep`).

Dev loss is computed by all ranks, each on every world-th dev batch, and the sums are all-reduced.

Stopping. At ``max_steps`` updates or after ``max_minutes`` of wall clock, whichever comes first, both counted
over resumes (each checkpoint records the seconds trained up to it): a run that crashed and resumed trains as long
as one that did not, and raising either budget continues the run. A final checkpoint is always written.
Time-based decisions (``max_minutes``, ``checkpoint_every_minutes``, the clock of ``train.cooldown``, which lowers
the learning rate linearly to 0 over the budget's last fraction, and the budget schedule's warm-up fitted to the
updates the clock will buy, :mod:`pipeline.train.budget`) are taken by rank 0 and shared, so that all ranks act on
the same step.

Non-finite updates. An update whose loss or gradient is not finite (inf or nan: a diverging model, an overflowing
batch) is skipped whole: no weight, Adam or schedule change, its batches not trained on, the update count not
advanced. Every rank takes the same decision (the loss is summed over ranks, the norm is of the all-reduced
gradient). More than ``train.max_nonfinite_updates`` in a row stop the run with :class:`NonFiniteError` (exit
status 2), naming the update; no checkpoint of non-finite weights is ever written, so the newest one holds the last
finite weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from model import Transformer, TransformerLRLambda, cooldown_factor, transformer_lr
from pipeline.checkpoint import read_index
from pipeline.config import RunConfig, TrainConfig, dump_config, write_resolved
from pipeline.support.fsutil import exclusive, remove_stale_temps, write_json
from pipeline.support.hardware import machine_class
from pipeline.shards import ShardDataset

from .batches import Batch, TrainData, accumulation_steps, make_batch, usable_batches
from .budget import BudgetWarmup
from .checkpointing import Checkpointer, Progress
from .distributed import DistInfo, all_gather_object, all_reduce_sum, seed_everything, setup
from .errors import NonFiniteError, TrainConfigError, diverged
from .metering import DevInterval, IntervalMeter
from .metrics import ConsoleSink, JsonlSink, MetricsSink
from .resume import resume
from .step import TrainStep, Update, dev_loss

__all__ = ["Batch", "NonFiniteError", "TrainConfigError", "TrainStep", "Update", "accumulation_steps", "dev_loss",
           "make_batch", "preflight", "train", "usable_batches"]

log = logging.getLogger("aiayn.train")


def preflight(cfg: RunConfig, train_ds: ShardDataset, world_size: int) -> None:
    """Refuse, before training starts, a config that these shards or this many processes cannot honour."""
    t, where = cfg.train, train_ds.dir
    vocab = train_ds.manifest["tokenizer"]["vocab_size"]
    if vocab != cfg.tokenizer.vocab_size:
        raise TrainConfigError(f"tokenizer.vocab_size={cfg.tokenizer.vocab_size} but the shards in {where} were "
                               f"encoded with a {vocab}-piece tokenizer: use the shards this config builds (omit "
                               f"--shards) or set tokenizer.vocab_size={vocab}")
    longest = int(train_ds.sizes.max(initial=0))  # max(src, tgt) + 1 tokens of the longest pair
    micro = t.micro_batch_tokens(world_size)
    for field, limit in (("train.max_tokens", micro), ("train.update_tokens", t.update_tokens),
                         ("model.max_positions", cfg.model.max_positions)):
        if longest > limit:
            raise TrainConfigError(f"the longest training pair in {where} needs {longest} tokens but {field}="
                                   f"{limit}: raise {field} to at least {longest}, or drop long pairs in the data "
                                   "stage (data.cleaning.max_words)")
    # Adam's first steps are up to 1 / (1 - beta1) times the rate: beyond float32's range they fail inside Adam
    peak = transformer_lr(t.warmup_steps, cfg.model.d_model, t.warmup_steps, t.lr_scale)
    if peak / (1 - t.adam_beta1) > torch.finfo(torch.float32).max:
        raise TrainConfigError(f"train.lr_scale={t.lr_scale:g} makes the peak learning rate {peak:.3g} (at step "
                               f"train.warmup_steps={t.warmup_steps}), beyond what float32 weights can take: set "
                               "a lower train.lr_scale (1 = the paper's rate)")
    if t.update_tokens < micro * world_size:
        raise TrainConfigError(f"train.update_tokens={t.update_tokens} cannot be split over {world_size} processes "
                               f"of train.max_tokens={micro} each (one update needs at least "
                               f"{micro * world_size}): set train.max_tokens to at most "
                               f"{t.update_tokens // world_size} (or to update), or raise train.update_tokens")


def train(cfg: RunConfig, shard_dir: Path, out_dir: Path, sinks: Sequence[MetricsSink] = (),
          info: DistInfo | None = None, init_checkpoint: Path | None = None, lock: bool = True) -> Path:
    """Train ``cfg.model`` on the shards in ``shard_dir``; outputs (checkpoints, metrics, summary) in ``out_dir``.

    Resumes from the newest intact checkpoint in ``out_dir/checkpoints`` when there is one. Otherwise, with
    ``init_checkpoint`` (``train.init_from``), the model starts from that checkpoint's weights (same model config
    and tokenizer, else :class:`CheckpointError`); optimizer, schedule and step count start fresh.

    Runs in one process, or in every process of a torchrun job (the process group is joined here if the caller
    has not). Rank 0 holds ``out_dir``'s lock for the whole run, whoever started it (CLI, torchrun, the flow): a
    second run of the same folder logs that it waits, then resumes where the first stopped, instead of training
    beside it; its other ranks wait at the first collective. ``lock=False``: the launcher holds that lock for the
    job (the pipeline's training stage does, for every node). Temporary files left by a killed run are removed
    first. ``sinks`` receive metrics in addition to the JSONL file and the console (rank 0 only). Returns
    ``out_dir``.
    """
    info = info or setup()
    out_dir = Path(out_dir).resolve()
    started = time.monotonic()
    # Rank 0 hashes every shard file; the others check sizes only (same files, no need to read them N times).
    # Checked before the lock: a refused config leaves no run folder behind.
    train_ds = ShardDataset(shard_dir, "train", verify=info.is_main)
    preflight(cfg, train_ds, info.world_size)
    if not info.is_main:
        return _train(cfg, train_ds, shard_dir, out_dir, sinks, info, init_checkpoint, started)
    with exclusive(out_dir, "run folder") if lock else contextlib.nullcontext():
        for folder in (out_dir, out_dir / "checkpoints"):
            remove_stale_temps(folder)
        return _train(cfg, train_ds, shard_dir, out_dir, sinks, info, init_checkpoint, started)


def _train(cfg: RunConfig, train_ds: ShardDataset, shard_dir: Path, out_dir: Path, sinks: Sequence[MetricsSink],
           info: DistInfo, init_checkpoint: Path | None, started: float) -> Path:
    t = cfg.train
    ckpt_dir = out_dir / "checkpoints"
    data = TrainData(cfg, train_ds, shard_dir, info)
    pad = train_ds.special.pad

    seed_everything(t.seed)  # identical initial weights on every rank
    model = Transformer(cfg.model.architecture(train_ds.manifest["tokenizer"]["vocab_size"], pad)).to(info.device)
    step_fn = TrainStep(model, cfg, info, pad)
    seed_everything(t.seed + info.rank)  # distinct dropout streams per rank

    start = resume(ckpt_dir, model, step_fn.optimizer, step_fn.scheduler, t.seed, data.shards["fingerprint"],
                   data.tokenizer_sha256, info, init_checkpoint)
    step_fn.refresh_work()  # the weights resumed or initialised from
    run = Progress(step=start.step, epoch=start.epoch, batch_pos=start.batch_pos,
                   totals=torch.tensor(start.totals, dtype=torch.float64, device=info.device),  # [3]
                   skipped=start.skipped_updates, dev=start.dev)

    def trained_seconds() -> float:
        """Wall-clock seconds trained so far, over resumes (also the resource a sweep prunes on)."""
        return start.train_seconds + time.monotonic() - started

    in_a_row = 0  # updates skipped as non-finite lately, in a row
    meter = IntervalMeter(cfg, info, step_fn, train_ds.manifest["tokenizer"]["vocab_size"])
    machine = machine_class(info.device)  # the log's, the params' and the summary's
    all_sinks = _open_sinks(cfg, out_dir, sinks, step_fn, meter, data, machine, run.step)

    def log_metrics(metrics: dict[str, float]) -> None:
        for s in all_sinks:
            s.log_metrics(metrics, run.step)

    dev = DevInterval(cfg, step_fn, data.dev, data.dev_batches, log_metrics, trained_seconds, start.dev, run.step)
    epoch_ds, batches = data.epoch(run.epoch)
    accum, group = data.accum, data.group
    budget_s = t.max_minutes * 60 if t.max_minutes is not None else math.inf
    schedule = step_fn.scheduler.lr_lambdas[0]  # the warm-up a budgeted run fitted comes back with a resume
    warmup = (BudgetWarmup(schedule, t.max_steps, budget_s, t.budget_warmup, fit_steps=t.schedule == "budget")
              if t.budget_schedule else None)
    out_of_time = run.step < t.max_steps and start.train_seconds >= budget_s  # resumed with its time already spent
    shared_seconds = start.train_seconds  # rank 0's training seconds as of the last decision (the cooldown's clock)
    stopped_by = "max_minutes" if out_of_time else "max_steps"
    records = {"shards": data.shards, "tokenizer_sha256": data.tokenizer_sha256, "init_checkpoint": start.init}
    ckpts = Checkpointer(ckpt_dir, cfg, step_fn, info, records, trained_seconds, run.step if start.resumed else -1)
    meter.reset()

    while run.step < t.max_steps and not out_of_time:
        if run.batch_pos + group > len(batches):
            run.epoch, run.batch_pos = run.epoch + 1, 0
            epoch_ds, batches = data.epoch(run.epoch)
        micro = [make_batch(epoch_ds, batches[run.batch_pos + k * info.world_size + info.rank], info.device)
                 for k in range(accum)]
        sums, counts = step_fn.accumulate(micro)
        run.batch_pos += group  # used up even when the update is skipped: its batches are not tried again
        progress = max(run.step / t.max_steps, shared_seconds / budget_s)  # through the budget, before this update
        update = step_fn.apply(sums, counts, lr_factor=cooldown_factor(progress, t.cooldown))
        if not update.applied:
            run.skipped, in_a_row = run.skipped + 1, in_a_row + 1
            _skipped(update, run, in_a_row, t.max_nonfinite_updates, info, log_metrics, ckpt_dir)
            continue
        run.step, in_a_row = run.step + 1, 0
        meter.add(sums, counts)
        run.totals += counts

        if run.step % t.log_every_steps == 0:
            metrics = meter.metrics(update, run.skipped, run.epoch, run.totals[0].item())
            if warmup is not None:
                metrics |= warmup.at_log(run.step, shared_seconds, step_fn.optimizer, step_fn.scheduler.last_epoch)
            log_metrics(metrics)
            meter.reset()

        with meter.paused():  # dev loss and checkpoints are not training time
            dev.maybe(run.step)
            # Time-based decisions are rank 0's, shared with all ranks so that they act on the same step.
            shared_seconds, clock_due = _rank0_decides([trained_seconds(), ckpts.clock_due()], info)
            out_of_time = shared_seconds >= budget_s
            if ckpts.due(run.step, clock_due):
                ckpts.save(run)
        if out_of_time:
            stopped_by = "max_minutes"

    if ckpts.saved_step != run.step:
        ckpts.save(run)
    dev.final(run.step)
    # Every rank's step and parameter digest: DDP replicas must agree; a mismatch shows up in the summary.
    ranks = all_gather_object({"rank": info.rank, "step": run.step, "params_sha256": _params_digest(model)}, info)
    if info.is_main:
        tgt, src, sents = (int(n) for n in run.totals.tolist())
        summary = {"steps": run.step, "epoch": run.epoch, "stopped_by": stopped_by, "world_size": info.world_size,
                   "accumulation_steps": accum, "machine": machine, "precision": step_fn.precision,
                   "recipe": cfg.recipe_applied, "tokens": {"src": src, "tgt": tgt, "sentences": sents},
                   "final_dev": dev.last, "ranks": ranks, "checkpoints": read_index(ckpt_dir),
                   "init_checkpoint": start.init, "wall_seconds": round(time.monotonic() - started, 3),
                   "train_seconds": round(trained_seconds(), 3), "out_dir": str(out_dir),
                   "schedule": warmup.summary() if warmup else _paper_schedule(t, schedule)}
        write_json(out_dir / "train_summary.json", summary)
        log.info("training stopped (%s) at step %d; outputs in %s", stopped_by, run.step, out_dir)
        for s in all_sinks:
            s.close()
    return out_dir


def _open_sinks(cfg: RunConfig, out_dir: Path, sinks: Sequence[MetricsSink], step_fn: TrainStep,
                meter: IntervalMeter, data: TrainData, machine: str, step: int) -> list[MetricsSink]:
    """Rank 0's sinks (the JSONL file, the console, ``sinks``), the run's config recorded and its params logged;
    none on the other ranks."""
    if not step_fn.info.is_main:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    # The run's record of its config; the pipeline's launcher already wrote it there (the file every rank read).
    record = out_dir / "config.yaml"
    if not (record.is_file() and record.read_text(encoding="utf-8") == dump_config(cfg)):
        write_resolved(cfg, record)
    # Rows past the step resumed from were logged by the interrupted run and are now trained again.
    all_sinks = [JsonlSink(out_dir / "metrics.jsonl", resume_step=step), ConsoleSink(cfg.train.max_steps, step),
                 *sinks]
    params = {**_flat(cfg.model_dump(mode="json")), "world_size": step_fn.info.world_size,
              "accumulation_steps": data.accum, "num_parameters": step_fn.model.num_parameters(),
              "device": str(step_fn.info.device), "machine": machine, "precision": step_fn.precision,
              "precision_reason": step_fn.precision_reason, "recipe_applied": cfg.recipe_applied,
              "shards_fingerprint": data.shards["fingerprint"], **meter.params()}
    for s in all_sinks:
        s.log_params(params)
    return all_sinks


def _paper_schedule(t: TrainConfig, schedule: TransformerLRLambda) -> dict:
    """The summary of a run that trained on the paper's schedule (no budget schedule)."""
    return {"kind": "paper", "warmup_steps": t.warmup_steps, "predicted_updates": None,
            "peak_lr": schedule.rate(t.warmup_steps), "decay_from": t.warmup_steps}


def _skipped(update: Update, run: Progress, in_a_row: int, limit: int, info: DistInfo,
             log_metrics: Callable[[dict], None], ckpt_dir: Path) -> None:
    """A non-finite update skipped: logged, or the run stopped when more than ``limit`` came in a row."""
    what = f"update {run.step + 1} (loss {update.loss:.4g}, gradient norm {update.grad_norm:.4g})"
    if in_a_row > limit:
        log_metrics({"skipped_updates": run.skipped})
        raise diverged(f"training stopped at {what}: non-finite updates in a row: {in_a_row}, more than "
                       f"train.max_nonfinite_updates={limit} allows (a skipped update is tried again on new batches)",
                       ckpt_dir)
    if info.is_main:
        log.warning("%s: not finite, so skipped (weights, Adam and the learning-rate schedule unchanged; its batches "
                    "are not trained on); %d in a row, train.max_nonfinite_updates=%d", what, in_a_row, limit)


def _rank0_decides(values: list[float], info: DistInfo) -> list[float]:
    """Rank 0's ``values`` (numbers and flags) on every rank (one tiny all-reduce; no collective, no device sync in
    one process)."""
    if not info.distributed:
        return values
    t = torch.tensor([float(v) if info.is_main else 0.0 for v in values], dtype=torch.float64, device=info.device)
    return all_reduce_sum(t, info).tolist()


def _params_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes, in state-dict order."""
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out
