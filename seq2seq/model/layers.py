"""Norms, feed-forward variants, residual placements, and the encoder and decoder layers.

Residual placement around each sub-layer f (attention or feed-forward), with dropout `drop`:
    post      x = norm(x + drop(f(x)))                   the paper; no final norm
    pre       x = x + drop(f(norm(x)))                   + a final norm after the stack
    sandwich  x = x + drop(norm_out(f(norm_in(x))))      CogView; + a final norm after the stack
    deepnorm  x = norm(alpha * x + drop(f(x)))           DeepNet (Wang et al. 2022); alpha per stack,
                                                         plus a beta init scaling (see transformer.py)
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.attention import Attend, MultiHeadAttention
from seq2seq.model.config import TransformerConfig
from seq2seq.model.numerics import PackedLinear
from seq2seq.model.positions import Rotary

CacheExtender = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""(new keys, new values) -> (all keys, all values) of one layer's self-attention (DecoderState.extend)."""

GATED: dict[str, Callable[[Tensor], Tensor]] = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}
PLAIN: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}


class Dropout(nn.Module):
    """nn.Dropout, with a cheaper random mask on CPU.

    On CPU, torch's dropout draws one Bernoulli sample per element. Here each random 64-bit word gives
    four 16-bit uniforms, which makes dropout and the training step faster (bench/train_ablation.py;
    docs/results/training-speed.md has its figures), and backward keeps a bool mask. `p` is rounded to a multiple of
    1/65536. Other devices use F.dropout, which is fused on GPUs.
    """

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        # Under torch.compile, F.dropout: inductor draws the mask inside the fused kernel (random_ is not traced)
        if x.device.type != "cpu" or self.p == 1.0 or torch.compiler.is_compiling():
            return F.dropout(x, self.p, training=True)
        words = torch.empty((x.numel() + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), 2**63 - 1)
        uniform16 = words.view(torch.int16)[: x.numel()].view(x.shape)  # uniform on [-32768, 32767]
        keep = uniform16 >= round(self.p * 65536) - 32768  # P(keep) = 1 - round(p * 65536) / 65536
        # A product with the mask, not torch.where: a faster pass each way (backward is the same product), the
        # same values (a dropped position is a zero, signed as x was)
        return x * keep * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm, whose weight meets a bf16 or float16 input under autocast (the residual stream: Embedder; a
    sandwich norm's sub-layer output) in the input's dtype: torch's fused kernel takes one dtype (LayerNorm's takes
    a low-precision input with float32 parameters), and its unfused path warns. The statistics are float32 either
    way; the weight's gradient comes back float32."""

    def forward(self, x: Tensor) -> Tensor:
        weight: Tensor | None = self.weight
        if weight is not None and weight.dtype != x.dtype and x.dtype in (torch.bfloat16, torch.float16):
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def make_norm(config: TransformerConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.d_model, eps=config.norm_eps)
    return RMSNorm(config.d_model, eps=config.norm_eps)


