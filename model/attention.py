"""Multi-head attention (paper section 3.2): h heads of scaled dot-product attention, concatenated, projected."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import AttentionCache, StaticAttentionCache


# Up to this many keys, fp32 attention on the CPU runs as explicit products (attention_with_weights): forward +
# backward took less time than torch's CPU flash-attention kernel at Multi30k's sentence lengths, about as long
# near this bound, and longer beyond it (bench/attention_paths.py; the whole update in ledger L53).
CPU_FP32_EXPLICIT_MAX_KEYS = 100


def key_keep_mask(key_padding_mask: Tensor) -> Tensor:
    """Boolean attention mask, True where a key may be attended, from a padding mask (True at padding).

    (batch, src_len) -> (batch, 1, 1, src_len), broadcast over heads and queries. A row with no real key at
    all (an empty source) would leave softmax with only -inf, i.e. 0/0 = NaN; such a row is allowed to attend
    to every position instead, which keeps the output finite on every backend (its value is meaningless).
    """
    keep = ~key_padding_mask  # (batch, src_len)
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def causal_keep_mask(tgt_len: int, src_len: int, device: torch.device | None = None) -> Tensor:
    """(tgt_len, src_len) boolean mask, True where query i may see key j.

    The queries are the last ``tgt_len`` of ``src_len`` positions (earlier ones come from a cache), so query i
    sits at position ``src_len - tgt_len + i`` and sees keys up to and including that position.
    """
    return torch.ones(tgt_len, src_len, dtype=torch.bool, device=device).tril(src_len - tgt_len)


def attention_with_weights(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention computed explicitly, returning the attention weights as well.

    Same result as ``F.scaled_dot_product_attention`` (more memory: the weights are materialised); used when
    weights are asked for (attention heat-maps), for one query per row (incremental decoding) and for bf16 on
    the CPU (see :meth:`MultiHeadAttention.forward`). The softmax runs in float32 whatever the input precision.
    q: (batch, heads, tgt_len, d_k), k: (batch, heads, src_len, d_k), v: (batch, heads, src_len, d_v),
    keep: broadcastable to (batch, heads, tgt_len, src_len), True = attend.
    Returns (output (batch, heads, tgt_len, d_v), weights (batch, heads, tgt_len, src_len), in v's dtype); the
    weights are those before attention dropout.
    """
    scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)  # (batch, heads, tgt_len, src_len)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return F.dropout(weights, dropout_p) @ v, weights


