"""The training loop: token-budget batches, gradient accumulation, DDP, checkpoints, dev loss and metrics.

Data order. Each epoch's batches come from :func:`pipeline.shards.token_batches` with ``(train.seed, epoch)``,
the same list on every rank. One update consumes a *group* of ``accumulation * world_size`` consecutive
batches: rank ``r`` takes batches ``r, r + world, r + 2 world, ...`` of the group, one per micro-step. A
trailing part of an epoch too short for a whole group is skipped (the next epoch reshuffles), so every update
holds the same number of batches on every rank. The checkpoint records (epoch, batch position), which with
the seed fully determines the rest of the order. With sampled copies of the training split (BPE-dropout,
``tokenizer.sampling_alpha``), epoch ``e`` reads copy ``e mod copies``: another segmentation of the same pairs.

Normalisation. The loss of an update is the sum of per-token losses over every micro-batch of every rank,
divided by the total number of target tokens of the update (all-reduced before the forward passes). DDP
averages gradients over ranks, so each rank back-propagates ``loss_sum * world / total``.

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
import copy
import hashlib
import logging
import math
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from model import (LabelSmoothedCrossEntropy, Transformer, cooldown_factor, symmetric_kl, transformer_lr,
                   transformer_lr_scheduler)
from pipeline.checkpoint import read_index, save_checkpoint
from pipeline.config import RunConfig, dump_config, write_resolved
from pipeline.errors import UserError
from pipeline.fsutil import MANIFEST, exclusive, remove_stale_temps, sha256_file, write_json
from pipeline.hardware import machine_class, nominal_cpu_peak, training_precision
from pipeline.shards import ShardDataset, token_batches, train_splits

from .budget import BudgetWarmup
from .distributed import DistInfo, all_gather_object, all_reduce_sum, rng_state, seed_everything, setup
from .metrics import ConsoleSink, JsonlSink, MetricsSink, matmul_roofline, peak_flops, peak_memory_mb, perplexity
from .optim import build_optimizer
from .resume import resume

log = logging.getLogger("aiayn.train")


class Batch(NamedTuple):
    """One padded micro-batch on the device, with its real (non-padding) token counts."""

    src: Tensor  # int64 [B, S]: source ids + eos
    tgt_in: Tensor  # int64 [B, T]: bos + target ids (decoder input)
    tgt_out: Tensor  # int64 [B, T]: target ids + eos (what each position predicts)
    n_src: int
    n_tgt: int


def make_batch(ds: ShardDataset, indices: np.ndarray, device: torch.device) -> Batch:
    """Collate examples ``indices`` for teacher forcing: ``tgt_in[:, t]`` is the token before ``tgt_out[:, t]``."""
    src = ds.collate(indices, "src", eos=True)  # [B, S]
    tgt_in = ds.collate(indices, "tgt", bos=True)  # [B, T]: bos y1 .. yn pad..
    tgt_out = ds.collate(indices, "tgt", eos=True)  # [B, T]: y1 .. yn eos pad..
    n = len(indices)
    return Batch(torch.from_numpy(src).to(device, non_blocking=True),
                 torch.from_numpy(tgt_in).to(device, non_blocking=True),
                 torch.from_numpy(tgt_out).to(device, non_blocking=True),
                 int(ds.src_len[indices].sum()) + n, int(ds.tgt_len[indices].sum()) + n)


def usable_batches(ds: ShardDataset, max_tokens: int, max_positions: int, seed: int, epoch: int,
                   limit: int | None = None) -> list[np.ndarray]:
    """Token-budget batches of the examples (the first ``limit``, if given) that fit both ``max_tokens`` and the
    model's ``max_positions``."""
    sizes = ds.sizes[:limit]  # [N]: max(src, tgt) + 1
    keep = np.flatnonzero(sizes <= min(max_tokens, max_positions))  # [K]
    return [keep[b] for b in token_batches(sizes[keep], max_tokens, seed, epoch)]


