"""The Transformer of "Attention Is All You Need" in pure PyTorch: layers, loss and learning-rate schedule.

Imports nothing from the rest of the project; the pipeline builds the model from ``ModelConfig`` with
``Transformer(model_config.architecture(vocab_size, pad_id))``, one :class:`TransformerConfig` passed down whole.
"""

from .attention import MultiHeadAttention, attention_with_weights
from .cache import AttentionCache, DecoderCache, StaticAttentionCache, StaticDecoderCache, reorder_cache
from .config import TransformerConfig
from .embedding import ScaledEmbedding
from .ensemble import Ensemble, EnsembleConfig
from .layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward, ResidualConnection
from .loss import LabelSmoothedCrossEntropy, symmetric_kl
from .positional import LearnedPositionalEmbedding, PositionalEncoding, sinusoid_table
from .schedule import TransformerLRLambda, cooldown_factor, ramped_lr, transformer_lr, transformer_lr_scheduler
from .static_decoding import StaticBeamSearch, static_beam_search
from .transformer import Decoder, Encoder, Transformer

__all__ = [
    "AttentionCache",
    "Decoder",
    "DecoderCache",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "Ensemble",
    "EnsembleConfig",
    "LabelSmoothedCrossEntropy",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "PositionalEncoding",
    "PositionwiseFeedForward",
    "ResidualConnection",
    "ScaledEmbedding",
    "StaticAttentionCache",
    "StaticBeamSearch",
    "StaticDecoderCache",
    "Transformer",
    "TransformerConfig",
    "TransformerLRLambda",
    "attention_with_weights",
    "cooldown_factor",
    "ramped_lr",
    "reorder_cache",
    "sinusoid_table",
    "static_beam_search",
    "symmetric_kl",
    "transformer_lr",
    "transformer_lr_scheduler",
]
