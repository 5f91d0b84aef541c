"""One optimizer update: forward and backward over a rank's micro-batches (gradient accumulation, DDP, the bf16
working copy), then the clipped Adam step of the schedule's rate; and the dev loss, in the training precision.

Normalisation. The loss of an update is the sum of per-token losses over every micro-batch of every rank,
divided by the total number of target tokens of the update (all-reduced before the forward passes). DDP
averages gradients over ranks, so each rank back-propagates ``loss_sum * world / total``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from model import Transformer, transformer_lr_scheduler
from pipeline.config import RunConfig
from pipeline.support.hardware import training_precision
from pipeline.shards import ShardDataset

from .batches import Batch, make_batch
from .distributed import DistInfo, all_reduce_sum
from .metrics import perplexity
from .objective import objective_for
from .optim import build_optimizer


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
        # What each micro-batch's forward computes and backward differentiates: chosen once, here
        self.objective = objective_for(t, pad_id, self.work)
        self.criterion = self.objective.criterion  # also dev loss's
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
        # one-parameter copy kernels, one per parameter and update, were what remained of the casts on a GPU
        # (results ledger L28).
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

    def accumulate(self, batches: Sequence[Batch]) -> tuple[Tensor, Tensor]:
        """Forward and backward over ``batches``, leaving the update's gradient in ``.grad``.

        Returns (local sums float64 [2]: loss, nll; global counts float64 [3]: target tokens, source tokens,
        sentences of the whole update over all ranks). Gradients equal those of
        ``sum(objective over every rank's batches) / total target tokens``, the objective :attr:`objective`'s
        (:mod:`pipeline.train.objective`); with several passes per batch (R-Drop: ``(loss(pass 1) + loss(pass 2)
        + alpha * symmetric KL) / 2``) the sums returned are the passes' means, comparable with a one-pass run's.
        """
        dev = self.info.device
        counts = torch.tensor([sum(b.n_tgt for b in batches), sum(b.n_src for b in batches),
                               sum(len(b.src) for b in batches)], dtype=torch.float64, device=dev)
        all_reduce_sum(counts, self.info)  # [3]
        scale = self.info.world_size / counts[0]  # DDP averages gradients over ranks: undo that, divide by tokens
        sums = torch.zeros(2, dtype=torch.float64, device=dev)
        passes = self.objective.passes
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            # Gradients are all-reduced only on the last micro-batch; the earlier ones accumulate locally.
            sync = contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()
            with sync:
                terms = self.objective(self.net, b, self.autocast)
                (terms.objective * (scale / passes)).backward()
            if self.master_weights and (self.ddp is None or last):
                self._gradients_to_master()
            sums += torch.stack([terms.loss.detach(), terms.nll.detach()]).double() / passes
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
