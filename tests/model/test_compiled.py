"""The compiled decoding step (seq2seq/model/compiled.py) against the model's own eager step.

Each compile takes seconds even for these tiny models (inductor, with its GEMM templates timed), so the tests
share a few compiled decoders: one per model variant, each checked step by step and through the searches."""

import copy
import dataclasses
import threading
import warnings
from unittest import mock

import pytest
import torch
from near_ties import beam_near_ties, greedy_near_ties, tokens_of
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.graph import GraphLowering

from seq2seq.decoding import ranking as search_module  # the eager ranking functions
from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.search import decode
from seq2seq.model import Transformer, TransformerConfig, compiled_step
from seq2seq.model import compiled as compiled_module
from seq2seq.model.attention import CACHE_GROWTH
from seq2seq.model.compiled import (
    CompiledDecoder,
    CompiledState,
    bf16_around_int8,
    check_compilable,
    int8_compiled,
)
from seq2seq.model.inductor import tracing_settings
from seq2seq.model.layers import DecoderLayer, EncoderLayer
from seq2seq.model.numerics import RowInt8Linear, for_inference

BOS, EOS, PAD = 1, 2, 0
pytestmark = pytest.mark.xdist_group("compiled")  # one worker runs them all (make test's --dist loadgroup): they
# share the compiled decoders below, which each worker would compile again
VARIANTS = {
    "post-sinusoidal-relu": {},
    "sandwich-learned-swiglu-rmsnorm-untied": dict(norm_placement="sandwich", positions="learned",
                                                   activation="swiglu", norm="rmsnorm", tie_embeddings="none",
                                                   output_bias=True, scale_embeddings=False),
}
"""The paper's, and one where every switch the step goes through differs (DeepNorm's and pre-norm's residuals are
Residual's own code, as post's and sandwich's). Compiled without inductor's GEMM templates and C++ call, in a
quarter of the time: test_gemm_templates_* compiles with both, as the Translator does, and the threads' test with
the C++ call."""


def tiny(*, seed: int = 0, dtype: torch.dtype = torch.float32, **variant) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(**{**dict(vocab_size=48, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                                         num_decoder_layers=2, dropout=0.0, max_positions=40), **variant})
    model = Transformer(config)
    with torch.no_grad():  # an untrained model's output bias is zero: make it count
        if model.output_projection.bias is not None:
            model.output_projection.bias.normal_()
    return for_inference(model.fuse_self_attention(), "bf16" if dtype == torch.bfloat16 else "fp32")


DECODERS: dict[tuple[str, bool], tuple[Transformer, CompiledDecoder]] = {}


def compiled_variant(name: str, *, attention_kernel: bool = True) -> tuple[Transformer, CompiledDecoder]:
    """The variant's model and its compiled decoder, made once for the module's tests (compiling is the cost); with
    `attention_kernel` False, the step's attention written out, as on a GPU."""
    if (name, attention_kernel) not in DECODERS:
        with torch.inference_mode(False):  # (the model shared by tests that decode outside inference mode too)
            model = tiny(**VARIANTS[name])
        DECODERS[name, attention_kernel] = model, CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False,
                                                                  attention_kernel=attention_kernel)
    return DECODERS[name, attention_kernel]


# make test compiles the paper's variant; `make e2e` the other too (its kinds take minutes to
# compile on an AVX2-only CPU, and every switch it differs by is the model's own code, run eagerly by test_model.py)
SANDWICH = pytest.mark.e2e


@pytest.fixture(params=[name if name == "post-sinusoidal-relu" else pytest.param(name, marks=SANDWICH)
                        for name in VARIANTS])
def pair(request: pytest.FixtureRequest) -> tuple[Transformer, CompiledDecoder]:
    return compiled_variant(request.param)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process: a test that decodes with a new decoder sees it grow, where a
    silent fall back to the eager step would not."""
    return counters["stats"]["unique_graphs"]


def agree(model: Transformer, src: torch.Tensor, got: list, expected: list, *, beams: bool = False,
          precision: str = "fp32") -> None:
    """The compiled searches' hypotheses are the eager searches' (n-best lists rank by rank, log-probabilities to
    1e-4 where the tokens are the same), but for near-ties the model confirms (tests/near_ties.py): the compiled
    kernels round in other places than the eager ones, and which ties flip depends on the CPU (these random models'
    distributions are flat, their ties near). The reference is the model in float64, or, quantised, the eager model
    itself; greedy outputs are checked at their first difference, beams by their totals (float32: in bf16 and int8
    these tests decode greedy)."""
    reference = model if precision in ("int8", "bf16") else copy.deepcopy(model).double()
    ids = tokens_of(src, PAD)
    assert [len(hyps) for hyps in got] == [len(hyps) for hyps in expected]
    near_ties = beam_near_ties if beams else greedy_near_ties
    for rank in range(max(len(hyps) for hyps in expected)):
        rows = [i for i, hyps in enumerate(expected) if len(hyps) > rank]
        problems = near_ties(reference, [ids[i] for i in rows], [got[i][rank].tokens for i in rows],
                             [expected[i][rank].tokens for i in rows], precision=precision, bos=BOS, eos=EOS)
        assert not problems, f"rank {rank}: " + "; ".join(problems)
        for i in rows if precision == "fp32" else ():  # (bf16's and int8's: their tests compare tokens alone)
            if got[i][rank].tokens == expected[i][rank].tokens:
                assert got[i][rank].log_prob == pytest.approx(expected[i][rank].log_prob, abs=1e-4, nan_ok=True)


def sources(*, seed: int = 1) -> torch.Tensor:
    """Four sentences of different lengths, right-padded: (4, 9)."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, 48, (4, 9), generator=generator)
    for row, length in enumerate((9, 3, 6, 1)):
        src[row, length:] = PAD
    return src


@torch.inference_mode()
@pytest.mark.parametrize(("variant", "attention_kernel"), [
    ("post-sinusoidal-relu", True),
    # (make e2e: a decoder of its own to compile; make test: the traced test of the written-out attention below)
    pytest.param("post-sinusoidal-relu", False, marks=pytest.mark.e2e),
    pytest.param("sandwich-learned-swiglu-rmsnorm-untied", True, marks=SANDWICH)],
    ids=["post", "post-attention-written-out", "sandwich"])
