"""Encoder and decoder layers (paper section 3.1) and the position-wise feed-forward network (section 3.3)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .cache import AttentionCache, StaticAttentionCache
from .config import TransformerConfig
from .dropout import dropout


class PositionwiseFeedForward(nn.Module):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2``, applied to each position separately (inner size d_ff)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float = 0.0) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation_dropout = activation_dropout  # after the ReLU; not in the paper (0 = paper)
        for linear in (self.w_1, self.w_2):
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: (batch, len, d_model) -> (batch, len, d_model)."""
        # Not in place: W1's 3-D output is a view of a 2-D product, and an in-place op on a view makes autograd
        # add a copy-and-zero-fill node on every step.
        h = F.relu(self.w_1(x))  # (batch, len, d_ff)
        if self.activation_dropout:
            h = dropout(h, self.activation_dropout, self.training)
        return self.w_2(h)


class ResidualConnection(nn.Module):
    """Residual dropout and layer normalisation around one sub-layer.

    post-norm (paper): ``LayerNorm(x + Dropout(Sublayer(x)))``;
    pre-norm: ``x + Dropout(Sublayer(LayerNorm(x)))``, which keeps an identity path from input to output and
    trains more stably in deep or high learning-rate settings (it needs a final LayerNorm on the stack).
    Use as ``x = connection(x, sublayer(connection.sublayer_input(x)))``.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def sublayer_input(self, x: Tensor) -> Tensor:
        """What the sub-layer reads: LayerNorm(x) for pre-norm, x for post-norm."""
        return self.norm(x) if self.pre_norm else x

    def forward(self, x: Tensor, sublayer_output: Tensor) -> Tensor:
        """x, sublayer_output: (batch, len, d_model) -> (batch, len, d_model)."""
        y = x + dropout(sublayer_output, self.dropout, self.training)
        return y if self.pre_norm else self.norm(y)


class EncoderLayer(nn.Module):
    """Multi-head self-attention, then the feed-forward network, each wrapped in a residual connection."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        c = config
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, self_attention=True)
        self.self_attn_residual = ResidualConnection(c.d_model, c.dropout, c.pre_norm)
        self.ffn = PositionwiseFeedForward(c.d_model, c.d_ff, c.activation_dropout)
        self.ffn_residual = ResidualConnection(c.d_model, c.dropout, c.pre_norm)

    def forward(
        self, x: Tensor, src_pad_mask: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x: (batch, src_len, d_model); src_pad_mask: (batch, src_len), True at padding.

        Returns (output (batch, src_len, d_model), self-attention weights (batch, heads, src_len, src_len) or None).
        """
        h, weights = self.self_attn(
            self.self_attn_residual.sublayer_input(x), key_padding_mask=src_pad_mask, need_weights=need_weights
        )
        x = self.self_attn_residual(x, h)
        x = self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x)))
        return x, weights


class DecoderLayer(nn.Module):
    """Masked multi-head self-attention, encoder-decoder attention over the memory, then the feed-forward
    network, each wrapped in a residual connection."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        c = config
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, self_attention=True)
        self.self_attn_residual = ResidualConnection(c.d_model, c.dropout, c.pre_norm)
        self.cross_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, self_attention=False)
        self.cross_attn_residual = ResidualConnection(c.d_model, c.dropout, c.pre_norm)
        self.ffn = PositionwiseFeedForward(c.d_model, c.d_ff, c.activation_dropout)
        self.ffn_residual = ResidualConnection(c.d_model, c.dropout, c.pre_norm)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None,
        src_pad_mask: Tensor | None,
        self_attn_cache: AttentionCache | StaticAttentionCache | None = None,
        cross_attn_cache: AttentionCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x: (batch, tgt_len, d_model); memory: (batch, src_len, d_model) (unused once ``cross_attn_cache`` is
        filled); src_pad_mask: (batch, src_len), True at padding.

        Returns (output (batch, tgt_len, d_model), self-attention weights (batch, heads, tgt_len, tgt_len),
        encoder-decoder attention weights (batch, heads, tgt_len, src_len)); the weights are None unless asked.
        """
        # Targets are right-padded, so every padding position comes after all real tokens and the causal mask
        # already hides it from them: no target padding mask is needed.
        h, self_weights = self.self_attn(
            self.self_attn_residual.sublayer_input(x), causal=True, cache=self_attn_cache, need_weights=need_weights
        )
        x = self.self_attn_residual(x, h)
        h, cross_weights = self.cross_attn(
            self.cross_attn_residual.sublayer_input(x),
            memory,
            key_padding_mask=src_pad_mask,
            cache=cross_attn_cache,
            need_weights=need_weights,
        )
        x = self.cross_attn_residual(x, h)
        x = self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x)))
        return x, self_weights, cross_weights
