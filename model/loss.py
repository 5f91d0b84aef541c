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


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token smoothed loss and nll with a hand-written backward.

    The gradient of cross-entropy against a target distribution q is ``softmax(x) - q``; writing it into one
    (tokens, vocab) buffer in place is about twice as fast on CPU as autograd through log_softmax, gather and
    sum, and allocates fewer (tokens, vocab) temporaries (the largest tensors of a training step).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float, ignore_index: int) -> tuple[Tensor, Tensor]:
        # logits: (tokens, vocab); target: (tokens,)
        vocab = logits.size(-1)
        keep = target.ne(ignore_index)  # (tokens,)
        safe_target = target.masked_fill(~keep, 0)[:, None]  # (tokens, 1), a valid index everywhere
        lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)  # (tokens, vocab), float32 even under bf16
        nll = -lprobs.gather(-1, safe_target).squeeze(-1)  # (tokens,)
        eps_other = smoothing / (vocab - 1)  # mass on each non-reference token
        # -sum_j q_j log p_j = (1 - eps - eps_other) * nll + eps_other * (-sum_j log p_j)
        loss = (1.0 - smoothing - eps_other) * nll - eps_other * lprobs.sum(-1)
        ctx.save_for_backward(lprobs, safe_target, keep)
        ctx.eps_other = eps_other
        ctx.smoothing = smoothing
        ctx.logits_dtype = logits.dtype
        return loss.masked_fill(~keep, 0.0), nll.masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        lprobs, safe_target, keep = ctx.saved_tensors
        grad_loss = grad_loss * keep  # (tokens,)
        grad_nll = grad_nll * keep
        # d loss / dx = p - q_smoothed, d nll / dx = p - onehot:
        # grad = (g_loss + g_nll) p - g_loss eps_other - (g_loss (1 - eps - eps_other) + g_nll) onehot
        grad = lprobs.exp_()  # (tokens, vocab): softmax, overwriting the saved log-probabilities (freed next)
        grad.mul_((grad_loss + grad_nll)[:, None])
        grad.sub_((grad_loss * ctx.eps_other)[:, None])
        on_target = grad_loss * (1.0 - ctx.smoothing - ctx.eps_other) + grad_nll  # (tokens,)
        grad.scatter_add_(-1, safe_target, -on_target[:, None])
        return grad.to(ctx.logits_dtype), None, None, None


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