def test_each_step_gives_the_models_logits_and_keeps_them_through_reorders(variant: str, attention_kernel: bool):
    """Step by step over 12 positions (the cache grows past CACHE_GROWTH), with beams reordered, duplicated,
    and a sentence dropped on the way: the compiled logits equal the eager step's given the same history, with the
    step's attention the CPU's kernel (model/kernels.py) or written out (a GPU's, run here on the CPU)."""
    model, compiled = compiled_variant(variant, attention_kernel=attention_kernel)
    assert compiled.attention_kernel == attention_kernel
    src = sources()
    memory, src_mask = model.encode(src), src != PAD
    eager_state, state = model.new_state(), compiled.new_state()
    tokens = torch.full((4, 1), BOS)
    generator = torch.Generator().manual_seed(2)
    before = graphs_compiled()
    for step in range(12):
        expected = model.decode(tokens, memory, src_mask, state=eager_state)
        got = compiled.decode(tokens, memory, src_mask, state=state)
        assert got.shape == expected.shape == (tokens.size(0), 1, 48)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        rows = tokens.size(0)
        if step == 0:  # the beams open: each sentence's row copied to 3 hypotheses
            indices = torch.arange(rows).repeat_interleave(3)
            eager_state, state = eager_state.reorder(indices), state.reorder(indices)
        elif step == 5:  # the second sentence is done: its rows and its memory go
            keep = torch.tensor([0, 2, 3])
            indices = (keep[:, None] * 3 + torch.arange(3)).view(-1)
            eager_state = eager_state.reorder(indices, sentences=keep)
            state = state.reorder(indices, sentences=keep)
            memory, src_mask = memory[keep], src_mask[keep]
        else:  # beams swap within their sentence
            sentences = rows // 3
            indices = (torch.arange(sentences)[:, None] * 3 + torch.randint(0, 3, (sentences, 3), generator=generator))
            eager_state, state = eager_state.reorder(indices.view(-1)), state.reorder(indices.view(-1))
        tokens = torch.randint(3, 48, (indices.numel(), 1), generator=generator)
    assert state.length == eager_state.length == 12
    assert state.capacity >= 12
    assert graphs_compiled() >= before + 2  # several sentences; several with beams


@torch.inference_mode()
@pytest.mark.parametrize("attention_kernel", [True, False], ids=["kernel", "attention-written-out"])
def test_the_compiled_encoder_and_step_follow_a_change_to_the_layers(monkeypatch: pytest.MonkeyPatch,
                                                                   attention_kernel: bool):
    """The compiled encoder and step call the model's own layers (EncoderLayer and DecoderLayer.forward, given the
    step's attention and cache writer), not a copy of their arithmetic: a layer whose forward changes (its output
    halved and shifted here) changes the compiled memory and logits as it changes the eager ones. Dynamo traces the
    functions CompiledDecoder compiles, whole (fullgraph); the graphs run as traced, without inductor's code
    generation (what that compiles, the other tests here check against the eager model)."""
    monkeypatch.setattr("seq2seq.model.compiled.inductor_backend",
                        lambda options, **_: lambda graph, inputs: graph.forward)  # the traced graph, run as it is
    model = tiny()
    src = sources()
    src_mask, tokens = src != PAD, torch.full((4, 1), BOS)
    unchanged = model.decode(tokens, model.encode(src), src_mask, state=model.new_state())  # (R, 1, V)
    for layer_type in (EncoderLayer, DecoderLayer):
        def changed(self, x, *, original=layer_type.forward, **arguments):
            return original(self, x, **arguments) * 0.5 + 0.25

        monkeypatch.setattr(layer_type, "forward", changed)
    compiled = CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False, attention_kernel=attention_kernel)
    expected_memory = model.encode(src)
    memory = compiled.encode(src)
    torch.testing.assert_close(memory, expected_memory, atol=2e-5, rtol=1e-5)
    expected = model.decode(tokens, expected_memory, src_mask, state=model.new_state())
    got = compiled.decode(tokens, memory, src_mask, state=compiled.new_state())
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(expected, unchanged, atol=1e-2)  # (the change shows in the logits)


@pytest.mark.parametrize("search", [SearchConfig(beam_size=1), SearchConfig(beam_size=3, nbest=2),
                                    # (make e2e: graphs of their own; make test: the beams' and greedy's)
                                    pytest.param(SearchConfig(beam_size=1, min_len=3, no_repeat_ngram_size=2),
                                                 marks=pytest.mark.e2e)],
                         ids=["greedy", "beam3-nbest2", "greedy-constrained"])
def test_searches_give_the_eager_searches_outputs(pair, search: SearchConfig):
    model, compiled = pair
    one_at_a_time = compiled_variant("post-sinusoidal-relu")[1]
    src = sources(seed=3)
    eager = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
    got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
    agree(model, src, got, eager, beams=search.beam_size > 1)
    if compiled is not one_at_a_time:  # (the other variant's one-row graphs: a minute of compiling, the same code)
        return
    one = [decode(compiled, src[i : i + 1], search, bos=BOS, eos=EOS, pad=PAD)[0] for i in range(4)]
    agree(model, src, one, eager, beams=search.beam_size > 1)


