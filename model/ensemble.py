"""An ensemble of Transformers decoded as one model: each step's next-token distribution is the normalised mean of
the members' log-probabilities (their geometric mean), in one beam search.

Not in the paper (which decodes single and checkpoint-averaged models); it is how distillation teachers are run
(Kim & Rush, 2016; the Bergamot and mozilla/translations teachers are ensembles). fairseq averages probabilities
instead (an arithmetic mean); Marian, like this module, sums log-probabilities. Both agree on what the tests hold:
an ensemble of one is its member, and of identical members is any one of them.

The members must share the vocabulary and padding id (one tokenizer); their sizes may differ. An ensemble has
the interface :func:`model.decoding.beam_search` uses (``encode``, ``decode`` with a cache, ``new_cache``,
``reorder_cache``, ``pad_id``, ``config.max_positions``) and ``new_static_cache`` (for
:func:`model.static_decoding.static_beam_search`), so decoding code takes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from .cache import DecoderCache, StaticDecoderCache, reorder_cache
from .transformer import Transformer


@dataclass(frozen=True)
class EnsembleConfig:
    """What decoding reads of an ensemble: the shared vocabulary and padding id, and the shortest position table of
    its members (which bounds what the ensemble can read and write)."""

    vocab_size: int
    pad_id: int
    max_positions: int


class Memories(list):
    """The members' encoder outputs, one (batch, src_len, d_model of that member) tensor each; selecting or
    repeating rows acts on every one, as beam search does on one model's memory."""

    def repeat_interleave(self, repeats: int, dim: int = 0) -> Memories:
        return Memories(m.repeat_interleave(repeats, dim=dim) for m in self)

    def __getitem__(self, index):
        if isinstance(index, Tensor):  # rows, as memory[order]
            return Memories(m[index] for m in self)
        return super().__getitem__(index)


class Ensemble(nn.Module):
    """``Ensemble([model_a, model_b, ...])``: members decoded together; call in eval mode."""

    def __init__(self, members: Sequence[Transformer]) -> None:
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one model")
        for key in ("vocab_size", "pad_id"):
            values = {getattr(m.config, key) for m in members}
            if len(values) > 1:
                raise ValueError(f"ensemble members must share {key}, got {sorted(values)}: use models trained "
                                 "with one tokenizer")
        self.members = nn.ModuleList(members)
        self.pad_id = members[0].pad_id
        self.config = EnsembleConfig(members[0].config.vocab_size, self.pad_id,
                                     min(m.config.max_positions for m in members))

    def encode(self, src_tokens: Tensor) -> tuple[Memories, Tensor]:
        """src_tokens: (batch, src_len) -> (each member's memory, src_pad_mask (batch, src_len), True at padding)."""
        return Memories(m.encode(src_tokens)[0] for m in self.members), src_tokens.eq(self.pad_id)

    def decode(self, tgt_tokens: Tensor, memory: Memories | None, src_pad_mask: Tensor | None,
               cache: list[DecoderCache] | list[StaticDecoderCache] | None = None) -> Tensor:
        """The mean of the members' log-probabilities (batch, tgt_len, vocab) for ``tgt_tokens`` (batch, tgt_len),
        read by the caller as logits (a log-softmax of it is the normalised geometric mean). ``memory`` as
        :meth:`encode` returns it; ``cache`` from :meth:`new_cache`, or None (see :meth:`model.Transformer.decode`)."""
        memories = memory if memory is not None else [None] * len(self.members)
        caches = cache if cache is not None else [None] * len(self.members)
        total = None
        for model, mem, member_cache in zip(self.members, memories, caches):
            lprobs = F.log_softmax(model.decode(tgt_tokens, mem, src_pad_mask, member_cache).float(), dim=-1)
            total = lprobs if total is None else total.add_(lprobs)
        return total.div_(len(self.members))  # (batch, tgt_len, vocab)

    def new_cache(self, group: int = 1) -> list[DecoderCache]:
        """One empty cache per member (see :meth:`model.Transformer.new_cache`)."""
        return [m.new_cache(group) for m in self.members]

    def new_static_cache(self, memory: Memories, src_pad_mask: Tensor, *, group: int, max_len: int,
                         position: Tensor) -> list[StaticDecoderCache]:
        """One fixed-shape cache per member, all at the one ``position`` (see
        :meth:`model.Transformer.new_static_cache`)."""
        return [m.new_static_cache(mem, src_pad_mask, group=group, max_len=max_len, position=position)
                for m, mem in zip(self.members, memory)]

    @staticmethod
    def reorder_cache(cache: list[DecoderCache] | list[StaticDecoderCache], order: Tensor,
                      reorder_memory: bool = True) -> None:
        """Reorder every member's cache as :func:`model.reorder_cache` does one."""
        for member_cache in cache:
            reorder_cache(member_cache, order, reorder_memory=reorder_memory)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """The members' parameters, summed."""
        return sum(m.num_parameters(non_embedding) for m in self.members)
