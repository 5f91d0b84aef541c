"""Label-smoothed cross-entropy (paper section 5.4, epsilon_ls = 0.1), and the symmetric KL divergence of R-Drop.

Target distribution, as in fairseq (``label_smoothed_nll_loss``) and tensor2tensor: ``1 - eps`` on the reference
token and ``eps / (V - 1)`` on each of the other ``V - 1`` vocabulary entries, the padding token included (it
is never a reference, and leaving it out would change nothing but the constant). Positions whose target is
``ignore_index`` (padding) contribute nothing to the loss, the nll or the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


_CPU_CHUNK_ELEMENTS = 2**19  # logits per chunk on a CPU: 2 MB in float32, which stays in cache between its passes
# On a GPU each chunk costs a handful of kernel launches and cache-sized chunks are launch-bound (a WMT vocabulary
# leaves a few rows a chunk, thousands of chunks per batch); 2**26 elements (256 MiB in float32) bound the float32
# temporaries while keeping the launches few (results ledger L20).
_GPU_CHUNK_ELEMENTS = 2**26


def _chunk_rows(device: torch.device, vocab: int) -> int:
    """Rows of (tokens, vocab) logits on ``device`` worked on at once: cache-sized on a CPU, launch-amortising on a
    GPU."""
    elements = _CPU_CHUNK_ELEMENTS if device.type == "cpu" else _GPU_CHUNK_ELEMENTS
    return max(1, elements // vocab)


def _forward_rows(x: Tensor, target: Tensor, nll: Tensor, lp_sum: Tensor, lse: Tensor) -> None:
    """For float32 logits ``x`` (rows, vocab) and their targets (rows, 1): each row's nll, sum of log-probabilities
    and log-sum-exp, written into ``nll``, ``lp_sum`` and ``lse`` (rows,)."""
    lprobs = F.log_softmax(x, dim=-1)  # (rows, vocab)
    lp_target = lprobs.gather(-1, target).squeeze(-1)  # (rows,)
    torch.neg(lp_target, out=nll)
    torch.sum(lprobs, dim=-1, out=lp_sum)
    lse.copy_(x.gather(-1, target).squeeze(-1) - lp_target)  # the row's log-sum-exp


def _smoothed(nll: Tensor, lp_sum: Tensor, smoothing: float, vocab: int) -> Tensor:
    """The smoothed loss per row: -sum_j q_j log p_j = (1 - eps - eps_other) * nll + eps_other * (-sum_j log p_j),
    with ``eps_other = eps / (vocab - 1)`` the mass on each non-reference token."""
    eps_other = smoothing / (vocab - 1)
    return (1.0 - smoothing - eps_other) * nll - eps_other * lp_sum


def _gradient_terms(grad_loss: Tensor, grad_nll: Tensor, keep: Tensor, smoothing: float,
                    vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """(scale, shift, on_target), each (tokens, 1), of d loss / dx = p - q_smoothed and d nll / dx = p - onehot:
    grad = (g_loss + g_nll) p - g_loss eps_other - (g_loss (1 - eps - eps_other) + g_nll) onehot."""
    eps_other = smoothing / (vocab - 1)
    grad_loss, grad_nll = grad_loss * keep, grad_nll * keep  # (tokens,): padding gets nothing
    return ((grad_loss + grad_nll)[:, None], (grad_loss * eps_other)[:, None],
            -(grad_loss * (1.0 - smoothing - eps_other) + grad_nll)[:, None])


def _gradient_rows(x: Tensor, lse: Tensor, target: Tensor, scale: Tensor, shift: Tensor, on_target: Tensor) -> Tensor:
    """d objective / d logits of float32 logits ``x`` (rows, vocab; overwritten), from the rows' log-sum-exp and
    :func:`_gradient_terms`: the softmax, recomputed, scaled and shifted."""
    return x.sub_(lse[:, None]).exp_().mul_(scale).sub_(shift).scatter_add_(-1, target, on_target)


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token smoothed loss and nll with a hand-written backward, computed over chunks of rows.

    The gradient of cross-entropy against a target distribution q is ``softmax(x) - q``. Forward keeps only
    the logits (which exist anyway) and each row's log-sum-exp; backward recomputes the softmax chunk by chunk
    and writes ``softmax - q`` straight into a gradient of the logits' dtype. Each chunk is converted to
    float32 once and worked on while it is in cache, so no float32 (tokens, vocab) tensor is ever
    materialised: with bf16 logits, loss forward + backward takes less time than log_softmax + gather over the
    whole tensor, and less memory (results ledger L04).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float, ignore_index: int,
                overwrite: bool) -> tuple[Tensor, Tensor]:
        # logits: (tokens, vocab); target: (tokens,)
        tokens, vocab = logits.shape
        keep = target.ne(ignore_index)  # (tokens,)
        safe_target = target.masked_fill(~keep, 0)[:, None]  # (tokens, 1), a valid index everywhere
        lse, nll, lp_sum = (torch.empty(tokens, dtype=torch.float32, device=logits.device) for _ in range(3))
        rows = _chunk_rows(logits.device, vocab)
        for r in range(0, tokens, rows):
            chunk = slice(r, r + rows)
            # (rows, vocab), float32 even under bf16
            _forward_rows(logits[chunk].float(), safe_target[chunk], nll[chunk], lp_sum[chunk], lse[chunk])
        loss = _smoothed(nll, lp_sum, smoothing, vocab)
        ctx.save_for_backward(logits, lse, safe_target, keep)
        ctx.smoothing, ctx.rows, ctx.overwrite = smoothing, rows, overwrite
        return loss.masked_fill(~keep, 0.0), nll.masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, lse, safe_target, keep = ctx.saved_tensors
        scale, shift, on_target = _gradient_terms(grad_loss, grad_nll, keep, ctx.smoothing, logits.size(1))
        # overwrite: each chunk's gradient goes over its logits, read for the last time here: no second (tokens,
        # vocab) tensor at the peak of the update's memory (peak RSS in ledger L53); float32 chunks are worked on
        # in place, without a copy
        grad = logits if ctx.overwrite else torch.empty_like(logits)  # (tokens, vocab)
        in_place = ctx.overwrite and logits.dtype == torch.float32  # no float32 copy of a chunk needed either
        rows = ctx.rows
        for r in range(0, logits.size(0), rows):
            chunk = slice(r, r + rows)
            x = logits[chunk] if in_place else logits[chunk].to(torch.float32, copy=True)  # (rows, vocab)
            g = _gradient_rows(x, lse[chunk], safe_target[chunk], scale[chunk], shift[chunk], on_target[chunk])
            if not in_place:
                grad[chunk] = g
        return grad, None, None, None, None


class _ProjectedSmoothedCrossEntropy(torch.autograd.Function):
    """The pre-softmax linear transformation and the smoothed loss together, chunk of rows by chunk of rows: each
    chunk's logits ``hidden @ weight.T`` exist only while it is worked on, so no (tokens, vocab) tensor is ever
    materialised, neither the logits nor their gradient (at a WMT update, 25,000 tokens x 37,000 pieces, 1.85 GB
    each in bf16). The price: backward computes each chunk's logits again (one more matrix product of the output
    layer). Loss, nll and gradients are :class:`_SmoothedCrossEntropy`'s over ``hidden @ weight.T``.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float,
                ignore_index: int) -> tuple[Tensor, Tensor]:
        # hidden: (tokens, d_model); weight: (vocab, d_model); target: (tokens,)
        tokens, vocab = hidden.size(0), weight.size(0)
        # The products' type: autocast's where it is on (the decoder's output may be float32 after its layer norm,
        # and backward runs outside autocast), else the inputs'. The weight is cast once, not once per chunk.
        kind = hidden.device.type
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        dt = torch.get_autocast_dtype(kind) if autocast else hidden.dtype
        w = weight.to(dt)
        keep = target.ne(ignore_index)  # (tokens,)
        safe_target = target.masked_fill(~keep, 0)[:, None]  # (tokens, 1)
        lse, nll, lp_sum = (torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3))
        rows = _chunk_rows(hidden.device, vocab)
        for r in range(0, tokens, rows):
            chunk = slice(r, r + rows)
            x = (hidden[chunk].to(dt) @ w.T).float()  # (rows, vocab): this chunk's logits only
            _forward_rows(x, safe_target[chunk], nll[chunk], lp_sum[chunk], lse[chunk])
        loss = _smoothed(nll, lp_sum, smoothing, vocab)
        ctx.save_for_backward(hidden, weight, lse, safe_target, keep)
        ctx.smoothing, ctx.rows, ctx.dt = smoothing, rows, dt
        return loss.masked_fill(~keep, 0.0), nll.masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        hidden, weight, lse, safe_target, keep = ctx.saved_tensors
        dt = ctx.dt
        w = weight.to(dt)
        scale, shift, on_target = _gradient_terms(grad_loss, grad_nll, keep, ctx.smoothing, weight.size(0))
        grad_hidden = torch.empty_like(hidden)  # (tokens, d_model)
        # (vocab, d_model), summed over the chunks in float32 at least
        grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                  device=weight.device)
        rows = ctx.rows
        for r in range(0, hidden.size(0), rows):
            chunk = slice(r, r + rows)
            h = hidden[chunk].to(dt)  # (rows, d_model)
            g = _gradient_rows((h @ w.T).float(), lse[chunk], safe_target[chunk], scale[chunk], shift[chunk],
                               on_target[chunk]).to(dt)  # (rows, vocab): d objective / d logits of this chunk
            grad_hidden[chunk] = g @ w  # (rows, d_model)
            grad_weight += g.T @ h  # (vocab, d_model)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


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

    def forward(self, logits: Tensor, target: Tensor, overwrite_logits: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """logits: (..., vocab); target: (...) token ids. Returns (loss_sum, nll_sum, n_tokens), 0-d tensors.

        overwrite_logits: backward writes the logits' gradient over the logits themselves (less memory),
        for a caller that needs them no more once this loss is computed. Autograd guards what it can: a second
        backward, or the backward of another operation that saved the logits and runs after this one's, raises
        instead of reading them.
        """
        vocab = logits.size(-1)
        loss, nll = _SmoothedCrossEntropy.apply(
            logits.reshape(-1, vocab), target.reshape(-1), self.smoothing, self.ignore_index, overwrite_logits
        )  # each (tokens,)
        return loss.sum(), nll.sum(), target.ne(self.ignore_index).sum()

    def projected(self, hidden: Tensor, weight: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The same sums for the logits ``hidden @ weight.T``, computed with the projection chunk by chunk so that
        the logits never exist whole (:class:`_ProjectedSmoothedCrossEntropy`). hidden: (..., d_model), the
        decoder's output; weight: (vocab, d_model), the pre-softmax linear transformation's; target: (...)."""
        loss, nll = _ProjectedSmoothedCrossEntropy.apply(
            hidden.reshape(-1, hidden.size(-1)), weight, target.reshape(-1), self.smoothing, self.ignore_index
        )  # each (tokens,)
        return loss.sum(), nll.sum(), target.ne(self.ignore_index).sum()


def _log_softmax_and_softmax(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float32 (log p, p, log-sum-exp) of logits ``x`` (rows, vocab), with one exp per element."""
    x = x.to(torch.float32, copy=True)  # (rows, vocab): a copy, worked on in place below
    top = x.amax(-1, keepdim=True)  # (rows, 1)
    p = (x - top).exp_()
    total = p.sum(-1, keepdim=True)
    lse = top + total.log()  # (rows, 1)
    return x.sub_(lse), p.div_(total), lse.squeeze(-1)


class _SymmetricKL(torch.autograd.Function):
    """Per-row ``(KL(p||q) + KL(q||p)) / 2`` of ``p = softmax(a)``, ``q = softmax(b)``, chunk by chunk.

    Gradients (``d = log p - log q``): ``d/da_k = (p_k (d_k - KL(p||q) + 1) - q_k) / 2`` and
    ``d/db_k = (q_k (-d_k - KL(q||p) + 1) - p_k) / 2``. As for the loss above, backward recomputes the softmaxes
    from the logits and one log-sum-exp per row, and no float32 (tokens, vocab) tensor is materialised: autograd
    over ``log_softmax`` of the whole tensors took several times as long, for the float32 tensors it keeps.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, keep: Tensor) -> Tensor:
        # a, b: (tokens, vocab) logits of two passes; keep: (tokens,) bool, False on padding
        tokens = a.size(0)
        lse_a, lse_b, kl_pq, kl_qp = (torch.empty(tokens, dtype=torch.float32, device=a.device) for _ in range(4))
        rows = _chunk_rows(a.device, a.size(-1))
        for r in range(0, tokens, rows):
            chunk = slice(r, r + rows)
            lp, p, lse_a[chunk] = _log_softmax_and_softmax(a[chunk])  # (rows, vocab) each
            lq, q, lse_b[chunk] = _log_softmax_and_softmax(b[chunk])
            d = lp.sub_(lq)  # log p - log q
            kl_pq[chunk] = (p * d).sum(-1)
            kl_qp[chunk] = -(q * d).sum(-1)
        ctx.save_for_backward(a, b, lse_a, lse_b, kl_pq, kl_qp, keep)
        ctx.rows = rows
        return (0.5 * (kl_pq + kl_qp)).masked_fill(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        a, b, lse_a, lse_b, kl_pq, kl_qp, keep = ctx.saved_tensors
        half = (0.5 * grad * keep)[:, None]  # (tokens, 1)
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        rows = ctx.rows
        for r in range(0, a.size(0), rows):
            chunk = slice(r, r + rows)
            lp = a[chunk].to(torch.float32, copy=True).sub_(lse_a[chunk, None])  # (rows, vocab)
            lq = b[chunk].to(torch.float32, copy=True).sub_(lse_b[chunk, None])
            d = lp - lq
            p, q = lp.exp_(), lq.exp_()
            grad_a[chunk] = (p * (d - kl_pq[chunk, None] + 1.0) - q).mul_(half[chunk])
            grad_b[chunk] = (q * (1.0 - kl_qp[chunk, None] - d) - p).mul_(half[chunk])
        return grad_a, grad_b, None


def symmetric_kl(logits_a: Tensor, logits_b: Tensor, target: Tensor, ignore_index: int = 0) -> Tensor:
    """R-Drop's consistency term (Liang et al., 2021; not in the paper): summed over the non-padding positions of
    ``target``, ``(KL(p||q) + KL(q||p)) / 2`` of the distributions two passes predict, ``p = softmax(logits_a)``,
    ``q = softmax(logits_b)``. logits_*: (..., vocab); target: (...). Returns a 0-d float32 tensor."""
    vocab = logits_a.size(-1)
    keep = target.reshape(-1).ne(ignore_index)  # (tokens,)
    return _SymmetricKL.apply(logits_a.reshape(-1, vocab), logits_b.reshape(-1, vocab), keep).sum()