@pytest.mark.e2e  # (make e2e: a decoder of its own to compile; make test: the searches' tests over the step's outputs)
@torch.inference_mode()
def test_the_step_gives_the_normaliser_and_chunk_maxima_the_search_would_compute():
    """With a vocabulary top_k_rows ranks in chunks, even for beam 3's 6 candidates (1,650: 25 whole chunks of 64
    and a part), the step gives the chunk maxima (top_k_rows' bounds) and, where the rows are beams, the
    log-normaliser, as search.py computes them from its logits; one row per sentence leaves the normaliser to the
    search and gives the argmax instead. The searches that take them give the eager searches' outputs, constraints (which lower logits below
    the bounds) included."""
    model = tiny(seed=4, vocab_size=1650, num_decoder_layers=1)
    compiled = CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False)
    src = sources(seed=4)
    memory, src_mask = model.encode(src), src != PAD
    state = compiled.new_state()
    for rows, beams in ((4, False), (12, True)):
        logits, normalizer, maxima, argmax = compiled.decode_step(torch.full((rows, 1), BOS), memory, src_mask, state,
                                                                  chunk=64)
        assert maxima is not None and torch.equal(maxima, search_module.chunk_maxima(logits, chunk=64))
        assert maxima.shape == (rows, 25)
        if beams:
            assert normalizer is not None and argmax is None
            torch.testing.assert_close(normalizer, search_module.log_normalizer(logits), atol=1e-5, rtol=1e-6)
        else:
            assert normalizer is None and argmax is not None
            assert torch.equal(argmax, logits.argmax(dim=-1))
            state.reorder(torch.arange(4).repeat_interleave(3))
    with pytest.raises(ValueError, match="one token per row"):
        compiled.decode_step(torch.full((12, 2), BOS), memory, src_mask, state, chunk=64)
    with pytest.raises(ValueError, match="each of the 4 sentences the same number of rows"):
        compiled.decode_step(torch.full((10, 1), BOS), memory, src_mask, state, chunk=64)  # (before the state is touched)
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=1, scores=False),
                   SearchConfig(beam_size=3, nbest=2, min_len=4, no_repeat_ngram_size=2)):
        eager = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
        got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
        agree(model, src, got, eager, beams=search.beam_size > 1)
    compiled.chunk = 32
    with pytest.raises(ValueError, match="chunk maxima are of 32 columns; 64 were asked for"):
        decode(compiled, src, SearchConfig(beam_size=1), bos=BOS, eos=EOS, pad=PAD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_s_argmax_by_chunks_is_torch_s_first_of_equal_maxima(dtype):
    """chunk_argmax, compiled by inductor as the step is, on logits full of ties (a few integers) and with the maximum
    in the last, partial chunk or tied with it: torch.argmax's column, the first of equal maxima, in every row."""
    argmax = torch.compile(compiled_step.chunk_argmax, dynamic=True, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for vocab in (1024, 1000):
        logits = torch.randint(0, 4, (300, vocab), generator=generator).to(dtype)  # (R, V)
        logits[:100, 960:] = 4.0  # the maximum in the last chunk (whole at 1,024, partial at 1,000) only
        logits[100:150, [5, 999]] = 4.0  # tied with one in the first chunk
        maxima = compiled_step.step_chunk_maxima(logits, chunk=64)
        assert torch.equal(argmax(logits, maxima=maxima, chunk=64), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_s_normaliser_takes_its_maximum_from_the_chunk_maxima_and_the_last_partial_chunk(dtype):
    """The step's log-normaliser (written for inductor, run eagerly here) takes each row's maximum from the chunk
    maxima it computes anyway and from the last, partial chunk, which they leave out: the same numbers as taking
    it from the whole row, a best token in the partial chunk included."""
    logits = (torch.randn(6, 1650, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)  # 25 chunks and 50
    logits[1, 1640] = 40.0  # the best in the partial chunk
    logits[2, 5] = 40.0  # in the first chunk
    logits[3, :] = -1.0e4  # nothing likely (a finished row's logits)
    maxima = compiled_step.step_chunk_maxima(logits, chunk=64)
    assert maxima.shape == (6, 25)
    got = compiled_step.step_log_normalizer(logits, maxima=maxima, chunk=64)
    assert torch.equal(got, compiled_step.step_log_normalizer(logits))
    torch.testing.assert_close(got, search_module.log_normalizer(logits), atol=1e-5, rtol=1e-6)
    whole = torch.randn(2, 1600)  # (no partial chunk)
    maxima = compiled_step.step_chunk_maxima(whole, chunk=64)
    assert torch.equal(compiled_step.step_log_normalizer(whole, maxima=maxima, chunk=64),
                       compiled_step.step_log_normalizer(whole))


def test_stateless_calls_are_the_models_own(pair):
    """Teacher-forced scoring and alignments decode without a state: the eager model, unchanged."""
    model, compiled = pair
    src = sources()
    memory, src_mask = model.encode(src), src != PAD
    tgt_in = torch.randint(3, 48, (4, 5))
    with torch.inference_mode():
        assert torch.equal(compiled.decode(tgt_in, memory, src_mask), model.decode(tgt_in, memory, src_mask))
        got = compiled.decode_with_attention(tgt_in, memory, src_mask, layer=1)
        expected = model.decode_with_attention(tgt_in, memory, src_mask, layer=1)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_the_compiled_encoder_gives_the_models_memory(pair):
    """`encode` runs the model's encoder compiled, by Transformer.encode's chunks of similar lengths: the memory is the
    eager encoder's (zero at padding) for a batch cut into chunks, one sentence, and one-token sources (padded to two,
    masked, as the step's are), in two graphs (one sentence; several). A source made outside inference mode (the
    Translator's) reuses them: dynamo guards on a tensor's dispatch keys, and such a source would be a graph apart."""
    model, compiled = pair
    generator = torch.Generator().manual_seed(4)
    long = torch.randint(3, 48, (24, 30), generator=generator)  # 720 positions, most of them padding: chunked
    for row, length in enumerate(torch.randint(1, 31, (24,), generator=generator).tolist()):
        long[row, length:] = PAD
    long[0] = torch.randint(3, 48, (30,), generator=generator)
    with torch.inference_mode():
        for src in (sources(), sources()[:1], long):
            compiled.encode(src)  # each kind compiled (the test's variants share their decoder)
    before = graphs_compiled()
    for src in (sources(), sources()[:1], long, sources()[3:4, :1], sources()[3:4, :1].repeat(3, 1)):
        with torch.inference_mode():
            expected = model.encode(src)
        got = compiled.encode(src)  # the source, and the call, outside inference mode
        assert got.shape == expected.shape == (*src.shape, 32)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        assert not got[src == PAD].any()
    assert graphs_compiled() == before
    encoder_kinds = {kind for kind in compiled._kinds_compiled if kind[0] == "encoder"}
    assert encoder_kinds == {("encoder", True), ("encoder", False)}


def test_the_compiled_cross_projection_gives_every_layers_keys_and_values(pair):
    """A state's first step projects the memory into every decoder layer's cross-attention keys and values by a
    compiled function of its own, over the real source positions alone: they are the eager projection's
    (cross_keys_values) there and zeros at the padding (masked), contiguous, in the decoder's dtype, for several
    sentences, one, and one-token sources (the memory padded to two positions, masked, as the step's source mask
    is), in two graphs (one sentence; several), none compiled again."""
    model, compiled = pair
    cases = [sources(), sources()[:1], sources()[3:4, :1], sources()[3:4, :1].repeat(3, 1)]
    with torch.inference_mode():
        memories = [model.encode(src) for src in cases]
        for src, memory in zip(cases[:2], memories[:2], strict=True):  # each kind compiled (variants share decoders)
            compiled.decode(torch.full((src.size(0), 1), BOS), memory, src != PAD, state=compiled.new_state())
        before = graphs_compiled()
        for src, memory in zip(cases, memories, strict=True):
            state = compiled.new_state()
            compiled.decode(torch.full((src.size(0), 1), BOS), memory, src != PAD, state=state)
            expected = compiled_step.cross_keys_values(model, memory=memory)
            assert len(state.cross_keys) == len(state.cross_values) == len(expected) == 2
            real = (src != PAD)[:, None, :, None]  # (N, 1, S, 1)
            for keys, values, (expected_keys, expected_values) in zip(state.cross_keys, state.cross_values, expected,
                                                                       strict=True):
                assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == compiled.dtype
                assert keys.shape == values.shape == (src.size(0), 4, max(src.size(1), 2), 8)
                length = src.size(1)
                for got, want in ((keys, expected_keys), (values, expected_values)):
                    torch.testing.assert_close(got[:, :, :length], want.masked_fill(~real, 0.0), atol=2e-5, rtol=1e-5)
                    assert not got[:, :, length:].any()
    assert graphs_compiled() == before
    assert {kind for kind in compiled._kinds_compiled if kind[0] == "cross"} == {("cross", True), ("cross", False)}


@torch.inference_mode()
def test_the_cross_projection_of_the_real_positions_is_the_padded_one_s_where_the_source_is_real():
    """real_positions and cross_keys_values' `places`: the real positions' rows projected alone and laid out over
    the padded batch are, to the bit, the whole padded memory's projection at those positions (each int8 row is
    quantised by itself), and zeros elsewhere; one real position in all (one one-token sentence, padded to two)
    takes the padding in, a size of 1 being a graph apart."""
    model = int8_compiled(tiny(num_decoder_layers=3))
    src = sources()
    memory = model.encode(src)  # (N, S, D)
    mask = src != PAD
    real, places = compiled_step.real_positions(mask)
    assert real.tolist() == mask.reshape(-1).nonzero()[:, 0].tolist()
    assert places.shape == mask.shape and (places[~mask] == real.numel()).all()
    assert torch.equal(places[mask], torch.arange(real.numel()))
    packed = compiled_step.cross_projection(model, dtype=torch.float32)(memory, real, places)
    padded = [x for pair in compiled_step.cross_keys_values(model, memory=memory) for x in pair]
    assert len(packed) == len(padded) == 6
    for got, want in zip(packed, padded, strict=True):
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want.masked_fill(~mask[:, None, :, None], 0.0))
    one = torch.tensor([[True, False]])
    assert [x.tolist() for x in compiled_step.real_positions(one)] == [[0, 1], [[0, 1]]]
    assert [x.tolist() for x in compiled_step.real_positions(one.repeat(2, 1))] == [[0, 2], [[0, 2], [1, 2]]]


def test_one_token_sources_reuse_the_graphs_of_longer_ones():
    """A batch whose longest source is one token is padded to two (masked): torch would compile sizes of 1
    apart, four graphs more a decoder. The outputs are the eager model's."""
    model, compiled = compiled_variant("post-sinusoidal-relu")
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3)):  # every kind compiled first
        for src in (sources(), sources()[:1]):
            decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
    before = graphs_compiled()
    short = sources()[3:4, :1]  # (1, 1)
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3)):
        for src in (short, short.repeat(3, 1)):
            got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
            expected = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
            agree(model, src, got, expected, beams=search.beam_size > 1)
    assert graphs_compiled() == before