def accumulation_steps(update_tokens: int, max_tokens: int, world_size: int) -> int:
    """Micro-batches per rank per update so that one update holds about ``update_tokens`` target tokens."""
    return max(1, round(update_tokens / (max_tokens * world_size)))


class Update(NamedTuple):
    """What :meth:`TrainStep.apply` did with one update's gradient."""

    applied: bool  # False: the loss or the gradient was not finite, and nothing changed
    loss: float  # per target token, over every rank's batches (label smoothing included)
    grad_norm: float  # the gradient's global norm, before clipping
    lr: float  # the learning rate Adam stepped at (would have, when not applied)


class TrainStep:
    """One optimizer update over a rank's micro-batches: model (DDP-wrapped when world > 1), Adam, schedule.

    Precision. fp32: the model as it is. bf16 (``train.bf16_copy``; the copy unless it is ``off``): forward and
    backward run a bf16 copy of the model (``work``), and Adam updates the fp32 weights
    (``model``, what checkpoints hold), which are copied into the bf16 copy after every update; each micro-batch's
    bf16 gradients are added to fp32 gradients of ``model`` (under DDP, once per update, after the all-reduce).
    Autocast instead casts every weight at every use and every activation around each product: the bf16 copy was
    faster at the same training loss on a CPU (base and tiny, results ledger L04) and on an H100 (base and big, the
    casts were the largest share of the step's kernel time: L28).
    """

    def __init__(self, model: Transformer, cfg: RunConfig, info: DistInfo, pad_id: int):
        t = cfg.train
        self.model, self.info = model, info
        self.precision, self.precision_reason = training_precision(t.precision, info.device)
        self.bf16 = self.precision == "bf16"
        self.master_weights = self.bf16 and t.bf16_copy != "off"
        # The module forward and backward run: a bf16 copy (shared embeddings stay shared) or the model itself.
        self.work = copy.deepcopy(model).to(torch.bfloat16) if self.master_weights else model
        self.ddp = (DistributedDataParallel(self.work,
                                            device_ids=[info.device] if info.device.type == "cuda" else None)
                    if info.distributed else None)
        self.net = self.ddp if self.ddp is not None else self.work
        self.criterion = LabelSmoothedCrossEntropy(t.label_smoothing, pad_id)
        self.rdrop_alpha = t.rdrop_alpha
        self.passes = 2 if t.rdrop_alpha > 0 else 1  # R-Drop: each batch twice, under independent dropout
        self.fused_loss = t.fused_output_loss  # the config refuses it with R-Drop
        self.optimizer = build_optimizer(model, t)
        self.scheduler = transformer_lr_scheduler(self.optimizer, cfg.model.d_model, t.warmup_steps, t.lr_scale)
        self.clip_norm = t.clip_norm

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast where training runs that way (CUDA); a no-op otherwise."""
        return torch.autocast(self.info.device.type, dtype=torch.bfloat16,
                              enabled=self.bf16 and not self.master_weights)

    def refresh_work(self) -> None:
        """Copy ``model``'s weights into the bf16 working copy (after an update, or after loading weights)."""
        if self.master_weights:
            with torch.no_grad():
                torch._foreach_copy_(list(self.work.parameters()), list(self.model.parameters()))

    def _gradients_to_master(self) -> None:
        # bf16 gradients of the working copy, cast into (first micro-batch) or added to the fp32 gradients of the
        # model, then cleared. Grouped (foreach) kernels rather than a cast or an add per parameter: with the copy,
        # ~200 one-parameter copy kernels per update were what remained of the casts on a GPU (results ledger L28).
        cast: tuple[list[Tensor], list[Tensor]] = ([], [])
        add: tuple[list[Tensor], list[Tensor]] = ([], [])
        for p, w in zip(self.model.parameters(), self.work.parameters()):
            if w.grad is not None:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                    into = cast
                else:
                    into = add
                into[0].append(p.grad)
                into[1].append(w.grad)
                w.grad = None
        if cast[0]:
            torch._foreach_copy_(*cast)
        if add[0]:
            torch._foreach_add_(*add)

    def _each_pass(self, rows: Tensor) -> Tensor:
        # [B, L] -> [passes * B, L]: R-Drop's copies of the batch; the batch itself (no copy) for one pass
        return rows.repeat(self.passes, 1) if self.passes > 1 else rows

    def accumulate(self, batches: Sequence[Batch]) -> tuple[Tensor, Tensor]:
        """Forward and backward over ``batches``, leaving the update's gradient in ``.grad``.

        Returns (local sums float64 [2]: loss, nll; global counts float64 [3]: target tokens, source tokens,
        sentences of the whole update over all ranks). Gradients equal those of
        ``sum(loss over every rank's batches) / total target tokens``. With R-Drop (``train.rdrop_alpha``) a
        batch's loss is ``(loss(pass 1) + loss(pass 2) + alpha * symmetric KL) / 2`` and the sums returned are the
        two passes' means, comparable with a one-pass run's.
        """
        dev = self.info.device
        counts = torch.tensor([sum(b.n_tgt for b in batches), sum(b.n_src for b in batches),
                               sum(len(b.src) for b in batches)], dtype=torch.float64, device=dev)
        all_reduce_sum(counts, self.info)  # [3]
        scale = self.info.world_size / counts[0]  # DDP averages gradients over ranks: undo that, divide by tokens
        sums = torch.zeros(2, dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            # Gradients are all-reduced only on the last micro-batch; the earlier ones accumulate locally.
            sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
            with sync:
                if self.fused_loss:  # the logits are formed chunk by chunk inside the loss (model.loss)
                    with self.autocast():
                        hidden = self.net(b.src, b.tgt_in, project=False)  # [B, T, d_model]
                    loss, nll, _ = self.criterion.projected(hidden, self.work.output_projection.weight, b.tgt_out)
                else:
                    with self.autocast():
                        logits = self.net(self._each_pass(b.src), self._each_pass(b.tgt_in))  # [pB, T, V]
                    # one pass: nothing reads the logits after the loss, whose backward may overwrite them
                    loss, nll, _ = self.criterion(logits, self._each_pass(b.tgt_out), overwrite_logits=self.passes == 1)
                objective = loss
                if self.passes == 2:
                    rows = len(b.src)  # slices, not chunk(): autograd refuses saved views of a multi-view op
                    objective = objective + self.rdrop_alpha * symmetric_kl(logits[:rows], logits[rows:], b.tgt_out,
                                                                            self.criterion.ignore_index)
                (objective * (scale / self.passes)).backward()
            if self.master_weights and (self.ddp is None or last):
                self._gradients_to_master()
            sums += torch.stack([loss.detach(), nll.detach()]).double() / self.passes
        return sums, counts

    def apply(self, sums: Tensor, counts: Tensor, lr_factor: float = 1.0) -> Update:
        """Clip (if configured), step Adam at the schedule's rate times ``lr_factor`` (the budget cooldown), step
        the schedule, clear gradients; ``sums`` and ``counts`` are what :meth:`accumulate` returned.

        When the update's loss or gradient norm is not finite, only the gradients are cleared (``applied`` False):
        every rank decides alike, on the loss summed over ranks and the norm of the all-reduced gradient.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        # One sum over ranks: the update's loss, and a verdict every rank shares (a non-finite value anywhere makes
        # the sum non-finite everywhere). Each rank holds the same all-reduced gradient, so norms / world is its norm.
        # It waits for the device once per update: the verdict must precede the optimizer step.
        loss_sum, norms = all_reduce_sum(torch.stack([sums[0], norm.double()]), self.info).tolist()
        loss, grad_norm = loss_sum / counts[0].item(), norms / self.info.world_size
        lr = self.optimizer.param_groups[0]["lr"] * lr_factor
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # No Adam step (its moments and step count stay) and no schedule step either: the paper's rate is a
            # function of the update count, and an update not made must not move warm-up and decay along.
            self.optimizer.zero_grad(set_to_none=True)
            return Update(False, loss, grad_norm, lr)
        if self.clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.clip_norm, norm, foreach=True)
        for group in self.optimizer.param_groups:  # LambdaLR sets each step's rate afresh: the factor never compounds
            group["lr"] *= lr_factor
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.refresh_work()
        return Update(True, loss, grad_norm, lr)


@torch.no_grad()
def dev_loss(step_fn: TrainStep, ds: ShardDataset, batches: list[np.ndarray]) -> dict[str, float]:
    """Label-smoothed loss, nll and perplexity per target token on ``batches``, and nll per sentence
    (``dev_sentence_nll``: the negative log-likelihood of a whole reference sentence, which does not depend on how
    the tokenizer cuts it, so runs with different vocabularies compare on it); every rank takes a share."""
    info, model = step_fn.info, step_fn.work  # in the training precision
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=info.device)  # loss, nll, tokens, sentences
    for idx in batches[info.rank :: info.world_size]:
        b = make_batch(ds, idx, info.device)
        with step_fn.autocast():
            logits = model(b.src, b.tgt_in)  # [B, T, V]
        sums[:3] += torch.stack(step_fn.criterion(logits, b.tgt_out)).double()
        sums[3] += b.tgt_out.shape[0]
    model.train()
    loss, nll, n, sentences = all_reduce_sum(sums, info).tolist()
    n = max(n, 1.0)
    return {"dev_loss": loss / n, "dev_nll": nll / n, "dev_ppl": perplexity(nll / n),
            "dev_sentence_nll": nll / max(sentences, 1.0)}


def _rank0_decides(values: list[float], info: DistInfo) -> list[float]:
    """Rank 0's ``values`` (numbers and flags) on every rank (one tiny all-reduce; no collective, no device sync in
    one process)."""
    if not info.distributed:
        return values
    t = torch.tensor([float(v) if info.is_main else 0.0 for v in values], dtype=torch.float64, device=info.device)
    return all_reduce_sum(t, info).tolist()


def _flops_peak(cfg: RunConfig, info: DistInfo, bf16: bool, vocab: int) -> tuple[float | None, str | None]:
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


class TrainConfigError(UserError, ValueError):
    """A config that cannot train on these shards; raised before any training step, saying what to change."""


class NonFiniteError(UserError, FloatingPointError):
    """Training diverged: its loss or weights are no longer finite; the message names the update, the newest
    (finite) checkpoint and what to try."""


def _diverged(what: str, ckpt_dir: Path) -> NonFiniteError:
    """:class:`NonFiniteError` saying ``what`` happened, which checkpoint holds the last finite weights and what to
    try instead."""
    entries = read_index(ckpt_dir)
    kept = (f"the newest checkpoint, {ckpt_dir / entries[-1]['file']} (step {entries[-1]['step']}), holds the last "
            "finite weights" if entries else "no checkpoint was written")
    return NonFiniteError(f"{what}; {kept}. Try a lower learning rate (train.lr_scale) or a longer warm-up "
                          "(train.warmup_steps), gradient clipping (train.clip_norm, e.g. 1.0), or check the training "
                          "data for broken pairs")


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
    dev_ds = ShardDataset(shard_dir, "dev", verify=info.is_main)
    splits = train_splits(train_ds.manifest)
    epoch_sets = [train_ds] if splits == ["train"] else [ShardDataset(shard_dir, k, verify=info.is_main)
                                                           for k in splits]
    shards = {"fingerprint": train_ds.manifest["fingerprint"],
              "manifest_sha256": sha256_file(Path(shard_dir) / MANIFEST)}
    tokenizer_sha256 = train_ds.manifest["tokenizer"]["sha256"]
    pad = train_ds.special.pad

    seed_everything(t.seed)  # identical initial weights on every rank
    model = Transformer(cfg.model.architecture(train_ds.manifest["tokenizer"]["vocab_size"], pad)).to(info.device)
    step_fn = TrainStep(model, cfg, info, pad)
    seed_everything(t.seed + info.rank)  # distinct dropout streams per rank

    start = resume(ckpt_dir, model, step_fn.optimizer, step_fn.scheduler, t.seed, shards["fingerprint"],
                   tokenizer_sha256, info, init_checkpoint)
    step_fn.refresh_work()  # the weights resumed or initialised from
    step, epoch, batch_pos, last_dev, init = start.step, start.epoch, start.batch_pos, start.dev, start.init

    def trained_seconds() -> float:
        """Wall-clock seconds trained so far, over resumes (also the resource a sweep prunes on)."""
        return start.train_seconds + time.monotonic() - started

    totals = torch.tensor(start.totals, dtype=torch.float64, device=info.device)  # [3]: tgt, src tokens, sentences
    skipped, in_a_row = start.skipped_updates, 0  # updates skipped as non-finite: over resumes, and lately in a row
    micro_tokens = t.micro_batch_tokens(info.world_size)  # train.max_tokens for this many processes
    accum = accumulation_steps(t.update_tokens, micro_tokens, info.world_size)
    group = accum * info.world_size

    vocab = train_ds.manifest["tokenizer"]["vocab_size"]
    flops_peak, peak_source = _flops_peak(cfg, info, step_fn.bf16, vocab) if info.is_main else (None, None)
    machine = machine_class(info.device)  # the log's, the params' and the summary's
    nominal, nominal_source = (nominal_cpu_peak(step_fn.precision, torch.get_num_threads())
                               if info.is_main and info.device.type == "cpu" else (None, None))
    all_sinks: list[MetricsSink] = []
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        # The run's record of its config; the pipeline's launcher already wrote it there (the file every rank read).
        record = out_dir / "config.yaml"
        if not (record.is_file() and record.read_text(encoding="utf-8") == dump_config(cfg)):
            write_resolved(cfg, record)
        # Rows past the step resumed from were logged by the interrupted run and are now trained again.
        all_sinks = [JsonlSink(out_dir / "metrics.jsonl", resume_step=step), ConsoleSink(t.max_steps, step), *sinks]
        params = {**_flat(cfg.model_dump(mode="json")), "world_size": info.world_size, "accumulation_steps": accum,
                  "num_parameters": model.num_parameters(), "device": str(info.device),
                  "machine": machine, "precision": step_fn.precision,
                  "precision_reason": step_fn.precision_reason, "recipe_applied": cfg.recipe_applied,
                  "shards_fingerprint": shards["fingerprint"],
                  "mfu_peak_tflops": flops_peak / 1e12 if flops_peak else None,
                  "mfu_peak_source": peak_source,
                  "mfu_nominal_peak_tflops": nominal / 1e12 if nominal else None,
                  "mfu_nominal_peak_source": nominal_source}
        for s in all_sinks:
            s.log_params(params)

    def log_metrics(metrics: dict[str, float]) -> None:
        for s in all_sinks:
            s.log_metrics(metrics, step)

    def checkpoint() -> None:
        # Every rank holds the same weights, so every rank refuses alike. Skipped updates keep them finite; this
        # guards the newest checkpoint's promise (the last finite weights) against whatever else could break them.
        broken = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
        if broken:
            raise _diverged(f"the weights after update {step} are not finite ({', '.join(broken[:3])}"
                            f"{', ...' if len(broken) > 3 else ''}), so they are not saved", ckpt_dir)
        rngs = all_gather_object(rng_state(), info)  # every rank's RNG streams, for an exact resume
        if info.is_main:
            state = {"model": model.state_dict(), "optimizer": step_fn.optimizer.state_dict(),
                     "scheduler": step_fn.scheduler.state_dict(), "step": step, "epoch": epoch,
                     "batch_pos": batch_pos, "totals": totals.tolist(), "rng": rngs, "world_size": info.world_size,
                     "config": cfg.model_dump(mode="json"), "model_config": model.config.to_dict(), "shards": shards,
                     "tokenizer_sha256": tokenizer_sha256, "init_checkpoint": init, "dev": last_dev,
                     "train_seconds": trained_seconds(), "skipped_updates": skipped}
            entry = save_checkpoint(ckpt_dir, state, step, t.keep_last_checkpoints)
            log.info("checkpoint %s (sha256 %s...)", ckpt_dir / entry["file"], entry["sha256"][:12])

    dev_batches = usable_batches(dev_ds, micro_tokens, cfg.model.max_positions, seed=0, epoch=0,
                                 limit=t.dev_max_sentences)
    def epoch_batches(epoch: int) -> tuple[ShardDataset, list[np.ndarray]]:
        """The split epoch ``epoch`` reads and its batches."""
        ds = epoch_sets[epoch % len(epoch_sets)]
        return ds, usable_batches(ds, micro_tokens, cfg.model.max_positions, t.seed, epoch)

    epoch_ds, batches = epoch_batches(epoch)
    if len(batches) < group:
        raise TrainConfigError(f"the train split has {len(batches)} batches of max_tokens={micro_tokens}, fewer "
                               f"than one update needs ({accum} per rank x {info.world_size} ranks); lower "
                               "train.update_tokens")
    saved_step = step if start.resumed else -1
    dev_step = step if last_dev else -1
    budget_s = t.max_minutes * 60 if t.max_minutes is not None else math.inf
    schedule = step_fn.scheduler.lr_lambdas[0]  # the warm-up a budgeted run fitted comes back with a resume
    warmup = (BudgetWarmup(schedule, t.max_steps, budget_s, t.budget_warmup, fit_steps=t.schedule == "budget")
              if t.budget_schedule else None)
    out_of_time = step < t.max_steps and start.train_seconds >= budget_s  # resumed with its time already spent
    shared_seconds = start.train_seconds  # rank 0's training seconds as of the last decision (the cooldown's clock)
    stopped_by = "max_minutes" if out_of_time else "max_steps"
    last_ckpt_time = interval_start = time.monotonic()
    paused = 0.0  # seconds of the log interval spent on dev loss and checkpoints (not training)
    interval_sums = torch.zeros(2, dtype=torch.float64, device=info.device)  # loss, nll (this rank)
    interval_counts = torch.zeros(3, dtype=torch.float64, device=info.device)  # global tgt, src, sentences
    interval_steps = 0

    while step < t.max_steps and not out_of_time:
        if batch_pos + group > len(batches):
            epoch, batch_pos = epoch + 1, 0
            epoch_ds, batches = epoch_batches(epoch)
        micro = [make_batch(epoch_ds, batches[batch_pos + k * info.world_size + info.rank], info.device)
                 for k in range(accum)]
        sums, counts = step_fn.accumulate(micro)
        batch_pos += group  # used up even when the update is skipped: its batches are not tried again
        progress = max(step / t.max_steps, shared_seconds / budget_s)  # through the budget, before this update
        update = step_fn.apply(sums, counts, lr_factor=cooldown_factor(progress, t.cooldown))
        if not update.applied:
            skipped, in_a_row = skipped + 1, in_a_row + 1
            what = f"update {step + 1} (loss {update.loss:.4g}, gradient norm {update.grad_norm:.4g})"
            if in_a_row > t.max_nonfinite_updates:
                log_metrics({"skipped_updates": skipped})
                raise _diverged(f"training stopped at {what}: non-finite updates in a row: {in_a_row}, more than "
                                f"train.max_nonfinite_updates={t.max_nonfinite_updates} allows (a skipped update is "
                                "tried again on new batches)", ckpt_dir)
            if info.is_main:
                log.warning("%s: not finite, so skipped (weights, Adam and the learning-rate schedule unchanged; "
                            "its batches are not trained on); %d in a row, train.max_nonfinite_updates=%d", what,
                            in_a_row, t.max_nonfinite_updates)
            continue
        step, interval_steps, in_a_row = step + 1, interval_steps + 1, 0
        interval_sums += sums
        interval_counts += counts
        totals += counts

        if step % t.log_every_steps == 0:
            loss, nll = all_reduce_sum(interval_sums, info).tolist()
            n_tgt, n_src, n_sent = interval_counts.tolist()
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            seconds = max(time.monotonic() - interval_start - paused, 1e-9)
            metrics = {"loss": loss / n_tgt, "nll": nll / n_tgt, "ppl": perplexity(nll / n_tgt), "lr": update.lr,
                       "grad_norm": update.grad_norm, "skipped_updates": skipped, "src_tokens_per_s": n_src / seconds,
                       "tgt_tokens_per_s": n_tgt / seconds,
                       "step_time_s": seconds / interval_steps, "peak_memory_mb": peak_memory_mb(info.device),
                       "epoch": epoch, "tgt_tokens": totals[0].item()}
            if flops_peak:
                achieved = (model.flops_per_token(n_src / n_sent, n_tgt / n_sent) * n_tgt * step_fn.passes / seconds
                            / info.world_size)
                if achieved > flops_peak:  # the start-up measurement was no peak: never report MFU above 1
                    log.warning("achieved %.3g FLOP/s per process, above the measured peak %.3g (%s): the peak is "
                                "raised to it", achieved, flops_peak, peak_source)
                    flops_peak = achieved
                metrics |= {"mfu": achieved / flops_peak, "mfu_peak_tflops": flops_peak / 1e12}
                if nominal:
                    metrics["mfu_nominal"] = achieved / nominal
            if warmup is not None and (predicted := warmup.update(step, shared_seconds)):
                for g in step_fn.optimizer.param_groups:  # the next update's rate, from the refitted warm-up
                    g["lr"] = schedule(step_fn.scheduler.last_epoch)
                metrics |= {"schedule_predicted_updates": predicted.updates,
                            "schedule_warmup_steps": schedule.ramp_steps}
            log_metrics(metrics)
            interval_sums.zero_()
            interval_counts.zero_()
            interval_steps, paused, interval_start = 0, 0.0, time.monotonic()

        pause_start = time.monotonic()
        if step % t.dev_every_steps == 0:
            last_dev, dev_step = dev_loss(step_fn, dev_ds, dev_batches), step
            log_metrics({**last_dev, "train_seconds": trained_seconds()})
        # Time-based decisions are rank 0's, shared with all ranks so that they act on the same step.
        now = time.monotonic()
        shared_seconds, ckpt_due = _rank0_decides(
            [trained_seconds(), now - last_ckpt_time >= t.checkpoint_every_minutes * 60], info)
        out_of_time = shared_seconds >= budget_s
        if step % t.checkpoint_every_steps == 0 or ckpt_due:
            checkpoint()
            saved_step, last_ckpt_time = step, time.monotonic()
        paused += time.monotonic() - pause_start
        if out_of_time:
            stopped_by = "max_minutes"

    if saved_step != step:
        checkpoint()
    if dev_step != step:
        last_dev = dev_loss(step_fn, dev_ds, dev_batches)
        log_metrics({**last_dev, "train_seconds": trained_seconds()})
    # Every rank's step and parameter digest: DDP replicas must agree; a mismatch shows up in the summary.
    ranks = all_gather_object({"rank": info.rank, "step": step, "params_sha256": _params_digest(model)}, info)
    if info.is_main:
        tgt, src, sents = totals.tolist()
        summary = {"steps": step, "epoch": epoch, "stopped_by": stopped_by, "world_size": info.world_size,
                   "accumulation_steps": accum, "machine": machine,
                   "precision": step_fn.precision, "recipe": cfg.recipe_applied,
                   "tokens": {"src": int(src), "tgt": int(tgt), "sentences": int(sents)},
                   "final_dev": last_dev, "ranks": ranks, "checkpoints": read_index(ckpt_dir), "init_checkpoint": init,
                   "wall_seconds": round(time.monotonic() - started, 3),
                   "train_seconds": round(trained_seconds(), 3), "out_dir": str(out_dir),
                   "schedule": warmup.summary() if warmup else {
                       "kind": "paper", "warmup_steps": t.warmup_steps, "predicted_updates": None,
                       "peak_lr": schedule.rate(t.warmup_steps), "decay_from": t.warmup_steps}}
        write_json(out_dir / "train_summary.json", summary)
        log.info("training stopped (%s) at step %d; outputs in %s", stopped_by, step, out_dir)
        for s in all_sinks:
            s.close()
    return out_dir
