"""Tests for seq2seq.inference.translator, the translate CLI and serve/translate.py.

Two models: the checkpoint of the short training run (`tiny_run`), loaded as a user would, and a
randomly initialised Transformer with the run's tokenizer. Twelve training steps teach little
beyond "A" and "t t t", and a random model rarely ends a sentence, so the random one gets a
larger EOS embedding (tied to the output projection) to end some hypotheses early: between them
the outputs vary in length and content. Where results must match to the last token the models run
in float64, so that padding a sentence among others cannot flip a near-tie.
"""

import argparse
import contextlib
import copy
import gzip
import io
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import output_checks
import pytest
import sacrebleu
import torch
from conftest import DEMO_DATA, sigterm_to_this_process, write_not_ours
from near_ties import (
    ROUNDINGS,
    UNIT_ROUNDOFF,
    beam_near_ties,
    greedy_near_ties,
    reference_model,
    teacher_forced_logits,
)
from torch import nn
from torch._dynamo.utils import counters

from seq2seq.checkpoint import store_search_defaults
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
from seq2seq.textio import Output
from seq2seq.translate import format_nbest, main, one_line, read_lines, workers_of, write_translations

REPO = Path(__file__).resolve().parents[2]
IDS = {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}

SENTENCES = [
    "Ein Hund läuft über die Wiese.",
    "Zwei Männer spielen Fußball im Park.",
    "Eine Frau mit einem roten Hut sitzt auf einer Bank und liest ein Buch.",
    "Kinder.",
    "Ein Mann fährt Fahrrad auf einer Straße in der Stadt, während es regnet.",
    "Eine Gruppe von Menschen steht vor einem Gebäude.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small, busy machine two threads spinning on tiny matrices are ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(one_thread, request: pytest.FixtureRequest) -> Path:
    # Asked for here, not as an argument (pytest would build the session fixture before one_thread):
    # when this module is the first to need the training run, it trains with one thread, ~1 s
    # instead of ~40 s on a busy two-core machine.
    _, checkpoints = request.getfixturevalue("tiny_run")
    return checkpoints / "best.ckpt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint)


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


def python_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------
# Translating: batches, odd lines, the search paths.


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


def test_cli_switch_flags_are_none_until_given():
    """A SearchConfig switch's flag is None when absent (the checkpoint's value then applies): --alignments
    turns an off switch on, --no-scores an on switch off."""
    from seq2seq.cli import add_search_arguments, search_config, search_flags

    parser = argparse.ArgumentParser()
    add_search_arguments(parser)
    assert search_flags()["scores"] == ["--no-scores"] and search_flags()["alignments"] == ["--alignments"]
    stored = SearchConfig(alignments=True, scores=False, beam_size=3)
    assert search_config(parser, parser.parse_args([]), stored) == stored
    given = search_config(parser, parser.parse_args(["--no-scores", "--token-scores"]), SearchConfig())
    assert (given.scores, given.token_scores, given.alignments) == (False, True, False)


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


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_bar_only_on_a_terminal(terminal: bool):
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    progress, output, best = Stream(), io.StringIO(), []
    hyps = [[Translation(text=f"line {i}", score=-1.0, tokens=[4])] for i in range(3)]
    write_translations(iter(hyps), output, search=SearchConfig(), best=best, total=3, progress=progress)
    assert output.getvalue() == "line 0\nline 1\nline 2\n" and best == ["line 0", "line 1", "line 2"]
    assert ("/3 [" in progress.getvalue()) == terminal  # the bar ("0/3 [00:00<?, ...]"); nothing when piped
    assert terminal or progress.getvalue() == ""


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


# ---------------------------------------------------------------------------------------------
# python -m seq2seq.translate


def test_read_lines_drops_a_byte_order_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "in.txt"
    path.write_bytes("\ufeffEin Hund.\nZwei.\n".encode())  # what Notepad writes
    assert read_lines(str(path)) == ["Ein Hund.", "Zwei."]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffEin Hund.\n".encode())))
    assert read_lines("-") == ["Ein Hund."]
    path.write_bytes("Ein\ufeffHund.\n".encode())  # inside a line it is the sentence's (a zero-width space)
    assert read_lines(str(path)) == ["Ein\ufeffHund."]


def test_read_lines_splits_at_newlines_only(tmp_path: Path):
    # str.splitlines would split the first line at U+2028 and U+0085: one more output line than input.
    path = tmp_path / "in.txt"
    path.write_bytes("Ein\u2028Hund\x85.\r\n\nzwei\x0c\n".encode())
    assert read_lines(str(path)) == ["Ein\u2028Hund\x85.", "", "zwei\x0c"]
    path.write_bytes(b"")
    assert read_lines(str(path)) == []
    path.write_bytes(b"no newline at the end")
    assert read_lines(str(path)) == ["no newline at the end"]


def test_output_lines_stay_one_line_each():
    # Byte-fallback pieces can decode to a newline; it must not split a translation over two lines.
    hyps = [Translation(text="a\nb\r", score=-1.5, tokens=[4]), Translation(text="c", score=-2.0, tokens=[5])]
    assert one_line(hyps[0].text) == "a b "
    assert format_nbest(hyps, nbest=2, prefix="3\t") == ["3\t-1.5000\ta b ", "3\t-2.0000\tc"]
    assert format_nbest([], nbest=2, prefix="4\t") == ["4\t0.0000\t", "4\t0.0000\t"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # fp32 unless a test asks otherwise: auto would pick bf16 on a CPU with bf16 units, and the
    # outputs are compared with the in-process fp32 Translator's.
    precision = [] if "--precision" in args else ["--precision", "fp32"]
    command = [sys.executable, "-m", "seq2seq.translate", *args, *precision]
    return subprocess.run(command, cwd=REPO, env=python_env(), input=stdin, capture_output=True, text=True,
                          encoding="utf-8", timeout=120)


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


def test_compiled_decoding_translates_as_the_eager_step(trained: Path, monkeypatch: pytest.MonkeyPatch):
    """Translator(compiled=True) in fp32: the searches run seq2seq/model/compiled.py's encoder, cross-attention
    projection and step over the model's unpacked linear layers and give the eager Translator's
    tokens (tests/model/test_compiled.py decodes one sentence at a time, and more variants); `compile_decoding` compiles
    every kind of step at once, after which no search compiles another. A model with rotary
    positions is refused in one line, before anything compiles. (Compiled without timing inductor's GEMM
    templates, which for this model took minutes, and with the step's call in Python: tests/model/test_compiled.py runs
    both on tiny models.)"""
    sources = quick_to_compile(monkeypatch)
    base = Translator.from_checkpoint(trained, precision="fp32")
    compiled = Translator.from_checkpoint(trained, precision="fp32", compiled=True, threads=1)  # on its own thread
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
        Translator(model=rotary, tokenizer=compiled.tokenizer, compiled=True)


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
    """make test's share of the next test (which compiles, in .ci/run): the Translator's int8 compiled model, made
    without compiling anything (tests/model/test_compiled.py decodes with such models, compiled, on tiny ones)."""
    monkeypatch.setattr("seq2seq.inference.preparation.bf16_matmuls_pay", lambda device: bf16_pays)
    compiled_int8_is_made_so(Translator.from_checkpoint(trained, precision="int8", compiled=True, threads=1), bf16_pays)


@pytest.mark.e2e  # (.ci/run: two compiles of a minute or more; make test: the test above, tests/model/test_compiled.py)
@pytest.mark.parametrize("bf16_pays", [False, True])
def test_compiled_int8_translates_as_its_eager_step(trained: Path, monkeypatch: pytest.MonkeyPatch, bf16_pays: bool):
    """Translator(precision="int8", compiled=True): every linear layer RowInt8Linear (int8 activations a row each,
    oneDNN's op, compiled into the encoder and the step; int8 without compile runs fbgemm's Int8Linear, activations
    quantised a tensor at once); where bf16 pays on the CPU (both verdicts forced here) the rest of the decoder is
    bf16 around them (bf16_around_int8). The compiled step's translations are the same model's eager step's (in bf16
    all but a near-tie), and close to int8's without compile (another quantisation of the activations: a few
    sentences may differ, at near-ties). Near-ties, not counts of equal outputs (tests/near_ties.py): in bf16 the
    compiled step's logits round in other places (0.06 apart at most in a sum of ~10 log-probs on one CPU), and
    which ties flip depends on the CPU's kernels."""
    sources = quick_to_compile(monkeypatch)
    monkeypatch.setattr("seq2seq.inference.preparation.bf16_matmuls_pay", lambda device: bf16_pays)
    compiled = Translator.from_checkpoint(trained, precision="int8", compiled=True, threads=1)
    compiled_int8_is_made_so(compiled, bf16_pays)
    precision = "bf16" if bf16_pays else "int8"
    eager = copy.copy(compiled)
    eager.decoding = compiled.model  # the same model, its eager step: the reference, its weights quantised
    src = compiled.tokenizer.encode_source(sources)
    beams = SearchConfig(beam_size=2)  # (the beams' kinds compiled and their scores checked on a few sentences)
    same_tokens(eager.translate_nbest(sources[:4], beams), compiled.translate_nbest(sources[:4], beams), compiled.model,
                src[:4], precision, beams=True)
    greedy_search = SearchConfig(beam_size=1)  # greedy: a first point of divergence to check (tests/near_ties.py)
    got = compiled.translate_nbest(sources, greedy_search)
    same_tokens(eager.translate_nbest(sources, greedy_search), got, compiled.model, src, precision)
    # int8 without compile quantises the activations otherwise (a tensor at once, fbgemm): its outputs may part
    # from these at ties within int8's rounding too, which its own model confirms
    eager_int8 = Translator.from_checkpoint(trained, precision="int8")
    problems = greedy_near_ties(eager_int8.model, src, [h[0].tokens for h in eager_int8.translate_nbest(sources, greedy_search)],
                                [h[0].tokens for h in got], precision="int8", bos=BOS_ID, eos=EOS_ID)
    assert not problems, "int8 without compile: " + "; ".join(problems)


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


def test_cli_files_with_references(checkpoint: Path, translator: Translator, tmp_path: Path):
    sources = [SENTENCES[0], "", SENTENCES[1], "   ", SENTENCES[2], SENTENCES[3]]
    references = ["A dog runs across the meadow.", "", "Two men play football in the park.", "",
                  "A woman in a red hat sits on a bench reading a book.", "Children."]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("\n".join(references) + "\n", encoding="utf-8")
    result = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"),
                     "--output", str(tmp_path / "out.en"), "--ref", str(tmp_path / "ref.en"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""  # translations went to the file, scores to stderr
    lines = (tmp_path / "out.en").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines[:-1]) == len(sources)
    assert lines[:-1] == translator.translate(sources, SearchConfig(beam_size=5))
    assert lines[1] == lines[3] == ""
    # The end-of-run line names the precision, the workers and their threads, and the search
    assert re.search(r"^translated 6 lines in [\d.]+s \((fp32|bf16), \d+ workers? x \d+ threads?, beam 5, ",
                     result.stderr, re.MULTILINE), result.stderr
    assert re.search(r"^BLEU = [\d.]+ .*nrefs:1\|case:mixed\|eff:no\|tok:13a\|smooth:exp\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr
    assert re.search(r"^chrF2 = [\d.]+ .*nrefs:1\|case:mixed\|eff:yes\|nc:6\|nw:0\|space:no\|version:[\d.]+$",
                     result.stderr, re.MULTILINE), result.stderr


def test_the_end_line_gives_the_compiling_s_share_where_there_was_some(checkpoint: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]):
    """--compile: every process compiles its graphs again (a minute or more), so a short run is mostly compiling, and
    its tokens/s say nothing without the share (the seconds pretended here: test_compiled_decoding_translates_as_the_
    eager_step has the tally's)."""
    (tmp_path / "in.de").write_text(SENTENCES[0] + "\n", encoding="utf-8")
    command = ["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "out"),
               "--force"]  # run twice into one file
    main(command)
    assert "of it compiling" not in capsys.readouterr().err
    monkeypatch.setattr(Translator, "compiling_seconds", property(lambda self: 12.34))
    main(command)
    assert re.search(r"^translated 1 lines in [\d.]+s, 12\.3s of it compiling \((fp32|bf16), ", capsys.readouterr().err,
                     re.MULTILINE)


def test_cli_stdin_nbest(checkpoint: Path, translator: Translator):
    sources = [SENTENCES[0], "", SENTENCES[4]]
    result = run_cli("--checkpoint", str(checkpoint), "--input", "-", "--nbest", "2", "--beam", "3",
                     stdin="\n".join(sources) + "\n")
    assert result.returncode == 0, result.stderr
    rows = [re.fullmatch(r"(\d+)\t(-?\d+\.\d{4})\t(.*)", line) for line in result.stdout.splitlines()]
    assert all(rows), result.stdout
    assert [int(row[1]) for row in rows] == [0, 0, 1, 1, 2, 2]
    expected = translator.translate_nbest(sources, SearchConfig(beam_size=3, nbest=2))
    for i in (0, 2):
        got = rows[2 * i : 2 * i + 2]
        assert [row[3] for row in got] == [h.text for h in expected[i]]
        assert [float(row[2]) for row in got] == pytest.approx([h.score for h in expected[i]], abs=1e-4)
    assert [row.groups()[1:] for row in rows[2:4]] == [("0.0000", ""), ("0.0000", "")]  # the empty line


def test_cli_reference_line_count_mismatch(tmp_path: Path):
    (tmp_path / "in.de").write_text("a\n\nb\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a\nb\n", encoding="utf-8")
    # The check comes before the checkpoint is read: this one need not exist.
    with pytest.raises(SystemExit, match=r"in\.de has 3 lines but .*ref\.en has 2; the references must be line"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de"), "--ref", str(tmp_path / "ref.en")])


def test_cli_names_the_line_that_is_not_utf8(checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture):
    data = "Ein Hund.\nZwei Männer.\n".encode() + b"Dr\xe4i Frauen.\nVier.\n"  # latin-1 ä on line 3
    (tmp_path / "in.de").write_bytes(data)
    # A file is checked whole before the checkpoint is read (this one need not exist).
    with pytest.raises(SystemExit, match=r"in\.de line 3 is not UTF-8; convert the file to UTF-8$"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de")])
    # stdin is read once, as it comes: the lines before the bad one are translated and kept.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    with pytest.raises(SystemExit, match="^error: stdin line 3 is not UTF-8; convert the file to UTF-8; stdout holds "
                                         "the translations of the 2 lines before it$"):
        main(["--checkpoint", str(checkpoint), "--precision", "fp32"])
    expected = Translator.from_checkpoint(checkpoint, precision="fp32").translate(["Ein Hund.", "Zwei Männer."])
    assert capsys.readouterr().out == "".join(f"{line}\n" for line in expected)


def test_cli_explains_bad_checkpoints(tmp_path: Path):
    (tmp_path / "in.de").write_text("a\n", encoding="utf-8")
    write_not_ours(tmp_path / "other.ckpt", "other_dict")
    with pytest.raises(SystemExit, match=r"^error: .*other\.ckpt is not a seq2seq training checkpoint"):
        main(["--checkpoint", str(tmp_path / "other.ckpt"), "--input", str(tmp_path / "in.de")])
    with pytest.raises(SystemExit, match="error: .*missing.ckpt does not exist"):
        main(["--checkpoint", str(tmp_path / "missing.ckpt"), "--input", str(tmp_path / "in.de")])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--beam", "2", "--nbest", "3"], "--nbest: must be between 1 and --beam (2), got 3"),
        (["--beam", "0"], "--beam: must be >= 1, got 0"),
        (["--length-penalty", "nan"], "--length-penalty: must be a finite number, got nan"),
        (["--length-penalty", "inf"], "--length-penalty: must be a finite number, got inf"),
        (["--max-len-a", "nan"], "--max-len-a: must be a finite number, got nan"),
        (["--max-len-a", "1e300"], "--max-len-a: must be >= 0 and <= 1000, got 1e+300"),
        (["--max-len-b", "-5"], "--max-len-b: must be >= 0 and <= 1000000, got -5"),
        (["--max-len-a", "0", "--max-len-b", "0"], "--max-len-a and --max-len-b are both 0"),
        (["--min-len", "-1"], "--min-len: must be >= 0, got -1"),
        (["--sampling", "--temperature", "nan"], "--temperature: must be a finite number, got nan"),
        (["--sampling", "--temperature", "0"], "--temperature: must be >= 0.0001 and <= 10000.0, got 0.0"),
        (["--sampling", "--temperature", "1e-38"], "--temperature: must be >= 0.0001 and <= 10000.0, got 1e-38"),
        (["--length-penalty", "300"], "--length-penalty: must be >= 0 and <= 10, got 300.0"),
        (["--sampling", "--top-p", "0"], "--top-p: must be > 0 and <= 1, got 0.0"),
        (["--sampling", "--top-k", "-1"], "--top-k: must be >= 0, got -1"),
        (["--sampling", "--nbest", "2"], "--nbest: --sampling draws one translation per sentence: must be 1, got 2"),
        (["--seed", "-3"], "--seed: must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "--device: device 'cuda"),
        (["--device", "abacus"], "--device: device 'abacus' cannot be used here"),
    ],
)
def test_cli_refuses_bad_options_before_loading_anything(options, message, capsys: pytest.CaptureFixture):
    # The checkpoint does not exist: the option must be refused before it is looked for.
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", "unused.ckpt", *options])
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m seq2seq.translate: error: ") and message in error, error


def test_cli_refuses_a_beam_wider_than_the_vocabulary_before_translating(checkpoint: Path, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --beam: 1000000 needs a vocabulary of at least 2000000 tokens; "
                                         "this model has 600$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--beam", "1000000"])


@pytest.mark.parametrize("where", ["missing_folder", "folder", "under_a_file"])
def test_cli_checks_the_output_path_before_translating(where: str, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "a_file").write_text("x", encoding="utf-8")
    output = {"missing_folder": tmp_path / "nope" / "out.en", "folder": tmp_path,
              "under_a_file": tmp_path / "a_file" / "out.en"}[where]
    expected = {"folder": "is a folder; name the file to write", "missing_folder": "does not exist; create it first",
                "under_a_file": "a_file is a file, not a folder"}[where]
    # No checkpoint either: the output is checked first, before the model loads and the input is translated.
    with pytest.raises(SystemExit, match=rf"^error: --output {re.escape(str(output))}.*{expected}"):
        main(["--checkpoint", "unused.ckpt", "--input", str(tmp_path / "in.de"), "--output", str(output)])


def test_cli_refuses_to_overwrite_its_input_and_names_a_missing_ref(tmp_path: Path):
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --output .*in\.de is the input file .*in\.de: it would be overwritten"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--output", str(source)])
    assert source.read_text(encoding="utf-8") == "Ein Hund.\n"
    with pytest.raises(SystemExit, match=r"^error: --output is empty"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--output", ""])
    with pytest.raises(SystemExit, match=r"^error: --ref .*nope\.en does not exist"):
        main(["--checkpoint", "unused.ckpt", "--input", str(source), "--ref", str(tmp_path / "nope.en")])


def test_cli_write_errors_are_one_line_and_a_closed_pipe_is_quiet(checkpoint: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "in.de").write_text("Ein Hund.\nZwei.\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: cannot write --output /dev/full \(No space left on device\); it "
                                         "holds the translations of the first 0 lines$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", "/dev/full"])
    read_end, write_end = os.pipe()
    os.close(read_end)  # `| head -0`: nobody reads
    with open(write_end, "w", encoding="utf-8") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        with pytest.raises(SystemExit) as caught:
            main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de")])
        assert caught.value.code == 141  # what `cat` gives in a shell: 128 + SIGPIPE, and no traceback
        monkeypatch.undo()