def test_calls_check_no_guards_on_the_frozen_model():
    """The model is frozen into the compiled code, so its calls guard on their inputs and the global state, not on
    the modules: a module's flag changed after compiling (the model set to training, which every dropout's guard
    would catch) compiles nothing again and changes no output."""
    model, compiled = compiled_variant("post-sinusoidal-relu")
    src = sources()
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3)):
        expected = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)  # (compiles what is not yet)
        before = graphs_compiled()
        model.train()
        try:
            got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
        finally:
            model.eval()
        assert [h[0].tokens for h in got] == [h[0].tokens for h in expected]
        assert graphs_compiled() == before
        assert compiled.retried == 0


def test_decoder_threads_meeting_a_new_kind_compile_it_once_then_run_it_at_once():
    """Two threads decode at once with a new decoder: each kind of call is compiled once (dynamo alone compiled
    it in both), its call generated in C++ that lets go of the GIL (so the threads' steps run at once: Python's
    call holds it), and each thread gets the eager model's outputs, twice (the second time both run the graphs)."""
    model = tiny(seed=5, num_encoder_layers=1, num_decoder_layers=1)  # (one layer: the C++ call compiles for a minute)
    compiled = CompiledDecoder(model, gemm_templates=False)
    search = SearchConfig(beam_size=1)
    batches = [sources(seed=6)[:2], sources(seed=7)[:2]]
    start = threading.Barrier(2)
    outputs: dict[tuple[int, int], list] = {}
    codes: list[str] = []  # the compiled graphs' generated code

    def decoder_thread(i: int) -> None:
        torch.set_num_threads(1)
        start.wait(timeout=60)
        with inductor_config.patch(fx_graph_cache=False):  # compiled, not read from the disk (no code to see)
            outputs[i, 0] = decode(compiled, batches[i], search, bos=BOS, eos=EOS, pad=PAD)
        start.wait(timeout=600)
        outputs[i, 1] = decode(compiled, batches[i], search, bos=BOS, eos=EOS, pad=PAD)

    before = graphs_compiled()
    threads = [threading.Thread(target=decoder_thread, args=(i,)) for i in range(2)]
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert compiled._kinds_compiled and graphs_compiled() - before == len(compiled._kinds_compiled) == len(codes)
    assert all("py::gil_scoped_release" in code for code in codes)
    for i, src in enumerate(batches):
        expected = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
        for run in range(2):
            agree(model, src, outputs[i, run], expected)


