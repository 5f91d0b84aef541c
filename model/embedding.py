"""Token embeddings scaled by sqrt(d_model) (paper section 3.4)."""

from __future__ import annotations

import math

from torch import Tensor, nn


class ScaledEmbedding(nn.Embedding):
    """``Embedding(tokens) * sqrt(d_model)``.

    With ``share_embeddings`` one instance serves the encoder and the decoder, and its ``weight`` is also the
    pre-softmax projection (see :class:`model.transformer.Transformer`). The scale keeps embeddings, whose
    entries are ~d_model^-0.5, on the same scale as the positional encodings (entries in [-1, 1]).

    Initialisation: normal(0, d_model^-0.5), padding row zero, as in fairseq and tensor2tensor; the paper does
    not say. The padding row receives no gradient from the lookup (it may from the tied output projection).
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int) -> None:
        super().__init__(vocab_size, d_model, padding_idx=pad_id)
        self.scale = math.sqrt(d_model)

    def reset_parameters(self) -> None:
        """normal(0, d_model^-0.5) with a zero padding row."""
        nn.init.normal_(self.weight, mean=0.0, std=self.embedding_dim**-0.5)
        self._fill_padding_idx_with_zero()

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (batch, len) -> (batch, len, d_model)."""
        return super().forward(tokens) * self.scale