class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O``, ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.

    ``d_k = d_v = d_model / h``. A self-attention module holds W^Q, W^K, W^V as one fused (3 d_model, d_model)
    projection (one matrix product instead of three); an encoder-decoder attention module holds W^Q alone and
    W^K, W^V fused, because keys and values come from the encoder memory and are computed once per sentence
    when decoding. Attention goes through ``F.scaled_dot_product_attention`` (fused kernels) except when the
    weights are requested, for one query per row when decoding, and in bf16 on the CPU (explicit products: see
    :meth:`forward`).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, self_attention: bool = True) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.dropout = dropout  # on the attention weights; 0 in the paper
        self.self_attention = self_attention
        if self_attention:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # [W^Q; W^K; W^V]
        else:
            self.q_proj = nn.Linear(d_model, d_model)  # W^Q
            self.kv_proj = nn.Linear(d_model, 2 * d_model)  # [W^K; W^V]
        self.out_proj = nn.Linear(d_model, d_model)  # W^O
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases. Fused matrices are initialised block by block, as the separate
        d_model x d_model matrices they stand for (Xavier over the fused shape would give a smaller range)."""
        projections = [self.qkv_proj] if self.self_attention else [self.q_proj, self.kv_proj]
        for linear in [*projections, self.out_proj]:
            for block in linear.weight.split(self.d_model, dim=0):
                nn.init.xavier_uniform_(block)
            nn.init.zeros_(linear.bias)

    def _split_heads(self, x: Tensor, parts: int) -> tuple[Tensor, ...]:
        # (batch, len, parts * d_model) -> parts x (batch, heads, len, d_k), strided views (SDPA reads strided
        # inputs). Unbinding the `parts` axis in place (not moved to the front) lets backward stack the
        # gradients straight into the (batch, len, parts * d_model) layout: one copy instead of two.
        batch, length, _ = x.shape
        return tuple(t.transpose(1, 2) for t in x.view(batch, length, parts, self.n_heads, self.d_k).unbind(2))

    def memory_keys_values(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder attention's keys and values for a cache: memory (batch, src_len, d_model) -> each
        (batch, heads, src_len, d_k), contiguous (as strided views, every later step's batched products would
        copy them)."""
        k, v = self._split_heads(self.kv_proj(memory), 2)
        return k.contiguous(), v.contiguous()

    def forward(
        self,
        query: Tensor,
        memory: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: AttentionCache | StaticAttentionCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to itself (self-attention) or to ``memory`` (encoder-decoder attention).

        query: (batch, tgt_len, d_model). memory: (batch, src_len, d_model), encoder-decoder attention only.
        key_padding_mask: (batch, src_len), True at padding keys. causal: each query sees only keys at or
        before its own position (decoder self-attention). cache: keys/values of earlier decoding steps;
        self-attention appends this call's keys/values to it, encoder-decoder attention fills it on the first
        call and reuses it afterwards (``memory`` is then not read); a :class:`StaticAttentionCache` (self-attention,
        one query per row) stores this step's key/value at its position and attends to the positions up to it.
        need_weights: also return the attention weights (batch, heads, tgt_len, src_len), computed explicitly.
        Returns (output (batch, tgt_len, d_model), weights or None).
        """
        batch, tgt_len, _ = query.shape
        if self.self_attention:
            q, k, v = self._split_heads(self.qkv_proj(query), 3)  # each (batch, heads, tgt_len, d_k)
            if isinstance(cache, StaticAttentionCache):
                k, v = cache.write(k, v)  # (batch, heads, max_len, d_k), positions after this one masked below
            elif cache is not None:
                if cache.key is not None:
                    k = torch.cat([cache.key, k], dim=2)  # (batch, heads, past + tgt_len, d_k)
                    v = torch.cat([cache.value, v], dim=2)
                cache.key, cache.value = k, v
        else:
            # A grouped cache (beam search): the `group` consecutive rows of one sentence query its memory row
            # together, as one row of group * tgt_len queries.
            group = 1 if cache is None else cache.group
            q_in = self.q_proj(query).view(batch // group, group * tgt_len, self.d_model)
            (q,) = self._split_heads(q_in, 1)  # (batch / group, heads, group * tgt_len, d_k)
            if cache is not None and cache.key is None:
                cache.key, cache.value = self.memory_keys_values(memory)
            if cache is not None:
                k, v = cache.key, cache.value
            else:
                k, v = self._split_heads(self.kv_proj(memory), 2)  # each (batch, heads, src_len, d_k)
        src_len = k.size(2)

        keep = None if key_padding_mask is None else key_keep_mask(key_padding_mask)  # (batch, 1, 1, src_len)
        if isinstance(cache, StaticAttentionCache):  # a mask, not a slice, keeps the shapes fixed
            visible = cache.visible()  # (max_len,)
            keep = visible if keep is None else keep & visible
        # The common training case (full square causal mask, nothing else) goes to SDPA's is_causal path; one
        # new query at the end of a cached prefix sees every key and needs no mask at all.
        is_causal = causal and tgt_len > 1 and keep is None and tgt_len == src_len and not need_weights
        if causal and tgt_len > 1 and not is_causal:
            future = causal_keep_mask(tgt_len, src_len, query.device)  # (tgt_len, src_len)
            keep = future if keep is None else keep & future

        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = attention_with_weights(q, k, v, keep, dropout_p)
        elif tgt_len == 1 and not self.training:
            # One query per row (incremental decoding): two small batched products beat the CPU SDPA kernel's
            # per-call overhead by far at beam search's small shapes; the weights are not returned.
            out, weights = attention_with_weights(q, k, v, keep)[0], None
        elif q.device.type == "cpu" and (q.dtype == torch.bfloat16 or src_len <= CPU_FP32_EXPLICIT_MAX_KEYS):
            # In bf16 on the CPU (autocast, or a bf16 model), the two products in bf16 on the matrix units with the
            # softmax in float32 run forward + backward faster than torch's CPU flash-attention kernel, in fp32 or
            # bf16 (that kernel is slower in bf16 than in fp32), at sentence lengths (ledger L04). In fp32 they are
            # faster up to CPU_FP32_EXPLICIT_MAX_KEYS keys. The weights it materialises are batch x heads x tgt_len x
            # src_len, small at these lengths.
            if is_causal:
                keep = causal_keep_mask(tgt_len, src_len, query.device)  # (tgt_len, src_len)
            out, weights = attention_with_weights(q, k, v, keep, dropout_p)[0], None
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal)
            weights = None
        # (batch, heads, tgt_len, d_v) -> (batch, tgt_len, heads * d_v): the concatenation of the heads (grouped:
        # (batch / group, heads, group * tgt_len, d_v) -> (batch / group, group * tgt_len, ...), the same rows)
        out = out.transpose(1, 2).reshape(batch, tgt_len, self.d_model)
        if weights is not None and q.size(0) != batch:  # grouped: back to one row per decoder row
            weights = weights.view(q.size(0), self.n_heads, batch // q.size(0), tgt_len, src_len)
            weights = weights.transpose(1, 2).reshape(batch, self.n_heads, tgt_len, src_len)
        return self.out_proj(out), weights