@torch.inference_mode()
def test_several_tokens_with_a_state_are_one_step_each():
    model, compiled = compiled_variant("post-sinusoidal-relu")
    src = sources()[:2]
    memory, src_mask = model.encode(src), src != PAD
    prefix = torch.randint(3, 48, (2, 4))
    prefix[:, 0] = BOS
    got = compiled.decode(prefix, memory, src_mask, state=compiled.new_state())
    torch.testing.assert_close(got, model.decode(prefix, memory, src_mask, state=model.new_state()),
                               atol=2e-5, rtol=1e-5)
    state = compiled.new_state()
    compiled.decode(prefix[:, :1], memory, src_mask, state=state)
    state.length = model.config.max_positions  # as if full: one more position is past the table
    with pytest.raises(ValueError, match="exceeds max_positions=40"):
        compiled.decode(prefix[:, :1], memory, src_mask, state=state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_gemm_templates_decode_one_sentence_as_the_eager_step(dtype: torch.dtype):
    """The step as the Translator compiles it, inductor's GEMM templates timed against ATen's (which wins depends on
    the CPU: AMX, AVX-512 or AVX2) and its call in C++, at one row, on a one-layer model (each template a compile of
    its own: about a minute, fp32's more where the CPU has no AVX-512: slow). Each step's logits follow the eager
    step's, to float32's or bf16's rounding. (The encoder compiled so, and a whole search over both: make e2e's
    test_a_decoder_compiled_for_the_machine_is_what_the_translate_command_runs_with_no_flag.)"""
    model = tiny(dtype=dtype, num_encoder_layers=1, num_decoder_layers=1, norm_placement="pre")
    compiled = CompiledDecoder(model)
    src = sources()[:1]
    bound = 1e-5 if dtype == torch.float32 else 0.05
    before = graphs_compiled()
    with torch.inference_mode():
        memory, src_mask = model.encode(src), src != PAD
        tokens = torch.full((1, 1), BOS)
        eager_state, state = model.new_state(), compiled.new_state()
        for _ in range(10):
            expected = model.decode(tokens, memory, src_mask, state=eager_state).float()
            got = compiled.decode(tokens, memory, src_mask, state=state).float()
            assert (got - expected).abs().max() <= bound * expected.abs().max()
            tokens = expected[:, -1].argmax(-1, keepdim=True)
    assert graphs_compiled() == before + 2  # the step's, and the cross-attention projection's


def test_kinds_are_compiled_at_the_sizes_of_real_batches(monkeypatch: pytest.MonkeyPatch):
    """compile_kinds' first call of each kind is at KINDS' sizes (inductor keeps the kernels it timed at a graph's
    first sizes for every size): one row, one sentence's 4 beams, 64 sentences, 64 with 4 beams each, sources of
    16 tokens, encoded by the compiled encoder (one sentence, 64); each kind once, and none again once compiled."""
    model = tiny(num_decoder_layers=1)
    compiled = CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False)
    seen, encoded = [], []

    def decode(tgt_in, memory, src_mask, state=None):
        seen.append((tgt_in.size(0), memory.size(0), memory.size(1), bool(src_mask.all())))
        compiled._kinds_compiled.add(("step", tgt_in.size(0) == 1, memory.size(0) == 1,
                                      tgt_in.size(0) > memory.size(0)))
        return torch.zeros(tgt_in.size(0), 1, 48)

    def encoder(src):
        encoded.append((*src.shape, bool((src != PAD).all())))
        return torch.zeros(*src.shape, 32)

    monkeypatch.setattr(compiled, "decode", decode)
    monkeypatch.setattr(compiled, "_compiled_encoder_and_step",
                        compiled_module.EncoderAndStep(encoder=encoder, step=decode))  # (the step unused)
    assert compiled.compile_kinds() == 6  # the encoder's two among them; `decode` mocked: no cross
    assert seen == [(1, 1, 16, True), (4, 1, 16, True), (64, 64, 16, True), (256, 64, 16, True)]
    assert encoded == [(1, 16, True), (1, 16, True), (64, 16, True), (64, 16, True)]
    assert compiled.compile_kinds() == 0


@pytest.mark.e2e  # (make e2e: ~80 s of compiling with timed templates; make test: test_bf16_around_int8_*'s int8 step)
def test_int8_step_follows_the_eager_int8_step():
    """int8_compiled's model (every linear layer RowInt8Linear, oneDNN's int8 op) compiled as the
    Translator compiles it: on a CPU with VNNI or AMX inductor's int8 micro-kernels among the fused work, elsewhere
    oneDNN's op kept as a call (~60 s to compile). Its logits follow the eager int8 step's, which quantises the same
    rows, not the float32 model's, one row and several, and greedy search gives the eager int8 search's tokens."""
    fp32 = tiny(num_encoder_layers=1, num_decoder_layers=1, norm_placement="pre")
    model = int8_compiled(tiny(num_encoder_layers=1, num_decoder_layers=1, norm_placement="pre"))
    linears = [m for m in model.decoder.modules() if isinstance(m, RowInt8Linear)]
    assert len(linears) == 8 and isinstance(model.output_projection, RowInt8Linear)  # qkv, out; q, kv, out; ffn 2;
    assert isinstance(model.decoder.cross_kv_proj, RowInt8Linear)  # and every layer's cross kv stacked
    assert sum(isinstance(m, RowInt8Linear) for m in model.encoder.modules()) == 4  # qkv, out; ffn 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    compiled = CompiledDecoder(model)
    assert compiled.gemm_templates == torch.cpu._is_vnni_supported()
    src = sources()
    before = graphs_compiled()
    with torch.inference_mode():
        for rows in (slice(0, 1), slice(0, 4)):
            memory, src_mask = model.encode(src[rows]), src[rows] != PAD
            tokens = torch.full((memory.size(0), 1), BOS)
            eager_state, state, fp32_state = model.new_state(), compiled.new_state(), fp32.new_state()
            for _ in range(8):
                expected = model.decode(tokens, memory, src_mask, state=eager_state)
                got = compiled.decode(tokens, memory, src_mask, state=state)
                unquantised = fp32.decode(tokens, fp32.encode(src[rows]), src_mask, state=fp32_state)
                scale = expected.abs().max()
                # (a product's halfway case may round the other way compiled: one step of one activation)
                assert (got - expected).abs().max() <= 1e-3 * scale
                assert (unquantised - expected).abs().max() >= 1e-3 * scale  # quantised: int8's error is larger
                tokens = expected[:, -1].argmax(-1, keepdim=True)
    assert graphs_compiled() == before + 4  # one row; several sentences: a step and a cross projection each
    with torch.inference_mode():  # the compiled encoder follows the eager int8 encoder, to a step of one activation
        memory = model.encode(src)
        assert (compiled.encode(src) - memory).abs().max() <= 1e-3 * memory.abs().max()
    assert graphs_compiled() == before + 5  # the encoder's, several sentences
    search = SearchConfig(beam_size=1)  # (beams, with their two kinds more to compile: test_translator.py's int8 test)
    eager = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
    got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
    agree(model, src, got, eager, precision="int8")
    assert graphs_compiled() == before + 5