@pytest.mark.parametrize(("stop", "status"), [("interrupted", 130), ("stopped by SIGTERM", 143)])
def test_cli_writes_as_it_goes_and_an_interrupted_run_keeps_its_lines(stop: str, status: int, checkpoint: Path,
                                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]):
    """Ctrl-C, or SIGTERM (a scheduler's time limit, `kill`), at the third window: the two windows done kept, one line
    saying how many, exit 130 or 143. SIGTERM ended the run at once before (143 and no line, nothing saying how far it
    got); it is handled as Ctrl-C is now (cli.stop_on_sigterm), a real signal to this process here. A second one is
    ignored until the output is cut to whole lines, then ends the process at once (the exit may wait for a batch)."""
    sources = [SENTENCES[i % len(SENTENCES)] for i in range(7)]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    monkeypatch.setattr("seq2seq.translate.WINDOW", 3)
    real = Translator._decode_batches
    calls = []

    def stopped_at_the_third_window(self, inputs, *args, **kwargs):
        calls.append(len(inputs))
        if len(calls) == 3:
            if status == 130:
                raise KeyboardInterrupt
            sigterm_to_this_process()
        return real(self, inputs, *args, **kwargs)

    real_cut, sigterm_while_cut = Output.cut_to_whole_lines, []

    def cut(self: Output) -> None:
        sigterm_while_cut.append(signal.getsignal(signal.SIGTERM))
        real_cut(self)

    monkeypatch.setattr(Translator, "_decode_batches", stopped_at_the_third_window)
    monkeypatch.setattr(Output, "cut_to_whole_lines", cut)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output)])
    assert caught.value.code == status
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"{stop}: --output {output} holds the translations "
                                                                "of the first 6 lines")
    if status == 143:
        assert sigterm_while_cut == [signal.SIG_IGN] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.setattr(Translator, "_decode_batches", real)
    expected = Translator.from_checkpoint(checkpoint).translate(sources[:6])
    assert output.read_text(encoding="utf-8") == "".join(f"{line}\n" for line in expected)  # two whole windows


