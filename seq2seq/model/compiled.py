"""The compiled decoder: the model's encoder, cross-attention projection and one-token decoding step compiled by
torch.compile (model/compiled_step.py's functions), and what runs them between calls.

At a few rows a decoding step is mostly overhead between kernels: each eager op and each linear layer's
oneDNN call costs more than its arithmetic (docs/performance/compiled-decoding.md). Compiled, the step is
one function of generated code in which the matmuls' micro-kernels (inductor's CPP GEMM templates: AMX
or AVX-512 on a CPU) sit among the fused element-wise work. The decoding cache is one buffer per layer,
(R, H, capacity, Dh) (CompiledState), grown here between steps and written in place by the step, so that
a growing cache, changing rows and sources of any length reuse the graphs compiled for them: one per kind
of call (one row; one sentence's beams; several sentences; several with beams). Which kinds are compiled,
one thread at a time, and the calls made again where dynamo finds no graph are CompiledDecoder's.

    src (N, S) ──compiled encoder──► memory (N, S, D)
    memory ──compiled cross keys/values, once──► CompiledState ◄── reorder (beams, finished sentences)
    tgt_in (R, 1), position ──compiled step──► logits (R, V), the cache written at `position`;
                                               the search's normaliser (R,) and chunk maxima of the logits
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.attention import CACHE_GROWTH
from seq2seq.model.compiled_step import (
    StepOutputs,
    check_compilable,
    cross_projection,
    decoder_step,
    encoder_memory,
    real_positions,
)
from seq2seq.model.inductor import (
    CPP_WRAPPER,
    GEMM_TEMPLATES,
    QUIET,
    T,
    UnexpectedCompile,
    compile_frozen,
    inductor_backend,
    one_line_compile_errors,
    quiet_compile_warnings,
    tracing_settings,
)
from seq2seq.model.inductor import CompileError as CompileError  # (its users import it from here)
from seq2seq.model.kernels import decode_attention_op
from seq2seq.model.numerics import RowInt8Linear, replace_linears
from seq2seq.model.transformer import Transformer, check_length


class CompiledState:
    """What the compiled step keeps between steps (decoding/config.py's DecoderState protocol): per decoder layer the
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
    read by the attention and copied by beam reorders, the cross-attention's batched matmuls, the logits
    (docs/performance/compiled-decoding.md#bf16-around-int8). A token embedding the encoder shares is copied first
    (the encoder stays float32)."""
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


Kind = tuple[str | bool, ...]
"""A kind of call with a graph of its own: ("encoder", one sentence), ("cross", one sentence) or ("step", one row, one
sentence, beams)."""

KIND_NAMES: dict[Kind, str] = {
    ("encoder", True): "encoder-one-sentence", ("encoder", False): "encoder-sentences",
    ("cross", True): "cross-one-sentence", ("cross", False): "cross-sentences",
    ("step", True, True, False): "step-one-row", ("step", False, True, True): "step-one-sentence-beams",
    ("step", False, False, False): "step-sentences", ("step", False, False, True): "step-sentences-beams",
}
"""Every kind of call a search makes, by the name its compiled function has in a package (model/packaged.py)."""
ALL_KINDS = tuple(KIND_NAMES)


def kind_name(kind: Kind) -> str:
    return KIND_NAMES.get(kind, "-".join(map(str, kind)))


KINDS = ((1, 1), (1, 4), (BULK_SENTENCES := 64, 1), (BULK_SENTENCES, 4))
"""(sentences, beams) of `compile_kinds`' one step of each kind: one row; one sentence's beams; several sentences;
several with beams. inductor times its GEMM templates at the sizes of a graph's first call and keeps what it chose
for every size, so the kinds of several sentences are first called at a real batch's size: kernels chosen at two
sentences run bulk decoding far slower (docs/performance/compiled-decoding.md#kinds). The translate CLI, which
compiles each kind at its first real batch, chooses at real sizes too."""

KIND_SOURCE_LENGTH = 16
"""Source tokens of `compile_kinds`' made-up sentences (the cross-attention's sizes at its first call, as above)."""

RETRIES = 16
"""Times a call whose kind has its graph is made again when dynamo finds none fitting it
(`CompiledDecoder._call_retrying`): a failed guard check costs far less than a compile
(docs/performance/compiled-decoding.md#guards)."""
RETRY_WAIT = 0.0005
"""Seconds before the second retry, doubled before each one after, up to RETRY_WAIT_MAX: the guards fail while
another thread's step is under way, and a step runs milliseconds, in C++ without the GIL (CPP_WRAPPER), or longer
when the machine's other work takes its core, so retries a few microseconds apart all fall inside the same step
(with no wait, and with waits of under a tenth of a second in all, the three-thread test in
tests/model/test_compiled.py compiled a graph again now and then while the other core was busy)."""
RETRY_WAIT_MAX = 0.1
TRACED_RETRIES = 2
"""Times a call whose kind has its graph is made again after dynamo traced it as new (UnexpectedCompile: see
CompiledDecoder._call_retrying): a trace costs as much as a few steps, and a call no graph covers is traced each time."""
"""The longest wait between two retries: all of them wait under a second in all, below a compile."""


@dataclass(frozen=True)
class EncoderAndStep:
    """CompiledDecoder's compiled encoder and step, made at the first compile (CompiledDecoder._encoder_and_step)."""

    encoder: Callable[[Tensor], Tensor]
    step: Callable[..., StepOutputs]


class CompiledDecoder:
    """A Transformer whose encoder, cross-attention projection and decoding step run compiled: seq2seq/decoding's
    EncoderDecoder, for `search.decode`.

    `encode` runs the compiled encoder; a stateless `decode` (teacher-forced scoring, alignments) is the model's
    own, eager; a decode with a state (from `new_state`) runs the compiled step once per fed token (its first
    projects the memory for cross-attention, compiled). The first calls of each kind compile (in every process:
    docs/performance/compiled-decoding.md#cost), on the thread that first decodes, with its intra-op
    thread count built into the code (decoder threads meeting a new kind at once wait for the one compiling it,
    `_kinds_compiled`; once it is compiled their steps run at once; a thread of another intra-op count compiles its own
    graphs, as dynamo guards on the count). On a CPU, `gemm_templates` off compiles faster to a slower step
    (GEMM_TEMPLATES), and `cpp_wrapper` off compiles faster to a step that holds the GIL while it runs
    (CPP_WRAPPER): both are for tests. The model's linear layers must be plain nn.Linear, fp32 or bf16, or
    RowInt8Linear (int8_compiled), and neither its weights nor its modules may change afterwards: they are frozen
    into the compiled code, whose calls do not guard on them (`compile_frozen`)."""

    def __init__(self, model: Transformer, *, chunk: int = 64, gemm_templates: bool = True, cpp_wrapper: bool = True,
                 attention_kernel: bool = True, packaged: Mapping[Kind, Callable[..., Any]] | None = None):
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
        self._inductor_options = {**QUIET, **(CPP_WRAPPER if cpp_wrapper and on_cpu else {}),
                                  **(GEMM_TEMPLATES if gemm_templates and on_cpu else {})}
        self._kinds_compiled: set[Kind] = set()  # compiled so far
        self.compile_lock = threading.Lock()
        self._this_thread = threading.local()  # .compiling: this thread holds compile_lock (_under_compile_lock)
        """Held around every call that compiles (`_under_compile_lock`): one thread compiles at a time."""
        self.retried = 0
        """Calls made again because dynamo found no graph fitting them (`_call_retrying`): a tally for reading."""
        self.compiling_seconds = 0.0
        """Seconds in calls that compiled (each kind's first, and a call compiled after its retries): a tally for
        reading. A process compiles every graph again, whatever inductor's disk cache holds
        (docs/performance/compiled-decoding.md#cost), so a short run is mostly this."""
        # One graph per kind of call (one row or several, one sentence or several, beams or not), each
        # decoder's apart from other decoders' (all share the step's code): a graph break or more graphs
        # than RECOMPILE_LIMIT is an error, not a silent fall back to the eager step.
        self.attention_kernel = attention_kernel and on_cpu
        """Whether the step attends with model/kernels.py's kernel (on a CPU), not the attention written out."""
        # The step, and the encoder too: eager, its norms, residuals and (int8) activation quantising are separate
        # passes over a batch's activations, where compiled they are fused around the int8 micro-kernels
        # (docs/performance/compiled-decoding.md#what). Two kinds: one sentence, several (dynamo makes a size of 1 a
        # graph of its own). Both
        # made at the first compile (_encoder_and_step), after the attention kernel is built, which may fail as
        # compiling does.
        self._compiled_encoder_and_step: EncoderAndStep | None = None
        # And the memory's projection into the cross-attention keys and values, once a batch: eager, the int8
        # projection's quantising, its dequantising, the cast to the decoder's dtype and the copies into the heads'
        # layout are passes of their own over the batch's (N, S, layers * 2D)
        # (docs/performance/compiled-decoding.md#cross-projection).
        self._compiled_cross_projection: Callable[..., list[Tensor]] | None = None
        self.packaged = dict(packaged) if packaged is not None else None
        """Every kind's function compiled ahead of time (model/packaged.py's, loaded from a package built for this
        model, precision, machine and thread count), which runs in place of torch.compile's: no compile, no guards,
        no dynamo. None: torch.compile compiles each kind at its first call."""
        if self.packaged is not None and set(self.packaged) != set(ALL_KINDS):
            missing = ", ".join(kind_name(kind) for kind in ALL_KINDS if kind not in self.packaged)
            raise ValueError(f"a compiled package holds every kind of call; this one lacks {missing}")
        self._recording: list[tuple[Kind, str, tuple[Any, ...]]] | None = None

    def _backend(self) -> Callable[..., object]:
        """torch.compile's backend, made when a function is first compiled (inductor's import takes seconds, which a
        package's decoder does not need)."""
        return inductor_backend(self._inductor_options, allowed=self._holds_compile_lock)

    def _holds_compile_lock(self) -> bool:
        return getattr(self._this_thread, "compiling", False)

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
            memory = call("encoder", src)  # (B, S, D)
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
                projected = call("cross", memory, *real_positions(src_mask))  # [keys, values] of
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
                outputs.append(call("step", *inputs))
                state.length += 1
        return outputs

    def _encoder_and_step(self) -> EncoderAndStep:
        """The compiled encoder and step, made on first use (in a call of a kind not yet compiled: one thread at a
        time, and a kernel that cannot be built a CompileError, `_call_policy`)."""
        if self._compiled_encoder_and_step is None:
            backend = self._backend()
            self._compiled_encoder_and_step = EncoderAndStep(
                encoder=compile_frozen(self.uncompiled("encoder"), backend=backend),
                step=compile_frozen(self.uncompiled("step"), backend=backend))
        return self._compiled_encoder_and_step

    @torch.inference_mode()
    def compile_kinds(self) -> int:
        """Compile every kind of call now, on this thread (with its intra-op thread count, as the decoding threads
        would): a server does this before it answers, so that no request waits while a kind compiles. One
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
        """Around calls of one kind, the policy in one place: yields how to call one of the compiled functions by its
        name ("encoder", "cross" or "step": `call(name, *inputs)`). A package's function for the kind where there is a
        package (`packaged`); while `recorded_calls` records, the function itself, uncompiled; else torch.compile's:
        `_call_retrying` once the kind has its graph, else a plain call, the first of its kind, which compiles it
        (`_first_of_kind`). Inductor's failure to compile becomes a CompileError (`one_line_compile_errors`)."""
        if self.packaged is not None:
            function = self.packaged[kind]
            yield lambda _name, *inputs: function(*inputs)
            return
        if self._recording is not None:
            yield lambda name, *inputs: self._record(kind, name, inputs)
            return
        compiled = kind in self._kinds_compiled
        first = nullcontext() if compiled else self._first_of_kind(kind)
        with tracing_settings(compiled=compiled), first, one_line_compile_errors():
            if compiled:
                yield lambda name, *inputs: self._call_retrying(self._compiled(name), *inputs)
            else:
                yield lambda name, *inputs: self._compiled(name)(*inputs)

    def _compiled(self, name: str) -> Callable[..., Any]:
        """The torch.compile'd function of that name, made on first use."""
        if name == "cross":
            if self._compiled_cross_projection is None:
                self._compiled_cross_projection = compile_frozen(self.uncompiled("cross"), backend=self._backend())
            return self._compiled_cross_projection
        made = self._encoder_and_step()
        return made.encoder if name == "encoder" else made.step

    def uncompiled(self, name: str) -> Callable[..., Any]:
        """The function of that name as it is written (model/compiled_step.py's), which torch.compile or a package
        compiles: what model/packaged.py exports."""
        kernel = decode_attention_op() if self.attention_kernel and name != "cross" else None
        if name == "encoder":
            return encoder_memory(self.model, kernel=kernel)
        if name == "cross":
            return cross_projection(self.model, dtype=self.dtype)
        return decoder_step(self.model, chunk=self.chunk, kernel=kernel)

    @torch.inference_mode()
    def recorded_calls(self) -> dict[Kind, tuple[str, tuple[Any, ...]]]:
        """compile_kinds' calls, one of each kind, run uncompiled and recorded: each kind's function name and its
        inputs as the call had them (the step's cache before it wrote to it). What model/packaged.py exports each kind
        at: the sizes at which inductor times its GEMM templates (KINDS)."""
        self._recording = []
        try:
            self.compile_kinds()
            recorded = self._recording
        finally:
            self._recording = None
        calls: dict[Kind, tuple[str, tuple[Any, ...]]] = {}
        for kind, name, inputs in recorded:
            calls.setdefault(kind, (name, inputs))
        return calls

    def _record(self, kind: Kind, name: str, inputs: tuple[Any, ...]) -> Any:
        assert self._recording is not None
        self._recording.append((kind, name, copy.deepcopy(inputs)))
        return self.uncompiled(name)(*inputs)

    def _call_retrying(self, function: Callable[..., T], *inputs: Tensor | list[Tensor]) -> T:
        """The compiled `function` (the step, the encoder, the cross projection), for a call whose kind has its graph.
        Threads sharing the decoder now and then find none of its graphs fitting such a call (dynamo's guards
        fail as one thread checks them while another decodes, and pass when checked again: "runtime guards
        failed even though they passed during recompilation-reason analysis"), and dynamo would compile the graph
        again: a long wait on a decoder thread, and a place of RECOMPILE_LIMIT, past which every call fails
        (docs/performance/compiled-decoding.md#guards). Such a call raises instead (`error_on_recompile`,
        tracing_settings), before the step has run or written the cache, and is made again, which finds the
        graph; one that finds none RETRIES times over is a call the kind's graph does not cover, compiled as a
        new kind's first call is. Dynamo does not always count such a call a recompile (under load, now and then, its
        count of the graphs that the call's guards were checked against came out as none, and it compiled a
        graph with no RecompileError): the backend refuses to compile outside the compile lock (UnexpectedCompile,
        after dynamo has traced the call, which costs more than a guard check), so that call is made again too, up
        to TRACED_RETRIES times."""
        from torch._dynamo.exc import BackendCompilerFailed, RecompileError

        traced = 0
        for attempt in range(RETRIES):
            try:
                return function(*inputs)
            except BackendCompilerFailed as error:
                if not isinstance(error.inner_exception, UnexpectedCompile):
                    raise
                self.retried += 1
                traced += 1
                if traced >= TRACED_RETRIES:
                    break
            except RecompileError:
                self.retried += 1
                # The GIL to the thread whose decoding upset the guards at once, then time for its step to end.
                time.sleep(0 if attempt == 0 else min(RETRY_WAIT * 2 ** (attempt - 1), RETRY_WAIT_MAX))
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
            self._this_thread.compiling = True
            try:
                yield
            finally:
                self._this_thread.compiling = False
                self.compiling_seconds += time.perf_counter() - started
