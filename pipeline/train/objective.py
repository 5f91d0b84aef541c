"""The training objective, chosen once per run from ``train``: what one micro-batch's forward computes and what its
backward differentiates.

Three objectives share one interface (:class:`Objective`): the paper's label-smoothed cross-entropy over the
logits (:class:`LabelSmoothed`); the same loss with the pre-softmax linear transformation folded into it, so that
the logits never exist whole (:class:`FusedOutputLoss`, ``train.fused_output_loss``); and R-Drop
(:class:`RDrop`, ``train.rdrop_alpha > 0``; Liang et al., 2021, not in the paper), which runs each batch twice
under independent dropout and adds the symmetric KL divergence of the two passes' predictions. The maths lives in
:mod:`model.loss`; these objects only say which of it a training step runs, and how.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Protocol

from torch import Tensor, nn

from model import LabelSmoothedCrossEntropy, symmetric_kl
from pipeline.config import TrainConfig

from .batches import Batch

Autocast = Callable[[], contextlib.AbstractContextManager]


class Terms(NamedTuple):
    """One micro-batch's sums (0-d tensors) over its ``passes`` forward passes."""

    objective: Tensor  # what backward differentiates (before the update's normalisation)
    loss: Tensor  # label-smoothed loss, summed over the non-padding targets of every pass
    nll: Tensor  # negative log-likelihood, likewise


class Objective(Protocol):
    """The training objective of a run; ``criterion`` is also what dev loss is measured with."""

    criterion: LabelSmoothedCrossEntropy
    passes: int  # forward and backward passes per batch (what MFU counts)

    def __call__(self, net: nn.Module, batch: Batch, autocast: Autocast) -> Terms:
        """Forward ``batch`` through ``net`` under ``autocast()``."""
        ...


class LabelSmoothed:
    """The paper's objective: label-smoothed cross-entropy over the logits (section 5.4)."""

    passes = 1

    def __init__(self, criterion: LabelSmoothedCrossEntropy):
        self.criterion = criterion

    def __call__(self, net: nn.Module, batch: Batch, autocast: Autocast) -> Terms:
        with autocast():
            logits = net(batch.src, batch.tgt_in)  # [B, T, V]
        # nothing reads the logits after the loss, whose backward may overwrite them
        loss, nll, _ = self.criterion(logits, batch.tgt_out, overwrite_logits=True)
        return Terms(loss, loss, nll)


class FusedOutputLoss:
    """The same loss, its logits formed chunk by chunk inside it from the decoder's output and the output projection's
    weight (:meth:`model.loss.LabelSmoothedCrossEntropy.projected`): no (tokens, vocab) tensor, at the price of
    computing the logits again in backward."""

    passes = 1

    def __init__(self, criterion: LabelSmoothedCrossEntropy, projection: nn.Linear):
        self.criterion = criterion
        self.projection = projection  # the pre-softmax linear transformation of the module that runs

    def __call__(self, net: nn.Module, batch: Batch, autocast: Autocast) -> Terms:
        with autocast():
            hidden = net(batch.src, batch.tgt_in, project=False)  # [B, T, d_model]
        loss, nll, _ = self.criterion.projected(hidden, self.projection.weight, batch.tgt_out)
        return Terms(loss, loss, nll)


class RDrop:
    """R-Drop: the batch twice in one forward (each copy under its own dropout masks), the two passes' losses plus
    ``alpha`` times the symmetric KL divergence of their predictions. Its sums cover both passes: the trainer
    divides by :attr:`passes`, which makes the loss logged the passes' mean, comparable with a one-pass run's."""

    passes = 2

    def __init__(self, criterion: LabelSmoothedCrossEntropy, alpha: float):
        self.criterion, self.alpha = criterion, alpha

    def __call__(self, net: nn.Module, batch: Batch, autocast: Autocast) -> Terms:
        with autocast():
            logits = net(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))  # [2B, T, V]
        # the KL term reads the logits after the loss: its backward must not overwrite them
        loss, nll, _ = self.criterion(logits, batch.tgt_out.repeat(2, 1), overwrite_logits=False)
        rows = len(batch.src)  # slices, not chunk(): autograd refuses saved views of a multi-view op
        objective = loss + self.alpha * symmetric_kl(logits[:rows], logits[rows:], batch.tgt_out,
                                                     self.criterion.ignore_index)
        return Terms(objective, loss, nll)


def objective_for(t: TrainConfig, pad_id: int, work: nn.Module) -> Objective:
    """The objective ``t`` asks for, over the module forward and backward run (``work``: its output projection is
    what the fused loss multiplies by). The config already refuses the fused loss with R-Drop, whose consistency
    term reads the logits that the fused loss never forms; so does this."""
    criterion = LabelSmoothedCrossEntropy(t.label_smoothing, pad_id)
    if t.fused_output_loss and t.rdrop_alpha > 0:
        raise ValueError(f"train.fused_output_loss never forms the logits, and R-Drop (rdrop_alpha="
                         f"{t.rdrop_alpha:g}) compares them: turn one of them off")
    if t.rdrop_alpha > 0:
        return RDrop(criterion, t.rdrop_alpha)
    if t.fused_output_loss:
        return FusedOutputLoss(criterion, work.output_projection)
    return LabelSmoothed(criterion)