def test_sigterm_while_the_references_are_scored_says_every_translation_was_written(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """--ref's BLEU and chrF come after the last line is written (seconds on a large file): a stop then said "before any
    line was translated; ... was not written" of a complete output."""
    (tmp_path / "in.de").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("a dog runs .\ntwo men .\na woman .\n", encoding="utf-8")
    monkeypatch.setattr(sacrebleu.metrics.BLEU, "corpus_score", sigterm_to_this_process)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output), "--ref",
              str(tmp_path / "ref.en")])
    assert caught.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"stopped by SIGTERM while scoring: --output {output} "
                                                                "holds every translation")
    assert len(output.read_text(encoding="utf-8").splitlines()) == 3


def test_ctrl_c_in_the_middle_of_a_line_leaves_whole_lines_and_says_how_many(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Half of the third line written when Ctrl-C comes: that half is cut off, and the message counts the
    lines that are whole (it said one more before)."""
    sources = SENTENCES[:4]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    output = tmp_path / "out.en"
    real_write, writes = os.write, []

    def interrupted_halfway_through_the_third_line(fd: int, data) -> int:
        if fd <= 2:  # the terminal and pytest's capture
            return real_write(fd, data)
        writes.append(bytes(data))
        if len(writes) == 3:
            real_write(fd, bytes(data)[: len(data) // 2])
            raise KeyboardInterrupt
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", interrupted_halfway_through_the_third_line)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output)])
    monkeypatch.undo()
    assert caught.value.code == 130
    assert capsys.readouterr().err.strip().endswith(f"interrupted: --output {output} holds the translations of the "
                                                    "first 2 lines")
    assert output.read_bytes() == writes[0] + writes[1]  # the half line is gone


def test_cli_with_compile_whose_step_cannot_be_compiled_says_so_in_one_line(
        checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """--compile compiles each kind of step at its first batch: one that cannot be compiled (no C++ compiler) is one
    line saying so, what to do and what was written (the compiling's failure pretended)."""
    (tmp_path / "in.de").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    output = tmp_path / "out.en"

    def cannot_compile(self, tgt_in, memory, src_mask, state):
        raise CompileError("the decoding step could not be compiled (InvalidCxxCompiler: No working C++ compiler)")

    monkeypatch.setattr(CompiledDecoder, "_steps", cannot_compile)  # (decode's and decode_step's)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output),
              "--compile", "--precision", "fp32"])
    assert caught.value.code == ("error: the decoding step could not be compiled (InvalidCxxCompiler: No working C++ "
                                 f"compiler): translate without --compile; --output {output} holds the translations "
                                 "of the 0 lines before it")
    assert capsys.readouterr().err.splitlines()[0] == ("de→en: --compile: each kind of decoding step compiles at its "
                                                       "first batch (seconds to a minute each, in every run)")
    (tmp_path / "in.html").write_text("<p>" + SENTENCES[0] + "</p>", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.html"), "--output", str(output),
              "--format", "html", "--compile", "--precision", "fp32"])
    assert str(caught.value.code).endswith(f"translate without --compile; --output {output} was not written")


