"""TransformerConfig: the model's whole schema, saved in every checkpoint; and the standard presets.

It lives apart from transformer.py so that the layers can take it too (as nanoGPT's blocks take
their config) without an import cycle.
"""

import math
import typing
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A field of a config dataclass has a bad value; `field` names it, so a CLI can name its flag."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check_field_types(config: Any) -> None:
    """Raise ConfigError for a field whose value is not of its annotated type (Literal choices included).

    Dataclasses check nothing themselves, and a value from YAML, JSON or a checkpoint can be
    anything: `norm: rms` would otherwise fall through to some default branch of the model code.
    """
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
        if not any(_is_instance(value, t) for t in allowed):
            choices = [c for t in allowed for c in (typing.get_args(t) if typing.get_origin(t) is Literal else ())]
            expected = f"one of {choices}" if choices else " or ".join(_type_name(t) for t in allowed)
            raise ConfigError(f.name, f"expected {expected}, got {value!r}")


_UnionType = type(int | None)


def _is_instance(value: Any, hint: Any) -> bool:
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if hint is float:  # an int is a float here (YAML writes 1 for 1.0); a bool is not a number
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))


def check_range(config: Any, name: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """Raise ConfigError unless the numeric field `name` is finite and inside the given bounds."""
    value = getattr(config, name)
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # ints are finite (isfinite overflows on 10**400)
        raise ConfigError(name, f"must be a finite number, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = "" if low is None else f"{'>' if low_open else '>='} {low}"
        right = "" if high is None else f"{'<' if high_open else '<='} {high}"
        raise ConfigError(name, f"must be {' and '.join(x for x in (left, right) if x)}, got {value}")


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
    output_bias: bool = False
    """A bias on the output projection (the paper has none; Marian's models do: final_logits_bias)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "d_model", "num_heads", "d_ff", "num_encoder_layers", "num_decoder_layers",
                     "max_positions", "relative_buckets", "relative_max_distance"):
            check_range(self, name, low=1)
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            check_range(self, name, low=0, high=1, high_open=True)
        check_range(self, "rotary_base", low=1, low_open=True)
        check_range(self, "norm_eps", low=0, low_open=True)
        if self.d_model % self.num_heads:
            raise ConfigError("num_heads", f"d_model ({self.d_model}) must be divisible by it, got {self.num_heads}")
        if self.positions == "rotary" and (self.d_model // self.num_heads) % 2:
            raise ConfigError("positions", f"'rotary' needs an even head size, got {self.d_model // self.num_heads}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError("pad_id", f"must be a token id below vocab_size ({self.vocab_size}), got {self.pad_id}")

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, so a checkpoint holding it loads with torch.load(weights_only=True)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TransformerConfig":
        """The config a dict describes (a checkpoint's); an unknown or missing key is a ConfigError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(unknown[0], f"is not a TransformerConfig field (known: {', '.join(sorted(names))})")
        if "vocab_size" not in values:
            raise ConfigError("vocab_size", "is missing")
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
