"""Position information added to the token embeddings (paper section 3.5)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoid_table(num_positions: int, d_model: int) -> Tensor:
    """(num_positions, d_model) table: ``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``, ``PE(pos, 2i+1) = cos(...)``.

    Interleaved sin/cos as the paper writes it (tensor2tensor and fairseq concatenate the two halves instead;
    equivalent up to a fixed permutation of the model dimensions). Computed in float64 so large positions
    keep their precision, then stored as float32.
    """
    position = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (positions, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angle = position * inv_freq  # (positions, ceil(d_model / 2))
    table = torch.empty(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.float()


def _rows(table: Tensor, offset: int | Tensor, length: int) -> Tensor:
    """Rows ``offset .. offset + length - 1`` of a position table, (length, d_model).

    An int offset is range-checked and sliced (contiguous positions: a slice, cheaper backward than a lookup). A
    (1,) long tensor offset (a static-shape decoding step, :mod:`model.static_decoding`) is looked up on its device
    with no host read, so one CUDA graph of the step serves every position; its caller keeps it in range.
    """
    if isinstance(offset, Tensor):
        return table.index_select(0, offset + torch.arange(length, device=offset.device))
    max_positions = table.size(0)
    if offset + length > max_positions:
        raise ValueError(
            f"positions {offset}..{offset + length - 1} exceed max_positions={max_positions}; "
            "raise model.max_positions or shorten the input"
        )
    return table[offset : offset + length]


class PositionalEncoding(nn.Module):
    """Fixed sinusoidal positional encoding, added to the (already scaled) embeddings.

    The table is a non-persistent buffer: it is a function of the shape, so checkpoints do not carry it.
    ``offset`` is the position of the first input token (the cache length during incremental decoding), an int or
    a (1,) long tensor on the device.
    """

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.register_buffer("table", sinusoid_table(max_positions, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x: (batch, len, d_model) -> x + PE[offset : offset + len]."""
        return x + _rows(self.table, offset, x.size(1))  # (len, d_model) broadcast over batch


class LearnedPositionalEmbedding(nn.Module):
    """Learned absolute position embeddings (paper Table 3 row E: about the same BLEU as sinusoids).

    Initialised normal(0, d_model^-0.5) like the token embeddings (fairseq's choice; the paper is silent).
    """

    def __init__(self, d_model: int, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x: (batch, len, d_model) -> x + P[offset : offset + len] (``offset`` as :class:`PositionalEncoding`'s)."""
        return x + _rows(self.weight, offset, x.size(1))
