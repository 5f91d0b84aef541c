"""Key/value cache for incremental (one step at a time) decoding, and its reordering for beam search.

Without a cache, every decoding step would re-run the decoder over the whole prefix: O(T^2) work per sentence
instead of O(T). The cache keeps, per decoder layer, the self-attention keys/values of all earlier target
positions (appended each step) and the encoder-decoder keys/values (projected from the memory once).

:class:`DecoderCache` grows by one position per step (its tensors change shape); :class:`StaticDecoderCache`
writes into buffers preallocated for the longest output, so a decoding step has the same shapes and tensors every
time and can be captured once in a CUDA graph and replayed (see :mod:`model.static_decoding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionCache:
    """Keys and values one attention module has already computed."""

    key: Tensor | None = None  # (batch, heads, len, d_k); (batch / group, ...) for encoder-decoder attention
    value: Tensor | None = None  # (batch, heads, len, d_v)
    group: int = 1  # encoder-decoder attention: consecutive decoder rows per memory row (see DecoderCache)


@dataclass
class DecoderCache:
    """Everything the decoder keeps between steps: per layer, self- and encoder-decoder attention caches.

    ``src_pad_mask`` is stored on the first step so that :func:`reorder_cache` keeps it in step with the
    encoder-decoder keys/values; later steps need neither the memory nor the mask from the caller.

    ``group`` g > 1: every g consecutive decoder rows read the same source sentence (beam search's beams), and
    the memory and its mask hold one row per sentence, not per decoder row. Encoder-decoder attention then
    projects keys/values once per sentence and attends from the g rows' queries together: g times less
    key/value memory read per step and no repeated copy of the memory (faster decoding: results ledger L05).
    """

    self_attn: list[AttentionCache]
    cross_attn: list[AttentionCache]
    src_pad_mask: Tensor | None = None  # (batch / group, src_len), True at padding

    @classmethod
    def empty(cls, num_layers: int, group: int = 1) -> "DecoderCache":
        """A cache for a decoder of ``num_layers`` layers, before the first step; ``group`` rows per sentence."""
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        return cls(
            self_attn=[AttentionCache() for _ in range(num_layers)],
            cross_attn=[AttentionCache(group=group) for _ in range(num_layers)],
        )

    @property
    def group(self) -> int:
        """Decoder rows per source sentence (held by the encoder-decoder caches, which use it)."""
        return self.cross_attn[0].group if self.cross_attn else 1

    @property
    def length(self) -> int:
        """Number of target positions already decoded (the position of the next token)."""
        key = self.self_attn[0].key
        return 0 if key is None else key.size(2)


@dataclass
class StaticAttentionCache:
    """Self-attention keys/values in buffers preallocated for ``max_len`` positions, written one step at a time.

    ``position`` (1,) long, on the buffers' device and shared by every layer, is where this step's key/value goes
    (the position of the step's input token); the buffers' later positions hold stale values and are masked out
    (:meth:`visible`), not sliced off, so that the shapes never change. The caller advances ``position``.
    """

    key: Tensor  # (rows, heads, max_len, d_k)
    value: Tensor  # (rows, heads, max_len, d_v)
    position: Tensor  # (1,) long

    def write(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Store one step's key/value (rows, heads, 1, d_k) at ``position``; returns the whole buffers."""
        if key.size(2) != 1:
            raise ValueError(f"a static cache takes one token per row and step, got {key.size(2)}")
        # Under autocast the projections may come out in a lower precision than the buffers.
        self.key.index_copy_(2, self.position, key.to(self.key.dtype))
        self.value.index_copy_(2, self.position, value.to(self.value.dtype))
        return self.key, self.value

    def visible(self) -> Tensor:
        """(max_len,) bool, True at the positions written so far (up to and including ``position``)."""
        return torch.arange(self.key.size(2), device=self.key.device) <= self.position


@dataclass
class StaticDecoderCache:
    """A :class:`DecoderCache` of fixed shapes: per layer, a :class:`StaticAttentionCache` and the grouped
    encoder-decoder keys/values (filled when the cache is made, from one memory row per sentence; see
    :meth:`model.Transformer.new_static_cache`). Reordering (:func:`reorder_cache`) copies rows within the buffers.
    """

    self_attn: list[StaticAttentionCache]
    cross_attn: list[AttentionCache]
    src_pad_mask: Tensor  # (batch / group, src_len), True at padding
    position: Tensor  # (1,) long, the self-attention caches' shared position

    @property
    def group(self) -> int:
        """Decoder rows per source sentence."""
        return self.cross_attn[0].group if self.cross_attn else 1

    @property
    def length(self) -> Tensor:
        """(1,) long on the device: the positions already decoded, i.e. the position of the next token (a tensor,
        not an int, so that the positional encoding of a step replayed from a CUDA graph follows it)."""
        return self.position


def _memory_rows(new_order: Tensor, group: int) -> Tensor:
    """The memory rows (sentences) that the decoder rows ``new_order`` read."""
    return new_order if group == 1 else new_order[::group] // group


def reorder_cache(cache: DecoderCache | StaticDecoderCache, new_order: Tensor,
                  reorder_memory: bool = True) -> DecoderCache | StaticDecoderCache:
    """Select rows of the cache along the batch (batch * beam) dimension, in place; returns the cache.

    ``new_order`` is a 1-D LongTensor of row indices into the current batch, e.g. the beam each surviving
    hypothesis came from (``batch_index * beam + beam_index``). It may be shorter than the batch (finished
    sentences dropped) or repeat rows (a beam that forks). ``reorder_memory=False`` leaves the encoder-decoder
    keys/values and the source mask as they are: right (and a copy saved per layer) whenever every new row comes
    from the same sentence's group of rows, which all hold the same memory (beam search when no sentence left).
    With ``cache.group`` g > 1, ``new_order`` must keep whole groups (its rows ``j g .. j g + g - 1`` all come
    from one sentence's rows), and the memory side follows the sentences ``new_order[::g] // g``.
    A :class:`StaticDecoderCache` is reordered by copying within its buffers: ``new_order`` must then have one
    entry per row (no row leaves).
    """
    in_place = isinstance(cache, StaticDecoderCache)

    def select(t: Tensor | None, rows: Tensor) -> Tensor | None:
        if t is None:  # a cache before its first step
            return None
        if in_place:  # same tensor, same shape every step
            return t.copy_(t.index_select(0, rows))
        return t.index_select(0, rows)

    for entry in cache.self_attn:
        entry.key, entry.value = select(entry.key, new_order), select(entry.value, new_order)
    if reorder_memory:
        sentences = _memory_rows(new_order, cache.group)
        for entry in cache.cross_attn:
            entry.key, entry.value = select(entry.key, sentences), select(entry.value, sentences)
        cache.src_pad_mask = select(cache.src_pad_mask, sentences)
    return cache