class FeedForward(nn.Module):
    """Position-wise FFN: w_out(act(w_in x)), or for the GLU family w_out(act(x W) * (x V)).

    The gated variants fuse W and V into one `w_in` of width 2*d_ff (one matmul instead of two).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.gated = config.activation in GATED
        self.act = GATED[config.activation] if self.gated else PLAIN[config.activation]
        self.w_in = nn.Linear(config.d_model, 2 * config.d_ff if self.gated else config.d_ff)
        self.w_out = nn.Linear(config.d_ff, config.d_model)
        self.dropout = Dropout(config.activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.act is F.relu and isinstance(self.w_in, PackedLinear):
            return self.w_out(self.dropout(self.w_in.then_relu(x)))  # (B, T, D)
        hidden = self.w_in(x)  # (B, T, d_ff) or (B, T, 2*d_ff)
        if self.gated:
            gate, linear = hidden.chunk(2, dim=-1)
            hidden = self.act(gate) * linear
        else:
            hidden = self.act(hidden)
        return self.w_out(self.dropout(hidden))  # (B, T, D)


class Residual(nn.Module):
    """One sub-layer's norm(s), dropout and skip connection, in the chosen placement."""

    def __init__(self, config: TransformerConfig, *, alpha: float):
        super().__init__()
        self.placement = config.norm_placement
        self.alpha = alpha  # DeepNorm's residual scale; 1 for the other placements
        self.norm = make_norm(config)
        self.norm_out = make_norm(config) if self.placement == "sandwich" else None
        self.dropout = Dropout(config.dropout)

    def before(self, x: Tensor) -> Tensor:
        """The sub-layer's input."""
        return self.norm(x) if self.placement in ("pre", "sandwich") else x

    def after(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """Combine the residual stream `x` with the sub-layer's output."""
        if self.norm_out is not None:
            sublayer_out = self.norm_out(sublayer_out)
        sublayer_out = self.dropout(sublayer_out)
        if self.placement in ("pre", "sandwich"):
            return x + sublayer_out
        return self.norm(self.alpha * x + sublayer_out)


def attention(config: TransformerConfig) -> MultiHeadAttention:
    return MultiHeadAttention(d_model=config.d_model, num_heads=config.num_heads,
                              attention_dropout=config.attention_dropout)


class EncoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, *, alpha: float):
        super().__init__()
        self.self_attn = attention(config)
        self.self_attn_residual = Residual(config, alpha=alpha)
        self.ffn = FeedForward(config)
        self.ffn_residual = Residual(config, alpha=alpha)

    def forward(
        self, x: Tensor, *, mask: Tensor, position_bias: Tensor | None = None, rotary: Rotary | None = None,
        attend: Attend | None = None,
    ) -> Tensor:
        # x: (B, S, D); mask: (B, 1, 1, S); attend: the self-attention's in place of the masked one (MultiHeadAttention)
        h = self.self_attn_residual.before(x)
        queries, keys, values = self.self_attn.self_projections(h, rotary=rotary)
        h = self.self_attn(h, queries=queries, keys=keys, values=values, mask=mask, position_bias=position_bias,
                           rotary=rotary, attend=attend)
        x = self.self_attn_residual.after(x, h)
        return self.ffn_residual.after(x, self.ffn(self.ffn_residual.before(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerConfig, *, alpha: float):
        super().__init__()
        self.self_attn = attention(config)
        self.self_attn_residual = Residual(config, alpha=alpha)
        self.cross_attn = attention(config)
        self.cross_attn_residual = Residual(config, alpha=alpha)
        self.ffn = FeedForward(config)
        self.ffn_residual = Residual(config, alpha=alpha)

    def forward(
        self,
        x: Tensor,
        *,
        extend_cache: CacheExtender | None,
        cross_kv: tuple[Tensor, Tensor],
        self_mask: Tensor | None,
        cross_mask: Tensor,
        position_bias: Tensor | None = None,
        rotary: Rotary | None = None,
        offset: int = 0,
        cross_weights: list[Tensor] | None = None,
        self_attend: Attend | None = None,
        cross_attend: Attend | None = None,
    ) -> Tensor:
        """One layer over the new target positions offset..offset+T-1.

        x: (R, T, D); extend_cache: stores these positions' self-attention keys/values after the
        cached ones of positions 0..offset-1 and returns them all (None: no cache, offset 0), in a
        DecoderState or, in the compiled step, a cache of fixed shape written at a tensor position;
        cross_kv: the projected source, (N, H, S, Dh) each, N = R or R / beams (see MultiHeadAttention);
        cross_weights: where to append the cross-attention's probabilities, (R, H, T, S) (MultiHeadAttention.weights;
        one memory row per target row), for reading where each target position looked;
        self_attend, cross_attend: the attentions in place of the masked ones (MultiHeadAttention; the compiled
        step's kernel), the masks then unused.
        """
        h = self.self_attn_residual.before(x)
        queries, keys, values = self.self_attn.self_projections(h, rotary=rotary, offset=offset)  # (R, H, T, Dh)
        if extend_cache is not None:
            keys, values = extend_cache(keys, values)  # (R, H, offset+T, Dh); nothing before offset recomputed
        h = self.self_attn(h, queries=queries, keys=keys, values=values, mask=self_mask, position_bias=position_bias,
                           rotary=rotary, offset=offset, attend=self_attend)
        x = self.self_attn_residual.after(x, h)

        h = self.cross_attn_residual.before(x)
        cross_queries = None
        if cross_weights is not None:  # the queries projected once, for the weights and the attention
            cross_queries = self.cross_attn.split_heads(self.cross_attn.q_proj(h))  # (R, H, T, Dh)
            cross_weights.append(self.cross_attn.weights(cross_queries, keys=cross_kv[0], mask=cross_mask))
        h = self.cross_attn(h, queries=cross_queries, keys=cross_kv[0], values=cross_kv[1], mask=cross_mask,
                            attend=cross_attend)
        x = self.cross_attn_residual.after(x, h)

        return self.ffn_residual.after(x, self.ffn(self.ffn_residual.before(x)))