@torch.inference_mode()
def test_every_layers_cross_keys_and_values_are_one_int8_projection_of_the_memory_quantised_once():
    """int8_compiled stacks the decoder layers' cross-attention key/value projections before quantising them, and the
    compiled step's state takes every layer's keys and values from that one call, which quantises the memory once:
    to the bit each layer's own int8 projection's (the same rows quantised the same way, each weight row its own
    scale), without compiling anything."""
    model = int8_compiled(tiny(num_decoder_layers=3))
    calls: list[str] = []
    model.decoder.cross_kv_proj.register_forward_hook(lambda *args: calls.append("stacked"))
    for layer in model.decoder.layers:
        layer.cross_attn.kv_proj.register_forward_hook(lambda *args: calls.append("layer"))
    memory = model.encode(sources())  # (N, S, D)
    pairs = compiled_step.cross_keys_values(model, memory=memory)
    assert calls == ["stacked"]
    assert len(pairs) == 3
    for layer, (keys, values) in zip(model.decoder.layers, pairs, strict=True):
        expected_keys, expected_values = layer.cross_attn.keys_values(memory)
        assert keys.is_contiguous() and values.is_contiguous()
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    model.decoder.cross_kv_proj = None  # (a model whose projections could not be stacked: layer by layer)
    calls.clear()
    assert all(torch.equal(a, b) for got, expected in zip(compiled_step.cross_keys_values(model, memory=memory),
                                                          pairs, strict=True) for a, b in zip(got, expected, strict=True))
    assert calls == ["layer"] * 3


def test_bf16_around_int8_runs_the_step_in_bf16_around_its_int8_matmuls():
    """bf16_around_int8 (the Translator's int8 compiled step where bf16 pays; forced here on any CPU): the decoder's
    embedding, positions and norms in bf16, its int8 layers' scales and biases and the whole encoder float32 (a
    shared embedding copied); the compiled step's cache and logits are bf16 and follow the same model's eager step,
    which takes the encoder's float32 memory too; the compiled encoder follows the eager one, and greedy search gives
    the eager search's tokens."""
    model = bf16_around_int8(int8_compiled(tiny(num_encoder_layers=1, num_decoder_layers=1, norm_placement="pre")))
    assert model.config.tie_embeddings == "all"
    assert model.decoder.embed.tokens is not model.encoder.embed.tokens
    assert model.decoder.embed.tokens.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.encoder.parameters())
    int8_layers = [m for m in (*model.decoder.modules(), model.output_projection) if isinstance(m, RowInt8Linear)]
    assert len(int8_layers) == 9  # (the layer's cross kv and their stacked copy: test_every_layers_cross_keys_*)
    assert all(m.weight_scale.dtype == torch.float32 and (m.bias is None or m.bias.dtype == torch.float32)
               for m in int8_layers)
    compiled = CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False)
    assert compiled.dtype == torch.bfloat16
    src = sources()
    with torch.inference_mode():
        memory, src_mask = model.encode(src), src != PAD
        assert memory.dtype == torch.float32
        tokens = torch.full((memory.size(0), 1), BOS)
        eager_state, state = model.new_state(), compiled.new_state()
        for _ in range(6):
            expected = model.decode(tokens, memory, src_mask, state=eager_state)
            got = compiled.decode(tokens, memory, src_mask, state=state)
            assert got.dtype == expected.dtype == torch.bfloat16 and state.keys[0].dtype == torch.bfloat16
            assert state.cross_keys[0].dtype == torch.bfloat16
            assert (got.float() - expected.float()).abs().max() <= 3e-2 * expected.float().abs().max()
            tokens = expected[:, -1].argmax(-1, keepdim=True)
        compiled_memory = compiled.encode(src)  # the eager int8 encoder's, to a step of one activation
        assert (compiled_memory - memory).abs().max() <= 1e-3 * memory.abs().max()
    search = SearchConfig(beam_size=1)
    src = sources(seed=3)  # (this random model's bf16 logits hold ties one bf16 step apart, which the compiled and
    # eager roundings tip either way, depending on the CPU: near-ties, which the eager model confirms)
    eager = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
    got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
    agree(model, src, got, eager, precision="bf16")


def test_int8_steps_time_inductor_s_templates_only_where_its_int8_micro_kernels_run(monkeypatch: pytest.MonkeyPatch):
    """inductor's int8 micro-kernels are VNNI's and AMX's: on other CPUs its template is a scalar loop, tens of times
    slower than oneDNN's int8 call, so an int8 step keeps the call there; float steps time the templates everywhere."""
    fp32 = tiny(num_decoder_layers=1)
    int8 = int8_compiled(tiny(num_decoder_layers=1))
    for vnni in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda vnni=vnni: vnni)
        assert CompiledDecoder(int8).gemm_templates is vnni
        assert CompiledDecoder(fp32).gemm_templates is True
        assert CompiledDecoder(int8, gemm_templates=False).gemm_templates is False