def test_cli_never_overwrites_the_checkpoint_or_a_file_that_is_not_text(checkpoint: Path, tmp_path: Path):
    """`--output c.ckpt` made a 121 MB checkpoint 650 bytes of text, exit 0."""
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    copy = tmp_path / "model.ckpt"
    shutil.copy(checkpoint, copy)
    before = copy.read_bytes()
    with pytest.raises(SystemExit, match=r"^error: --output .*model\.ckpt is the --checkpoint file .*model\.ckpt: it "
                                         "would be overwritten$"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(copy)])
    other = tmp_path / "other.ckpt"  # another checkpoint, or any binary file, under a name of its own
    shutil.copy(checkpoint, other)
    with pytest.raises(SystemExit, match=r"^error: --output .*other\.ckpt exists and is not a text file"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(other)])
    assert copy.read_bytes() == before and other.read_bytes() == before
    old = tmp_path / "old.en"  # earlier translations are the user's output to replace, with --force
    old.write_text("stale\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"^error: --output .*old\.en exists: name a new file, or pass --force"):
        main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(old)])
    assert old.read_text(encoding="utf-8") == "stale\n"
    main(["--checkpoint", str(copy), "--input", str(tmp_path / "in.de"), "--output", str(old), "--force"])
    assert old.read_text(encoding="utf-8").count("\n") == 1 and "stale" not in old.read_text(encoding="utf-8")


