"""Batched beam search on the cached decoder (paper section 6.1: beam 4, alpha 0.6, max length = input + 50).

Scores are sums of token log-probabilities, normalised by the GNMT length penalty of Wu et al. (2016), which
the paper uses: ``lp(Y) = ((5 + |Y|) / 6) ** alpha``, ``score(Y) = log P(Y | X) / lp(Y)``, where |Y| counts the
generated tokens including the end-of-sentence token. fairseq, Marian and HF divide by ``|Y| ** alpha``
instead; this module implements the paper's form only.

A sentence's search ends (and it leaves the batch, so later steps cost less) when either holds:
- no open beam can beat its best finished hypothesis: scores only fall as tokens are added, and ``lp`` grows
  with length, so ``open_score / lp(max_len)`` bounds every continuation (alpha >= 0);
- it reached its maximum length ``max_len_a * source_len + max_len_b`` (end-of-sentence is then forced).
fairseq instead stops once ``beam_size`` hypotheses have finished, which can return a hypothesis that scores
below the greedy one (four early, short endings fill the quota); the bound never retires a sentence whose
result could still improve. With alpha = 0 the bound makes beam 1 exactly greedy decoding; with alpha > 0
beam 1 may continue past greedy's end-of-sentence, and only ever to a higher score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Hypothesis:
    """One finished output: ``tokens`` without bos/eos, ``score`` length-normalised, ``log_prob`` raw."""

    tokens: list[int]
    score: float
    log_prob: float


def length_penalty(length: Tensor | float, alpha: float) -> Tensor | float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (paper section 6.1)."""
    return ((5.0 + length) / 6.0) ** alpha


def max_output_lengths(src_tokens: Tensor, pad_id: int, max_len_a: float, max_len_b: int, limit: int) -> Tensor:
    """Per sentence (batch,): ``floor(a * source_len + b)`` output tokens at most, eos included, and <= limit."""
    src_len = src_tokens.ne(pad_id).sum(dim=1)  # (batch,)
    return (max_len_a * src_len.double() + max_len_b).floor().long().clamp(min=1, max=limit)


def output_limits(model, src_tokens: Tensor, max_len_a: float, max_len_b: int, alpha: float) -> tuple[Tensor, Tensor]:
    """(batch,) each: the sentences' maximum output lengths (within the model's position table, whose position 0
    bos takes) and the length penalty at that length, the largest a sentence can reach."""
    max_lens = max_output_lengths(src_tokens, model.pad_id, max_len_a, max_len_b, model.config.max_positions - 1)
    return max_lens, length_penalty(max_lens.double(), alpha)


def check_search_args(beam_size: int, nbest: int, alpha: float) -> None:
    """Raise ValueError unless beam_size >= 1, 1 <= nbest <= beam_size and alpha >= 0."""
    if beam_size < 1 or not 1 <= nbest <= beam_size:
        raise ValueError(f"need beam_size >= 1 and 1 <= nbest <= beam_size, got {beam_size}, {nbest}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 (the early-stopping bound relies on it), got {alpha}")


