"""Beam search with a static-shape decoding step, for CUDA graphs: the same results as
:func:`model.decoding.beam_search` (paper section 6.1: beam 4, alpha 0.6, max length = input + 50).

On a GPU, :func:`~model.decoding.beam_search` is bound by kernel launches and host reads: every step drops the
finished sentences (the shapes change), grows its key/value cache by concatenation and reads finished hypotheses
on the host. Here every step has the same shapes and tensors:

- all batch * k beams stay for the whole search; a finished sentence's beams keep running with score -inf, so
  they produce no candidate (an eos needs a finite score) and record nothing;
- the prefixes are a (batch * k, max_len + 1) token buffer, reordered in place by beam origin; the keys/values are
  in a :class:`model.cache.StaticDecoderCache` (preallocated for the longest output, masked after the current
  position, reordered in place); the step's position is a device tensor, read by the positional encoding;
- finished hypotheses go to a per-sentence buffer of the ``nbest`` best by normalised score (tokens, raw score,
  normalised score, length), merged with each step's new ones by a stable sort: the same nbest, in the same order
  for equal scores, as ``beam_search``'s stable sort of all of them in the order they finished.

So the step reads and writes only tensors allocated before the search: on CUDA it is captured once in a CUDA graph
and replayed. The host reads whether every sentence is done once per ``sync_every`` steps (steps after that change
nothing) and the nbest buffers at the end. The step's selection rules are ``beam_search``'s (shared helpers:
:func:`~model.decoding.select_candidates`, :func:`~model.decoding.sentences_done`), so outputs are equal token
for token; scores agree to float rounding (attention sums over the whole buffer, zeros included, and the batch
keeps its shape, so float32 products may round differently in the last bits).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .decoding import Hypothesis, check_search_args, length_penalty, output_limits, select_candidates, sentences_done


class StaticBeamSearch:
    """The state of one batched beam search in tensors of fixed shape, and its step (:meth:`step`), which reads
    and writes only those tensors (in place): capturable in a CUDA graph. Built by :func:`static_beam_search`.
    """

    def __init__(self, model, src_tokens: Tensor, *, bos_id: int, eos_id: int, beam_size: int, alpha: float,
                 max_len_a: float, max_len_b: int, nbest: int, min_len: int) -> None:
        k, batch, device = beam_size, src_tokens.size(0), src_tokens.device
        self.model, self.k, self.nbest, self.eos_id, self.min_len = model, k, nbest, eos_id, min_len
        self.pad_id, self.bos_id = model.pad_id, bos_id
        self.max_lens, self.max_lp = output_limits(model, src_tokens, max_len_a, max_len_b, alpha)  # (batch,) each
        self.steps = int(self.max_lens.max())  # the one host read before the search: buffer sizes
        # lp by output length, from the same Python floats beam_search divides by (bit-equal scores)
        self.lp = torch.tensor([length_penalty(float(n), alpha) for n in range(self.steps + 1)],
                               dtype=torch.float64, device=device)  # (steps + 1,)

        self.position = torch.zeros(1, dtype=torch.long, device=device)  # (1,) the step: its input token's position
        memory, src_pad_mask = model.encode(src_tokens)  # (batch, src_len, d_model), (batch, src_len)
        self.cache = model.new_static_cache(memory, src_pad_mask, group=k, max_len=self.steps,
                                            position=self.position)
        self.first_row = torch.arange(batch, device=device)[:, None] * k  # (batch, 1) each sentence's first beam
        self.not_eos = torch.arange(model.config.vocab_size, device=device).ne(eos_id)  # (vocab,)

        self.prefixes = torch.full((batch * k, self.steps + 1), self.pad_id, dtype=torch.long, device=device)
        self.prefixes[:, 0] = bos_id  # (batch * k, steps + 1): bos, then one token per step
        self.scores = torch.zeros(batch, k, dtype=torch.float64, device=device)  # (batch, k) raw log-probs
        self.scores[:, 1:] = -math.inf  # all beams start identical: only the first may expand at step one
        self.open = torch.ones(batch, dtype=torch.bool, device=device)  # (batch,) still searching
        # The nbest best finished hypotheses per sentence, best first; score -inf marks an empty slot.
        self.done_tokens = torch.full((batch, nbest, self.steps + 1), self.pad_id, dtype=torch.long,
                                      device=device)  # (batch, nbest, steps + 1) prefixes, bos first
        self.done_length = torch.zeros(batch, nbest, dtype=torch.long, device=device)  # tokens, bos/eos excluded
        self.done_log_prob = torch.zeros(batch, nbest, dtype=torch.float64, device=device)  # raw
        self.done_score = torch.full((batch, nbest), -math.inf, dtype=torch.float64, device=device)  # normalised

    def step(self) -> None:
        """One decoding step for every beam, in place: beam_search's step, finished sentences masked."""
        batch, k = self.scores.shape
        tokens = self.prefixes.index_select(1, self.position)  # (batch * k, 1) the last token of each prefix
        logits = self.model.decode(tokens, None, None, self.cache)  # (batch * k, 1, vocab)
        # log-softmax in float32, scores in float64, as beam_search
        lprobs = F.log_softmax(logits[:, -1].float(), dim=-1)  # (batch * k, vocab)
        length = self.position + 1  # (1,) tokens generated once this step's token is chosen, eos included
        must_end = length >= self.max_lens  # (batch,)
        # beam_search's masks, without host reads: pad and bos never, eos not before min_len, only eos at the end
        lprobs[:, self.pad_id] = -math.inf
        lprobs[:, self.bos_id] = -math.inf
        lprobs[:, self.eos_id].masked_fill_(length < self.min_len, -math.inf)
        lprobs.view(batch, k, -1).masked_fill_(must_end[:, None, None] & self.not_eos, -math.inf)

        top_scores, top_beam, top_tok, is_eos = select_candidates(lprobs, self.scores, self.eos_id)  # (batch, 2k)
        # eos among the k best candidates ends a hypothesis (finished sentences have none: their scores are -inf)
        self._keep_finished(top_scores[:, :k], top_beam[:, :k], is_eos[:, :k], length)

        open_scores, open_pos = top_scores.masked_fill(is_eos, -math.inf).topk(k, dim=1)  # (batch, k)
        done = sentences_done(open_scores, self.done_score[:, 0], self.max_lp, must_end)  # (batch,)
        self.open.logical_and_(~done)
        self.scores.copy_(open_scores.masked_fill(~self.open[:, None], -math.inf))
        order = (self.first_row + top_beam.gather(1, open_pos)).view(-1)  # (batch * k,) rows of the new prefixes
        self.prefixes.copy_(self.prefixes.index_select(0, order))
        self.prefixes.index_copy_(1, length, top_tok.gather(1, open_pos).view(-1, 1))
        # every row stays in its sentence: the encoder-decoder keys/values stay as they are
        self.model.reorder_cache(self.cache, order, reorder_memory=False)
        self.position.add_(1)

    def _keep_finished(self, raw: Tensor, beam: Tensor, is_eos: Tensor, length: Tensor) -> None:
        """Merge this step's finished hypotheses (raw scores, beams, is_eos: (batch, k)) into the nbest buffers."""
        batch, k = raw.shape
        score = (raw / self.lp.index_select(0, length)).masked_fill(~is_eos, -math.inf)  # (batch, k) normalised
        tokens = self.prefixes.index_select(0, (self.first_row + beam).view(-1)).view(batch, k, -1)
        merged = torch.cat([self.done_score, score], dim=1)  # (batch, nbest + k)
        # Stable: equal scores keep the order they finished in (beam_search sorts its list of them stably).
        best = merged.sort(dim=1, descending=True, stable=True).indices[:, : self.nbest]  # (batch, nbest)
        self.done_score.copy_(merged.gather(1, best))
        self.done_log_prob.copy_(torch.cat([self.done_log_prob, raw], dim=1).gather(1, best))
        self.done_length.copy_(torch.cat([self.done_length, self.position.expand(batch, k)], dim=1).gather(1, best))
        all_tokens = torch.cat([self.done_tokens, tokens], dim=1)  # (batch, nbest + k, steps + 1)
        self.done_tokens.copy_(all_tokens.gather(1, best[:, :, None].expand(-1, -1, all_tokens.size(2))))

    def all_done(self) -> bool:
        """Whether every sentence's search has ended (a host read)."""
        return not bool(self.open.any())

    def hypotheses(self) -> list[list[Hypothesis]]:
        """Per sentence, its finished hypotheses, best first (host reads of the nbest buffers)."""
        tokens, lengths = self.done_tokens.tolist(), self.done_length.tolist()
        scores, log_probs = self.done_score.tolist(), self.done_log_prob.tolist()
        return [[Hypothesis(t[1 : 1 + n], s, lp) for t, n, s, lp in zip(*slots) if s > -math.inf]
                for slots in zip(tokens, lengths, scores, log_probs)]