@pytest.mark.parametrize("positions", ["relative", "rotary"])
def test_relative_and_rotary_positions_are_refused_in_one_line(positions: str):
    config = TransformerConfig(vocab_size=48, d_model=32, num_heads=4, d_ff=64, positions=positions)
    with pytest.raises(ValueError, match=f"this model's are '{positions}': decode without compile"):
        check_compilable(config)
    with pytest.raises(ValueError, match="decode without compile"):
        CompiledDecoder(Transformer(config))


def test_tracing_settings_hold_only_inside_and_only_in_the_calling_thread():
    from torch._dynamo import config as dynamo
    from torch._inductor import config as inductor
    from torch.fx.experimental import _config as shapes

    def settings() -> tuple[bool, bool, bool]:
        return inductor.freezing, shapes.use_duck_shape, dynamo.error_on_recompile

    before = settings()
    inside, release = threading.Event(), threading.Event()
    seen: list[tuple[bool, bool, bool]] = []

    def decoder_thread() -> None:
        with tracing_settings(compiled=True):
            seen.append(settings())
            inside.set()
            release.wait(timeout=30)
        seen.append(settings())

    thread = threading.Thread(target=decoder_thread)
    thread.start()
    try:
        inside.wait(timeout=30)
        elsewhere = settings()
    finally:
        release.set()
        thread.join()
    assert seen == [(True, False, True), before] and elsewhere == before
    with tracing_settings():
        assert settings() == (True, False, False)
    assert settings() == before


@torch.inference_mode()
def test_a_call_of_a_compiled_kind_finding_no_graph_is_made_again_not_compiled_again():
    """Threads sharing a decoder now and then find none of its graphs fitting a call dynamo compiled one for
    (compiled.CompiledDecoder._call_retrying): such a call of a compiled kind raises before the step runs and is made
    again (here dynamo's failure stood in for, once), which finds the graph; the outputs are the eager model's."""
    from torch._dynamo.exc import RecompileError

    model, compiled = compiled_variant("post-sinusoidal-relu")
    search = SearchConfig(beam_size=1)
    src = sources(seed=8)[:2]
    decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)  # the kind compiled
    made, failures = compiled._encoder_and_step(), [RecompileError("runtime guards failed")]

    def failing_once(*inputs):
        if failures:
            raise failures.pop()
        return made.step(*inputs)

    before, retried = graphs_compiled(), compiled.retried
    with mock.patch.object(compiled, "_compiled_encoder_and_step", dataclasses.replace(made, step=failing_once)):
        got = decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD)
    expected = decode(model, src, search, bos=BOS, eos=EOS, pad=PAD)
    agree(model, src, got, expected)
    assert (compiled.retried - retried, graphs_compiled() - before, failures) == (1, 0, [])


@torch.inference_mode()
def test_a_call_the_graphs_of_its_kind_do_not_cover_is_compiled_after_the_retries():
    """With its kind compiled, a call dynamo needs a new graph for (here a mask of other strides) raises
    (dynamo's error_on_recompile, on in the decoding thread only) instead of compiling one; after RETRIES it is
    compiled, as a new kind's first call is, and gives the eager step's logits."""
    from torch._dynamo.exc import RecompileError

    model, compiled = compiled_variant("post-sinusoidal-relu")
    src = sources(seed=9)[:2]
    memory, src_mask = model.encode(src), src != PAD
    tokens = torch.full((2, 1), BOS)
    compiled.decode(tokens, memory, src_mask, state=compiled.new_state())  # the kind (two sentences) compiled
    state = compiled.new_state()
    compiled.decode(tokens, memory, src_mask, state=state)  # the cross keys made, the cache reserved
    state.reserve(rows=2, heads=4, head_dim=8, num_layers=2, dtype=memory.dtype, device=memory.device)
    strided_mask = src_mask.t().contiguous().t()  # (N, S), column-major: the graph's guards fail on its strides
    inputs = (torch.full((2, 1), 7), torch.tensor(state.length), state.keys, state.values, state.cross_keys,
              state.cross_values, strided_mask)
    step = compiled._encoder_and_step().step
    with tracing_settings(compiled=True), pytest.raises(RecompileError):
        step(*inputs)
    before, retried = graphs_compiled(), compiled.retried
    with tracing_settings(compiled=True):
        got, *_ = compiled._call_retrying(step, *inputs)
    assert compiled.retried - retried == compiled_module.RETRIES
    assert graphs_compiled() == before + 1
    eager_state = model.new_state()
    model.decode(tokens, memory, src_mask, state=eager_state)
    expected = model.decode(torch.full((2, 1), 7), memory, src_mask, state=eager_state)[:, 0]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_graph_dynamo_compiles_for_a_compiled_kind_outside_the_lock_is_refused_and_the_call_made_again():
    """A call of a compiled kind that dynamo compiles a graph for without counting it a recompile (no
    RecompileError: here a function with no graph yet stands for it) is refused by the backend outside the compile
    lock (UnexpectedCompile, wrapped in dynamo's BackendCompilerFailed: no graph made or counted), made again
    TRACED_RETRIES times, then compiled under the lock once; its result is the function's."""
    _, compiled = compiled_variant("post-sinusoidal-relu")
    doubled = compiled_module.compile_frozen(lambda x: x * 2 + 1, backend=compiled._backend())
    x = torch.arange(6.0).view(2, 3)
    before, retried = graphs_compiled(), compiled.retried
    with tracing_settings(compiled=True):
        got = compiled._call_retrying(doubled, x)
        again = compiled._call_retrying(doubled, x + 1)  # (the graph made: no retry)
    torch.testing.assert_close(got, x * 2 + 1)
    torch.testing.assert_close(again, (x + 1) * 2 + 1)
    assert (compiled.retried - retried, graphs_compiled() - before) == (compiled_module.TRACED_RETRIES, 1)


