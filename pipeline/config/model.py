"""The ``model`` section: the encoder-decoder's hyperparameters (the paper's Table 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from pipeline.config.base import Strict

if TYPE_CHECKING:
    from model import TransformerConfig


class ModelConfig(Strict):
    """Encoder-decoder hyperparameters (paper Table 3 'base' by default)."""

    encoder_layers: int = Field(default=6, ge=1, description=(
        "Number of encoder layers. Paper: N = 6 (base and big), 4 for parsing."))
    decoder_layers: int = Field(default=6, ge=1, description=(
        "Number of decoder layers. Paper: N = 6 (base and big), 4 for parsing."))
    d_model: int = Field(default=512, ge=1, description=(
        "Width of the model (embeddings and every sub-layer's output). Paper: 512 base, 1024 big."))
    d_ff: int = Field(default=2048, ge=1, description=(
        "Inner size of the position-wise feed-forward network. Paper: 2048 base, 4096 big."))
    n_heads: int = Field(default=8, ge=1, description=(
        "Attention heads h; each head has d_k = d_v = d_model / h, so d_model must be divisible by it. "
        "Paper: 8 base, 16 big."))
    dropout: float = Field(default=0.1, ge=0, lt=1, description=(
        "P_drop: dropout on every sub-layer output before the residual add and on embeddings plus positions. "
        "Paper: 0.1 base, 0.3 big (0.1 for En-Fr)."))
    attention_dropout: float = Field(default=0.0, ge=0, lt=1, description=(
        "Dropout on the attention weights. 0 = off (the paper). Not in the paper."))
    activation_dropout: float = Field(default=0.0, ge=0, lt=1, description=(
        "Dropout inside the feed-forward network, after its activation. 0 = off (the paper). Not in the paper."))
    norm: Literal["post", "pre"] = Field(default="post", description=(
        "Where LayerNorm sits. post: LayerNorm(x + Dropout(Sublayer(x))) (the paper); pre: x + "
        "Dropout(Sublayer(LayerNorm(x))), a more stable variant."))
    positions: Literal["sinusoidal", "learned"] = Field(default="sinusoidal", description=(
        "Positional encoding: sinusoidal (the paper) or learned embeddings (Table 3 row E)."))
    share_embeddings: bool = Field(default=True, description=(
        "One weight matrix for the source embedding, the target embedding and the pre-softmax projection (the "
        "paper; needs the shared vocabulary)."))
    max_positions: int = Field(default=1024, ge=1, description=(
        "Longest sequence the model accepts, in tokens; a longer input is cut to fit (with a warning)."))

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads

    def architecture(self, vocab_size: int, pad_id: int) -> TransformerConfig:
        """This section with the vocabulary: what :class:`model.Transformer` is built from."""
        from model import TransformerConfig  # imports torch: only where a model is built

        return TransformerConfig(vocab_size=vocab_size, pad_id=pad_id, **self.model_dump())