def test_cli_never_empties_its_output_for_an_input_it_cannot_read(checkpoint: Path, tmp_path: Path):
    """A missing or folder --input was found only after --output had been emptied; `--output F < F`
    emptied F, the input being read."""
    old = tmp_path / "old.en"
    old.write_text("earlier translations\n", encoding="utf-8")
    (tmp_path / "folder").mkdir()
    for source, message in (("nope.de", "does not exist"), ("folder", "is a folder; give a file")):
        with pytest.raises(SystemExit, match=f"^error: --input .*{source} {message}"):
            main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / source), "--output", str(old)])
    with old.open("rb") as stdin:  # the shell's `< old.en`
        result = subprocess.run([sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint),
                                 "--output", str(old)], cwd=REPO, env=python_env(), stdin=stdin, capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"error: --output {old} is the input file, read from stdin: it would be overwritten; write to another file")
    assert old.read_text(encoding="utf-8") == "earlier translations\n"


def test_cli_stdin_read_twice_or_closed_is_one_line(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(SystemExit):
        main(["--checkpoint", "unused.ckpt", "--ref", "-"])
    assert "--ref - and --input - would both read stdin" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets when started with fd 0 closed (`<&-`)
    with pytest.raises(SystemExit, match="^error: --input -: stdin is closed; give --input FILE"):
        read_lines("-")


def test_cli_writes_into_a_fifo_without_emptying_or_closing_it_first(checkpoint: Path, translator: Translator,
                                                                     tmp_path: Path):
    """The writability check opened and closed the FIFO: it hung without a reader, and a reader got EOF
    before the first translation."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n{SENTENCES[1]}\n", encoding="utf-8")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint), "--precision", "fp32",
               "--input", str(tmp_path / "in.de"), "--output", str(fifo)]
    process = subprocess.Popen(command, cwd=REPO, env=python_env(), stderr=subprocess.PIPE)

    def unblock() -> None:  # a writer that never opens the FIFO would leave open() below waiting for ever
        process.kill()
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(120, unblock)
    timer.start()
    try:
        with fifo.open("r", encoding="utf-8") as reader:  # open() waits for the writer, read() for its close
            got = reader.read()
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        timer.cancel()
        process.kill()
    assert got.splitlines() == translator.translate(SENTENCES[:2])


def test_lines_of_exactly_the_limit_are_read_and_one_byte_more_is_refused(tmp_path: Path):
    from seq2seq.textio import MAX_LINE_BYTES, InputError, iter_lines

    path = tmp_path / "in.txt"
    path.write_bytes(b"a" * MAX_LINE_BYTES + b"\r\n" + b"b" * MAX_LINE_BYTES + b"\n" + b"c" * MAX_LINE_BYTES)
    assert [len(line) for line in iter_lines(str(path))] == [MAX_LINE_BYTES] * 3
    path.write_bytes(b"ok\n" + b"d" * (MAX_LINE_BYTES + 1) + b"\n")
    with pytest.raises(InputError, match="line 2 is longer than 1 MiB"):
        list(iter_lines(str(path)))
    path.write_bytes("\ufeff".encode())  # a BOM alone is an empty file, not one empty line
    assert read_lines(str(path)) == []


def test_a_full_disk_leaves_whole_lines_and_says_how_many(checkpoint: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    """The disk fills in the middle of line 3: the file keeps lines 1-2 whole (no partial third line), and
    the message counts the lines written, not the one being written."""
    sources = [SENTENCES[i % len(SENTENCES)] for i in range(5)]
    (tmp_path / "in.de").write_text("\n".join(sources) + "\n", encoding="utf-8")
    real_write, writes = os.write, []

    def disk_fills_on_the_third_line(fd: int, data) -> int:
        writes.append(len(data))
        if len(writes) == 3:
            real_write(fd, bytes(data[: len(data) // 2]))  # the first half gets out, then the disk is full
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr("seq2seq.translate.os.write", disk_fills_on_the_third_line)
    output = tmp_path / "out.en"
    with pytest.raises(SystemExit, match=r"^error: cannot write --output .*out\.en \(No space left on device\); it "
                                         r"holds the translations of the first 2 lines$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(output),
              "--precision", "fp32"])
    expected = Translator.from_checkpoint(checkpoint, precision="fp32").translate(sources[:2])
    assert output.read_text(encoding="utf-8") == "".join(f"{line}\n" for line in expected)


def test_cli_failures_around_model_load_are_one_line(checkpoint: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    folder = tmp_path / "out"
    folder.mkdir()
    real = Translator.from_checkpoint

    def folder_goes_during_load(*args, **kwargs):
        folder.rmdir()  # an unmounted disk, a cleaned-up folder: the output cannot be opened any more
        return real(*args, **kwargs)

    monkeypatch.setattr(Translator, "from_checkpoint", folder_goes_during_load)
    with pytest.raises(SystemExit, match=r"^error: --output .*out\.en cannot be written \(No such file or directory\)$"):
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(folder / "out.en")])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the model loads

    monkeypatch.setattr(Translator, "from_checkpoint", interrupted)
    (tmp_path / "kept.en").write_text("kept\n", encoding="utf-8")
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(tmp_path / "kept.en"),
              "--force"])
    assert caught.value.code == 130
    assert capsys.readouterr().err.strip() == f"interrupted before any line was translated; --output {tmp_path / 'kept.en'} was not written"
    assert (tmp_path / "kept.en").read_text(encoding="utf-8") == "kept\n"


def test_cli_streams_its_input_and_refuses_what_has_no_lines(checkpoint: Path):
    """`--input /dev/zero` read everything first (+456 MiB, then MemoryError); now the input is read a
    window at a time, and a "line" of more than 1 MiB is refused."""
    result = run_cli("--checkpoint", str(checkpoint), "--input", "/dev/zero")
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
        "error: /dev/zero line 1 is longer than 1 MiB: not a text file with one sentence per line; stdout holds the "
        "translations of the 0 lines before it"), result.stderr
    # The first window's translations come out while stdin is still open: the input is streamed.
    command = [sys.executable, "-m", "seq2seq.translate", "--checkpoint", str(checkpoint), "--precision", "fp32"]
    with subprocess.Popen(command, cwd=REPO, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as process:
        process.stdin.write(("Ein Hund.\n" * 1000).encode())  # one window (seq2seq.translate.WINDOW)
        process.stdin.flush()
        read_line(process, timeout=120)  # fails unless the first line arrives before the end of the input
        process.stdin.write(b"Zwei.\n")
        process.stdin.close()
        rest = process.stdout.read().decode().split("\n")
        assert process.wait(timeout=60) == 0 and len(rest) == 1001  # 999, the 1001st, and "" after the last newline


# ---------------------------------------------------------------------------------------------
# serve/translate.py, driven through a pipe.


def serve(checkpoint: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, str(REPO / "serve/translate.py"), "--checkpoint", str(checkpoint), *args,
               "--precision", "fp32"]  # as the in-process Translator it is compared with (see run_cli)
    return subprocess.Popen(command, cwd=REPO, env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_line(process: subprocess.Popen, *, timeout: float = 60) -> str:
    """One line of the server's answer; fails (instead of hanging) if it never comes, e.g. unflushed."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "serve/translate.py did not answer a line (not flushed?)"
    return process.stdout.readline().decode("utf-8").removesuffix("\n")


def test_serve_answers_each_line_as_it_comes(checkpoint: Path, translator: Translator):
    lines = [SENTENCES[1].encode(), b"", b"Dr\xe4i Frauen.", b"   ", SENTENCES[0].encode()]
    expected = [translator.translate([text])[0] for text in (SENTENCES[1], "", "", "", SENTENCES[0])]
    process = serve(checkpoint)
    try:
        answers = []
        for line in lines:  # one at a time: the answer must come before the next line is sent
            process.stdin.write(line + b"\n")
            process.stdin.flush()
            answers.append(read_line(process))
        process.stdin.close()
        assert process.wait(timeout=60) == 0
        assert process.stdout.read() == b""
        assert answers == expected
        assert "input line 3 is not UTF-8" in process.stderr.read().decode()
    finally:
        process.kill()


def test_serve_nbest(checkpoint: Path, translator: Translator):
    process = serve(checkpoint, "--nbest", "2", "--beam", "3")
    out, err = process.communicate(f"{SENTENCES[2]}\n\n{SENTENCES[3]}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    blocks = out.decode("utf-8").split("\n\n")
    assert blocks[-1] == "" and len(blocks[:-1]) == 3  # N lines and a blank line per input
    for block, text in zip(blocks[:-1], [SENTENCES[2], "", SENTENCES[3]], strict=True):
        expected = format_nbest(translator.translate_nbest([text], SearchConfig(beam_size=3, nbest=2))[0], nbest=2)
        got = block.split("\n")
        assert [line.split("\t")[1] for line in got] == [line.split("\t")[1] for line in expected]
        assert [float(line.split("\t")[0]) for line in got] == pytest.approx(
            [float(line.split("\t")[0]) for line in expected], abs=1e-4
        )


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
    translator = Translator.from_checkpoint(checkpoint, precision="fp32", compiled=True, workers=2, threads=1)
    assert translator.compile_decoding() == 4 and translator.compile_decoding(threads=2) == 4
    assert seen == [("decoder-compile", True, 1), ("decoder-compile", True, 2)]
    failure.append(CompileError("the decoding step could not be compiled (InvalidCxxCompiler)"))
    with pytest.raises(CompileError, match="could not be compiled"):
        translator.compile_decoding()
    caller = Translator.from_checkpoint(checkpoint, precision="fp32", compiled=True)  # no threads of its own
    failure.clear()
    seen.clear()
    assert caller.compile_decoding() == 4 and seen == [(threading.current_thread().name, False,
                                                        torch.get_num_threads())]


def test_serve_with_compile_compiles_before_it_reads_the_first_line(checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]):
    """serve/translate.py --compile compiles every kind of step before it reads a line (run in this process, the
    compiling pretended: Translator.compile_decoding is the test above)."""
    from seq2seq import interactive
    events: list[str] = []
    monkeypatch.setattr(Translator, "compile_decoding", lambda self, threads=None: events.append("compiled") or 8)

    class Lines(io.BytesIO):
        def readline(self, size: int | None = -1) -> bytes:
            events.append("read")
            return super().readline(size)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(Lines(b"\n")))  # an empty line: nothing to decode (compile)
    interactive.main(["--checkpoint", str(checkpoint), "--compile", "--precision", "fp32"])
    assert events[0] == "compiled" and events.count("compiled") == 1 and "read" in events
    out, err = capsys.readouterr()
    assert out == "\n" and "compiling the encoder and the decoding steps (--compile" in err
    assert "8 kinds of call (encoder, cross-attention projection, decoding step) compiled" in err
    # A step that cannot be compiled: one line, before any line is read
    events.clear()
    monkeypatch.setattr(Translator, "compile_decoding", lambda self, threads=None: (_ for _ in ()).throw(
        CompileError("the decoding step could not be compiled (InvalidCxxCompiler)")))
    with pytest.raises(SystemExit) as caught:
        interactive.main(["--checkpoint", str(checkpoint), "--compile", "--precision", "fp32"])
    assert caught.value.code == ("error: the decoding step could not be compiled (InvalidCxxCompiler); "
                                 "serve/translate.py was not started: run it without --compile") and events == []


