"""Tests for seq2seq.inference.translator.

Two models: the checkpoint of the short training run (`tiny_run`), loaded as a user would, and a
randomly initialised Transformer with the run's tokenizer. Twelve training steps teach little
beyond "A" and "t t t", and a random model rarely ends a sentence, so the random one gets a
larger EOS embedding (tied to the output projection) to end some hypotheses early: between them
the outputs vary in length and content. Where results must match to the last token the models run
in float64, so that padding a sentence among others cannot flip a near-tie.
"""

import copy
import gzip
import math
import random
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA
from near_ties import (
    ROUNDINGS,
    UNIT_ROUNDOFF,
    beam_near_ties,
    greedy_near_ties,
    reference_model,
    teacher_forced_logits,
    token_log_probs,
)
from torch import nn
from torch._dynamo.utils import counters
from translating import SENTENCES

from seq2seq.decoding.beam import beam_search
from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.sampling import greedy
from seq2seq.inference import translator as translator_module
from seq2seq.inference.documents import Translation
from seq2seq.inference.pool import length_sorted_batches, shared_out
from seq2seq.inference.translator import Translator, pad_batch
from seq2seq.model import MultiHeadAttention, Transformer, TransformerConfig
from seq2seq.model.compiled import CompiledDecoder, CompileError
from seq2seq.model.numerics import Int8Linear, PackedLinear, RowInt8Linear
from seq2seq.precision import Verdict
from seq2seq.text.tokenizer import BOS_ID, EOS_ID, PAD_ID
from seq2seq.translate import main, workers_of

IDS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}

pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def float64(translator: Translator) -> Translator:
    return Translator(model=translator.model.double(), tokenizer=translator.tokenizer)


@pytest.fixture(scope="module")
def trained64(checkpoint: Path) -> Translator:
    return float64(Translator.from_checkpoint(checkpoint))


@pytest.fixture(scope="module")
def random64(translator: Translator) -> Translator:
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=translator.tokenizer.vocab_size, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=2,
        num_decoder_layers=2, dropout=0.0, max_positions=128, norm_placement="pre",
    )
    model = Transformer(config)
    with torch.no_grad():
        model.decoder.embed.tokens.weight[EOS_ID] *= 4  # EOS logits spread 4x wider: some win early
    return float64(Translator(model=model, tokenizer=translator.tokenizer))


@pytest.fixture(params=["trained", "random"])
def model64(request) -> Translator:
    return request.getfixturevalue(f"{request.param}64")


def test_batch_equals_one_by_one(model64: Translator, request: pytest.FixtureRequest):
    """Padding, length-sorted batching and dropping finished sentences must not change any result."""
    texts = ["", *SENTENCES, "   ", SENTENCES[0]]
    batched = model64.translate_nbest(texts, SearchConfig(beam_size=4, nbest=2), max_tokens=80)  # 3 batches, out of order
    alone = [model64.translate_nbest([text], SearchConfig(beam_size=4, nbest=2)) for text in texts]
    assert len(batched) == len(texts)
    for together, (by_itself,) in zip(batched, alone, strict=True):
        assert [h.tokens for h in together] == [h.tokens for h in by_itself]
        assert [h.text for h in together] == [h.text for h in by_itself]
        assert [h.score for h in together] == pytest.approx([h.score for h in by_itself], abs=1e-5)
    lengths = {len(hyps[0].tokens) for hyps in batched if hyps}
    if request.node.callspec.params["model64"] == "random":  # seeded float64: the same on every CPU
        assert len(lengths) >= 3  # the outputs differ, so a mix-up between rows would show
    assert batched[0] == batched[-2] == [] and batched[1] == batched[-1]


def test_n_lines_in_n_lines_out_with_empty_and_too_long_lines(trained64: Translator):
    translator = trained64
    limit = translator.model.config.max_positions
    long_line = " ".join(SENTENCES * 4)
    long_ids = translator.tokenizer.encode_source([long_line])[0]
    assert len(long_ids) > limit
    texts = [SENTENCES[0], "", "  \t ", long_line, SENTENCES[1], ""]
    with pytest.warns(UserWarning, match=rf"input line 4 has {len(long_ids)} tokens, .*max_positions \({limit}\)"):
        out = translator.translate(texts)
    assert len(out) == len(texts)
    assert out[1] == out[2] == out[5] == ""
    assert out[0] == translator.translate([SENTENCES[0]])[0] and out[4] == translator.translate([SENTENCES[1]])[0]
    # The long line is translated as its first max_positions tokens.
    truncated = translator.tokenizer.decode([long_ids[:limit]])[0]
    assert translator.tokenizer.encode_source([truncated])[0] == long_ids[:limit]
    assert out[3] == translator.translate([truncated])[0]
    assert translator.translate([]) == []


def test_beam_size_1_is_greedy_search(model64: Translator):
    ids = model64.tokenizer.encode_source(SENTENCES)
    src = pad_batch(ids, pad=PAD_ID, device=torch.device("cpu"))
    expected = greedy(model64.model, src, SearchConfig(), **IDS)
    got = model64.translate_nbest(SENTENCES, SearchConfig(beam_size=1), max_tokens=50)
    assert [hyps[0].tokens for hyps in got] == [h.tokens for h in expected]
    assert [hyps[0].score for hyps in got] == pytest.approx([h.log_prob for h in expected], abs=1e-6)
    # ... and a beam of one ranked by raw log-probability finds the same (joeynmt's test).
    beam_one = beam_search(model64.model, src, SearchConfig(beam_size=1, length_penalty=0.0), **IDS)
    assert [hyps[0].tokens for hyps in beam_one] == [h.tokens for h in expected]


