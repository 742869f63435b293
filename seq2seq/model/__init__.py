"""The Transformer, in pure PyTorch: no Lightning, no I/O."""

from seq2seq.model.attention import DecoderState, MultiHeadAttention, causal_mask, padding_mask
from seq2seq.model.config import (
    ConfigError,
    TransformerConfig,
    transformer_base,
    transformer_big,
    transformer_small,
)
from seq2seq.model.transformer import Transformer

__all__ = [
    "ConfigError",
    "DecoderState",
    "MultiHeadAttention",
    "Transformer",
    "TransformerConfig",
    "causal_mask",
    "padding_mask",
    "transformer_base",
    "transformer_big",
    "transformer_small",
]
