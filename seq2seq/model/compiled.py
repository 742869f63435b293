"""The decoder's one-token step written for torch.compile, over a cache of fixed shape; and the encoder compiled.

At a few rows a decoding step is mostly overhead between kernels: each eager op and each linear layer's
oneDNN call costs more than its arithmetic (README, "A compiled decoding step"). Compiled, the step is
one function of generated code in which the matmuls' micro-kernels (inductor's CPP GEMM templates: AMX
or AVX-512 on a CPU) sit among the fused element-wise work. For dynamo to trace it once and replay it,
the step has no Python state and no branch on the data: the decoding cache is one buffer per layer,
(R, H, capacity, Dh), written in place at a position given as a tensor, and every length is a symbolic
size (`dynamic=True`), so a growing cache, changing rows and sources of any length reuse the graphs
compiled for them: one per kind of call (one row; one sentence's beams; several sentences; several with beams).
The encoder is the model's own, compiled as it is (one graph for one sentence, one for several), and so is the
projection of its memory into every layer's cross-attention keys and values.

The arithmetic is the model's own modules (norms, residual placements, projections, feed-forward), so
the compiled step computes what `Transformer.decode` computes, to the kernels' rounding. Relative (T5)
and rotary positions act inside self-attention at positions given as Python ints: they are not written
out here, and a model that uses them is refused (`check_compilable`).

    src (N, S) ──compiled encoder──► memory (N, S, D)
    memory ──compiled cross keys/values, once──► CompiledState ◄── reorder (beams, finished sentences)
    tgt_in (R, 1), position ──compiled step──► logits (R, V), the cache written at `position`;
                                               the search's normaliser (R,) and chunk maxima of the logits
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.attention import CACHE_GROWTH, Attend, fold_beams, unfold_beams
from seq2seq.model.config import TransformerConfig
from seq2seq.model.inductor import (
    CPP_WRAPPER,
    GEMM_TEMPLATES,
    QUIET,
    T,
    compile_frozen,
    inductor_backend,
    one_line_compile_errors,
    quiet_compile_warnings,
    tracing_settings,
)
from seq2seq.model.inductor import CompileError as CompileError  # (its users import it from here)
from seq2seq.model.kernels import decode_attention_op
from seq2seq.model.layers import CacheExtender, DecoderLayer
from seq2seq.model.numerics import RowInt8Linear, replace_linears
from seq2seq.model.transformer import Transformer, check_length

COMPILABLE_POSITIONS = ("sinusoidal", "learned")


def check_compilable(config: TransformerConfig) -> None:
    """ValueError, one line, for a model the compiled step does not write out."""
    if config.positions not in COMPILABLE_POSITIONS:
        raise ValueError(f"compiled decoding covers absolute positions ({', '.join(COMPILABLE_POSITIONS)}); this "
                         f"model's are {config.positions!r}: decode without compile")


class CompiledState:
    """What the compiled step keeps between steps (search.py's DecoderState protocol): per decoder layer the
    self-attention keys and values, (R, H, capacity, Dh) each, positions from `length` on zero (not attended), and the
    cross-attention keys and values, (N, H, S, Dh), one row per sentence."""

    def __init__(self) -> None:
        self.length = 0
        """Number of target positions cached so far."""
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.cross_keys: list[Tensor] = []
        self.cross_values: list[Tensor] = []

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2) if self.keys else 0

    def reserve(self, *, rows: int, heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
                device: torch.device) -> None:
        """Room for one more position: the buffers made on the first step, CACHE_GROWTH positions larger when full
        (a copy every CACHE_GROWTH steps)."""
        if self.length < self.capacity:
            return
        capacity = self.capacity + CACHE_GROWTH
        for cache in (self.keys, self.values):
            grown = [torch.zeros(rows, heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
            for new, old in zip(grown, cache, strict=False):  # (cache empty on the first step)
                new[:, :, : self.length] = old[:, :, : self.length]
            cache[:] = grown

    def reorder(self, indices: Tensor, *, sentences: Tensor | None = None) -> CompiledState:
        """Row j becomes row indices[j] (in place; returns self); `sentences` selects the cross keys' rows."""
        self.keys = [k.index_select(0, indices) for k in self.keys]
        self.values = [v.index_select(0, indices) for v in self.values]
        if sentences is not None:
            self.cross_keys = [k.index_select(0, sentences) for k in self.cross_keys]
            self.cross_values = [v.index_select(0, sentences) for v in self.cross_values]
        return self


def attend_masked(queries: Tensor, keys: Tensor, values: Tensor, *, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v, masked, written out for inductor to fuse, where the step's attention kernel is not
    (a GPU; SDPA would be an opaque kernel): (B, H, Tq, Dh) from queries (B, H, Tq, Dh), keys and values (B, H, Tk,
    Dh), a boolean mask broadcastable to (B, H, Tq, Tk); every query sees a key."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * queries.size(-1) ** -0.5  # (B, H, Tq, Tk)
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), values)