def test_text_only_callers_compute_no_scores_in_greedy_search(checkpoint: Path, translator: Translator,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """translate, translate_paragraphs and the translate CLI's one-best lines return text alone: greedy search
    there skips the normaliser over the vocabulary (SearchConfig.scores), with the same tokens;
    translate_nbest keeps the scores unless told otherwise, and then they are NaN."""
    import seq2seq.decoding.steps as search_module  # where step_logits reads the normaliser

    greedy_search = SearchConfig(beam_size=1)
    scored = translator.translate_nbest(SENTENCES, greedy_search)
    assert all(math.isfinite(hyps[0].score) for hyps in scored)

    def refused(*args, **kwargs):
        raise AssertionError("the normaliser ran for text alone")

    monkeypatch.setattr(search_module, "log_normalizer", refused)
    monkeypatch.setattr(search_module, "normalizer_and_bounds", refused)
    texts = [hyps[0].text for hyps in scored]
    assert translator.translate(SENTENCES, greedy_search) == texts
    assert translator.translate_paragraphs(SENTENCES, greedy_search) == texts
    unscored = translator.translate_nbest(SENTENCES, SearchConfig(beam_size=1, scores=False))
    assert [hyps[0].text for hyps in unscored] == texts and all(math.isnan(hyps[0].score) for hyps in unscored)
    (tmp_path / "in.de").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "out.en"),
          "--beam", "1"])
    assert (tmp_path / "out.en").read_text(encoding="utf-8").splitlines() == texts
    with pytest.raises(AssertionError, match="normaliser ran"):  # what the caller is shown needs the scores
        translator.translate_nbest(SENTENCES, greedy_search)
    for not_a_search in ({}, 0, ""):  # refused as translate_nbest refuses them, not taken for the default
        with pytest.raises(TypeError, match="search must be a SearchConfig"):
            translator.translate(SENTENCES, not_a_search)  # type: ignore[arg-type]


def test_nbest_is_sorted_and_its_first_is_the_translation(model64: Translator):
    nbest = model64.translate_nbest(SENTENCES, SearchConfig(beam_size=5, nbest=5))
    best = model64.translate(SENTENCES, SearchConfig(beam_size=5))
    for hyps, text in zip(nbest, best, strict=True):
        assert len(hyps) == 5
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 5  # five different hypotheses
        assert hyps[0].text == text


def test_sampling_with_a_seed_is_reproducible(model64: Translator):
    def draw(seed: int, **options) -> list[list[int]]:
        return [hyps[0].tokens for hyps in model64.translate_nbest(SENTENCES, SearchConfig(sampling=True, seed=seed, **options))]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    greedy_tokens = [hyps[0].tokens for hyps in model64.translate_nbest(SENTENCES, SearchConfig(beam_size=1))]
    assert draw(3, top_k=1) == greedy_tokens  # only the argmax left to draw


def test_search_options_are_checked_against_the_model_before_any_sentence(translator: Translator):
    vocab = translator.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"beam_size: {vocab} needs a vocabulary of at least {2 * vocab} tokens"):
        translator.translate_nbest(["", " "], SearchConfig(beam_size=vocab))
    with pytest.raises(ValueError, match="max_tokens must be a positive number of tokens, got 0"):
        translator.translate([], max_tokens=0)


def test_texts_any_iterable_of_str_but_not_a_bare_string(translator: Translator):
    expected = translator.translate([SENTENCES[0], SENTENCES[3]])
    assert translator.translate(text for text in (SENTENCES[0], SENTENCES[3])) == expected  # a generator
    assert translator.translate((SENTENCES[0], SENTENCES[3])) == expected
    with pytest.raises(TypeError, match=r"texts is a single string; pass a list of sentences, e\.g\. \[text\]"):
        translator.translate(SENTENCES[0])  # would otherwise give one translation per character
    with pytest.raises(TypeError, match=r"texts\[2\] is a int, not a str"):
        translator.translate([SENTENCES[0], "", 7])
    with pytest.raises(TypeError, match=r"texts\[0\] is a bytes, not a str"):
        translator.translate([b"Ein Hund."])
    with pytest.raises(TypeError, match="single string"):
        list(translator.translate_stream("Ein Hund."))
    with pytest.raises(TypeError, match=r"^search must be a SearchConfig, e\.g\. SearchConfig\(beam_size=5\), not a dict"):
        translator.translate([SENTENCES[0]], {"beam_size": 5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window must be a positive number of lines, got 0"):
        list(translator.translate_stream([SENTENCES[0]], window=0))  # gave [] for 1 line in
    with pytest.raises(TypeError, match=r"texts\[4\] is a int, not a str"):  # its index in the whole input
        list(translator.translate_stream(["a", "b", "c", "d", 5], window=3))


def test_translate_stream_equals_translate_and_numbers_lines_across_windows(trained64: Translator):
    translator = trained64
    long_line = " ".join(SENTENCES * 4)
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(7)] + [long_line, "", SENTENCES[0]]
    with pytest.warns(UserWarning) as caught:
        streamed = list(translator.translate_stream(iter(texts), SearchConfig(beam_size=3), window=3))
    assert [hyps[0].text if hyps else "" for hyps in streamed] == translator.translate(texts, SearchConfig(beam_size=3))
    assert [str(w.message).split(" has ")[0] for w in caught] == ["input line 8"]  # its line in the whole input
    # Sampling with a seed: one random stream for the whole input. A generator seeded anew per window
    # replayed the same draws: two identical windows came out identical.
    sampling, same_windows = SearchConfig(sampling=True, seed=5, temperature=2.0), SENTENCES[:3] * 2

    def draw() -> list[list[int]]:
        return [h[0].tokens for h in translator.translate_stream(same_windows, sampling, window=3)]

    drawn = draw()
    assert drawn[:3] != drawn[3:] and draw() == drawn  # different draws, reproducible by the seed


def test_translate_stream_yields_each_line_once_it_and_those_before_are_done(trained64: Translator, monkeypatch):
    """Within a window, batches run longest first: the longest line 0 comes out after the first
    batch, and the rest as the batches holding them (and every line before them) are done."""
    import seq2seq.inference.translator as translator_module

    calls = []
    real = translator_module.decode
    monkeypatch.setattr(translator_module, "decode", lambda model, src, *a, **k: calls.append(len(src)) or real(model, src, *a, **k))
    texts = [" ".join(SENTENCES[:3]), "", SENTENCES[3], SENTENCES[0], SENTENCES[1]]
    stream = trained64.translate_stream(texts, SearchConfig(beam_size=2), max_tokens=40, window=100)
    first, second = next(stream), next(stream)
    assert len(calls) == 1  # line 0 (the longest, in the first batch) and the empty line 1: no wait for the rest
    assert first and second == []
    rest = list(stream)
    assert len(calls) > 2 and len(rest) == 3
    expected = trained64.translate_nbest(texts, SearchConfig(beam_size=2))
    assert [first, second, *rest] == expected


def test_length_sorted_batches_respect_the_budget_and_cover_every_sentence_once():
    rng = random.Random(0)
    ids = [[5] * rng.choice([0, 0, 1, 2, 3, 7, 15, 40, 90]) for _ in range(300)]
    non_empty = {i for i, sentence in enumerate(ids) if sentence}
    for max_tokens in (1, 50, 64, 100, 1000, 10**6):
        batches = length_sorted_batches(ids, max_tokens=max_tokens)
        flat = [i for batch in batches for i in batch]
        assert sorted(flat) == sorted(non_empty)  # each non-empty sentence exactly once
        lengths = [len(ids[i]) for i in flat]
        assert lengths == sorted(lengths, reverse=True)  # longest first
        for batch in batches:
            padded = len(batch) * max(len(ids[i]) for i in batch)
            assert padded <= max_tokens or len(batch) == 1  # a sentence over budget goes alone
    assert length_sorted_batches([[], []], max_tokens=10) == []
    src = pad_batch([[5, 6, 7], [8]], pad=PAD_ID, device=torch.device("cpu"))
    assert src.tolist() == [[5, 6, 7], [8, PAD_ID, PAD_ID]]


def teacher_forced_log_probs(translator: Translator, sources: list[str], targets: list[list[int]]) -> torch.Tensor:
    """log P(target token | source, the target's prefix) under translator's model, every token, as float32."""
    scores = []
    for source, target in zip(translator.tokenizer.encode_source(sources), targets, strict=True):
        tgt_in = torch.tensor([[BOS_ID, *target]])
        with torch.inference_mode():
            logits = translator.model(torch.tensor([source]), tgt_in).float()[0]  # (T, V)
        scores.append(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor([[*target, EOS_ID]]).T)[:, 0])
    return torch.cat(scores)


