"""How our Transformer's weights correspond to a Hugging Face MarianMTModel's: the one map that the
export (ours -> Marian, seq2seq/export.py) and the import (Marian -> ours, seq2seq/convert.py) both walk,
each in its own direction.

Marian's sinusoids put every sin in the first half of the channels and every cos in the second; ours
interleave them. Reordering the residual stream's channels the same way in every tensor that reads or
writes it (embeddings, projections, norms) leaves the model's function unchanged: `channel_order`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from seq2seq.model import TransformerConfig

Kind = Literal["attention", "norm", "reads", "writes"]
"""How a module meets the residual stream: an attention block (q, k, v read it, out writes it), a norm
(its weight and bias are per channel), a Linear that reads it (input channels) or writes it (output)."""


def channel_order(d_model: int) -> torch.Tensor:
    """Marian's channel i is our channel order[i]: marian = ours[..., order], ours = marian[..., order.argsort()]."""
    return torch.cat((torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)))


def layer_modules(config: TransformerConfig) -> Iterator[tuple[Kind, str, str]]:
    """(kind, our module, Marian's module) for every module inside the layers of both stacks."""
    for stack in ("encoder", "decoder"):
        layers = config.num_encoder_layers if stack == "encoder" else config.num_decoder_layers
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"model.{stack}.layers.{i}"
            yield "attention", f"{ours}.self_attn", f"{theirs}.self_attn"
            yield "norm", f"{ours}.self_attn_residual.norm", f"{theirs}.self_attn_layer_norm"
            if stack == "decoder":
                yield "attention", f"{ours}.cross_attn", f"{theirs}.encoder_attn"
                yield "norm", f"{ours}.cross_attn_residual.norm", f"{theirs}.encoder_attn_layer_norm"
            yield "reads", f"{ours}.ffn.w_in", f"{theirs}.fc1"
            yield "writes", f"{ours}.ffn.w_out", f"{theirs}.fc2"
            yield "norm", f"{ours}.ffn_residual.norm", f"{theirs}.final_layer_norm"