def test_serve_reports_each_truncated_line_with_its_own_number(checkpoint: Path, translator: Translator):
    long_line = " ".join(SENTENCES * 4)
    tokens = len(translator.tokenizer.encode_source([long_line])[0])
    process = serve(checkpoint)
    out, err = process.communicate(f"{long_line}\n{SENTENCES[0]}\n{long_line}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    assert len(out.decode("utf-8").splitlines()) == 3
    warned = [line for line in err.decode().splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: input line {n} has {tokens} tokens, more than the model's max_positions (128); "
                      "translating its first 128 tokens only" for n in (1, 3)]


def test_serve_answers_a_line_of_megabytes_with_an_empty_line_and_goes_on(checkpoint: Path, translator: Translator):
    """A 3 MiB line (a binary file piped in) was read whole; now it is one error and one empty line."""
    process = serve(checkpoint)
    multibyte = "ä" * (1 << 19) + "a"  # 1 MiB + 1 byte, cut inside a character when read in bounded pieces
    out, err = process.communicate(b"\0" * (3 << 20) + f"\n{multibyte}\n{SENTENCES[0]}\n".encode(), timeout=120)
    assert process.returncode == 0, err.decode()
    assert out.decode("utf-8").split("\n") == ["", "", translator.translate([SENTENCES[0]])[0], ""]
    assert err.decode().splitlines() == [f"error: input line {n} is longer than 1 MiB; translating it as an empty "
                                         "line" for n in (1, 2)], err.decode()


def test_the_checkpoint_s_tuned_search_is_the_default_and_flags_override_it(checkpoint: Path, tmp_path: Path):
    tuned = tmp_path / "tuned.ckpt"
    shutil.copy(checkpoint, tuned)
    store_search_defaults(tuned, {"beam_size": 2, "length_penalty": 1.5})
    translator = Translator.from_checkpoint(tuned)
    assert translator.search == SearchConfig(beam_size=2, length_penalty=1.5)
    assert translator.translate(SENTENCES) == translator.translate(SENTENCES, SearchConfig(beam_size=2, length_penalty=1.5))
    stdin = "\n".join(SENTENCES) + "\n"
    result = run_cli("--checkpoint", str(tuned), stdin=stdin)
    assert result.returncode == 0 and "beam 2, length penalty 1.5)" in result.stderr, result.stderr
    assert result.stdout.splitlines() == translator.translate(SENTENCES)
    result = run_cli("--checkpoint", str(tuned), "--beam", "3", stdin=stdin)
    assert result.returncode == 0 and "beam 3, length penalty 1.5)" in result.stderr, result.stderr
    result = run_cli("--checkpoint", str(checkpoint), stdin=stdin)  # none stored: ours (beam 5, 0.6)
    assert result.returncode == 0 and "beam 5, length penalty 0.6)" in result.stderr, result.stderr


def test_decoding_puts_every_tensor_on_the_model_s_device(translator: Translator):
    """With another default device (`meta`: a tensor made without a device lands there and fails against
    the model's), greedy, beam and sampling on a CPU model give what they give without it: on a GPU, no
    tensor of the batch, the search or the cache would be made on the CPU."""
    sources = [SENTENCES[0], "", SENTENCES[2]]
    for search in (SearchConfig(beam_size=1), SearchConfig(beam_size=3, nbest=2), SearchConfig(sampling=True, seed=4)):
        expected = translator.translate_nbest(sources, search)
        with torch.device("meta"):
            assert translator.translate_nbest(sources, search) == expected, search


def test_a_cuda_build_on_a_machine_without_a_gpu_is_one_line(monkeypatch, capsys: pytest.CaptureFixture):
    """torch built for CUDA, no driver: what such a build raises for `--device cuda`, stood in for here."""
    empty = torch.empty

    def no_driver(*args, device=None, **kwargs):
        if torch.device(device).type == "cuda":
            raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU\n"
                               "and installed a driver from http://www.nvidia.com/Download/index.aspx")
        return empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", no_driver)
    with pytest.raises(SystemExit) as caught:
        main(["--checkpoint", "unused.ckpt", "--device", "cuda"])
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == ("python -m seq2seq.translate: error: --device: device 'cuda' cannot be used here (Found no "
                     "NVIDIA driver on your system. Please check that you have an NVIDIA GPU); use cpu, or a device "
                     "this machine has (cuda, cuda:1, mps)")