def _cuda_graph(step: Callable[[], None]) -> Callable[[], None]:
    """Run ``step`` once (eagerly, on a side stream: the warm-up that lazy CUDA initialisation needs before a
    capture), capture it in a CUDA graph and return the graph's replay, which repeats the step. ``step`` must read
    and write only tensors that outlive the graph, in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # recorded, not run
    return graph.replay


@torch.inference_mode()
def static_beam_search(
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
    min_len: int = 1,
    cuda_graph: bool | None = None,
    sync_every: int = 8,
    allowed: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
    rescore: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
) -> list[list[Hypothesis]]:
    """:func:`model.decoding.beam_search` (``use_cache=True``) with a static-shape step: the same hypotheses and
    scores (see the module docstring), returned the same way. ``model``: a :class:`model.Transformer` or
    :class:`model.Ensemble` in eval mode.

    ``cuda_graph``: capture the step in a CUDA graph and replay it; None does so when ``src_tokens`` is on CUDA.
    ``sync_every``: steps between the host's checks whether every sentence is done (each check waits for the
    device); the search ends at the first check that finds them done, or after the longest output's steps.
    ``allowed`` (output constraints) and ``rescore`` (their scores) are not supported here: they read every prefix
    on the host each step.
    """
    check_search_args(beam_size, nbest, alpha)
    if allowed is not None or rescore is not None:
        raise ValueError("static_beam_search does not take `allowed` constraints or a `rescore`: use "
                         "model.decoding.beam_search")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    if cuda_graph is None:
        cuda_graph = src_tokens.is_cuda
    elif cuda_graph and not src_tokens.is_cuda:
        raise ValueError("cuda_graph=True needs src_tokens (and the model) on a CUDA device")
    if src_tokens.size(0) == 0:
        return []
    search = StaticBeamSearch(model, src_tokens, bos_id=bos_id, eos_id=eos_id, beam_size=beam_size, alpha=alpha,
                              max_len_a=max_len_a, max_len_b=max_len_b, nbest=nbest, min_len=min_len)
    step, taken = search.step, 0
    if cuda_graph:
        step, taken = _cuda_graph(search.step), 1  # the capture ran the first step
    for i in range(taken, search.steps):
        step()
        if (i + 1) % sync_every == 0 and search.all_done():
            break
    return search.hypotheses()
