"""The Transformer encoder-decoder (paper section 3, Figure 1)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import AttentionCache, DecoderCache, StaticAttentionCache, StaticDecoderCache, reorder_cache
from .config import TransformerConfig
from .dropout import dropout
from .embedding import ScaledEmbedding
from .layers import DecoderLayer, EncoderLayer
from .positional import LearnedPositionalEmbedding, PositionalEncoding


def _positions(c: TransformerConfig) -> nn.Module:
    if c.positions == "sinusoidal":
        return PositionalEncoding(c.d_model, c.max_positions)
    return LearnedPositionalEmbedding(c.d_model, c.max_positions)


class _Stack(nn.Module):
    """What the encoder and decoder stacks share: token embeddings + positions + dropout (paper 3.4, 3.5, 5.4)
    feeding N layers, and a final LayerNorm when pre-norm (pre-norm layers add un-normalised sub-layer outputs
    to the residual stream, so it is normalised once at the end)."""

    def __init__(
        self, embed_tokens: ScaledEmbedding, embed_positions: nn.Module, layers: list[nn.Module], dropout: float,
        pre_norm: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.layers = nn.ModuleList(layers)
        self.dropout = dropout
        self.final_norm = nn.LayerNorm(embed_tokens.embedding_dim) if pre_norm else None

    def embed(self, tokens: Tensor, offset: int | Tensor = 0) -> Tensor:
        """tokens: (batch, len) -> Dropout(Embedding * sqrt(d_model) + PE): (batch, len, d_model); ``offset``: the
        position of the first token, an int or a (1,) long tensor on the device."""
        return dropout(self.embed_positions(self.embed_tokens(tokens), offset), self.dropout, self.training)


class Encoder(_Stack):
    """Embeddings + positions + dropout, then N encoder layers (+ a final LayerNorm when pre-norm)."""

    def forward(
        self, src_tokens: Tensor, src_pad_mask: Tensor, need_weights: bool = False
    ) -> tuple[Tensor, list[Tensor]]:
        """src_tokens, src_pad_mask: (batch, src_len). Returns (memory (batch, src_len, d_model), per-layer
        self-attention weights (batch, heads, src_len, src_len), empty unless ``need_weights``)."""
        x = self.embed(src_tokens)  # (batch, src_len, d_model)
        weights = []
        for layer in self.layers:
            x, w = layer(x, src_pad_mask, need_weights)
            if need_weights:
                weights.append(w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, weights


class Decoder(_Stack):
    """Embeddings + positions + dropout, then N decoder layers (+ a final LayerNorm when pre-norm).

    Returns hidden states; the pre-softmax projection belongs to :class:`Transformer` (it may share weights
    with the embeddings).
    """

    def forward(
        self,
        tgt_tokens: Tensor,
        memory: Tensor | None,
        src_pad_mask: Tensor | None,
        cache: DecoderCache | StaticDecoderCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """tgt_tokens: (batch, tgt_len), the tokens not yet in ``cache`` (all of them without a cache; one per row
        with a :class:`StaticDecoderCache`).

        Returns (hidden (batch, tgt_len, d_model), per-layer self-attention weights, per-layer encoder-decoder
        attention weights); the weight lists are empty unless ``need_weights``.
        """
        offset = 0 if cache is None else cache.length  # position of the first new token (a tensor: static cache)
        x = self.embed(tgt_tokens, offset)  # (batch, tgt_len, d_model)
        self_weights, cross_weights = [], []
        for i, layer in enumerate(self.layers):
            x, sw, cw = layer(
                x,
                memory,
                src_pad_mask,
                None if cache is None else cache.self_attn[i],
                None if cache is None else cache.cross_attn[i],
                need_weights,
            )
            if need_weights:
                self_weights.append(sw)
                cross_weights.append(cw)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, self_weights, cross_weights


class Transformer(nn.Module):
    """Encoder-decoder Transformer built from one :class:`model.config.TransformerConfig` (``self.config``);
    ``Transformer(TransformerConfig.from_dict(state["model_config"]))`` rebuilds the architecture a checkpoint
    holds. Its defaults are the paper's base model.

    Initialisation (the paper is silent; fairseq/tensor2tensor practice): Xavier-uniform weights and zero biases
    for every linear layer, normal(0, d_model^-0.5) for embeddings, LayerNorm weight 1 and bias 0.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        c = self.config = config
        self.pad_id = c.pad_id
        src_embed = ScaledEmbedding(c.vocab_size, c.d_model, c.pad_id)
        tgt_embed = src_embed if c.share_embeddings else ScaledEmbedding(c.vocab_size, c.d_model, c.pad_id)
        self.encoder = Encoder(src_embed, _positions(c), [EncoderLayer(c) for _ in range(c.encoder_layers)],
                               c.dropout, c.pre_norm)
        self.decoder = Decoder(tgt_embed, _positions(c), [DecoderLayer(c) for _ in range(c.decoder_layers)],
                               c.dropout, c.pre_norm)
        self.output_projection = nn.Linear(c.d_model, c.vocab_size, bias=False)  # pre-softmax linear transformation
        if c.share_embeddings:
            # Paper 3.4: one matrix for both embeddings and the pre-softmax projection (one Parameter object).
            self.output_projection.weight = src_embed.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0.0, std=c.d_model**-0.5)

    # ------------------------------------------------------------------------------------------------ running

    def encode(self, src_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """src_tokens: (batch, src_len) -> (memory (batch, src_len, d_model), src_pad_mask (batch, src_len),
        True at padding)."""
        src_pad_mask = src_tokens.eq(self.pad_id)
        memory, _ = self.encoder(src_tokens, src_pad_mask)
        return memory, src_pad_mask

    def decode(
        self,
        tgt_tokens: Tensor,
        memory: Tensor | None,
        src_pad_mask: Tensor | None,
        cache: DecoderCache | StaticDecoderCache | None = None,
    ) -> Tensor:
        """Decoder logits (batch, tgt_len, vocab) for ``tgt_tokens`` (batch, tgt_len).

        Without a cache, ``tgt_tokens`` is the whole (shifted) target prefix, decoded in parallel with a causal
        mask. With a cache (from :meth:`new_cache`), ``tgt_tokens`` holds only the tokens not yet decoded,
        usually one per step; their keys/values are appended to the cache and the logits of those positions
        are returned. ``memory`` and ``src_pad_mask`` are read on the first call with a fresh cache, which then
        keeps the encoder-decoder keys/values and the mask; later calls may pass None for both. A
        :class:`StaticDecoderCache` (from :meth:`new_static_cache`) already holds them: one token per row, at the
        cache's position, which the caller advances.
        """
        if cache is not None:
            if cache.src_pad_mask is None:
                cache.src_pad_mask = src_pad_mask
            src_pad_mask = cache.src_pad_mask
        hidden, _, _ = self.decoder(tgt_tokens, memory, src_pad_mask, cache)
        return self.output_projection(hidden)  # (batch, tgt_len, vocab)

    def forward(self, src: Tensor, tgt_in: Tensor, project: bool = True) -> Tensor:
        """Teacher-forced logits: src (batch, src_len), tgt_in (batch, tgt_len) -> (batch, tgt_len, vocab).

        ``tgt_in`` is the target shifted right (BOS first), right-padded like ``src``. ``project=False``: the
        decoder's output before the pre-softmax linear transformation, (batch, tgt_len, d_model), for a loss that
        applies ``output_projection.weight`` itself (``LabelSmoothedCrossEntropy.projected``)."""
        memory, src_pad_mask = self.encode(src)
        hidden, _, _ = self.decoder(tgt_in, memory, src_pad_mask)  # (batch, tgt_len, d_model)
        return self.output_projection(hidden) if project else hidden

    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Attention weights of a teacher-forced pass, for heat-maps (call in eval mode, under no_grad).

        Returns {"encoder_self": (layers, batch, heads, src_len, src_len),
        "decoder_self": (layers, batch, heads, tgt_len, tgt_len),
        "encoder_decoder": (layers, batch, heads, tgt_len, src_len)}; rows sum to 1 over the keys.
        """
        src_pad_mask = src.eq(self.pad_id)
        memory, enc_self = self.encoder(src, src_pad_mask, need_weights=True)
        _, dec_self, dec_cross = self.decoder(tgt_in, memory, src_pad_mask, need_weights=True)
        return {
            "encoder_self": torch.stack(enc_self),
            "decoder_self": torch.stack(dec_self),
            "encoder_decoder": torch.stack(dec_cross),
        }

    # -------------------------------------------------------------------------------- incremental decoding

    def new_cache(self, group: int = 1) -> DecoderCache:
        """An empty cache for step-by-step decoding with :meth:`decode`. ``group`` > 1: every ``group``
        consecutive target rows belong to one source sentence, whose memory and mask are passed once (one row
        per sentence) on the first call (beam search; see :class:`model.cache.DecoderCache`)."""
        return DecoderCache.empty(len(self.decoder.layers), group)

    def new_static_cache(
        self, memory: Tensor, src_pad_mask: Tensor, *, group: int, max_len: int, position: Tensor
    ) -> StaticDecoderCache:
        """A fixed-shape cache for ``memory.size(0) * group`` decoder rows (``group`` consecutive rows per source
        sentence, as :meth:`new_cache`) and up to ``max_len`` target positions, encoder-decoder keys/values
        projected here from ``memory`` (batch, src_len, d_model) and ``src_pad_mask`` (batch, src_len). Each
        :meth:`decode` call writes at ``position`` ((1,) long, on memory's device), which the caller advances."""
        rows = memory.size(0) * group
        self_attn, cross_attn = [], []
        for layer in self.decoder.layers:
            attn = layer.self_attn
            key = memory.new_zeros(rows, attn.n_heads, max_len, attn.d_k)  # zeros: masked, but never NaN
            self_attn.append(StaticAttentionCache(key, torch.zeros_like(key), position))
            cross_attn.append(AttentionCache(*layer.cross_attn.memory_keys_values(memory), group=group))
        return StaticDecoderCache(self_attn, cross_attn, src_pad_mask, position)

    reorder_cache = staticmethod(reorder_cache)

    # ---------------------------------------------------------------------------------------------- sizes

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of distinct parameters (a shared matrix counts once). ``non_embedding`` leaves out token and
        learned position embeddings and the output projection."""
        embedding_params = {
            id(p)
            for m in (self.encoder, self.decoder)
            for p in (*m.embed_tokens.parameters(), *m.embed_positions.parameters())
        } | {id(self.output_projection.weight)}
        return sum(p.numel() for p in self.parameters() if not (non_embedding and id(p) in embedding_params))

    def flops_per_token(self, src_len: float, tgt_len: float) -> float:
        """Training FLOPs (forward + backward) per target token, for model-FLOPs-utilisation logging.

        Counts 2 FLOPs per multiply-add and backward = 2 x forward, so training = 3 x forward (the "6 x
        parameters per token" rule of Kaplan et al. 2020), for sentence pairs of ``src_len`` source and
        ``tgt_len`` target tokens (batch averages), S = src_len, T = tgt_len, d = d_model, V = vocab:

            forward = 2 S P_enc + 2 T (P_dec - P_kv) + 2 S P_kv + 2 T d V       (weight matrix products)
                    + N_enc 4 S^2 d + N_dec (4 T^2 d + 4 T S d)                  (Q K^T and A V products)
            flops_per_token = 3 forward / T

        P_enc, P_dec: parameters of the encoder / decoder layers (embedding lookups cost no FLOPs; LayerNorm
        and biases are counted as if they were weights, a <1% overcount); P_kv: the decoder's encoder-decoder
        W^K, W^V, applied to the S memory positions; 2 T d V: the pre-softmax projection, a real product even
        when its weight is the shared embedding. Causal masking is not discounted (the PaLM MFU convention).
        """
        d, vocab = self.config.d_model, self.config.vocab_size
        p_enc = sum(p.numel() for p in self.encoder.layers.parameters())
        p_dec = sum(p.numel() for p in self.decoder.layers.parameters())
        p_kv = sum(p.numel() for layer in self.decoder.layers for p in layer.cross_attn.kv_proj.parameters())
        n_enc, n_dec = len(self.encoder.layers), len(self.decoder.layers)
        s, t = float(src_len), float(tgt_len)
        forward = (
            2 * s * p_enc + 2 * t * (p_dec - p_kv) + 2 * s * p_kv + 2 * t * d * vocab
            + n_enc * 4 * s * s * d + n_dec * (4 * t * t * d + 4 * t * s * d)
        )  # fmt: skip
        return 3 * forward / t
