"""The functions the compiled decoder (model/compiled.py) compiles: the encoder with the attention kernel, the
projection of the memory's real positions into every layer's cross-attention keys and values, and the decoder's
one-token step over a cache of fixed shape, with the search's work on its logits.

For dynamo to trace the step once and replay it, it has no Python state and no branch on the data: the decoding
cache is one buffer per layer, (R, H, capacity, Dh), written in place at a position given as a tensor, and every
length is a symbolic size (`dynamic=True`). The encoder is the model's own, compiled as it is (one graph for one
sentence, one for several), and so is the projection of its memory.

The arithmetic is the model's own layers (EncoderLayer, DecoderLayer: norms, residual placements, projections,
feed-forward), given the attention kernel (or the attention written out) and the step's cache writer, so the
compiled step computes what `Transformer.decode` computes, to the kernels' rounding. Relative (T5) and rotary
positions act inside self-attention at positions given as Python ints: they are not written out here, and a
model that uses them is refused (`check_compilable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.model.attention import Attend, fold_beams, unfold_beams
from seq2seq.model.config import TransformerConfig
from seq2seq.model.layers import CacheExtender, DecoderLayer
from seq2seq.model.transformer import Transformer

COMPILABLE_POSITIONS = ("sinusoidal", "learned")


def check_compilable(config: TransformerConfig) -> None:
    """ValueError, one line, for a model the compiled step does not write out."""
    if config.positions not in COMPILABLE_POSITIONS:
        raise ValueError(f"compiled decoding covers absolute positions ({', '.join(COMPILABLE_POSITIONS)}); this "
                         f"model's are {config.positions!r}: decode without compile")


def cross_keys_values(model: Transformer, *, memory: Tensor, places: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
    """memory (N, S, D) -> each decoder layer's cross-attention keys and values (N, H, S, Dh), contiguous (read at
    every step): from the model's stacked projection (Transformer.stack_cross_projections), else layer by layer.

    With `places` (N, S) long, `memory` is the real source positions' alone, (T, D), and places[n, s] the row of it
    at sentence n's position s, T at padding, whose keys and values are zeros (masked; finite, as the attention's
    zero weights times them must be): padding is not projected."""
    layers = cast(list[DecoderLayer], list(model.decoder.layers))
    stacked = model.decoder.cross_kv_proj
    projected = [stacked(memory)] if stacked is not None else [layer.cross_attn.kv_proj(memory) for layer in layers]
    if places is not None:  # (T, C) -> (N, S, C): a zero row appended for the padding to take
        projected = [F.pad(kv, (0, 0, 0, 1))[places] for kv in projected]
    if stacked is not None:
        projected = list(projected[0].chunk(len(layers), dim=-1))  # (N, S, 2D) each
    pairs = [layer.cross_attn.split_keys_values(kv) for layer, kv in zip(layers, projected, strict=True)]
    return [(keys.contiguous(), values.contiguous()) for keys, values in pairs]


def cross_projection(model: Transformer, *, dtype: torch.dtype) -> Callable[[Tensor, Tensor, Tensor], list[Tensor]]:
    """project(memory (N, S, D), real (T,), places (N, S)) -> [keys, values] of each decoder layer in turn, (N, H, S,
    Dh) each in `dtype` (the decoder's): cross_keys_values over the memory's real positions alone, the flat indices
    `real` of memory.view(N * S, D) (the rows of cross_keys_values' `places`), written for torch.compile (a flat list
    out; the rows gathered and taken to `dtype` inside, in the pass that quantises them where the projection is int8).
    A batch's sources are padded to its longest, and a batch of sentences of many lengths is largely padding, which
    the projection's matmul, its epilogue and the copies into the heads' layout would work through
    (docs/performance/compiled-decoding.md#cross-projection)."""

    def project(memory: Tensor, real: Tensor, places: Tensor) -> list[Tensor]:
        tokens = memory.reshape(-1, memory.size(-1)).index_select(0, real).to(dtype)  # (T, D)
        return [x for pair in cross_keys_values(model, memory=tokens, places=places) for x in pair]

    return project


def real_positions(src_mask: Tensor) -> tuple[Tensor, Tensor]:
    """src_mask (N, S) -> cross_projection's `real` (T,), the flat indices of the real positions, and `places` (N, S),
    each position's index in `real`, T at padding. Fewer than two real positions (one one-token sentence, its mask
    padded to two) take the padding in too: a size of 1 would be a graph apart."""
    flat = src_mask.reshape(-1)
    real = flat.nonzero()[:, 0] if int(flat.sum()) >= 2 else torch.arange(flat.numel(), device=flat.device)
    places = torch.full_like(flat, real.numel(), dtype=torch.long).index_copy_(
        0, real, torch.arange(real.numel(), device=flat.device))
    return real, places.view(src_mask.shape)


def step_chunk_maxima(logits: Tensor, *, chunk: int) -> Tensor:
    """logits (R, V) -> the maxima of each row's whole chunks of `chunk` columns (R, V // chunk) float32 (a last,
    partial chunk left out): decoding/ranking.py's top_k_rows bounds, its chunk_maxima's numbers (a maximum is exact) written
    for the step's generated code, which computes them as the logits are written, from logits of the decoder's dtype
    (search's strides a contiguous float32 block eagerly: on bf16 logits, a pass as slow as the output layer's
    matmul)."""
    rows, vocab = logits.shape
    body = vocab // chunk * chunk
    return logits[:, :body].float().reshape(rows, vocab // chunk, chunk).amax(dim=-1)


def chunk_argmax(logits: Tensor, *, maxima: Tensor, chunk: int) -> Tensor:
    """logits (R, V) and the maxima of their chunks (step_chunk_maxima's) -> each row's argmax (R,) long, the first of
    equal maxima, as torch.argmax gives it: the first chunk holding the row's maximum ranked alone, and the last,
    partial chunk, which wins only above it. Greedy search's pick made in the step's generated code, which a search
    of one hypothesis per sentence takes where its constraints did not lower the logit (search.greedy): eager, on
    the logits the step returns, ranking them was the search's largest work between two steps."""
    vocab = logits.size(1)
    first = maxima.argmax(dim=-1)  # (R,)
    columns = first[:, None] * chunk + torch.arange(chunk, device=logits.device)  # (R, chunk)
    values = logits.gather(1, columns)  # (R, chunk)
    best = first * chunk + values.argmax(dim=-1)  # (R,)
    body = maxima.size(1) * chunk
    if body < vocab:
        rest = logits[:, body:]  # (R, V - body)
        above = rest.amax(dim=-1) > values.amax(dim=-1)  # (R,)
        best = torch.where(above, body + rest.argmax(dim=-1), best)
    return best


def step_log_normalizer(logits: Tensor, *, maxima: Tensor | None = None, chunk: int = 0) -> Tensor:
    """logits (R, V) -> log(sum(exp(logits))) (R,) float32, the row maximum subtracted first: decoding/ranking.py's log_normalizer's
    numbers to float32's rounding, written for the step's generated code (one fused pass, where search's eager
    blocks of rows make five; docs/performance/compiled-decoding.md#search-in-step); the maximum taken from the
    maxima of the chunks of `chunk` columns (R, V // chunk) where given, and the last, partial chunk's (a pass
    fewer)."""
    x = logits.float()
    if maxima is None:
        peak = x.amax(dim=-1, keepdim=True)  # (R, 1)
    else:
        peak = maxima.amax(dim=-1, keepdim=True)
        body = maxima.size(1) * chunk
        if body < x.size(1):
            peak = torch.maximum(peak, x[:, body:].amax(dim=-1, keepdim=True))
    return (x - peak).exp().sum(dim=-1).log() + peak[:, 0]


StepOutputs = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]
"""The compiled step's logits (R, V), their log-normaliser (R,), their chunk maxima (R, V // chunk) and their argmax
(R,): search.StepDecoder's decode_step's."""

Step = Callable[[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor], list[Tensor], Tensor], StepOutputs]

AttentionKernel = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""model/kernels.py's decode_attention: (queries (B, Q, H * Dh), keys and values (B, H, S, Dh), lengths (B,)) -> (B, Q,
H * Dh), each row over its first lengths[b] positions."""


def kernel_attend(kernel: AttentionKernel, *, lengths: Tensor) -> Attend:
    """The layers' `attend` (model/attention.py) by the attention kernel: each row of keys n over its first lengths[n]
    positions (lengths (N,)), the queries of its beams and positions at once. The queries go in, and the output comes
    out, with the heads after the query, as the projections make them and the output projection takes them: no
    copies around the kernel."""

    def attend(queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        rows, heads, length, head_dim = queries.shape  # (R, H, T, Dh)
        joined = queries.transpose(1, 2).reshape(keys.size(0), -1, heads * head_dim)  # (N, K * T, D)
        return kernel(joined, keys, values, lengths).view(rows, length, -1)  # (R, T, D)

    return attend


def attend_masked(queries: Tensor, keys: Tensor, values: Tensor, *, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v, masked, written out for inductor to fuse, where the step's attention kernel is not
    (a GPU; SDPA would be an opaque kernel): (B, H, Tq, Dh) from queries (B, H, Tq, Dh), keys and values (B, H, Tk,
    Dh), a boolean mask broadcastable to (B, H, Tq, Tk); every query sees a key."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * queries.size(-1) ** -0.5  # (B, H, Tq, Tk)
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), values)


def written_out_attend(*, mask: Tensor) -> Attend:
    """The layers' `attend` (model/attention.py) written out (`attend_masked`) where the kernel is not: `mask`
    broadcastable to (N, H, K * T, S), a sentence's K beams folded into its queries as MultiHeadAttention folds them."""

    def attend(queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        rows, _, length, _ = queries.shape  # (R, H, T, Dh)
        folded = fold_beams(queries, sentences=keys.size(0))  # (N, H, K * T, Dh)
        out = unfold_beams(attend_masked(folded, keys, values, mask=mask), beams=rows // keys.size(0))  # (R, H, T, Dh)
        return out.transpose(1, 2).reshape(rows, length, -1)  # (R, T, D)

    return attend


def cache_writer(keys: Tensor, values: Tensor, *, position: Tensor) -> CacheExtender:
    """The layer's `extend_cache` over one layer's buffers, (R, H, capacity, Dh) each: the new keys and values (R, H,
    1, Dh) written in place at `position` (a tensor, () long: no Python int for dynamo to specialise on), the whole
    buffers returned (the attention sees the positions up to `position`)."""

    def write(new_keys: Tensor, new_values: Tensor) -> tuple[Tensor, Tensor]:
        keys[:, :, position.view(1)] = new_keys
        values[:, :, position.view(1)] = new_values
        return keys, values

    return write


def encoder_memory(model: Transformer, *, kernel: AttentionKernel | None = None) -> Callable[[Tensor], Tensor]:
    """memory(src (B, S)) -> (B, S, D), zero at padding: the model's encoder (Transformer._memory) with the attention
    kernel for its self-attention where given (each sentence over its own length), in place of torch's SDPA on a CPU
    (docs/performance/compiled-decoding.md#attention-kernel)."""
    if kernel is None:
        return model._memory

    def memory(src: Tensor) -> Tensor:
        lengths = model.src_mask(src).sum(dim=-1)  # (B,): right-padded sources
        return model._memory(src, attend=kernel_attend(kernel, lengths=lengths))

    return memory


def decoder_step(model: Transformer, *, chunk: int, kernel: AttentionKernel | None = None) -> Step:
    """step(tokens (N, K), position () long, keys, values, cross_keys, cross_values, src_mask (N, S) bool) -> logits
    (R, V), their log-normaliser (R,), the maxima of their chunks (R, V // chunk) and their argmax (R,): `model`'s
    decoder layers fed one token per row at `position`, each writing that position's self-attention keys and values
    into keys[i] and values[i] (R, H, capacity, Dh) in place (`cache_writer`) and attending over positions up to
    `position`; R = N * K rows, a sentence's K hypotheses adjacent (they share its cross keys/values, as
    MultiHeadAttention folds them). Both attentions are the layers' with `kernel` in place of torch's (each row over
    its own positions, the cross-attention's over its source's length, src_mask being a right-padded batch's), else
    written out (`written_out_attend`, masked: a sentence's padding and the cache's unwritten positions read).

    The tokens come as (N, K), not (R,), so that the beams K are a size of their own and the rows their product:
    with K as rows // N, and the head size a symbol of the caches' shapes, every index of the cross-attention's
    folding and of the quantising after it would hold floor divisions of symbols, which inductor compiles to a scalar
    loop (docs/performance/compiled-decoding.md#dynamic-shapes).

    The normaliser is computed where the search always takes it, with beams (K > 1), and is None without: greedy
    search without scores takes none, and the few rows of one hypothesis per sentence are left to the search. The
    argmax is computed where greedy search takes it, without beams (K = 1), from the chunk maxima (None without)."""
    check_compilable(model.config)
    decoder = model.decoder
    layers = cast(list[DecoderLayer], list(decoder.layers))
    embed = decoder.embed
    positions = embed.positions
    assert positions is not None  # absolute positions (check_compilable)

    heads = model.config.num_heads
    head_dim = model.config.d_model // heads

    def step(tokens: Tensor, position: Tensor, keys: list[Tensor], values: list[Tensor], cross_keys: list[Tensor],
             cross_values: list[Tensor], src_mask: Tensor) -> StepOutputs:
        sentences, beams = tokens.shape
        rows = sentences * beams
        tokens = tokens.reshape(rows)
        for cache in (*keys, *values, *cross_keys, *cross_values):  # (heads and head size constants, as the
            # projections' views make them)
            torch._check(cache.size(1) == heads)
            torch._check(cache.size(3) == head_dim)
        for cache in (*keys, *values):  # (every layer's cache of one shape, the cross keys' and values' of another:
            # sizes told equal are one symbol, and the attention kernel, an operator inductor hands each whole tensor,
            # would otherwise have every cache's sizes passed to the graph apart, each a tensor made at every step)
            torch._check(cache.size(0) == rows)
            torch._check(cache.size(2) == keys[0].size(2))
        for cache in (*cross_keys, *cross_values):
            torch._check(cache.size(0) == sentences)
            torch._check(cache.size(2) == src_mask.size(1))
        table = positions(model.config.max_positions)  # (P, D)
        x = embed.tokens(tokens[:, None]) * embed.scale + table.index_select(0, position.view(1))  # (R, 1, D)
        x = embed.dropout(x)
        cross_mask = src_mask[:, None, None, :]  # (N, 1, 1, S)
        if kernel is not None:
            self_attend = kernel_attend(kernel, lengths=(position + 1).view(1).expand(rows))  # (R,)
            cross_attend = kernel_attend(kernel, lengths=src_mask.sum(dim=-1))  # (N,)
        else:
            cached = torch.arange(keys[0].size(2), device=x.device) <= position  # (capacity,)
            self_attend = written_out_attend(mask=cached[None, None, None, :])  # (1, 1, 1, capacity)
            cross_attend = written_out_attend(mask=cross_mask)
        for i, layer in enumerate(layers):
            x = layer(x, extend_cache=cache_writer(keys[i], values[i], position=position),
                      cross_kv=(cross_keys[i], cross_values[i]), self_mask=None, cross_mask=cross_mask,
                      self_attend=self_attend, cross_attend=cross_attend)  # (R, 1, D)
        if decoder.final_norm is not None:
            x = decoder.final_norm(x)
        logits = model.output_projection(x)[:, 0]  # (R, V)
        maxima = step_chunk_maxima(logits, chunk=chunk) if logits.size(1) >= 4 * chunk else None  # (top_k_rows ranks
        # fewer columns whole: no chunks); `beams > 1` is a guard on the sizes: the kinds of call are apart already
        if beams > 1:
            return logits, step_log_normalizer(logits, maxima=maxima, chunk=chunk), maxima, None
        return logits, None, maxima, None if maxima is None else chunk_argmax(logits, maxima=maxima, chunk=chunk)

    return step