def int8_compiled(model: Transformer) -> Transformer:
    """`model` (float32; in place) with every linear layer RowInt8Linear (the decoder's cross-attention projections
    stacked first): the compiled encoder's and step's int8, whose oneDNN op inductor compiles to its int8 micro-kernels
    among the fused quantising, norms and residuals."""
    replace_linears(model.stack_cross_projections(), RowInt8Linear)
    return model


def bf16_around_int8(model: Transformer) -> Transformer:
    """`model`'s int8 decoder (int8_compiled's; in place) with all but its int8 linear layers in bfloat16: the token
    embedding, positions and norms, so that the compiled step's activations, cache, attention and logits are bf16
    around the int8 matmuls (RowInt8Linear takes bf16 and gives bf16, computing in float32), as CTranslate2's
    int8_bfloat16. Where bf16 pays on the CPU this halves the bytes the step moves besides the weights: the cache
    read by the attention and copied by beam reorders, the cross-attention's batched matmuls, the logits (README,
    "int8 with bf16 around it"). A token embedding the encoder shares is copied first (the encoder stays float32)."""
    decoder = model.decoder
    if any(decoder.embed.tokens is module for module in model.encoder.modules()):
        decoder.embed.tokens = copy.deepcopy(decoder.embed.tokens)
    for module in decoder.modules():
        if isinstance(module, RowInt8Linear):
            continue
        for name, parameter in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(parameter.detach().to(torch.bfloat16), requires_grad=False))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(torch.bfloat16))
    return model


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
    the projection's matmul, its epilogue and the copies into the heads' layout would work through (README, "The
    cross-attention projects real positions only; greedy's argmax in the step")."""

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
    partial chunk left out): search.top_k_rows' bounds, search.chunk_maxima's numbers (a maximum is exact) written
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
    """logits (R, V) -> log(sum(exp(logits))) (R,) float32, the row maximum subtracted first: search.log_normalizer's
    numbers to float32's rounding, written for the step's generated code (one fused pass, at a third of the time of
    search's eager blocks of rows); the maximum taken from the maxima of the chunks of `chunk` columns (R, V // chunk)
    where given, and the last, partial chunk's (a pass fewer)."""
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
    kernel for its self-attention where given (each sentence over its own length): torch's SDPA on a CPU, at a decoding
    batch's dozens of positions a sentence, was a quarter of the compiled encoder's time, the kernel ~30% less
    (README, "The step's attention, a kernel of our own")."""
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
    folding and of the quantising after it held floor divisions of symbols, which inductor compiled to a scalar
    loop, a quarter of int8 beam search's time (README, "Beams a size of their own").

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
            # would otherwise have every cache's sizes passed to the graph apart, ~5 us each a step)
            torch._check(cache.size(0) == rows)
            torch._check(cache.size(2) == keys[0].size(2))
        for cache in (*cross_keys, *cross_values):
            torch._check(cache.size(0) == sentences)
            torch._check(cache.size(2) == src_mask.size(1))
        table = positions(model.config.max_positions)  # (P, D)
        x = embed.tokens(tokens[:, None]) * embed.scale + table.index_select(0, position.view(1))  # (R, 1, D)
        x = embed.dropout(x)
        if kernel is not None:
            self_attend = kernel_attend(kernel, lengths=(position + 1).view(1).expand(rows))  # (R,)
            cross_attend = kernel_attend(kernel, lengths=src_mask.sum(dim=-1))  # (N,)
        else:
            self_attend = written_out_attend(
                mask=(torch.arange(keys[0].size(2), device=x.device) <= position)[None, None, None, :])  # (1, 1, 1,
            # capacity)
            cross_attend = written_out_attend(mask=src_mask[:, None, None, :])  # (N, 1, 1, S)
        for i, layer in enumerate(layers):
            x = layer(x, extend_cache=cache_writer(keys[i], values[i], position=position),
                      cross_kv=(cross_keys[i], cross_values[i]), self_mask=None, cross_mask=None,
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


Kind = tuple[str | bool, ...]
"""A kind of call with a graph of its own: ("encoder", one sentence), ("cross", one sentence) or ("step", one row, one
sentence, beams)."""

KINDS = ((1, 1), (1, 4), (BULK_SENTENCES := 64, 1), (BULK_SENTENCES, 4))
"""(sentences, beams) of `compile_kinds`' one step of each kind: one row; one sentence's beams; several sentences;
several with beams. inductor times its GEMM templates at the sizes of a graph's first call and keeps what it chose
for every size: the several-sentence kinds first called at 2 sentences chose kernels that ran the Multi30k model's
bf16 step at half the speed in bulk (beam 5: 951 against 2,039 tgt tok/s at 64 sentences) and at 0.6x in batches
of 8 (README, "A compiled decoding step"); the translate CLI, which compiles at its first batch, chose well."""

KIND_SOURCE_LENGTH = 16
"""Source tokens of `compile_kinds`' made-up sentences (the cross-attention's sizes at its first call, as above)."""

RETRIES = 10
"""Times a call whose kind has its graph is made again when dynamo finds none fitting it
(`CompiledDecoder._call_retrying`): a failed guard check costs microseconds, a compile seconds (with three, the
three-thread test in tests/test_compiled.py compiled a graph again now and then while the other core was busy)."""


def _call_compiling(function: Callable[..., T], *inputs: Tensor | list[Tensor]) -> T:
    """A plain call of a compiled `function`: the first of its kind, which compiles it (`CompiledDecoder._call_policy`)."""
    return function(*inputs)


@dataclass(frozen=True)
class EncoderAndStep:
    """CompiledDecoder's compiled encoder and step, made at the first compile (CompiledDecoder._encoder_and_step)."""

    encoder: Callable[[Tensor], Tensor]
    step: Callable[..., StepOutputs]