def demo_test_sentences(count: int) -> list[str]:
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:count]


def rounding_bound(precision: str, reference, sources: list[str], targets: list[list[int]], tokenizer) -> float:
    """What a token's log-probability may move by between two engines, on average, in `precision`
    (tests/near_ties.py): twice a logit's error (the logit's own and the normaliser's) for each engine, at the scale
    of the reference model's logits."""
    scales = [teacher_forced_logits(reference, src, tgt, bos=BOS_ID).abs().amax(dim=-1)
              for src, tgt in zip(tokenizer.encode_source(sources), targets, strict=True)]
    return 2 * 2 * ROUNDINGS[precision] * UNIT_ROUNDOFF[precision] * float(torch.cat(scales).mean())


def greedy_ids(translator: Translator, sources: list[str]) -> list[list[int]]:
    return [hyps[0].tokens for hyps in translator.translate_nbest(sources, SearchConfig(beam_size=1))]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_bf16_and_int8_score_as_fp32_within_their_rounding(trained: Path, precision: str):
    """The demo-corpus model (trained 300 steps) in bf16 weights or int8 linear layers, against fp32, on
    fp32's beam-4 translations: per token, the log-probability moves on average by more than nothing and by
    less than the precision's rounding allows (tests/near_ties.py: twice a logit's error at the logits' scale;
    a wrong scale or a missed layer moves it by nats); and the greedy translations are fp32's but for near-ties
    the float64 model confirms within the precision's tolerance. Not a count of identical lines, nor a chrF
    floor: which near-ties flip depends on the CPU's kernels. (Greedy, not beam, for the outputs: a tie at a
    beam's pruning step can part whole outputs by more than a tie.)"""
    sources = demo_test_sentences(60)
    search = SearchConfig(beam_size=4)
    fp32 = Translator.from_checkpoint(trained, precision="fp32")
    reference = reference_model(trained)
    reference_hyps = [hyps[0] for hyps in fp32.translate_nbest(sources, search)]
    other = Translator.from_checkpoint(trained, precision=precision)
    assert other.precision == precision
    targets = [hyp.tokens for hyp in reference_hyps]
    moved = (teacher_forced_log_probs(other, sources, targets) - teacher_forced_log_probs(fp32, sources, targets))
    bound = rounding_bound(precision, reference, sources, targets, fp32.tokenizer)
    assert 0 < moved.abs().mean() < bound, f"{precision}: log-probabilities moved by {moved.abs().mean():.4f} a token"
    problems = greedy_near_ties(reference, fp32.tokenizer.encode_source(sources), greedy_ids(other, sources),
                                greedy_ids(fp32, sources), precision=precision, bos=BOS_ID, eos=EOS_ID)
    assert not problems, f"{precision} against fp32: " + "; ".join(problems)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_linear_layers_packed_for_onednn_translate_as_torch_s_own(trained: Path, precision: str,
                                                                   monkeypatch: pytest.MonkeyPatch):
    """Whichever way precision.onednn_linears decides on the machine: the demo-corpus model with its
    linear layers packed for oneDNN scores fp32's translations as with torch's own linear layers (to
    float32's rounding, or bf16's: tests/near_ties.py), and translates alike, greedy, but for near-ties the
    float64 model confirms (not a chrF floor: which ties flip is the CPU's kernels')."""
    sources = demo_test_sentences(60)
    translators = {}
    for packed in (False, True):
        monkeypatch.setattr("seq2seq.inference.preparation.onednn_linears", lambda device, precision, packed=packed:
                            Verdict(packed, "pretended"))
        translators[packed] = Translator.from_checkpoint(trained, precision=precision)
    assert any(isinstance(m, PackedLinear) for m in translators[True].model.modules())
    assert not any(isinstance(m, PackedLinear) for m in translators[False].model.modules())
    search = SearchConfig(beam_size=4)
    reference_hyps = [hyps[0] for hyps in translators[False].translate_nbest(sources, search)]
    targets = [hyp.tokens for hyp in reference_hyps]
    moved = (teacher_forced_log_probs(translators[True], sources, targets)
             - teacher_forced_log_probs(translators[False], sources, targets))
    reference = reference_model(trained)
    bound = rounding_bound(precision, reference, sources, targets, translators[False].tokenizer)
    assert moved.abs().mean() < bound, f"{precision}: log-probabilities moved by {moved.abs().mean():.2g} a token"
    problems = greedy_near_ties(reference, translators[False].tokenizer.encode_source(sources),
                                greedy_ids(translators[True], sources), greedy_ids(translators[False], sources),
                                precision=precision, bos=BOS_ID, eos=EOS_ID)
    assert not problems, f"{precision}, packed against torch's linear layers: " + "; ".join(problems)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_few_rows_on_torch_s_own_linear_follow_the_machine_s_verdict(trained: Path, monkeypatch: pytest.MonkeyPatch):
    """An fp32 Translator whose linear layers are packed asks precision.few_rows_on_torch once per layer shape and
    gives each packed layer its answer; bf16 asks nothing. One sentence at a time (greedy: one row a step; beam 4:
    four), fp32 translates as with every row on oneDNN: the same tokens, scores to float32's rounding."""
    sources = demo_test_sentences(30)
    asked: list[tuple[str, int, int]] = []

    def verdict(device, precision, *, in_features, out_features):
        asked.append((precision, in_features, out_features))
        return 15 if in_features == out_features else 4  # square ones to the last count, the others to 4

    base = Translator.from_checkpoint(trained, precision="fp32")
    monkeypatch.setattr("seq2seq.inference.preparation.few_rows_on_torch", verdict)
    Translator.from_checkpoint(trained, precision="bf16")
    assert not asked
    few = Translator.from_checkpoint(trained, precision="fp32")
    layers = [m for m in few.model.modules() if isinstance(m, PackedLinear)]
    shapes = {(m.in_features, m.out_features) for m in layers}
    assert sorted(asked) == sorted(("fp32", *shape) for shape in shapes) and len(shapes) > 2
    assert all(m.few_rows == (15 if m.in_features == m.out_features else 4) for m in layers)
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=4)):
        for source in sources:
            ((want,),), ((got,),) = base.translate_nbest([source], search), few.translate_nbest([source], search)
            assert got.tokens == want.tokens and got.score == pytest.approx(want.score, abs=1e-4)


