"""Multi-head attention (self and cross) over `scaled_dot_product_attention`, and the decoding cache.

Mask convention, used everywhere in this package: a boolean tensor, True = this query MAY attend to
this key. It is what `torch.nn.functional.scaled_dot_product_attention` expects, so masks go to
the kernel unchanged. Shapes broadcast to (B, H, Tq, Tk): a source padding mask is (B, 1, 1, S),
the decoder's causal-and-padding mask is (B, 1, T, T).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.positions import Rotary


def padding_mask(tokens: Tensor, *, pad_id: int) -> Tensor:
    """(B, T) token ids -> (B, 1, 1, T) mask that lets every query see the real tokens only."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(tokens: Tensor, *, pad_id: int, offset: int = 0) -> Tensor:
    """(B, T) target ids -> (B, 1, T, offset+T): query i (at position offset+i) sees keys 0..offset+i.

    Keys before `offset` are cached positions, assumed real (the decoder is fed unpadded prefixes
    step by step); padding among the new tokens is masked as keys.
    """
    length = tokens.size(1)
    query_pos = torch.arange(offset, offset + length, device=tokens.device)[:, None]
    key_pos = torch.arange(offset + length, device=tokens.device)[None, :]
    causal = key_pos <= query_pos  # (T, offset+T)
    is_real = tokens != pad_id
    if offset:
        is_real = torch.cat((is_real.new_ones(tokens.size(0), offset), is_real), dim=1)
    return causal[None, None] & is_real[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Queries from `x`, keys and values from `x` (self) or the encoder output (cross).

    Keys and values are projected by `keys_values()` separately from the attention itself, so the
    decoder can cache them: its self-attention appends one position per step, its cross-attention
    projects the source once per sentence.
    """

    def __init__(self, *, d_model: int, num_heads: int, attention_dropout: float, bias: bool = True):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)  # one matmul for keys and values
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def keys_values(self, x: Tensor, *, rotary: Rotary | None = None, offset: int = 0) -> tuple[Tensor, Tensor]:
        keys, values = self.kv_proj(x).chunk(2, dim=-1)  # (B, T, D) each
        keys, values = self.split_heads(keys), self.split_heads(values)  # (B, H, T, Dh)
        if rotary is not None:
            keys = rotary(keys, offset=offset)
        return keys, values

    def forward(
        self,
        x: Tensor,
        *,
        keys: Tensor,
        values: Tensor,
        mask: Tensor | None,
        position_bias: Tensor | None = None,
        rotary: Rotary | None = None,
        offset: int = 0,
    ) -> Tensor:
        # x: (B, Tq, D); keys, values: (B, H, Tk, Dh); mask: bool, broadcastable to (B, H, Tq, Tk)
        queries = self.split_heads(self.q_proj(x))  # (B, H, Tq, Dh)
        if rotary is not None:
            queries = rotary(queries, offset=offset)
        attn_mask = mask
        if position_bias is not None:
            # SDPA takes one additive float mask: the bias where attending is allowed, -inf elsewhere.
            attn_mask = position_bias.to(queries.dtype)
            if mask is not None:
                attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=attn_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )  # (B, H, Tq, Dh)
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, Tq, D)


@dataclass
class DecoderState:
    """What incremental decoding keeps between steps, per decoder layer.

    `self_keys`/`self_values` grow by the number of new target positions at every `decode` call;
    `cross_keys`/`cross_values` are the projected encoder output, filled on the first call and
    reused unchanged. All are (B, H, T, Dh). Rows are hypotheses: `reorder` selects, shuffles and
    duplicates them (beam search), or drops finished ones.
    """

    self_keys: list[Tensor] = field(default_factory=list)
    self_values: list[Tensor] = field(default_factory=list)
    cross_keys: list[Tensor] = field(default_factory=list)
    cross_values: list[Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Number of target positions cached so far."""
        return self.self_keys[0].size(2) if self.self_keys else 0

    def reorder(self, indices: Tensor) -> "DecoderState":
        """New state whose row j is this state's row indices[j]."""

        def select(tensors: list[Tensor]) -> list[Tensor]:
            return [t.index_select(0, indices) for t in tensors]

        return DecoderState(
            self_keys=select(self.self_keys),
            self_values=select(self.self_values),
            cross_keys=select(self.cross_keys),
            cross_values=select(self.cross_values),
        )