# ---- target prefixes (autocompletion) ------------------------------------------------------------


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


def test_the_cli_reads_target_prefixes_line_by_line(checkpoint: Path, translator: Translator, tmp_path: Path):
    (tmp_path / "in").write_text("\n".join(SENTENCES[:3]) + "\n", encoding="utf-8")
    (tmp_path / "prefix").write_text("A dog\n\nTwo men\n", encoding="utf-8")
    done = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in"), "--target-prefix",
                   str(tmp_path / "prefix"), "--beam", "2")
    assert done.returncode == 0, done.stderr
    expected = translator.translate(SENTENCES[:3], SearchConfig(beam_size=2), prefixes=["A dog", "", "Two men"])
    assert done.stdout.split("\n")[:3] == expected
    (tmp_path / "prefix").write_text("A dog\n", encoding="utf-8")
    done = run_cli("--checkpoint", str(checkpoint), "--input", str(tmp_path / "in"), "--target-prefix",
                   str(tmp_path / "prefix"))
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'in'} has 3 lines but --target-prefix {tmp_path / 'prefix'} has 1; give one line per "
        "input line (an empty line for none)")


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


# ---- --output: the policy every face shares (seq2seq/textio.py's check_output), checked before the model loads ----


def refused(*args: str) -> str:
    """(No checkpoint is needed to get there.)"""
    return output_checks.refused(lambda args: main(["--checkpoint", "unused.ckpt", *args]), *args)


