"""The architecture of one Transformer as one object, passed whole from the model down to its layers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal


@dataclass(frozen=True)
class TransformerConfig:
    """What :class:`model.Transformer` is built from (paper Table 3 "base" by default); the pipeline's
    ``ModelConfig`` adds the vocabulary (``ModelConfig.architecture``). A checkpoint stores :meth:`to_dict` and
    :meth:`from_dict` rebuilds the same architecture."""

    vocab_size: int
    pad_id: int
    encoder_layers: int = 6  # N
    decoder_layers: int = 6  # N
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8  # h
    dropout: float = 0.1  # P_drop: sub-layer outputs, embeddings plus positions
    attention_dropout: float = 0.0  # on the attention weights; 0 in the paper
    activation_dropout: float = 0.0  # after the feed-forward network's ReLU; 0 in the paper
    norm: Literal["post", "pre"] = "post"
    positions: Literal["sinusoidal", "learned"] = "sinusoidal"
    share_embeddings: bool = True
    max_positions: int = 1024

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {self.norm!r}")
        if self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {self.positions!r}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id ({self.pad_id}) must be a token id in [0, {self.vocab_size})")

    @property
    def d_k(self) -> int:
        """d_k = d_v = d_model / h."""
        return self.d_model // self.n_heads

    @property
    def pre_norm(self) -> bool:
        return self.norm == "pre"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what a checkpoint holds, loadable with ``weights_only=True``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TransformerConfig:
        """The config :meth:`to_dict` wrote; a key that is not a field is refused, naming it."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"not fields of the model's architecture: {', '.join(unknown)}")
        return cls(**values)