def select_candidates(lprobs: Tensor, scores: Tensor, eos_id: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The 2k best continuations of each sentence's k beams, best first.

    lprobs: (n * k, vocab) next-token log-probabilities of every beam, masked; scores: (n, k) float64 raw scores
    of the beams. Returns (scores (n, 2k) float64, beam (n, 2k) in 0..k-1, token (n, 2k), is_eos (n, 2k): the
    token is eos and the score finite).
    """
    n, k = scores.shape
    # The 2k best continuations of a sentence are among the 2k best tokens of each of its beams (a token
    # outside its beam's 2k best is beaten by 2k continuations of that beam alone), so each row is cut to
    # its 2k best before adding the beam scores: float64 work on (n, k * 2k), not (n, k * vocab).
    width = min(2 * k, lprobs.size(-1))
    row_lprobs, row_tok = lprobs.topk(width, dim=1)  # (n * k, width)
    cand = (scores.view(n * k, 1) + row_lprobs.double()).view(n, k * width)  # (n, k * width)
    top_scores, top_idx = cand.topk(min(2 * k, k * width), dim=1)  # (n, 2k)
    top_beam, top_tok = top_idx // width, row_tok.view(n, k * width).gather(1, top_idx)  # (n, 2k)
    is_eos = top_tok.eq(eos_id) & top_scores.gt(-math.inf)  # (n, 2k)
    return top_scores, top_beam, top_tok, is_eos


def sentences_done(open_scores: Tensor, best_done: Tensor, max_lp: Tensor, must_end: Tensor) -> Tensor:
    """(n,) bool: which sentences' searches end after this step (see the module docstring): no open beam can
    beat the best finished hypothesis, the maximum length is reached, or no beam is left open.

    open_scores: (n, k) raw scores of the open beams, best first; best_done: (n,) best finished normalised score
    (-inf if none); max_lp: (n,) length penalty at the maximum length; must_end: (n,) bool.
    """
    bound = open_scores[:, 0] / max_lp  # (n,) best any continuation could still reach
    return must_end | best_done.ge(bound) | open_scores[:, 0].eq(-math.inf)


@torch.inference_mode()
def beam_search(
    model,
    src_tokens: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    nbest: int = 1,
    use_cache: bool = True,
    min_len: int = 1,
    allowed: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
    rescore: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
) -> list[list[Hypothesis]]:
    """Decode ``src_tokens`` (batch, src_len), right-padded with ``model.pad_id``; returns, per sentence, its
    ``nbest`` best hypotheses, best first. ``model`` is a :class:`model.Transformer` (encode / decode with a
    cache / reorder_cache); call it in eval mode. ``beam_size=1`` is greedy decoding. ``use_cache=False``
    re-runs the decoder over each whole prefix (O(T^2)): the reference the cached path is tested against.
    ``min_len``: eos is blocked until an output would hold this many tokens, eos included (fairseq's
    ``--min-len``; benchmarks force equal output lengths with it); the maximum length still wins.
    ``allowed(prefixes, sentences, room)``: a constraint on the output language, e.g. well-formed trees. It gets
    every open beam's prefix (rows, t), bos first, the index in ``src_tokens`` of each row's sentence (rows,) and
    how many tokens may still follow the next one, eos included (rows,), and returns which tokens may come next,
    bool (rows, vocab); the others get probability 0 (log-probability -inf after the log-softmax: the model's
    distribution is not renormalised over the allowed ones). The maximum length still wins. None: no constraint
    and no cost. ``rescore(lprobs, prefixes, sentences)``: the step's log-probabilities (rows, vocab) as the search
    should score them, before ``allowed`` masks them (e.g. a forced token credited with its class's mass).
    """
    check_search_args(beam_size, nbest, alpha)
    pad_id, k = model.pad_id, beam_size
    batch = src_tokens.size(0)
    device = src_tokens.device
    max_lens, max_lp = output_limits(model, src_tokens, max_len_a, max_len_b, alpha)  # (batch,) each

    memory, src_pad_mask = model.encode(src_tokens)  # (batch, src_len, d_model), (batch, src_len)
    if use_cache:  # the k beams of a sentence read its one memory row (a grouped cache)
        cache = model.new_cache(group=k)
    else:
        cache = None
        memory = memory.repeat_interleave(k, dim=0)  # (batch * k, src_len, d_model)
        src_pad_mask = src_pad_mask.repeat_interleave(k, dim=0)  # (batch * k, src_len)

    active = torch.arange(batch, device=device)  # (n,) original sentence index of each row group
    prefixes = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)  # (n * k, t)
    scores = torch.zeros(batch, k, dtype=torch.float64, device=device)  # (n, k) raw log-probs of open beams
    scores[:, 1:] = -math.inf  # all beams start identical: only the first may expand at step one
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    best_done = torch.full((batch,), -math.inf, dtype=torch.float64, device=device)  # best finished score

    step = 0
    while active.numel():
        n = active.numel()
        if use_cache:  # the cache keeps the encoder-decoder keys/values after the first step
            first = step == 0
            logits = model.decode(prefixes[:, -1:], memory if first else None, src_pad_mask if first else None,
                                  cache)
        else:
            logits = model.decode(prefixes, memory, src_pad_mask)
        # log-softmax in float32 (half the time of float64 here); scores accumulate in float64
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)  # (n * k, vocab)
        if rescore is not None:
            lprobs = rescore(lprobs, prefixes, active.repeat_interleave(k))
        length = step + 1  # tokens generated once this step's token is chosen, eos included
        must_end = length >= max_lens[active]  # (n,)
        if allowed is not None:
            room = (max_lens[active] - length).repeat_interleave(k)  # (n * k,) tokens after this one
            ok = allowed(prefixes, active.repeat_interleave(k), room)  # (n * k, vocab)
            ok[:, eos_id] |= must_end.repeat_interleave(k)  # the maximum length wins over the constraint
            lprobs.masked_fill_(~ok, -math.inf)
        lprobs[:, pad_id] = -math.inf
        lprobs[:, bos_id] = -math.inf
        if length < min_len:
            lprobs[:, eos_id] = -math.inf
        if must_end.any():
            rows = must_end.repeat_interleave(k)  # (n * k,)
            eos_col = lprobs[rows, eos_id]
            lprobs[rows] = -math.inf
            lprobs[rows, eos_id] = eos_col

        top_scores, top_beam, top_tok, is_eos = select_candidates(lprobs, scores, eos_id)  # each (n, 2k)

        # eos among the k best candidates ends a hypothesis (as fairseq: a lower-ranked eos would not be kept).
        lp_now = length_penalty(float(length), alpha)
        for row, col in is_eos[:, :k].nonzero().tolist():
            beam, sentence = int(top_beam[row, col]), int(active[row])
            raw = float(top_scores[row, col])
            finished[sentence].append(Hypothesis(prefixes[row * k + beam, 1:].tolist(), raw / lp_now, raw))
            best_done[sentence] = max(float(best_done[sentence]), raw / lp_now)

        open_scores, open_pos = top_scores.masked_fill(is_eos, -math.inf).topk(k, dim=1)  # (n, k)
        done = sentences_done(open_scores, best_done[active], max_lp[active], must_end)  # (n,)

        keep = (~done).nonzero().squeeze(1)  # (n',) row groups still searching
        beams = top_beam.gather(1, open_pos)[keep]  # (n', k)
        order = (keep[:, None] * k + beams).view(-1)  # (n' * k,) rows of the surviving prefixes
        prefixes = torch.cat([prefixes[order], top_tok.gather(1, open_pos)[keep].view(-1, 1)], dim=1)
        scores = open_scores[keep]
        active = active[keep]
        if use_cache:  # while no sentence leaves, every row keeps its sentence's memory: no copy needed
            model.reorder_cache(cache, order, reorder_memory=len(keep) < n)
        else:
            memory, src_pad_mask = memory[order], src_pad_mask[order]
        step += 1

    return [sorted(hyps, key=lambda h: -h.score)[:nbest] for hyps in finished]