class CompiledDecoder:
    """A Transformer whose encoder, cross-attention projection and decoding step run compiled: search.py's
    EncoderDecoder, for `search.decode`.

    `encode` runs the compiled encoder; a stateless `decode` (teacher-forced scoring, alignments) is the model's
    own, eager; a decode with a state (from `new_state`) runs the compiled step once per fed token (its first
    projects the memory for cross-attention, compiled). The first calls of each kind compile (tens of seconds;
    inductor keeps the code on disk for the next process), on the thread that first decodes, with its intra-op
    thread count built into the code (decoder threads meeting a new kind at once wait for the one compiling it,
    `_kinds_compiled`; once it is compiled their steps run at once; a thread of another intra-op count compiles its own
    graphs, as dynamo guards on the count). On a CPU, `gemm_templates` off compiles faster to a slower step
    (GEMM_TEMPLATES), and `cpp_wrapper` off compiles faster to a step that holds the GIL while it runs
    (CPP_WRAPPER): both are for tests. The model's linear layers must be plain nn.Linear, fp32 or bf16, or
    RowInt8Linear (int8_compiled), and neither its weights nor its modules may change afterwards: they are frozen
    into the compiled code, whose calls do not guard on them (`compile_frozen`)."""

    def __init__(self, model: Transformer, *, chunk: int = 64, gemm_templates: bool = True, cpp_wrapper: bool = True,
                 attention_kernel: bool = True):
        check_compilable(model.config)
        self.model = model.stack_cross_projections()  # (a model int8_compiled converted has them stacked already)
        self.chunk = chunk
        """Columns per chunk of the step's chunk maxima (`decode_step`): search.TOP_K_CHUNK, which top_k_rows takes."""
        self.config = model.config
        self.dtype = model.decoder_dtype
        """The step's activations, cache and logits: the model's dtype, bf16 for bf16_around_int8's int8 decoder."""
        on_cpu = next(model.parameters()).device.type == "cpu"
        if any(isinstance(module, RowInt8Linear) for module in model.modules()) and not torch.cpu._is_vnni_supported():
            # inductor's int8 micro-kernels are VNNI's and AMX's; elsewhere its template runs a scalar loop (tens of
            # times slower than oneDNN's int8 call, which the step then keeps)
            gemm_templates = False
        self.gemm_templates = gemm_templates
        """Whether inductor's GEMM templates are timed against ATen's kernels (on a CPU)."""
        backend = inductor_backend({**QUIET, **(CPP_WRAPPER if cpp_wrapper and on_cpu else {}),
                                    **(GEMM_TEMPLATES if gemm_templates and on_cpu else {})})
        self._kinds_compiled: set[Kind] = set()  # compiled so far
        self.compile_lock = threading.Lock()
        """Held around every call that compiles (`_under_compile_lock`): one thread compiles at a time."""
        self.retried = 0
        """Calls made again because dynamo found no graph fitting them (`_call_retrying`): a tally for reading."""
        self.compiling_seconds = 0.0
        """Seconds in calls that compiled (each kind's first, and a call compiled after its retries): a tally for
        reading. A process compiles every graph again, whatever inductor's disk cache holds (README, "A compiled
        decoding step"), so a short run is mostly this."""
        # One graph per kind of call (one row or several, one sentence or several, beams or not), each
        # decoder's apart from other decoders' (all share the step's code): a graph break or more graphs
        # than RECOMPILE_LIMIT is an error, not a silent fall back to the eager step.
        self.attention_kernel = attention_kernel and on_cpu
        """Whether the step attends with model/kernels.py's kernel (on a CPU), not the attention written out."""
        self._backend = backend
        # The step, and the encoder too: eager, its norms, residuals and (int8) activation quantising ran as separate
        # passes over a batch's activations, and fbgemm's int8 matmuls ran slower than the compiled ones (README, "The
        # encoder compiled too"). Two kinds: one sentence, several (dynamo makes a size of 1 a graph of its own). Both
        # made at the first compile (_encoder_and_step), after the attention kernel is built, which may fail as
        # compiling does.
        self._compiled_encoder_and_step: EncoderAndStep | None = None
        # And the memory's projection into the cross-attention keys and values, once a batch: eager, the int8
        # projection's quantising, its dequantising, the cast to the decoder's dtype and the copies into the heads'
        # layout were passes of their own over the batch's (N, S, layers * 2D) (README, "The cross-attention's keys
        # and values compiled").
        self._cross_projection = compile_frozen(cross_projection(model, dtype=self.dtype), backend=backend)

    def encode(self, src: Tensor) -> Tensor:
        """src (B, S) -> memory (B, S, D), as Transformer.encode gives it (by chunks of similar lengths), each chunk
        through the compiled encoder."""
        return self.model.encode(src, encode_chunk=self._encode_chunk)

    @torch.inference_mode()
    def _encode_chunk(self, src: Tensor) -> Tensor:
        # src a tensor of inference mode's, made here, whatever the caller's was: dynamo guards on a tensor's dispatch
        # keys, and a source made outside inference mode (the Translator's) would not fit compile_kinds' graphs
        one_token = src.size(1) == 1  # padded to two, masked (a size of 1 would make graphs apart)
        src = F.pad(src, (0, 1), value=self.config.pad_id) if one_token else src.clone()  # (B, S)
        with self._call_policy(("encoder", src.size(0) == 1)) as call:
            memory = call(self._encoder_and_step().encoder, src)  # (B, S, D)
        return memory[:, :1] if one_token else memory

    @staticmethod
    def new_state() -> CompiledState:
        return CompiledState()

    def decode_with_attention(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, *,
                              layer: int) -> tuple[Tensor, Tensor]:
        return self.model.decode_with_attention(tgt_in, memory, src_mask, layer=layer)

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: CompiledState | None = None) -> Tensor:
        """Logits (R, T, V) for `tgt_in` (R, T), as Transformer.decode gives them. With a state, each of the T
        tokens is one compiled step (the searches feed one a step; fed tokens are all real, none masked)."""
        if state is None:
            return self.model.decode(tgt_in, memory, src_mask)
        logits = [step[0] for step in self._steps(tgt_in, memory, src_mask, state)]
        # (R, T, V); one step's logits as a view: stacking would copy them (48 MB a step at 3,000 rows of 8,000)
        return logits[0][:, None] if len(logits) == 1 else torch.stack(logits, dim=1)

    def decode_step(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: CompiledState, *,
                    chunk: int) -> StepOutputs:
        """One token per row, `tgt_in` (R, 1): the next token's logits (R, V), their log-normaliser (R,) float32 where
        the rows are beams (None where they are one per sentence), the maxima of their chunks of `chunk` columns
        (R, V // chunk) float32 and, where the rows are one per sentence, their argmax (R,) long (chunk_argmax; None
        without chunk maxima), all from the compiled step: search.step_logits' work done in the step."""
        if chunk != self.chunk:
            raise ValueError(f"the decoder's chunk maxima are of {self.chunk} columns; {chunk} were asked for "
                             f"(top_k_rows takes search.TOP_K_CHUNK)")
        if tgt_in.size(1) != 1:
            raise ValueError(f"decode_step feeds one token per row, got {tgt_in.size(1)}")
        return self._steps(tgt_in, memory, src_mask, state)[0]

    def _steps(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor,
               state: CompiledState) -> list[StepOutputs]:
        """The compiled step's outputs for each of tgt_in's (R, T) tokens, fed in turn."""
        rows, length = tgt_in.shape
        sentences = src_mask.size(0)
        if rows % sentences:
            raise ValueError(f"the compiled step feeds each of the {sentences} sentences the same number of rows "
                             f"(its beams), got {rows} rows")
        check_length(state.length + length, max_positions=self.config.max_positions)
        one_token = src_mask.size(1) == 1  # padded to two, masked: a size of 1 would make graphs apart
        if one_token:
            src_mask = F.pad(src_mask, (0, 1))  # (N, 2), False at the pad
        if not state.cross_keys:  # (once, in the decoder's dtype: a float32 encoder's memory for bf16_around_int8's)
            if bool((src_mask[:, 1:] > src_mask[:, :-1]).any()):  # (the attention kernel reads each row's first
                # sum(src_mask[n]) positions)
                raise ValueError("the compiled step takes right-padded sources: a source mask has a real position "
                                 "after a padded one")
            if one_token:
                memory = F.pad(memory, (0, 0, 0, 1))  # (N, 2, D)
            with self._call_policy(("cross", sentences == 1)) as call:
                projected = call(self._cross_projection, memory, *real_positions(src_mask))  # [keys, values] of
                # each layer, (N, H, S, Dh) each
            state.cross_keys, state.cross_values = projected[0::2], projected[1::2]
        heads = self.config.num_heads
        outputs = []
        with self._call_policy(("step", rows == 1, sentences == 1, rows > sentences)) as call:
            for t in range(length):
                state.reserve(rows=rows, heads=heads, head_dim=self.config.d_model // heads,
                              num_layers=self.config.num_decoder_layers, dtype=self.dtype, device=memory.device)
                position = torch.tensor(state.length, device=tgt_in.device)
                tokens = tgt_in[:, t].contiguous().view(sentences, -1)  # (N, K): a strided column would be another graph's input
                inputs = (tokens, position, state.keys, state.values, state.cross_keys, state.cross_values,
                          src_mask)
                outputs.append(call(self._encoder_and_step().step, *inputs))
                state.length += 1
        return outputs

    def _encoder_and_step(self) -> EncoderAndStep:
        """The compiled encoder and step, made on first use (in a call of a kind not yet compiled: one thread at a
        time, and a kernel that cannot be built a CompileError, `_call_policy`)."""
        if self._compiled_encoder_and_step is None:
            kernel = decode_attention_op() if self.attention_kernel else None
            self._compiled_encoder_and_step = EncoderAndStep(
                encoder=compile_frozen(encoder_memory(self.model, kernel=kernel), backend=self._backend),
                step=compile_frozen(decoder_step(self.model, chunk=self.chunk, kernel=kernel),
                                    backend=self._backend))
        return self._compiled_encoder_and_step

    @torch.inference_mode()
    def compile_kinds(self) -> int:
        """Compile every kind of call now, on this thread (with its intra-op thread count, as the decoding threads
        would): a server does this before it answers, so that no request waits the minutes compiling takes. One
        step of each kind on made-up sentences of the sizes in KINDS; the number of kinds compiled (0 when all were)."""
        compiled = len(self._kinds_compiled)
        parameter = next(self.model.parameters())
        for sentences, beams in KINDS:
            length = min(KIND_SOURCE_LENGTH, self.config.max_positions)
            src = torch.full((sentences, length), 3, device=parameter.device)  # (N, S), none padding
            memory = self.encode(src)  # (N, S, D)
            tgt_in = torch.zeros(sentences * beams, 1, dtype=torch.long, device=parameter.device)  # (R, 1)
            self.decode(tgt_in, memory, torch.ones_like(src, dtype=torch.bool), state=self.new_state())
        return len(self._kinds_compiled) - compiled

    @contextmanager
    def _call_policy(self, kind: Kind) -> Iterator[Callable[..., Any]]:
        """Around calls of one kind, the policy in one place: yields how to call a compiled function (`call(function,
        *inputs)`): `_call_retrying` once the kind has its graph; else `_call_compiling`, the first of its kind, which
        compiles it (`_first_of_kind`). Inductor's failure to compile becomes a CompileError
        (`one_line_compile_errors`)."""
        compiled = kind in self._kinds_compiled
        first = nullcontext() if compiled else self._first_of_kind(kind)
        with tracing_settings(compiled=compiled), first, one_line_compile_errors():
            yield self._call_retrying if compiled else _call_compiling

    def _call_retrying(self, function: Callable[..., T], *inputs: Tensor | list[Tensor]) -> T:
        """The compiled `function` (the step, the encoder, the cross projection), for a call whose kind has its graph.
        Threads sharing the decoder now and then find none of its graphs fitting such a call (dynamo's guards
        fail as one thread checks them while another decodes, and pass when checked again: "runtime guards
        failed even though they passed during recompilation-reason analysis", torch 2.13; 6-11 calls in 300
        searches by three threads), and dynamo would compile the graph again: seconds on a decoder thread, and a
        place of RECOMPILE_LIMIT, past which every call fails. Such a call raises instead (`error_on_recompile`,
        tracing_settings), before the step has run or written the cache, and is made again, which finds the
        graph; one that finds none RETRIES times over is a call the kind's graph does not cover, compiled as a
        new kind's first call is."""
        from torch._dynamo.exc import RecompileError

        for _ in range(RETRIES):
            try:
                return function(*inputs)
            except RecompileError:
                self.retried += 1
                time.sleep(0)  # the GIL to the thread whose decoding upset the guards, before they are checked again
        with self._under_compile_lock(), tracing_settings(compiled=False):
            return function(*inputs)

    @contextmanager
    def _first_of_kind(self, kind: Kind) -> Iterator[None]:
        """Around the first call of a kind (the graph dynamo compiles for it): one thread at a time, so that
        decoder threads meeting the kind at once compile it once (each would compile its own: dynamo looks
        for a graph before it takes its compile lock), the others waiting and then finding it."""
        with self._under_compile_lock():
            yield
            self._kinds_compiled.add(kind)

    @contextmanager
    def _under_compile_lock(self) -> Iterator[None]:
        """Around a call that compiles (a kind's first; one compiled after its retries, `_call_retrying`): one thread at
        a time (`compile_lock`), inductor's TypedStorage warning hidden, its seconds counted in `compiling_seconds`."""
        with self.compile_lock:
            quiet_compile_warnings()
            started = time.perf_counter()
            try:
                yield
            finally:
                self.compiling_seconds += time.perf_counter() - started