def quick_to_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Translators made from now on compile without timing inductor's GEMM templates and with the step's call in
    Python (minutes less for the demo model); 24 demo test sentences to translate."""
    class QuickToCompile(CompiledDecoder):
        def __init__(self, model: Transformer):
            super().__init__(model, gemm_templates=False, cpp_wrapper=False)

    monkeypatch.setattr("seq2seq.inference.preparation.CompiledDecoder", QuickToCompile)
    return demo_test_sentences(24)


def same_tokens(want: list[list[Translation]], got: list[list[Translation]], reference, src: list[list[int]],
                precision: str, *, beams: bool = False) -> None:
    """The compiled step's one-best outputs are the eager step's, with their scores (to the precision's rounding, a
    token at a time), but for near-ties the reference model confirms (tests/near_ties.py): the compiled step's
    kernels round in other places than the eager step's, and which ties flip depends on the CPU. Beam outputs are
    compared so only in float32 (in bf16 and int8 a tie at a pruning step can part whole outputs by more than a
    tie: the caller compares greedy outputs there, and beams' scores where their tokens are the same)."""
    if not beams or precision in ("fp32", "fp64"):
        near_ties = beam_near_ties if beams else greedy_near_ties
        problems = near_ties(reference, src, [h[0].tokens for h in got], [h[0].tokens for h in want],
                             precision=precision, bos=BOS_ID, eos=EOS_ID)
        assert not problems, "; ".join(problems)
    for g, w, ids in zip(got, want, src, strict=True):
        if g[0].tokens == w[0].tokens:
            scale = teacher_forced_logits(reference, ids, w[0].tokens, bos=BOS_ID).abs().amax(dim=-1).sum()
            tolerance = 2 * 2 * ROUNDINGS[precision] * UNIT_ROUNDOFF[precision] * float(scale)
            assert g[0].score == pytest.approx(w[0].score, abs=tolerance)


@pytest.mark.e2e  # (make e2e: eight graphs compiled, a minute or more; make test: tests/model/test_compiled.py's
#  steps and searches, and test_compile_decoding_compiles_on_a_daemon_thread_of_the_decoder_threads_count)
def test_compiled_decoding_translates_as_the_eager_step(trained: Path, monkeypatch: pytest.MonkeyPatch):
    """Translator(compiled="jit") in fp32: the searches run seq2seq/model/compiled.py's encoder, cross-attention
    projection and step over the model's unpacked linear layers and give the eager Translator's
    tokens (tests/model/test_compiled.py decodes one sentence at a time, and more variants); `compile_decoding` compiles
    every kind of step at once, after which no search compiles another. A model with rotary
    positions is refused in one line, before anything compiles. (Compiled without timing inductor's GEMM
    templates, which for this model took minutes, and with the step's call in Python: tests/model/test_compiled.py runs
    both on tiny models.)"""
    sources = quick_to_compile(monkeypatch)
    base = Translator.from_checkpoint(trained, precision="fp32")
    compiled = Translator.from_checkpoint(trained, precision="fp32", compiled="jit", threads=1)  # on its own thread
    assert isinstance(compiled.decoding, CompiledDecoder) and base.decoding is base.model and compiled.compiled
    assert not any(isinstance(m, PackedLinear) for m in compiled.model.modules())
    assert base.compile_decoding() == 0
    graphs = counters["stats"]["unique_graphs"]
    assert compiled.compile_decoding() == 8  # every kind, now (what the server does before its first request)
    compiling = compiled.compiling_seconds
    assert compiling > 0 and base.compiling_seconds == 0
    assert counters["stats"]["unique_graphs"] == graphs + 8  # the step's 4, encoder's 2, cross projection's 2
    search = SearchConfig(beam_size=1)  # beam search's reorders: tests/model/test_compiled.py
    want, got = base.translate_nbest(sources, search), compiled.translate_nbest(sources, search)
    same_tokens(want, got, reference_model(trained), base.tokenizer.encode_source(sources), "fp32")
    for search in (SearchConfig(beam_size=3), SearchConfig(beam_size=1), SearchConfig(beam_size=2, nbest=2)):
        compiled.translate_nbest(sources[:1], search)
    compiled.translate_nbest(sources[:3], SearchConfig(beam_size=3))
    assert counters["stats"]["unique_graphs"] == graphs + 8 and compiled.compile_decoding() == 0
    assert compiled.compiling_seconds == compiling  # (only calls that compiled count)
    rotary = Transformer(TransformerConfig(vocab_size=compiled.tokenizer.vocab_size, d_model=32, num_heads=2,
                                           d_ff=64, positions="rotary"))
    with pytest.raises(ValueError, match="decode without compile"):
        Translator(model=rotary, tokenizer=compiled.tokenizer, compiled="jit")


def compiled_int8_is_made_so(compiled: Translator, bf16_pays: bool) -> None:
    assert compiled.precision == "int8" and isinstance(compiled.decoding, CompiledDecoder)
    dtype = torch.bfloat16 if bf16_pays else torch.float32
    assert compiled.decoding.dtype == compiled.model.decoder.embed.tokens.weight.dtype == dtype
    assert compiled.model.encoder.embed.tokens.weight.dtype == torch.float32
    assert isinstance(compiled.model.output_projection, RowInt8Linear)
    assert not any(isinstance(m, (nn.Linear, Int8Linear)) for m in compiled.model.modules())
    assert any(isinstance(m, RowInt8Linear) for m in compiled.model.encoder.modules())


@pytest.mark.parametrize("bf16_pays", [False, True])
def test_a_compiled_int8_translator_is_row_int8_and_bf16_around_it_where_bf16_pays(trained: Path, bf16_pays: bool,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    """make test's share of the next test (which compiles, in make e2e): the Translator's int8 compiled model, made
    without compiling anything (tests/model/test_compiled.py decodes with such models, compiled, on tiny ones)."""
    monkeypatch.setattr("seq2seq.inference.preparation.bf16_matmuls_pay", lambda device: bf16_pays)
    compiled_int8_is_made_so(Translator.from_checkpoint(trained, precision="int8", compiled="jit", threads=1), bf16_pays)


@pytest.mark.e2e  # (make e2e: two compiles of a minute or more; make test: the test above, tests/model/test_compiled.py)
@pytest.mark.parametrize("bf16_pays", [False, True])
def test_compiled_int8_translates_as_its_eager_step(trained: Path, monkeypatch: pytest.MonkeyPatch, bf16_pays: bool):
    """Translator(precision="int8", compiled="jit"): every linear layer RowInt8Linear (int8 activations a row each,
    oneDNN's op, compiled into the encoder and the step; int8 without compile runs fbgemm's Int8Linear, activations
    quantised a tensor at once); where bf16 pays on the CPU (both verdicts forced here) the rest of the decoder is
    bf16 around them (bf16_around_int8). The compiled step's translations are the same model's eager step's but for
    near-ties within int8's rounding, and int8 without compile (another quantisation of the activations) scores them
    as the compiled model does, on average, within int8's rounding. Near-ties, not counts of equal outputs
    (tests/near_ties.py): the compiled step's logits round in other places, and which ties flip depends on the CPU's
    kernels."""
    sources = quick_to_compile(monkeypatch)
    monkeypatch.setattr("seq2seq.inference.preparation.bf16_matmuls_pay", lambda device: bf16_pays)
    compiled = Translator.from_checkpoint(trained, precision="int8", compiled="jit", threads=1)
    compiled_int8_is_made_so(compiled, bf16_pays)
    # int8's tolerance in bf16 too: a bf16 rounding elsewhere can move an activation across an int8 step, a whole
    # step of int8's rounding
    precision = "int8"
    eager = copy.copy(compiled)
    eager.decoding = compiled.model  # the same model, its eager step: the reference, its weights quantised
    src = compiled.tokenizer.encode_source(sources)
    beams = SearchConfig(beam_size=2)  # (the beams' kinds compiled and their scores checked on a few sentences)
    same_tokens(eager.translate_nbest(sources[:4], beams), compiled.translate_nbest(sources[:4], beams), compiled.model,
                src[:4], precision, beams=True)
    greedy_search = SearchConfig(beam_size=1)  # greedy: a first point of divergence to check (tests/near_ties.py)
    got = compiled.translate_nbest(sources, greedy_search)
    same_tokens(eager.translate_nbest(sources, greedy_search), got, compiled.model, src, precision)
    # int8 without compile quantises the activations otherwise (a tensor at once, fbgemm, where the compiled step's
    # are a row at once): another model, whose choices part from these wherever a row's quantisation and the
    # tensor's differ by more than a tie, at places that differ by CPU. Its scores of the
    # compiled step's translations are these within int8's rounding, on average over every token (as int8's and
    # fp32's are, test_bf16_and_int8_score_as_fp32_within_their_rounding): a layer left unquantised or a wrong scale
    # moves them by nats
    eager_int8 = Translator.from_checkpoint(trained, precision="int8")
    targets = [h[0].tokens for h in got]

    def log_probs(model) -> torch.Tensor:
        # each token's, encoded and decoded as the searches do (bf16 around int8 takes the float32 memory)
        return torch.cat([token_log_probs(teacher_forced_logits(model, ids, target, bos=BOS_ID), target, eos=EOS_ID)
                          for ids, target in zip(src, targets, strict=True)])

    moved = log_probs(eager_int8.model) - log_probs(compiled.model)
    bound = rounding_bound("int8", reference_model(trained), sources, targets, compiled.tokenizer)
    assert 0 < moved.abs().mean() < bound, (f"int8 without compile: log-probabilities {moved.abs().mean():.4f} "
                                            f"apart a token, over {bound:.4f}")


def test_bf16_attention_at_one_query_a_row_follows_the_machine_s_verdict(trained: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A bf16 Translator on a CPU chooses its model's MultiHeadAttention.one_query_by_matmul from
    precision.one_query_sdpa, and no other model's (another Translator's, or the class's); fp32 leaves it; the demo-corpus model translates alike both ways, greedy,
    but for near-ties within bf16's rounding the float64 model confirms (tests/near_ties.py; not a chrF floor)."""
    monkeypatch.setattr("seq2seq.model.attention.MATMUL_ATTENTION_MATRICES", 1)  # every step, small batches too
    sources = demo_test_sentences(40)
    search = SearchConfig(beam_size=1)
    outputs = {}
    for sdpa in (True, False):
        monkeypatch.setattr("seq2seq.inference.preparation.one_query_sdpa", lambda device, precision, sdpa=sdpa:
                            Verdict(sdpa, "pretended"))
        fp32 = Translator.from_checkpoint(trained, precision="fp32")
        translator = Translator.from_checkpoint(trained, precision="bf16")
        chosen = {m.one_query_by_matmul for m in translator.model.modules() if isinstance(m, MultiHeadAttention)}
        assert chosen == {not sdpa}
        assert {m.one_query_by_matmul for m in fp32.model.modules() if isinstance(m, MultiHeadAttention)} == {True}
        assert not hasattr(MultiHeadAttention, "one_query_by_matmul")  # no setting of the process
        outputs[sdpa] = [hyps[0].tokens for hyps in translator.translate_nbest(sources, search)]
    problems = greedy_near_ties(reference_model(trained), translator.tokenizer.encode_source(sources), outputs[True],
                                outputs[False], precision="bf16", bos=BOS_ID, eos=EOS_ID)
    assert not problems, "SDPA against the matmuls at one query a row: " + "; ".join(problems)


def test_compile_decoding_compiles_on_a_daemon_thread_of_the_decoder_threads_count(checkpoint: Path,
                                                                                    monkeypatch: pytest.MonkeyPatch):
    """Dynamo compiles a graph per intra-op thread count: Translator.compile_decoding compiles for its workers' (or
    the `threads` given) on a thread of that count, a daemon one (Ctrl-C in the caller would otherwise wait for the
    compiling to end at exit), and raises what the compiling raised in the caller's thread (compiling pretended)."""
    seen: list[tuple[str, bool, int]] = []
    failure: list[BaseException] = []

    def compile_kinds(self: CompiledDecoder) -> int:
        seen.append((threading.current_thread().name, threading.current_thread().daemon, torch.get_num_threads()))
        if failure:
            raise failure[0]
        return 4

    monkeypatch.setattr(CompiledDecoder, "compile_kinds", compile_kinds)
    translator = Translator.from_checkpoint(checkpoint, precision="fp32", compiled="jit", workers=2, threads=1)
    assert translator.compile_decoding() == 4 and translator.compile_decoding(threads=2) == 4
    assert seen == [("decoder-compile", True, 1), ("decoder-compile", True, 2)]
    failure.append(CompileError("the decoding step could not be compiled (InvalidCxxCompiler)"))
    with pytest.raises(CompileError, match="could not be compiled"):
        translator.compile_decoding()
    caller = Translator.from_checkpoint(checkpoint, precision="fp32", compiled="jit")  # no threads of its own
    failure.clear()
    seen.clear()
    assert caller.compile_decoding() == 4 and seen == [(threading.current_thread().name, False,
                                                        torch.get_num_threads())]


def test_decoding_puts_every_tensor_on_the_model_s_device(translator: Translator):
    """With another default device (`meta`: a tensor made without a device lands there and fails against
    the model's), greedy, beam and sampling on a CPU model give what they give without it: on a GPU, no
    tensor of the batch, the search or the cache would be made on the CPU."""
    sources = [SENTENCES[0], "", SENTENCES[2]]
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3, nbest=2), SearchConfig(sampling=True, seed=4)):
        expected = translator.translate_nbest(sources, search)
        with torch.device("meta"):
            assert translator.translate_nbest(sources, search) == expected, search


@pytest.mark.parametrize("search", [SearchConfig(beam_size=3, nbest=2, max_len_a=0, max_len_b=12),
                                    SearchConfig(beam_size=1), SearchConfig(sampling=True, seed=1)],
                         ids=["beam", "greedy", "sampling"])
def test_target_prefixes_start_each_translation(translator: Translator, search: SearchConfig):
    texts, prefixes = SENTENCES[:3], ["A dog", "", "Two men play"]
    got = translator.translate_nbest(texts, search, prefixes=prefixes)
    if not search.sampling:  # (a draw depends on the other rows of its batch)
        assert got[1] == translator.translate_nbest(texts, search)[1]  # "" forces nothing
    for prefix, hyps in ((prefixes[0], got[0]), (prefixes[2], got[2])):
        ids = translator.tokenizer.encode_target([prefix])[0]
        assert hyps and all(h.tokens[: len(ids)] == ids and h.text.startswith(prefix) for h in hyps)
    streamed = list(translator.translate_stream(texts, search, prefixes=iter(prefixes), window=2))
    assert all(h.tokens[:2] == got[0][0].tokens[:2] for h in streamed[0])  # "A dog": two pieces
    if not search.sampling:
        assert [[h.tokens for h in hyps] for hyps in streamed] == [[h.tokens for h in hyps] for hyps in got]


def test_bad_target_prefixes_are_refused_naming_the_line(translator: Translator):
    with pytest.raises(ValueError, match=r"^2 target prefixes for 3 texts: give one per text"):
        translator.translate_nbest(SENTENCES[:3], prefixes=["a", "b"])
    long = " ".join(["dog"] * 200)
    with pytest.raises(ValueError, match=r"^the target prefix of line 5 has \d+ tokens, more than the model writes"):
        translator.translate_nbest(SENTENCES[:2], prefixes=["", long], first_line=4)
    with pytest.raises(ValueError, match=r"^the target prefixes end after line 1, before the texts do"):
        list(translator.translate_stream(SENTENCES[:3], prefixes=["a"]))
    with pytest.raises(ValueError, match=r"^there are more target prefixes than the 2 texts"):
        list(translator.translate_stream(SENTENCES[:2], prefixes=["a", "b", "c"]))


def test_workers_decode_the_same_batches_at_once(checkpoint: Path, monkeypatch: pytest.MonkeyPatch):
    """Two workers of one thread each: every output, score and order as one worker's, for searches and
    streams alike (the batches are one worker's); seeded sampling draws as one worker does."""
    with gzip.open(DEMO_DATA / "test.en.gz", "rt", encoding="utf-8") as f:
        texts = [line.strip() for line in f][:80] + ["", "  "]
    one = float64(Translator.from_checkpoint(checkpoint, precision="fp32"))
    two = Translator(model=one.model, tokenizer=one.tokenizer, precision="fp32", workers=2, threads=1)
    assert (two.workers, two.threads) == (2, 1)
    # What the CLI's end-of-run line reports: seeded sampling decodes on the caller's thread, with its threads
    assert two.decoding_threads(SearchConfig(beam_size=3)) == two.decoding_threads(SearchConfig(sampling=True)) == (2, 1)
    assert two.decoding_threads(SearchConfig(sampling=True, seed=7)) == (1, torch.get_num_threads())
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3, nbest=2),
                   SearchConfig(sampling=True, seed=7, top_k=5)):
        assert two.translate_nbest(texts, search, max_tokens=96) == one.translate_nbest(texts, search, max_tokens=96)
        assert list(two.translate_stream(texts, search, max_tokens=96, window=17)) == list(
            one.translate_stream(texts, search, max_tokens=96, window=17))
    # A lone batch is cut in two for the two workers: the same tokens, scores as close as float64 rounding
    # over other padding leaves them.
    sizes: list[int] = []
    real_decode = translator_module.decode

    def decode(model: Transformer, src: torch.Tensor, *args, **kwargs):
        sizes.append(len(src))
        return real_decode(model, src, *args, **kwargs)

    monkeypatch.setattr(translator_module, "decode", decode)
    lone = two.translate_nbest(texts, SearchConfig(beam_size=3))
    assert sorted(sizes) == [40, 40]
    for got, want in zip(lone, one.translate_nbest(texts, SearchConfig(beam_size=3)), strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-9)
    sizes.clear()
    streamed = list(two.translate_stream(texts, SearchConfig(beam_size=3)))
    assert [[h.tokens for h in line] for line in streamed] == [[h.tokens for h in line] for line in lone]
    assert sorted(sizes) == [40, 40]  # a stream's window is cut likewise, and its lines come out in order
    # Word alignments read a cross-attention layer's weights: each worker its own, though both decode at once
    # (a hook on the shared layer gave one worker's alignments from the other's inputs)
    aligned = SearchConfig(beam_size=2, alignments=True)
    for _ in range(3):
        got, want = two.translate_nbest(texts, aligned), one.translate_nbest(texts, aligned)
        assert [[h.alignment for h in line] for line in got] == [[h.alignment for h in line] for line in want]
    wide = SearchConfig(beam_size=64)  # one sentence of 64 rows: one part, never an empty one beside it
    assert [h.tokens for h in two.translate_nbest(texts[:1], wide)[0]] == [
        h.tokens for h in one.translate_nbest(texts[:1], wide)[0]]
    assert "wide" not in two.pool._executors
    # A lone batch too small to cut, but whose output projection is wide enough: on both workers' threads
    monkeypatch.setattr("seq2seq.inference.pool.WIDE_WORK", 0)
    sizes.clear()
    two.decoded.clear()
    got = two.translate_nbest(texts[:5], SearchConfig(beam_size=3))
    assert sizes == [5] and "wide" in two.pool._executors
    assert got == one.translate_nbest(texts[:5], SearchConfig(beam_size=3))
    # ... which the end-of-run line names as it ran, beside the batches that ran on the workers
    assert two.decoded == Counter({(1, 2): 1}) and workers_of(two, SearchConfig()) == "1 worker x 2 threads"
    two.translate_nbest(texts, SearchConfig(beam_size=3), max_tokens=64)
    assert len(two.decoded) == 2 and two.decoded[1, 2] == 1 and two.decoded[2, 1] >= 2
    assert workers_of(two, SearchConfig()) == "2 workers x 1 thread; 1 batch on 1 worker x 2 threads"
    stream = two.translate_stream(texts, SearchConfig(beam_size=2), max_tokens=32)
    next(stream)
    stream.close()  # a reader that stops early: what was queued for it is cancelled
    # Compiled, a lone wide batch stays on one worker's threads: dynamo compiles its graphs per thread count, and
    # all of them again for the wide pool's (the decoding here is eager: which threads decode is what is checked)
    monkeypatch.setattr(two.pool, "widen", False)  # as a compiled Translator's pool is made
    two.decoded.clear()
    assert two.translate_nbest(texts[:5], SearchConfig(beam_size=3)) == one.translate_nbest(
        texts[:5], SearchConfig(beam_size=3))
    assert two.decoded == Counter({(1, 1): 1})
    monkeypatch.setattr(two.pool, "widen", True)
    for bad in ({"workers": 0}, {"workers": True}, {"threads": 0}):
        with pytest.raises(ValueError, match="workers|threads"):
            Translator(model=one.model, tokenizer=one.tokenizer, precision="fp32", **bad)
    # Workers on one GPU wait on each other's kernels (an H100 ran 2 and 4 of them at 0.08-0.70x one): said so.
    # ("meta" stands in for a device other than the CPU.)
    with pytest.warns(UserWarning, match=r"^2 decoder workers on meta share one device"):
        Translator(model=copy.deepcopy(one.model), tokenizer=one.tokenizer, precision="fp32", device="meta", workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Translator(model=copy.deepcopy(one.model), tokenizer=one.tokenizer, precision="fp32", device="meta")


def test_an_input_of_fewer_batches_than_workers_is_shared_out_in_parts():
    even = [1] * 130  # every sentence the same work
    batches = [list(range(100)), list(range(100, 130))]
    assert shared_out(batches[:1], workers=1, rows=5, work=even) == batches[:1]
    assert shared_out(batches[:1], workers=2, rows=1, work=even) == [list(range(50)), list(range(50, 100))]
    assert shared_out(batches[:1], workers=3, rows=1, work=even) == [list(range(33)), list(range(33, 66)),
                                                                     list(range(66, 100))]
    # Parts of about PART_ROWS decoder rows (sentences x beam) or more; a batch too small stays whole
    assert shared_out(batches[:1], workers=8, rows=1, work=even) == [list(range(33)), list(range(33, 66)),
                                                                     list(range(66, 100))]
    assert shared_out([list(range(63))], workers=2, rows=1, work=even) == [list(range(63))]
    assert shared_out([list(range(13))], workers=2, rows=5, work=even) == [list(range(6)), list(range(6, 13))]
    assert shared_out(batches, workers=4, rows=1, work=even) == [list(range(33)), list(range(33, 66)),
                                                                 list(range(66, 100)), list(range(100, 130))]
    # A wide beam: never more parts than sentences (an empty part has nothing to decode)
    assert shared_out([[7]], workers=2, rows=64, work=even) == [[7]]
    assert shared_out([[0, 1, 2, 3]], workers=8, rows=40, work=even) == [[0], [1], [2], [3]]


def test_batches_of_unequal_work_are_cut_so_that_no_worker_waits_on_another():
    # Two batches for two workers: whole when their work is about equal, cut when one is a batch of long
    # sentences and the other of short ones (500 Multi30k sentences: one worker idle a third of the run)
    batches = [list(range(64)), list(range(64, 128))]
    assert shared_out(batches, workers=2, rows=1, work=[1] * 128) == batches
    long_then_short = [3] * 64 + [1] * 64
    parts = shared_out(batches, workers=2, rows=1, work=long_then_short)
    assert parts == [list(range(32)), list(range(32, 64)), list(range(64, 96)), list(range(96, 128))]
    # Cut no finer than PART_ROWS rows a part: the best cut that leaves, balanced or not (one sentence outweighs
    # the rest)
    assert shared_out(batches[:1], workers=2, rows=1, work=[1000] + [1] * 127) == [list(range(32)), list(range(32, 64))]
    # Every batch takes the same k: a heavy batch cut for two workers cuts the light ones too
    heavy_first = [list(range(64)), list(range(64, 128)), list(range(128, 192))]
    assert len(shared_out(heavy_first, workers=2, rows=1, work=[10] * 64 + [1] * 128)) == 6
    # Enough batches to go round stay whole (the 3 batches of 1,000 Multi30k sentences for two workers)
    three = [list(range(40)), list(range(40, 120)), list(range(120, 170))]
    assert shared_out(three, workers=2, rows=1, work=[3] * 40 + [2] * 80 + [1] * 50) == three
    # Every sentence in one part, in order, whatever the cut
    for workers in (2, 3, 4):
        cut = shared_out(batches, workers=workers, rows=1, work=long_then_short)
        assert [i for part in cut for i in part] == list(range(128))


@pytest.mark.parametrize("workers, threads, cores, device, expected", [
    (None, None, 4, "cpu", (4, 1)), (None, 2, 4, "cpu", (2, 2)), (2, None, 4, "cpu", (2, 2)), (3, 2, 4, "cpu", (3, 2)),
    (None, 8, 4, "cpu", (1, 8)),
    # A GPU: one worker unless --workers asks for more (several threads on one device ran 0.08-0.7x one)
    (None, None, 16, "cuda", (1, 16)), (None, None, 16, "cuda:1", (1, 16)), (None, 2, 16, "mps", (1, 2)),
    (4, None, 16, "cuda", (4, 4))])
def test_workers_and_threads_fill_the_cores(workers, threads, cores, device, expected, monkeypatch: pytest.MonkeyPatch):
    from argparse import Namespace

    from seq2seq.cli import parallelism

    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert parallelism(Namespace(workers=workers, threads=threads, device=device)) == expected