def test_cli_replaces_an_existing_file_only_with_force(checkpoint: Path, translator: Translator, tmp_path: Path):
    """An existing text file was emptied and written over without a word."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n", encoding="utf-8")
    taken = tmp_path / "out.en"
    taken.write_text("earlier translations\n", encoding="utf-8")
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(taken))
    assert message == f"error: --output {taken} exists: name a new file, or pass --force to replace it"
    assert taken.read_text(encoding="utf-8") == "earlier translations\n"
    main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(taken), "--force"])
    assert taken.read_text(encoding="utf-8").splitlines() == translator.translate(SENTENCES[:1])
    empty = tmp_path / "tmp.XXXX"  # an empty file (mktemp's) holds nothing to lose: written without --force
    empty.write_bytes(b"")
    main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(empty)])
    assert empty.read_text(encoding="utf-8") == taken.read_text(encoding="utf-8")


def test_cli_writes_into_a_fifo_in_this_process_without_force(checkpoint: Path, translator: Translator,
                                                                tmp_path: Path):
    """Streaming into a FIFO (a pipe to another program) is no replacing: it needs no --force, and is never emptied."""
    (tmp_path / "in.de").write_text(f"{SENTENCES[0]}\n{SENTENCES[1]}\n", encoding="utf-8")
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = output_checks.read_while(fifo, lambda: main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "in.de"), "--output", str(fifo)]))
    assert len(got) == 1 and got[0].splitlines() == translator.translate(SENTENCES[:2])
    assert fifo.is_fifo()


def test_cli_refuses_a_missing_folder_and_a_folder_in_one_line(tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    output = tmp_path / "new" / "out.en"
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(output), "--force")
    assert message == f"error: --output {output}: the folder {output.parent} does not exist; create it first"
    assert not output.parent.exists()
    message = refused("--input", str(tmp_path / "in.de"), "--output", str(tmp_path), "--force")
    assert message == (f"error: --output {tmp_path} is a folder; name the file to write, e.g. "
                       f"{tmp_path / 'translations.txt'}")


@pytest.mark.parametrize("option", ["--input", "--ref", "--checkpoint"])
def test_cli_refuses_an_input_as_output_even_with_force(option: str, checkpoint: Path, tmp_path: Path):
    (tmp_path / "in.de").write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("A dog.\n", encoding="utf-8")
    shutil.copy(checkpoint, tmp_path / "model.ckpt")
    paths = {"--input": tmp_path / "in.de", "--ref": tmp_path / "ref.en", "--checkpoint": tmp_path / "model.ckpt"}
    before = {path: path.read_bytes() for path in paths.values()}
    what = "the input file" if option == "--input" else f"the {option} file"
    with pytest.raises(SystemExit) as caught:
        main([*(x for flag, path in paths.items() for x in (flag, str(path))), "--output", str(paths[option]), "--force"])
    assert str(caught.value.code) == f"error: --output {paths[option]} is {what} {paths[option]}: it would be overwritten"
    assert {path: path.read_bytes() for path in paths.values()} == before
