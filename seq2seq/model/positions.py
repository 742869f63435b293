"""Position information: absolute (sinusoidal, learned) and relative (T5 bias, rotary).

Absolute positions are added to the scaled token embeddings once, below the first layer.
Relative positions act inside self-attention: T5's bias is added to the attention scores,
rotary (RoPE) rotates queries and keys. Neither applies to cross-attention: a target position
and a source position have no meaningful offset from each other.
"""

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(*, max_positions: int, d_model: int) -> Tensor:
    """The paper's table: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    positions = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(max_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(positions * inv_freq)
    table[:, 1::2] = torch.cos(positions * inv_freq)[:, : d_model // 2]
    return table.float()  # (P, D)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoids; a buffer, not a parameter, and not saved (it is a pure function of the config)."""

    table: Tensor  # (P, D), a buffer: follows .to(device), not saved (computed from the config)

    def __init__(self, *, max_positions: int, d_model: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_positions=max_positions, d_model=d_model), persistent=False)

    def forward(self, length: int, *, offset: int = 0) -> Tensor:
        return self.table[offset : offset + length]  # (T, D)


class LearnedPositions(nn.Module):
    """One trained vector per position (BERT, fairseq's `--decoder-learned-pos`)."""

    def __init__(self, *, max_positions: int, d_model: int):
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=d_model**-0.5)

    def forward(self, length: int, *, offset: int = 0) -> Tensor:
        return self.embedding.weight[offset : offset + length]  # (T, D)


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucketing of `key_position - query_position` into `num_buckets` ids.

    Half of the buckets (per direction) hold exact offsets 0..max_exact-1; the rest cover offsets up to
    `max_distance` on a log scale, and everything farther shares the last bucket. Bidirectional
    (encoder) buckets spend half their range on keys to the right; unidirectional (decoder) ones
    only see keys to the left, so all buckets go to the past.
    """
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1) only keeps log() finite on the small distances that torch.where discards anyway.
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """T5's learned scalar bias per (head, bucket), shared by all layers of one stack."""

    def __init__(self, *, num_heads: int, bidirectional: bool, num_buckets: int, max_distance: int):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bias = nn.Embedding(num_buckets, num_heads)
        nn.init.normal_(self.bias.weight, mean=0.0, std=num_heads**-0.5)

    def forward(self, query_length: int, key_length: int, *, offset: int = 0) -> Tensor:
        # Queries sit at absolute positions offset..offset+Tq-1 (offset > 0 while decoding step by step).
        device = self.bias.weight.device
        query_pos = torch.arange(offset, offset + query_length, device=device)[:, None]
        key_pos = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(
            key_pos - query_pos,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )  # (Tq, Tk)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, H, Tq, Tk)


class Rotary(nn.Module):
    """RoPE (Su et al. 2021): rotate each (x_i, x_{i+Dh/2}) pair of a head by angle p * base^(-2i/Dh).

    Rotating queries and keys by their own positions makes q·k depend only on their offset. The
    half-split pairing (GPT-NeoX, Llama) is used because it needs no interleaving copies.
    """

    cos: Tensor  # (P, Dh/2) buffers, computed from the config, not saved
    sin: Tensor

    def __init__(self, *, head_dim: int, max_positions: int, base: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, got d_model/num_heads = {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq  # (P, Dh/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        # x: (B, H, T, Dh), positions offset..offset+T-1
        length = x.size(-2)
        cos = self.cos[offset : offset + length].to(x.dtype)  # (T, Dh/2)
        sin = self.sin[offset : offset + length].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