@pytest.mark.e2e  # (make e2e: 120 searches; make test: test_decoder_threads_meeting_a_new_kind_*'s two threads)
def test_decoder_threads_sharing_a_decoder_compile_nothing_more_once_each_kind_is_compiled():
    """Three threads decoding at once, every kind compiled first: no call compiles a graph again (dynamo found
    no graph fitting 6-11 calls in 300 searches and compiled one again for some, each taking a place of
    RECOMPILE_LIMIT; _call_retrying makes them again), and every output is the eager model's."""
    model, compiled = compiled_variant("post-sinusoidal-relu")
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # as decoder workers run (dynamo compiles a graph per thread count)
    try:
        compiled.compile_kinds()
    finally:
        torch.set_num_threads(intra_op)
    searches = [SearchConfig(beam_size=1), SearchConfig(beam_size=3), SearchConfig(beam_size=1, scores=False)]
    jobs = [[(sources(seed=100 * i + r)[: 1 + (r + i) % 4], searches[(r + i) % 3]) for r in range(40)]
            for i in range(3)]
    expected = [[decode(model, src, search, bos=BOS, eos=EOS, pad=PAD) for src, search in thread_jobs]
                for thread_jobs in jobs]
    got: dict[int, list] = {}

    def decoder_thread(i: int) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            got[i] = [decode(compiled, src, search, bos=BOS, eos=EOS, pad=PAD) for src, search in jobs[i]]

    before, retried = graphs_compiled(), compiled.retried
    threads = [threading.Thread(target=decoder_thread, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert graphs_compiled() == before, f"{compiled.retried - retried} calls retried, {dict(counters['recompiles'])}"
    for i in range(3):
        for (src, search), mine, theirs in zip(jobs[i], got[i], expected[i], strict=True):
            agree(model, src, mine, theirs, beams=search.beam_size > 1)


@torch.inference_mode()
def test_a_step_that_cannot_be_compiled_is_one_line():
    """Inductor without a working C++ compiler (set in this thread only; nothing read from its disk cache): a
    CompileError of one line naming its reason, where inductor's own error is pages of traceback."""
    model = tiny(seed=11, num_decoder_layers=1)
    compiled = CompiledDecoder(model, gemm_templates=False, cpp_wrapper=False)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}):
        with pytest.raises(compiled_module.CompileError) as caught:
            decode(compiled, sources()[:1], SearchConfig(beam_size=1), bos=BOS, eos=EOS, pad=PAD)
    assert str(caught.value).startswith("the decoding step could not be compiled (InvalidCxxCompiler: No working C++ "
                                        "compiler found")
    assert "\n" not in str(caught.value)


def test_a_new_state_is_empty():
    state = CompiledState()
    assert (state.length, state.capacity, state.keys, state.cross_keys) == (0, 0, [], [])


def test_the_cache_grows_by_cache_growth_positions_when_full_and_keeps_what_was_written():
    """CompiledState.reserve makes room for the position the step writes: CACHE_GROWTH positions more when the cache
    is full (a copy once every CACHE_GROWTH steps), the positions written kept and the new ones zero."""
    state, capacities = CompiledState(), []
    for length in range(40):
        state.length = length
        state.reserve(rows=2, heads=4, head_dim=8, num_layers=2, dtype=torch.float32, device=torch.device("cpu"))
        assert state.capacity >= length + 1 and state.capacity % CACHE_GROWTH == 0
        capacities.append(state.capacity)
        for cache in (*state.keys, *state.values):
            assert cache.shape == (2, 4, state.capacity, 8) and not cache[:, :, length:].any()
            cache[:, :, length] = length + 1  # "written"
    assert sorted(set(capacities)) == [8, 16, 24, 32, 40]  # (grown every CACHE_GROWTH steps, no more often)
    assert torch.equal(state.keys[1][0, 0, :, 0], torch.arange(1.0, 41.0))


@torch.inference_mode()
def test_the_step_refuses_a_source_mask_that_is_not_a_right_padded_batch_s():
    """The attention kernel reads each sentence's first sum(mask) positions: a mask with a real position after a
    padded one (not made by padding a batch on the right) is refused, not read as another sentence."""
    model, compiled = compiled_variant("post-sinusoidal-relu")
    src = sources()
    memory, src_mask = model.encode(src), src != PAD
    src_mask[1, 5] = True  # (the second sentence is 3 tokens long)
    with pytest.raises(ValueError, match="right-padded sources"):
        compiled.decode(torch.full((4, 1), BOS), memory, src_mask, state=compiled.new_state())


def test_an_attention_kernel_that_cannot_be_built_is_a_one_line_compile_error(monkeypatch: pytest.MonkeyPatch):
    """The compiler failing on the attention kernel (at the step's first compile) is a CompileError of one line
    naming its reason, as inductor's failure is."""
    from seq2seq.model import kernels

    def failing(**_: object) -> None:
        raise RuntimeError("Error building extension 'seq2seq_avx512':\n[1/2] c++ ...\nattend.cpp:3: error: expected ';'\n"
                           "ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing)
    compiled = CompiledDecoder(tiny(seed=12, num_decoder_layers=1), gemm_templates=False, cpp_wrapper=False)
    with pytest.raises(compiled_module.CompileError) as caught:
        decode(compiled, sources()[:1], SearchConfig(beam_size=1), bos=BOS, eos=EOS, pad=PAD)
    assert str(caught.value) == ("the decoding step's attention kernel could not be built (attend.cpp:3: error: "
                                 "expected ';')")


def test_inductor_s_typedstorage_warning_is_not_shown_when_compiling_and_other_warnings_are():
    """Inductor's GEMM template timing calls torch's deprecated TypedStorage (torch 2.13): the CLIs, which show every
    UserWarning (cli.one_line_warnings), printed it as a `warning:` line at the first compile. A kind's first call
    now hides that one warning from inductor's code, ahead of the program's own filters; any other still shows."""
    compiled = CompiledDecoder(tiny(seed=13, num_decoder_layers=1), gemm_templates=False, cpp_wrapper=False)
    deprecated = "TypedStorage is deprecated. It will be removed in the future and UntypedStorage will be the only..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)  # as the CLIs set it, after the decoder was made
        with compiled._first_of_kind(("a kind",)):
            warnings.warn_explicit(deprecated, UserWarning, "select_algorithm.py", 1,
                                   module="torch._inductor.select_algorithm")
            warnings.warn_explicit(deprecated, UserWarning, "ours.py", 1, module="seq2seq.ours")
            warnings.warn_explicit("another warning", UserWarning, "select_algorithm.py", 2,
                                   module="torch._inductor.select_algorithm")
    assert [(str(w.message), w.filename) for w in caught] == [(deprecated, "ours.py"),
                                                              ("another warning", "select_algorithm.py")]
