"""TransformerConfig: the model's whole schema, saved in every checkpoint; and the standard presets.

It lives apart from transformer.py so that the layers can take it too (as nanoGPT's blocks take
their config) without an import cycle.
"""

from dataclasses import asdict, dataclass
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int
    """Size of the shared source/target vocabulary (comes from the tokenizer)."""
    d_model: int = 512
    """Width of embeddings and of every residual stream."""
    num_heads: int = 8
    """Attention heads per attention block; d_model must be divisible by it."""
    d_ff: int = 2048
    """Hidden width of the position-wise feed-forward network (per branch for the GLU family)."""
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    """On embeddings and on every sub-layer output before the residual add."""
    attention_dropout: float = 0.0
    """On attention probabilities."""
    activation_dropout: float = 0.0
    """Inside the feed-forward network, after the activation."""
    max_positions: int = 1024
    """Longest source or target sequence (in tokens) the model accepts."""
    pad_id: int = 0
    """Padding token id; masks are built from it and its embedding row is zero."""
    positions: Literal["sinusoidal", "learned", "relative", "rotary"] = "sinusoidal"
    """Absolute sinusoids (paper), absolute learned vectors, T5 relative bias, or rotary (RoPE)."""
    relative_buckets: int = 32
    """T5 relative bias: number of buckets."""
    relative_max_distance: int = 128
    """T5 relative bias: offsets beyond this share the last bucket."""
    rotary_base: float = 10000.0
    """RoPE: base of the rotation frequencies."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_placement: Literal["post", "pre", "sandwich", "deepnorm"] = "post"
    """post (paper), pre (+ final norm), sandwich (+ final norm) or DeepNorm (post with alpha/beta)."""
    norm_eps: float = 1e-5
    activation: Literal["relu", "gelu", "swish", "glu", "swiglu", "geglu"] = "relu"
    tie_embeddings: Literal["none", "decoder", "all"] = "all"
    """none; decoder input embedding = output projection; all three shared (needs the shared vocabulary)."""
    scale_embeddings: bool = True
    """Multiply token embeddings by sqrt(d_model), as the paper does."""

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"positions='rotary' needs an even head size, got {self.d_model // self.num_heads}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id ({self.pad_id}) must be a token id below vocab_size ({self.vocab_size})")
        if self.num_encoder_layers < 1 or self.num_decoder_layers < 1:
            raise ValueError("the model needs at least one encoder and one decoder layer")

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint holding it loads with torch.load(weights_only=True)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TransformerConfig":
        return cls(**values)


def transformer_base(*, vocab_size: int) -> TransformerConfig:
    """The paper's base model: 512 wide, 8 heads, FFN 2048, 6+6 layers, dropout 0.1 (~60M with 32k vocab)."""
    return TransformerConfig(vocab_size=vocab_size)


def transformer_big(*, vocab_size: int) -> TransformerConfig:
    """The paper's big model: 1024 wide, 16 heads, FFN 4096, 6+6 layers, dropout 0.3 (as for WMT14 en-de)."""
    return TransformerConfig(vocab_size=vocab_size, d_model=1024, num_heads=16, d_ff=4096, dropout=0.3)


def transformer_small(*, vocab_size: int) -> TransformerConfig:
    """A small model for ~30k-pair corpora such as Multi30k and for CPUs: 256 wide, 4 heads, 3+3 layers."""
    return TransformerConfig(
        vocab_size=vocab_size, d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3
    )
