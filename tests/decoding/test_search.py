"""Tests for seq2seq.decoding.search: fake models with written-out probabilities, a random fake with a real
incremental state, and the real Transformer decoded with and without its cache."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from seq2seq.decoding import beam, ranking, sampling, steps
from seq2seq.decoding import config as config_module
from seq2seq.decoding import search as search_module
from seq2seq.decoding.beam import beam_search
from seq2seq.decoding.config import Hypothesis, SearchConfig, SpecialIds
from seq2seq.decoding.ranking import (
    beam_step,
    length_normalize,
    log_normalizer,
    normalizer_and_bounds,
    top_k_rows,
)
from seq2seq.decoding.sampling import greedy, sample, top_k_filter, top_p_filter
from seq2seq.decoding.search import decode
from seq2seq.decoding.steps import Limits, constrain_, max_lengths, repeated_ngram_mask
from seq2seq.model import ConfigError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
A, B, C, D = 4, 5, 6, 7
IDS = {"bos": BOS, "eos": EOS, "pad": PAD}
INF = float("inf")
NEG = float("-inf")


def patch_decoding(monkeypatch: pytest.MonkeyPatch, name: str, value: object) -> None:
    """`name` replaced by `value` in every module of seq2seq/decoding/ that reads it (each looks it up in its own
    globals: the searches call the step and ranking functions they import)."""
    for module in (config_module, steps, ranking, beam, sampling, search_module):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)



def log(*probs: float) -> float:
    return sum(math.log(p) for p in probs)


def gnmt(log_prob: float, num_tokens_with_eos: int, alpha: float) -> float:
    return log_prob / ((5 + num_tokens_with_eos) / 6) ** alpha


def assert_hyps(hyps: list[Hypothesis], expected: list[tuple[list[int], float, float]]) -> None:
    """expected: (tokens, log_prob, score) per hypothesis, best first."""
    assert [h.tokens for h in hyps] == [tokens for tokens, _, _ in expected]
    assert [h.log_prob for h in hyps] == pytest.approx([lp for _, lp, _ in expected], abs=1e-5)
    assert [h.score for h in hyps] == pytest.approx([score for _, _, score in expected], abs=1e-5)


# ---------------------------------------------------------------------------------------------
# A fake model whose next-token probabilities are a written-out table.


class PrefixState:
    """Fake decoder state: the ids fed so far (BOS first). Like the real one, grown in place."""

    def __init__(self, fed: torch.Tensor | None = None):
        self.fed = fed

    @property
    def length(self) -> int:
        return 0 if self.fed is None else self.fed.size(1)

    def reorder(self, indices: torch.Tensor, *, sentences=None) -> "PrefixState":
        return PrefixState(self.fed.index_select(0, indices))

    def grow(self, tgt_in: torch.Tensor) -> None:
        self.fed = tgt_in if self.fed is None else torch.cat((self.fed, tgt_in), dim=1)


def per_row(x: torch.Tensor, src_mask: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
    """The searches pass one memory row per sentence and K adjacent target rows per sentence."""
    sentences, rows = src_mask.size(0), tgt_in.size(0)
    assert x.size(0) == sentences and rows % sentences == 0, (x.shape, src_mask.shape, tgt_in.shape)
    return x.repeat_interleave(rows // sentences, dim=0)


class TableModel:
    """P(next | source, prefix) = tables[src[0]][prefix] (a dict token -> prob; absent = 0), else `default`.

    The memory carries the source ids and is read at every step, so a row whose memory went out of
    step with its state shows up as a wrong distribution.
    """

    def __init__(self, tables: dict, *, default: dict, vocab_size: int = 8, max_positions: int = 64):
        self.tables, self.default, self.vocab_size = tables, default, vocab_size
        self.config = SimpleNamespace(max_positions=max_positions, pad_id=PAD, vocab_size=vocab_size)
        self.encode_calls = 0
        self.rows_per_step: list[int] = []

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        self.encode_calls += 1
        return src.float()[:, :, None]  # (B, S, 1)

    def new_state(self) -> PrefixState:
        return PrefixState()

    def decode(self, tgt_in, memory, src_mask, state=None):
        assert state is not None and tgt_in.size(1) == 1
        memory = per_row(memory, src_mask, tgt_in)
        state.grow(tgt_in)
        self.rows_per_step.append(tgt_in.size(0))
        probs = torch.zeros(tgt_in.size(0), self.vocab_size)
        for row, (key, fed) in enumerate(zip(memory[:, 0, 0].long().tolist(), state.fed.tolist(), strict=True)):
            assert fed[0] == BOS
            for token, p in self.tables.get(key, {}).get(tuple(fed[1:]), self.default).items():
                probs[row, token] = p
        return probs.log()[:, None, :]  # (R, 1, V) logits; log(0) = -inf


ONLY_EOS = {EOS: 1.0}
# Three source sentences, told apart by their first token. Beam size 2 is traced in the comments:
# candidates are the 2K = 4 best extensions; EOS in the top 2 finishes, the first 2 non-EOS go on.
TABLES = {
    # step 1: EOS|A .35 (finishes) > BA .315 > AA .10 > BB .09; step 2: EOS|BA .315 (finishes: K done)
    A: {(): {A: 0.5, B: 0.45, EOS: 0.05}, (A,): {EOS: 0.7, A: 0.2, B: 0.1}, (B,): {A: 0.7, B: 0.2, EOS: 0.1},
        (B, A): ONLY_EOS, (A, A): {EOS: 0.6, B: 0.4}},
    # step 1: EOS|B .54 and EOS|A .32 both finish: done after two decoder calls.
    B: {(): {B: 0.6, A: 0.4}, (B,): {EOS: 0.9, A: 0.1}, (A,): {EOS: 0.8, B: 0.2}},
    # step 1: AA .72, AB .135 go on (EOS|B .1 is third: dropped); step 2: AAA .504 goes on, EOS|AA .216
    # finishes, EOS|AB .135 is third (dropped), the second beam is dead (-inf); step 3: EOS|AAA .504.
    C: {(): {A: 0.9, B: 0.1}, (A,): {A: 0.8, B: 0.15, EOS: 0.05}, (A, A): {A: 0.7, EOS: 0.3},
        (A, A, A): ONLY_EOS},
}  # fmt: skip
SOURCES = torch.tensor([[A, D, D, PAD], [B, D, PAD, PAD], [C, D, D, D]])  # 3, 2 and 4 real tokens
LONG = {"max_len_a": 0.0, "max_len_b": 10}


def table_model(**kwargs) -> TableModel:
    return TableModel(TABLES, default=ONLY_EOS, **kwargs)


def test_beam_search_table_exact_tokens_and_scores_in_a_shrinking_batch():
    model = table_model()
    hyps = beam_search(model, SOURCES, SearchConfig(beam_size=2, nbest=2, length_penalty=0.0, **LONG), **IDS)
    assert_hyps(hyps[0], [([A], log(0.5, 0.7), log(0.5, 0.7)), ([B, A], log(0.45, 0.7), log(0.45, 0.7))])
    assert_hyps(hyps[1], [([B], log(0.6, 0.9), log(0.6, 0.9)), ([A], log(0.4, 0.8), log(0.4, 0.8))])
    # fairseq's stopping rule: done at K = 2 finished, so [A, A] (.216) ranks below the [A, A, A] (.504)
    # that finished a step later.
    assert_hyps(hyps[2], [([A, A, A], log(0.9, 0.8, 0.7), log(0.9, 0.8, 0.7)), ([A, A], log(0.9, 0.8, 0.3), log(0.9, 0.8, 0.3))])
    assert model.encode_calls == 1
    # 3 sentences, then 3 x 2 beams; sentence 1 leaves after step 2, sentence 0 after step 3.
    assert model.rows_per_step == [3, 6, 4, 2]


def test_beam_search_stops_once_no_live_hypothesis_can_win():
    """nbest 1, raw log-probs: sentence A's EOS|A (.35) beats its best live BA (.315), which can only
    lose probability: A is done after one step (fairseq's rule alone would decode BA's EOS too)."""
    model = table_model()
    hyps = beam_search(model, SOURCES, SearchConfig(beam_size=2, length_penalty=0.0, **LONG), **IDS)
    assert [h[0].tokens for h in hyps] == [[A], [B], [A, A, A]]
    # Step 2: only sentence C goes on (its live AAA, .504, beats EOS|AA, .216); fairseq's rule: [3, 6, 4, 2].
    assert model.rows_per_step == [3, 6, 2, 2]


def test_beam_search_batch_equals_each_sentence_alone():
    batched = beam_search(table_model(), SOURCES, SearchConfig(beam_size=2, nbest=2, **LONG), **IDS)
    for i in range(len(SOURCES)):
        alone = beam_search(table_model(), SOURCES[i : i + 1], SearchConfig(beam_size=2, nbest=2, **LONG), **IDS)
        assert alone[0] == batched[i]


def test_beam_search_length_penalty_reranks():
    # alpha = 1: [B, A] (3 tokens with EOS) beats [A] (2 tokens): -1.155 / (8/6) > -1.050 / (7/6).
    hyps = beam_search(table_model(), SOURCES[:1], SearchConfig(beam_size=2, nbest=2, length_penalty=1.0, **LONG), **IDS)[0]
    assert_hyps(hyps, [([B, A], log(0.45, 0.7), gnmt(log(0.45, 0.7), 3, 1.0)), ([A], log(0.5, 0.7), gnmt(log(0.5, 0.7), 2, 1.0))])
    # nbest=1 keeps the best one only.
    best = beam_search(table_model(), SOURCES[:1], SearchConfig(beam_size=2, nbest=1, length_penalty=1.0, **LONG), **IDS)[0]
    assert [h.tokens for h in best] == [[B, A]]


def test_beam_search_min_len_forbids_early_eos():
    hyps = beam_search(table_model(), SOURCES[:1], SearchConfig(beam_size=2, nbest=2, length_penalty=0.0, min_len=2, **LONG), **IDS)
    assert_hyps(hyps[0], [([B, A], log(0.45, 0.7), log(0.45, 0.7)), ([A, A], log(0.5, 0.2, 0.6), log(0.5, 0.2, 0.6))])


@pytest.mark.parametrize(
    "limits",
    [
        {"max_len_a": 0.0, "max_len_b": 1},
        {"max_len_a": 0.5, "max_len_b": 0},  # floor(0.5 * 3 real source tokens) = 1; the pad does not count
        {"max_len_a": 0.0, "max_len_b": 100, "max_positions": 2},  # BOS + 1 token fill the positions
    ],
)
def test_beam_search_max_len_forces_eos(limits):
    limits = dict(limits)
    model = table_model(max_positions=limits.pop("max_positions", 64))
    hyps = beam_search(model, SOURCES[:1], SearchConfig(beam_size=2, nbest=2, length_penalty=0.0, **limits), **IDS)
    # At length 1 only EOS may follow: both beams finish, even the unlikely EOS after B.
    assert_hyps(hyps[0], [([A], log(0.5, 0.7), log(0.5, 0.7)), ([B], log(0.45, 0.1), log(0.45, 0.1))])


def test_beam_search_forced_prefix():
    hyps = beam_search(table_model(), SOURCES[:1], SearchConfig(beam_size=2, nbest=2, length_penalty=0.0, **LONG), prefix=[[B]], **IDS)
    # The forced B's own probability counts; then BA .315 and BB .09 go on, EOS|B .045 is third.
    assert_hyps(hyps[0], [([B, A], log(0.45, 0.7), log(0.45, 0.7)), ([B, B], log(0.45, 0.2), log(0.45, 0.2))])


def test_greedy_table_exact():
    model = table_model()
    hyps = greedy(model, SOURCES, SearchConfig(**LONG), **IDS)
    expected = [([A], log(0.5, 0.7)), ([B], log(0.6, 0.9)), ([A, A, A], log(0.9, 0.8, 0.7))]
    for hyp, (tokens, log_prob) in zip(hyps, expected, strict=True):
        assert_hyps([hyp], [(tokens, log_prob, log_prob)])  # greedy: score = log_prob
    assert model.rows_per_step == [3, 3, 1, 1]


# The same distribution at every step: A .4 > B .3 > C .2 > D .06 > EOS .04.
CONSTANT = {A: 0.4, B: 0.3, C: 0.2, D: 0.06, EOS: 0.04}
SIX = {"max_len_a": 0.0, "max_len_b": 6}


def constant_model() -> TableModel:
    return TableModel({}, default=CONSTANT)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, [A, A, A, A, A, A]),
        (1, [A, B, C, D, EOS]),  # every token once; then EOS, its only choice left (UNK has p = 0)
        (2, [A, A, B, A, C, A]),  # after "A A", A would repeat the bigram (A, A): B; after "A A B A", C
        (3, [A, A, A, B, A, A]),
    ],
)
def test_greedy_no_repeat_ngram(n, expected):
    hyps = greedy(constant_model(), SOURCES[:1], SearchConfig(no_repeat_ngram_size=n, **SIX), **IDS)
    tokens = expected[: expected.index(EOS)] if EOS in expected else expected
    assert hyps[0].tokens == tokens
    assert hyps[0].log_prob == pytest.approx(log(*(CONSTANT[t] for t in tokens), CONSTANT[EOS]), abs=1e-5)


def test_greedy_forced_prefix_and_min_len():
    src = SOURCES[:3]
    prefix = [[C, B], [B] * 8, []]  # the second is longer than max_len 6: it is kept whole
    hyps = greedy(constant_model(), src, SearchConfig(**SIX), prefix=prefix, **IDS)
    assert [h.tokens for h in hyps] == [[C, B, A, A, A, A], [B] * 8, [A] * 6]
    assert hyps[0].log_prob == pytest.approx(log(0.2, 0.3, 0.4, 0.4, 0.4, 0.4, 0.04), abs=1e-5)
    # The prefix wins over no-repeat: the second A is forced although it repeats the unigram A.
    forced = greedy(constant_model(), src[:1], SearchConfig(no_repeat_ngram_size=1, **SIX), prefix=[[A, A]], **IDS)[0]
    assert forced.tokens == [A, A, B, C, D]
    assert forced.log_prob == pytest.approx(log(0.4, 0.4, 0.3, 0.2, 0.06, 0.04), abs=1e-5)
    eos_first = TableModel({}, default={EOS: 0.5, A: 0.3, B: 0.2})
    assert greedy(eos_first, src[:1], SearchConfig(min_len=3, **SIX), **IDS)[0].tokens == [A, A, A]
    assert greedy(eos_first, src[:1], SearchConfig(**SIX), **IDS)[0].tokens == []


# ---------------------------------------------------------------------------------------------
# Pure functions, on written-out inputs.


def test_beam_step_candidates():
    scores = torch.tensor([[-1.0, -1.5]])
    log_probs = torch.tensor([[[-3.0, -0.2, -4.0, -0.1, -5.0], [-0.3, -6.0, -0.4, -0.05, -7.0]]])
    # totals: beam 0: -4, -1.2, -5, -1.1 (EOS), -6; beam 1: -1.8, -7.5, -1.9, -1.55 (EOS), -8.5
    step = beam_step(scores, log_probs, beam_size=2, eos=EOS)
    assert step.cand_scores[0].tolist() == pytest.approx([-1.1, -1.2, -1.55, -1.8])
    assert step.cand_tokens.tolist() == [[EOS, 1, EOS, 0]]
    assert step.cand_beams.tolist() == [[0, 0, 1, 1]]
    assert step.finished.tolist() == [[True, False, False, False]]  # the second EOS ranks 3rd: dropped
    assert step.next_beams.tolist() == [[0, 1]]
    assert step.next_tokens.tolist() == [[1, 0]]
    assert step.next_scores[0].tolist() == pytest.approx([-1.2, -1.8])
    # The first step opens the beam from one row; a dead row (-inf) never finishes.
    first = beam_step(torch.zeros(2, 1), torch.tensor([[[-2.0, -0.5, -1.0, -3.0, -4.0]], [[-INF] * 5]]),
                      beam_size=2, eos=EOS)
    assert first.next_beams.tolist() == [[0, 0], [0, 0]]
    assert first.next_tokens[0].tolist() == [1, 2]
    assert not first.finished.any()
    with pytest.raises(ValueError, match="vocabulary"):
        beam_step(torch.zeros(1, 1), torch.zeros(1, 1, 5), beam_size=3, eos=EOS)


@pytest.mark.parametrize("vocab,k", [(8000, 10), (8000, 1), (3001, 6), (3001, 1), (64 * 40 + 63, 10), (50, 4)])
def test_top_k_rows_equals_topk_and_argmax(vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(37, vocab, generator=gen)
    x[3, :] = NEG  # a fully banned row
    x[4, 100:] = NEG  # fewer allowed tokens than chunks
    x[5, -5:] = 9.0 + torch.arange(5.0)  # the best in the last, partial chunk
    values, cols = top_k_rows(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    finite = expected.values.isfinite()
    assert torch.equal(cols[finite], expected.indices[finite])  # random values: no ties among them
    assert torch.equal(x.gather(1, cols), values)
    # argmax's rule on ties: the first column of the maximum.
    tied = torch.zeros(4, vocab)
    tied[0, [7, vocab - 1]] = 2.0
    tied[1, [vocab // 2, vocab // 2 + 1]] = 2.0
    tied[2, [vocab - 2, vocab - 1]] = 2.0
    assert torch.equal(top_k_rows(tied, 1)[1][:, 0], tied.argmax(dim=-1))


def test_log_normalizer_equals_float64_logsumexp():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 5000, generator=gen) * 8 + 40
    logits[1, 2000:] = NEG  # banned tokens, as the table model's log(0)
    assert torch.allclose(log_normalizer(logits).double(), torch.logsumexp(logits.double(), dim=-1), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_log_normalizer_in_row_blocks_changes_no_number(monkeypatch, dtype):

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(23, 3001, generator=gen) * 6).to(dtype)
    logits[2, 100:] = NEG
    whole = log_normalizer(logits)
    patch_decoding(monkeypatch, "NORMALIZER_CHUNK_BYTES", 4 * 3001 * 5)  # blocks of 5 rows, the last of 3
    blocks = log_normalizer(logits)
    assert whole.dtype == blocks.dtype == torch.float32
    assert torch.equal(blocks, whole)
    patch_decoding(monkeypatch, "NORMALIZER_CHUNK_BYTES", 4 * 3001 * 2)  # blocks of 2 rows, the last of 3
    assert torch.equal(log_normalizer(logits), whole)
    assert torch.equal(log_normalizer(logits[:22]), whole[:22])  # blocks of 2 all through
    patch_decoding(monkeypatch, "NORMALIZER_CHUNK_BYTES", 1)  # never a block of one row
    assert torch.equal(log_normalizer(logits), whole)
    for row in range(23):  # and each row as if it were alone
        assert torch.equal(log_normalizer(logits[row : row + 1]), whole[row : row + 1])
    expected = torch.logsumexp(logits.double(), dim=-1)
    assert torch.allclose(blocks.double(), expected, atol=1e-4)
    assert log_normalizer(logits[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("vocab", [3001, 64 * 40, 50])
def test_normalizer_and_bounds_give_the_normalizer_to_the_bit_and_the_exact_chunk_maxima(monkeypatch, dtype, vocab):
    """The normaliser and the chunk maxima in one pass over float32 blocks: the same numbers as log_normalizer
    whole or in blocks (its peak is the maximum of the maxima and the partial chunk), the maxima exact."""

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(23, vocab, generator=gen) * 6).to(dtype)
    logits[2, 20:] = NEG
    logits[3, -1] = 40.0  # the row's maximum in the partial chunk (when there is one)
    whole = log_normalizer(logits)
    for block_bytes in (ranking.NORMALIZER_CHUNK_BYTES, 4 * vocab * 5, 1):
        patch_decoding(monkeypatch, "NORMALIZER_CHUNK_BYTES", block_bytes)
        normalizer, bounds = normalizer_and_bounds(logits)
        assert torch.equal(normalizer, whole) and torch.equal(normalizer, log_normalizer(logits))
        chunks = vocab // 64
        expected = logits[:, : chunks * 64].float().reshape(23, chunks, 64).amax(dim=-1)
        assert bounds.dtype == torch.float32 and torch.equal(bounds, expected)


@pytest.mark.parametrize("vocab,k", [(8000, 10), (8000, 1), (3001, 6), (3001, 1), (64 * 40 + 63, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_on_bounds_taken_before_the_constraints_equals_it_on_exact_maxima(vocab, k, dtype):
    """Greedy search takes the chunk maxima with the normaliser, then its constraints lower logits to -inf:
    the bounds are then too high where a chunk's best was banned, so rows they cannot prove are ranked again.
    Every way a constraint lowers a row gives what top_k_rows finds from scratch, argmax's first column
    included."""
    gen = torch.Generator().manual_seed(vocab * 10 + k)
    x = (torch.randn(40, vocab, generator=gen) * 3).to(dtype)
    x[30, [9, vocab - 70]] = 50.0  # a tie at the top, across chunks
    x[31, [70, 71]] = 50.0  # and within one
    x[32, [10, 200]] = 50.0  # a tie whose later chunk ranks first on a bound about to go stale:
    x[32, 201] = 60.0  # its 60 is banned below, and argmax must still give column 10
    _, bounds = normalizer_and_bounds(x)
    best = x.float().argmax(dim=-1)
    x[0, best[0]] = NEG  # the best token banned (min_len bans EOS, n-grams ban repeats)
    x[1, :] = NEG  # nothing allowed
    x[2, :] = NEG
    x[2, 5] = x.new_tensor(-1.0)  # a forced token (a prefix, EOS at max_len): all else -inf
    x[3, torch.randperm(vocab, generator=gen)[: vocab // 2]] = NEG  # half the vocabulary banned
    x[4, best[4] // 64 * 64 : best[4] // 64 * 64 + 64] = NEG  # the best chunk banned whole
    x[5:8, [0, 1, 2]] = NEG  # the columns banned on every row (BOS, PAD)
    x[30, 9] = NEG  # the first of the tied best banned
    x[32, 201] = NEG
    values, cols = top_k_rows(x, k, bounds=bounds)
    exact_values, exact_cols = top_k_rows(x, k)
    assert torch.equal(values, exact_values)
    finite = exact_values.isfinite().all(dim=-1) & ~torch.isin(torch.arange(40), torch.tensor([30, 31, 32]))
    assert torch.equal(cols[finite], exact_cols[finite])  # random values: no ties among them
    if k == 1:  # argmax's rule on ties: the first column of the maximum
        assert torch.equal(cols[[30, 31, 32], 0], x[[30, 31, 32]].float().argmax(dim=-1))
    assert torch.equal(x[finite].gather(1, cols[finite]), values[finite])
    with pytest.raises(ValueError, match="are not the chunk maxima"):
        top_k_rows(x, k, bounds=bounds[:, :-1])


@pytest.mark.parametrize("vocab,beams", [(8000, 5), (8000, 1), (64 * 40 + 63, 5), (64 * 40 + 63, 1), (300, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_beam_candidates_by_the_sentence_on_stale_bounds_are_beam_steps(vocab, beams, dtype):
    """beam_step_on_bounds: each sentence's 2K candidates found on the chunk maxima of all its beams at once, the
    bounds taken before the constraints lowered logits (as the compiled step gives them), are beam_step's over the
    whole vocabulary: the same totals to the bit in every sentence, each the total of the beam and token it names,
    and (random float32 logits: no ties) the same beams and tokens. Sentences the bounds cannot prove (a constraint
    lowered the logits of the chunks read) are ranked row by row; the others are proven."""
    from seq2seq.decoding.ranking import beam_candidates, beam_step_on_bounds

    gen = torch.Generator().manual_seed(vocab + beams)
    sentences, beam_size = 12, 4
    logits = (torch.randn(sentences * beams, vocab, generator=gen) * 3).to(dtype)  # (N*K, V)
    normalizer, bounds = normalizer_and_bounds(logits)
    scores = -torch.rand(sentences, beams, generator=gen) * 5  # (N, K)
    best = logits.float().argmax(dim=-1)
    logits[0, best[0]] = NEG  # the best token banned (min_len bans EOS, n-grams ban repeats)
    logits[beams : 2 * beams, :] = NEG  # a sentence forced: EOS at max_len on every beam, all else -inf
    logits[beams : 2 * beams, EOS] = -1.0
    logits[2 * beams, torch.randperm(vocab, generator=gen)[: vocab // 2]] = NEG  # half the vocabulary banned
    logits[3 * beams, best[3 * beams] // 64 * 64 : best[3 * beams] // 64 * 64 + 64] = NEG  # the best chunk, whole
    logits[4 * beams :, [0, 1]] = NEG  # the columns banned on every row (BOS, PAD)
    if beams > 1:
        scores[5, 1:] = NEG  # dead beams (a forced prefix leaves one live beam)
    got = beam_step_on_bounds(scores, logits, normalizer, bounds, beam_size=beam_size, eos=EOS)
    full = beam_step(scores, (logits.float() - normalizer[:, None]).view(sentences, beams, vocab),
                     beam_size=beam_size, eos=EOS)
    assert torch.equal(got.cand_scores, full.cand_scores)
    rows = torch.arange(sentences)[:, None] * beams + got.cand_beams  # (N, 2K)
    recomputed = scores.gather(1, got.cand_beams) + (logits[rows, got.cand_tokens].float() - normalizer[rows])
    assert torch.equal(recomputed, got.cand_scores)
    if dtype == torch.float32:
        untied = full.cand_scores.isfinite().all(dim=1)  # (the forced sentence's -inf candidates are all tied)
        assert untied.sum() >= sentences - 2
        for name in ("cand_beams", "cand_tokens", "finished", "next_beams", "next_tokens", "next_scores"):
            assert torch.equal(getattr(got, name)[untied], getattr(full, name)[untied]), name
    *_, proven = beam_candidates(scores, logits, normalizer, bounds, count=2 * beam_size)
    assert not proven[1]  # the forced sentence: its chunks' bounds were its banned logits'
    assert proven[4:].sum() >= 6
    strided = torch.cat((logits, logits), dim=1)[:, :vocab]  # (a step's logits as a view of a wider output)
    assert torch.equal(beam_step_on_bounds(scores, strided, normalizer, bounds, beam_size=beam_size,
                                           eos=EOS).cand_scores, got.cand_scores)
    with pytest.raises(ValueError, match="are not the chunk maxima"):
        beam_candidates(scores, logits, normalizer, bounds[:, :-1], count=2 * beam_size)


def test_beam_search_ranks_candidates_by_the_sentence_on_a_step_decoder_s_bounds(monkeypatch):
    """beam_search on a decoder whose step gives the chunk maxima (the compiled one) takes its candidates by the
    sentence (beam_step_on_bounds) and returns what ranking plain topk over the whole vocabulary returns; a
    model without bounds, and one whose vocabulary has too few chunks, take them row by row."""

    class BoundsModel(RunningSumModel):  # a StepDecoder: its step gives the chunk maxima
        def decode_step(self, tgt_in, memory, src_mask, state, *, chunk):
            logits = self.decode(tgt_in, memory, src_mask, state=state)[:, -1]  # (R, V)
            return logits, None, ranking.chunk_maxima(logits, chunk=chunk), None

    calls = []
    by_sentence = ranking.beam_step_on_bounds
    patch_decoding(monkeypatch, "beam_step_on_bounds", lambda scores, *args, **kwargs: calls.append(
        scores.size(1)) or by_sentence(scores, *args, **kwargs))
    config = SearchConfig(beam_size=3, nbest=2, length_penalty=0.6, min_len=2, no_repeat_ngram_size=2, **MEDIUM)
    # 3,000 columns: 46 chunks of 64 a row; 300: 4, too few for 2K + 1 on the first step's one row, enough on three
    for vocab_size, first_beams in ((3000, 1), (300, 3)):
        calls.clear()
        got = beam_search(BoundsModel(seed=5, vocab_size=vocab_size), RANDOM_SOURCES, config, **IDS)
        assert calls[0] == first_beams and set(calls) <= {1, 3} and len(calls) >= 4
        with monkeypatch.context() as plain:
            patch_decoding(plain, "top_k_rows", lambda x, k, **options: x.topk(k, dim=-1))
            patch_decoding(plain, "beam_step_on_bounds", None)  # (not called without bounds)
            reference = beam_search(RunningSumModel(seed=5, vocab_size=vocab_size), RANDOM_SOURCES, config, **IDS)
        for hyps, want in zip(got, reference, strict=True):
            assert [(h.tokens, h.score) for h in hyps] == [(h.tokens, h.score) for h in want]


def test_top_k_rows_on_bounds_settles_a_tie_with_a_chunk_left_out_exactly():
    """A k-th value equal to the bound of a chunk left out is not proven (that chunk may hold a tie, and the
    exact ranking may keep it); nor is a float64 value the float32 bounds round below (review findings)."""
    x = torch.full((1, 1024), -10.0)
    x[0, [200, 330, 520, 530]] = torch.tensor([5.0, 9.0, 5.0, 20.0])
    _, bounds = normalizer_and_bounds(x)
    x[0, 530] = NEG  # banned after the bounds were taken
    assert top_k_rows(x, 2, bounds=bounds)[1].tolist() == top_k_rows(x, 2)[1].tolist() == [[330, 200]]
    wide = torch.full((1, 1024), -10.0, dtype=torch.float64)
    wide[0, [5, 100, 200]] = torch.tensor([5.0, 1.0, 1.0 + 1e-12], dtype=torch.float64)
    _, bounds = normalizer_and_bounds(wide)  # float32: 1 + 1e-12 rounds to 1
    assert top_k_rows(wide, 2, bounds=bounds)[1].tolist() == [[5, 200]]


def constrain_reference(log_probs, tokens, limits, *, bos, eos, pad, min_len, no_repeat_ngram_size):
    """The rules spelled out one entry at a time."""
    out = log_probs.clone()
    sentences, beams, vocab = out.shape
    step = tokens.size(-1)
    for n in range(sentences):
        for b in range(beams):
            for v in range(vocab):
                history = tokens[n, b].tolist()
                banned = v in (bos, pad) or (v == eos and step < min_len)
                m = no_repeat_ngram_size
                if m and len(history) >= m:
                    grams = {tuple(history[i : i + m]) for i in range(len(history) - m + 1)}
                    banned |= (*history[len(history) - m + 1 :], v) in grams
                if limits.max_len[n] <= step:
                    banned = v != eos
                if step < limits.prefix_len[n]:
                    banned = v != limits.prefix[n, step]
                if banned:
                    out[n, b, v] = NEG
    return out


@pytest.mark.parametrize("step,min_len,ngram", [(0, 0, 0), (2, 3, 0), (3, 0, 2), (4, 5, 1)])
def test_constrain_in_place_follows_the_rules(step, min_len, ngram):
    gen = torch.Generator().manual_seed(step)
    vocab = 9
    log_probs = torch.randn(4, 3, vocab, generator=gen).log_softmax(-1)
    tokens = torch.randint(4, vocab, (4, 3, step), generator=gen)
    # sentence 0 free, 1 at its max_len, 2 forced (prefix longer than step), 3 forced and at max_len
    limits = Limits(max_len=torch.tensor([9, step, 9, step + 2]),
                    prefix=torch.tensor([[PAD] * 6, [PAD] * 6, [5, 6, 7, 8, 5, 6], [8] * 6]),
                    prefix_len=torch.tensor([0, 0, 6, step + 1]))
    options = {"min_len": min_len, "no_repeat_ngram_size": ngram}
    expected = constrain_reference(log_probs, tokens, limits, **IDS, **options)
    out = constrain_(log_probs.clone(), tokens, limits, ids=SpecialIds(**IDS), **options)
    assert torch.equal(out, expected)


def test_repeated_ngram_mask():
    def banned(tokens, n):
        mask = repeated_ngram_mask(torch.tensor([[tokens]]), n=n, vocab_size=8)[0, 0]
        return mask.nonzero()[:, 0].tolist()

    assert banned([A, B, A], 1) == [A, B]
    assert banned([A, B, A], 2) == [B]  # "A B" seen: B may not follow A again
    assert banned([A, B, A], 3) == []  # "B A" never seen before
    assert banned([A, B, A, B], 3) == [A]
    assert banned([A, B, C, A, B, D, A, B], 3) == [C, D]
    assert banned([A], 2) == [] and banned([], 1) == []


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05]])  # sorted: .4 .25 .2 .1 .05
    for p, kept in [(0.3, [1]), (0.6, [1, 3]), (0.66, [1, 2, 3]), (0.9, [0, 1, 2, 3]), (0.99, [0, 1, 2, 3, 4])]:
        out = top_p_filter(probs.log(), p)
        assert out.isfinite()[0].nonzero()[:, 0].tolist() == kept, p
        assert torch.equal(out[0, kept], probs.log()[0, kept])  # kept values untouched
    assert torch.equal(top_p_filter(probs.log(), 1.0), probs.log())
    # Either side of a boundary (.5 + .25 = .75), not on it: exp(log(x)) lands on .75 exactly with
    # some CPUs' vectorised exp and not with others'. The two .125s tie: either may be kept.
    exact = torch.tensor([[0.25, 0.5, 0.125, 0.125]]).log()
    assert top_p_filter(exact, 0.75 - 1e-6).isfinite()[0].nonzero()[:, 0].tolist() == [0, 1]
    kept = top_p_filter(exact, 0.75 + 1e-6).isfinite()[0].nonzero()[:, 0].tolist()
    assert len(kept) == 3 and {0, 1} <= set(kept)
    # Measured after renormalising what top-k left: .4/.65 = .615 >= .6.
    assert top_p_filter(top_k_filter(probs.log(), 2), 0.6).isfinite()[0].nonzero()[:, 0].tolist() == [1]


def test_top_k_filter():
    log_probs = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05]]).log()
    assert top_k_filter(log_probs, 2).isfinite()[0].nonzero()[:, 0].tolist() == [1, 3]
    assert torch.equal(top_k_filter(log_probs, 0), log_probs)


def test_length_normalize_and_max_lengths():
    assert length_normalize(-2.0, 3, alpha=0.0) == -2.0
    assert length_normalize(-2.0, 3, alpha=1.0) == pytest.approx(-2.0 / (8 / 6))
    assert length_normalize(-2.0, 3, alpha=0.6) == pytest.approx(-2.0 / (8 / 6) ** 0.6)
    src_mask = torch.arange(10)[None, :] < torch.tensor([[3], [10], [0]])
    no_prefix = torch.zeros(3, dtype=torch.long)
    got = max_lengths(src_mask, max_len_a=1.2, max_len_b=2, max_positions=100, prefix_len=no_prefix)
    assert got.tolist() == [5, 14, 2]  # floor(1.2 * len + 2)
    got = max_lengths(src_mask, max_len_a=1.2, max_len_b=2, max_positions=12, prefix_len=torch.tensor([7, 0, 0]))
    assert got.tolist() == [7, 11, 2]  # raised to the prefix, capped at max_positions - 1
    with pytest.raises(ValueError, match="prefix"):
        max_lengths(src_mask, max_len_a=1.0, max_len_b=0, max_positions=12, prefix_len=torch.tensor([12, 0, 0]))


# ---------------------------------------------------------------------------------------------
# A random fake model with a real incremental state.


class SumState:
    def __init__(self, total=None, context=None, length=0):
        self.total, self.context, self.length = total, context, length

    def reorder(self, indices, *, sentences=None):
        return SumState(self.total.index_select(0, indices), self.context.index_select(0, indices), self.length)


class RunningSumModel:
    """Logits from a decayed running sum of the prefix's embeddings (order matters) plus a source
    context computed on the first call and then read from the state, as cross-attention keys are.
    EOS grows likelier with length, so hypotheses end at varied lengths."""

    def __init__(self, *, vocab_size: int = 12, dim: int = 16, seed: int = 0, max_positions: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.src_embed = torch.randn(vocab_size, dim, generator=g)
        self.tgt_embed = torch.randn(vocab_size, dim, generator=g)
        self.out = torch.randn(dim, vocab_size, generator=g)
        self.config = SimpleNamespace(max_positions=max_positions, pad_id=PAD, vocab_size=vocab_size)

    def encode(self, src):
        return self.src_embed[src]  # (B, S, D)

    def new_state(self):
        return SumState()

    def decode(self, tgt_in, memory, src_mask, state=None):
        own = state if state is not None else SumState()  # state=None: a full pass over tgt_in
        memory, src_mask = per_row(memory, src_mask, tgt_in), per_row(src_mask, src_mask, tgt_in)
        if own.context is None:
            weights = src_mask[..., None].float()
            own.context = (memory * weights).sum(1) / weights.sum(1)  # (R, D)
        logits = []
        for token in tgt_in.unbind(1):
            embedded = self.tgt_embed[token]
            own.total = embedded if own.total is None else 0.7 * own.total + embedded
            own.length += 1
            step = 2.5 * torch.tanh(own.total + own.context) @ self.out  # (R, V)
            step[:, EOS] += 0.5 * own.length - 1.5
            logits.append(step)
        return torch.stack(logits, dim=1)  # (R, T, V)


RANDOM_SOURCES = torch.tensor([[5, 6, 7, 8, 9], [9, 4, 0, 0, 0], [4, 4, 10, 11, 0], [7, 0, 0, 0, 0]])
MEDIUM = {"max_len_a": 1.0, "max_len_b": 4}


def rescore(model, src, tokens: list[int]) -> float:
    """Sum of log-probs of tokens + EOS by one full teacher-forced pass (no incremental state)."""
    tgt = torch.tensor([[BOS, *tokens, EOS]])
    memory = model.encode(src[None])
    logits = model.decode(tgt[:, :-1], memory, src[None] != PAD, state=None)
    return torch.log_softmax(logits.float(), dim=-1)[0].gather(1, tgt[0, 1:, None]).sum().item()


def test_beam_size_1_equals_greedy():
    model = RunningSumModel()
    beam = beam_search(model, RANDOM_SOURCES, SearchConfig(beam_size=1, length_penalty=0.0, **MEDIUM), **IDS)
    best = greedy(model, RANDOM_SOURCES, SearchConfig(**MEDIUM), **IDS)
    assert [b[0].tokens for b in beam] == [h.tokens for h in best]
    assert [b[0].log_prob for b in beam] == pytest.approx([h.log_prob for h in best], abs=1e-5)
    assert len({len(h.tokens) for h in best}) > 1  # the batch did shrink


@pytest.mark.parametrize("vocab_size", [12, 3000])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("nbest", [1, 3])
def test_early_stopping_and_chunked_top_k_change_no_result(monkeypatch, vocab_size, alpha, nbest):
    """Stopping a sentence once no live hypothesis can overtake its n-best, and ranking only each
    row's best 2K tokens (found chunk by chunk), return exactly what searching on with plain topk
    over the whole vocabulary returns."""

    model = RunningSumModel(seed=5, vocab_size=vocab_size)
    config = SearchConfig(beam_size=3, nbest=nbest, length_penalty=alpha, **MEDIUM)
    calls = []
    decode_calls = model.decode
    model.decode = lambda tgt_in, *args, **kwargs: calls.append(tgt_in.size(0)) or decode_calls(tgt_in, *args, **kwargs)
    fast = beam_search(model, RANDOM_SOURCES, config, **IDS)
    fast_rows = sum(calls)
    patch_decoding(monkeypatch, "cannot_be_overtaken", lambda worst, best, max_len, alpha: torch.zeros_like(best, dtype=torch.bool))
    patch_decoding(monkeypatch, "top_k_rows", lambda x, k, **options: x.topk(k, dim=-1))
    calls.clear()
    reference = beam_search(model, RANDOM_SOURCES, config, **IDS)
    for got, want in zip(fast, reference, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-6)
    assert fast_rows <= sum(calls)
    if alpha == 0.0 and nbest == 1 and vocab_size == 12:
        assert fast_rows < sum(calls)  # it did stop earlier


def test_sampling_top_k_1_equals_greedy():
    model = RunningSumModel(seed=1)
    best = greedy(model, RANDOM_SOURCES, SearchConfig(**MEDIUM), **IDS)
    drawn = sample(model, RANDOM_SOURCES, SearchConfig(top_k=1, temperature=1.7, **MEDIUM), generator=torch.Generator().manual_seed(0), **IDS)
    assert [h.tokens for h in drawn] == [h.tokens for h in best]
    assert [h.log_prob for h in drawn] == pytest.approx([h.log_prob for h in best], abs=1e-5)


def test_beam_search_random_model_batch_equals_alone_with_prefix_and_no_repeat():
    model = RunningSumModel(seed=2)
    prefix = [[6, 7], [], [8], [5, 5, 9]]
    options = {"beam_size": 3, "nbest": 3, "length_penalty": 0.6, "no_repeat_ngram_size": 2, **MEDIUM}
    batched = beam_search(model, RANDOM_SOURCES, SearchConfig(**options), prefix=prefix, **IDS)
    for i, src in enumerate(RANDOM_SOURCES):
        alone = beam_search(model, src[None], SearchConfig(**options), prefix=prefix[i : i + 1], **IDS)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[i]], abs=1e-5)
        for hyp in batched[i]:
            assert hyp.tokens[: len(prefix[i])] == prefix[i]
            assert PAD not in hyp.tokens and BOS not in hyp.tokens  # never generated
            bigrams = list(zip(hyp.tokens[len(prefix[i]) :], hyp.tokens[len(prefix[i]) + 1 :], strict=False))
            assert len(bigrams) == len(set(bigrams))
            assert hyp.log_prob == pytest.approx(rescore(model, src, hyp.tokens), abs=1e-4)
            assert hyp.score == pytest.approx(gnmt(hyp.log_prob, len(hyp.tokens) + 1, 0.6), abs=1e-6)
        assert [h.score for h in batched[i]] == sorted((h.score for h in batched[i]), reverse=True)


def test_sampling_survives_finished_rows_whose_constraints_ban_every_token():
    """Finished rows stay in the batch until a quarter are done; with no_repeat_ngram_size 1 a
    finished row can have every token banned, which multinomial cannot draw from (it raised)."""
    from seq2seq.model import Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=12, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, max_positions=64, tie_embeddings="none")
    src = torch.tensor([[5, 6, 7, 8]] * 8)
    prefix = [[9] * 8] * 7 + [[]]  # seven rows forced on for 8 steps; the free one may finish first and stay
    for seed in range(10):
        torch.manual_seed(seed)
        model = Transformer(config).eval()
        with torch.no_grad():
            model.output_projection.weight[EOS].mul_(4)  # EOS likely
        search = SearchConfig(sampling=True, seed=seed, no_repeat_ngram_size=1, max_len_a=0, max_len_b=30)
        hyps = decode(model, src, search, prefix=prefix, **IDS)
        assert all(len(set(h[0].tokens[8:])) == len(h[0].tokens[8:]) for h in hyps[:7])


def test_greedy_ranks_a_finished_row_riding_along_without_ranking_it_again(monkeypatch):
    """A finished row rides along until a quarter of the rows are done, its logits one token's and its chunk maxima
    saying so: top_k_rows proves it on the bounds at once, with no exact ranking of the row at each step (all its
    logits equal, it was a tie ranked again every step); the tokens and scores are argmax's."""
    from seq2seq.model import Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=1000, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                               num_decoder_layers=1, dropout=0.0, max_positions=64, tie_embeddings="none")
    torch.manual_seed(0)
    model = Transformer(config).eval()
    src = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]] * 8)
    src[7, 2:] = PAD  # its limit two tokens: it finishes first, the others decode on to theirs (12)
    config_ = SearchConfig(beam_size=1, max_len_a=1.0, max_len_b=0)
    rows_ranked_again = []
    top_k_rows = ranking.top_k_rows

    def counting(x, k, **options):
        if options.get("bounds") is None:
            rows_ranked_again.append(x.size(0))
        return top_k_rows(x, k, **options)

    patch_decoding(monkeypatch, "top_k_rows", counting)
    got = decode(model, src, config_, **IDS)
    assert len(got[7][0].tokens) <= 2 < 8 <= min(len(h[0].tokens) for h in got[:7])
    assert rows_ranked_again == [1, 7]  # only where the length limit forced EOS (at 2; at 12), lowering the best
    patch_decoding(monkeypatch, "top_k_rows", lambda x, k, **options: x.max(dim=-1, keepdim=True))
    want = decode(model, src, config_, **IDS)
    assert [(h[0].tokens, h[0].log_prob) for h in got] == [(h[0].tokens, h[0].log_prob) for h in want]


@pytest.mark.parametrize("scores", [True, False])
def test_greedy_keeps_a_step_decoder_s_argmax_where_no_constraint_lowered_it(monkeypatch, scores):
    """A StepDecoder whose step gives each row's argmax (the compiled one, one hypothesis per sentence): greedy keeps
    it where the constraints left its logit as it was and ranks only the rows where they lowered it (EOS banned
    below min_len, a forced prefix token, EOS forced at the limit, a repeated n-gram); the tokens and scores are the
    plain argmax's, every tie (each column has an equal twin further on) going to the first."""

    class ArgmaxModel(RunningSumModel):  # a StepDecoder: its step gives the chunk maxima and the argmax
        def decode_step(self, tgt_in, memory, src_mask, state, *, chunk):
            logits = self.decode(tgt_in, memory, src_mask, state=state)[:, -1]  # (R, V)
            return logits, None, ranking.chunk_maxima(logits, chunk=chunk), logits.argmax(dim=-1)

    def twins(model):
        model.out[:, 1500:] = model.out[:, :1500]  # (EOS's column alone is raised: its twin stays below)
        return model

    config = SearchConfig(min_len=2, no_repeat_ngram_size=2, max_len_a=1.0, max_len_b=3, scores=scores)
    prefix = [[7, 7], [], [], [3]]
    ranked, stepped = [], []
    top_k_rows, step_logits = ranking.top_k_rows, steps.step_logits
    patch_decoding(monkeypatch, "top_k_rows", lambda x, k, **options: ranked.append(x.size(0)) or top_k_rows(
        x, k, **options))
    patch_decoding(monkeypatch, "step_logits", lambda *args, **options: stepped.append(args[1].size(0)) or step_logits(
        *args, **options))
    got = greedy(twins(ArgmaxModel(seed=6, vocab_size=3000)), RANDOM_SOURCES, config, prefix=prefix, **IDS)
    assert 0 < sum(ranked) < sum(stepped)
    patch_decoding(monkeypatch, "top_k_rows", lambda x, k, **options: x.max(dim=-1, keepdim=True))
    want = greedy(twins(RunningSumModel(seed=6, vocab_size=3000)), RANDOM_SOURCES, config, prefix=prefix, **IDS)
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert got[0].tokens[:2] == [7, 7]
    assert all(token < 1500 or token == EOS for h in got for token in h.tokens)
    if scores:
        assert [h.log_prob for h in got] == [h.log_prob for h in want]
    else:
        assert all(math.isnan(h.log_prob) for h in got)
    ranked.clear()
    patch_decoding(monkeypatch, "top_k_rows", top_k_rows)
    free = greedy(twins(ArgmaxModel(seed=6, vocab_size=3000)), RANDOM_SOURCES, SearchConfig(max_len_b=40), **IDS)
    assert ranked == [] and max(len(h.tokens) for h in free) < 40  # (no constraint lowered an argmax: none ranked)


def test_sampling_near_zero_temperature_is_greedy():
    model = RunningSumModel(seed=4)
    best = greedy(model, RANDOM_SOURCES, SearchConfig(**MEDIUM), **IDS)
    cold = sample(model, RANDOM_SOURCES, SearchConfig(temperature=1e-3, **MEDIUM), generator=torch.Generator().manual_seed(0), **IDS)
    hot = sample(model, RANDOM_SOURCES, SearchConfig(temperature=1.0, **MEDIUM), generator=torch.Generator().manual_seed(0), **IDS)
    assert [h.tokens for h in cold] == [h.tokens for h in best]
    assert [h.tokens for h in hot] != [h.tokens for h in best]


def test_sampling_is_reproducible_with_a_generator():
    model = RunningSumModel(seed=3)

    def draw(seed: int) -> list[list[int]]:
        hyps = sample(model, RANDOM_SOURCES, SearchConfig(temperature=1.5, **MEDIUM), generator=torch.Generator().manual_seed(seed), **IDS)
        for hyp, src in zip(hyps, RANDOM_SOURCES, strict=True):  # the model's own log_prob, not the tempered one
            assert hyp.log_prob == pytest.approx(rescore(model, src, hyp.tokens), abs=1e-4)
        return [h.tokens for h in hyps]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


@pytest.mark.parametrize(("options", "support"), [({"top_k": 2}, {A, B}), ({"top_p": 0.6}, {A, B}),
                                                  ({"top_p": 0.75}, {A, B, C}), ({}, {A, B, C, D})])
def test_sampling_filters_restrict_the_support(options, support):
    src = SOURCES[:1].expand(40, -1)
    hyps = sample(constant_model(), src, SearchConfig(min_len=6, **options, **SIX), generator=torch.Generator().manual_seed(0), **IDS)
    assert {t for h in hyps for t in h.tokens} == support
    for hyp in hyps:
        assert len(hyp.tokens) == 6
        assert hyp.log_prob == pytest.approx(log(*(CONSTANT[t] for t in hyp.tokens), CONSTANT[EOS]), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# The real Transformer: its cache must give what recomputing the whole prefix gives.


class RecomputeState:
    def __init__(self, fed=None):
        self.fed = fed

    @property
    def length(self) -> int:
        return 0 if self.fed is None else self.fed.size(1)

    def reorder(self, indices, *, sentences=None):
        return RecomputeState(self.fed.index_select(0, indices))


class Recompute:
    """The same model without its cache: every step decodes the whole prefix from scratch."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def encode(self, src):
        return self.model.encode(src)

    def new_state(self):
        return RecomputeState()

    def decode(self, tgt_in, memory, src_mask, state=None):
        state.fed = tgt_in if state.fed is None else torch.cat((state.fed, tgt_in), dim=1)
        return self.model.decode(state.fed, memory, src_mask, state=None)[:, -1:]


def test_cached_decoding_matches_recomputing_the_prefix():
    from seq2seq.model import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=24, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                               num_decoder_layers=2, dropout=0.0, max_positions=32, pad_id=PAD)
    # float64 so that the two paths' rounding differences cannot flip a near-tie between candidates
    model = Transformer(config).double().eval()
    src = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 4, 0, 0, 0, 0], [12, 13, 14, 0, 0, 0]])
    options = {"max_len_a": 1.0, "max_len_b": 2, "min_len": 1}
    cached = beam_search(model, src, SearchConfig(beam_size=3, nbest=3, **options), prefix=[[], [7], []], **IDS)
    recomputed = beam_search(Recompute(model), src, SearchConfig(beam_size=3, nbest=3, **options), prefix=[[], [7], []], **IDS)
    for got, want in zip(cached, recomputed, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)
    greedy_cached = greedy(model, src, SearchConfig(**options), **IDS)
    greedy_recomputed = greedy(Recompute(model), src, SearchConfig(**options), **IDS)
    assert [h.tokens for h in greedy_cached] == [h.tokens for h in greedy_recomputed]
    assert [h.log_prob for h in greedy_cached] == pytest.approx([h.log_prob for h in greedy_recomputed], abs=1e-5)



@pytest.mark.parametrize("search_config", [SearchConfig(beam_size=4, nbest=2, max_len_a=1.0, max_len_b=3, min_len=2,
                                                        no_repeat_ngram_size=2),
                                           SearchConfig(beam_size=1, max_len_a=1.0, max_len_b=3, min_len=2),
                                           SearchConfig(sampling=True, seed=3, top_k=5, max_len_a=1.0, max_len_b=3)])
def test_a_bf16_model_ranks_its_logits_in_bf16_as_in_a_float32_copy(monkeypatch, search_config):
    """A bf16 model's logits are masked and ranked in bf16 (step_logits keeps them there); taking them to
    float32 first, as before, gives the same hypotheses and log-probabilities to the last bit."""
    from seq2seq.model import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=300, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                               num_decoder_layers=2, dropout=0.0, max_positions=32, pad_id=PAD)
    model = Transformer(config).to(torch.bfloat16).eval()
    src = torch.randint(4, 300, (6, 7))
    src[3:, 4:] = PAD
    logits, normalizer, _, _ = steps.step_logits(model, torch.full((6, 1), BOS), model.encode(src), src != PAD,
                                               model.new_state())
    assert logits.dtype == torch.bfloat16 and normalizer.dtype == torch.float32
    kept = decode(model, src, search_config, prefix=[[], [9], [], [], [], []], **IDS)
    narrow_step = steps.step_logits

    def float32_step(*args, **kwargs):
        logits, normalizer, bounds, argmax = narrow_step(*args, **kwargs)
        return steps.StepLogits(logits.float(), normalizer, bounds, argmax)

    patch_decoding(monkeypatch, "step_logits", float32_step)
    widened = decode(model, src, search_config, prefix=[[], [9], [], [], [], []], **IDS)
    for got, want in zip(kept, widened, strict=True):
        assert [(h.tokens, h.log_prob, h.score) for h in got] == [(h.tokens, h.log_prob, h.score) for h in want]

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", [{}, {"min_len": 3, "no_repeat_ngram_size": 2}])
def test_greedy_without_scores_gives_the_same_tokens_and_never_normalizes(monkeypatch, dtype, options):
    """SearchConfig(scores=False): greedy search takes its argmax from the logits alone, as it does with
    scores (the normaliser is one number per row), never runs the normaliser's pass, and its scores are NaN.
    Beam search and sampling need the normaliser, and keep their scores."""
    from seq2seq.model import Transformer, TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=300, d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                               num_decoder_layers=2, dropout=0.0, max_positions=40, pad_id=PAD)
    model = Transformer(config).to(dtype).eval()
    src = torch.randint(4, 300, (6, 7))
    src[3:, 4:] = PAD
    prefix = [[], [9, 10], [], [], [], []]
    base = SearchConfig(beam_size=1, max_len_a=1.0, max_len_b=6, **options)
    scored = decode(model, src, base, prefix=prefix, **IDS)
    assert all(math.isfinite(h.score) for hyps in scored for h in hyps)

    def refused(*args, **kwargs):
        raise AssertionError("the normaliser ran for a search that reports no scores")

    patch_decoding(monkeypatch, "log_normalizer", refused)
    patch_decoding(monkeypatch, "normalizer_and_bounds", refused)
    plain = decode(model, src, replace(base, scores=False), prefix=prefix, **IDS)
    assert [h.tokens for hyps in plain for h in hyps] == [h.tokens for hyps in scored for h in hyps]
    assert all(math.isnan(h.score) and math.isnan(h.log_prob) for hyps in plain for h in hyps)
    logits, normalizer, bounds, _ = steps.step_logits(model, torch.full((6, 1), BOS), model.encode(src), src != PAD,
                                                    model.new_state(), bounds=True, normalize=False)
    assert logits.shape == (6, 300) and normalizer.isnan().all() and bounds is None
    with pytest.raises(AssertionError, match="normaliser ran"):  # beam search ranks by log-probabilities
        decode(model, src, replace(base, beam_size=2, scores=False), **IDS)


# ---------------------------------------------------------------------------------------------
# SearchConfig: every option checked once, when it is built, with the field named.


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"beam_size": 0}, "beam_size: must be >= 1, got 0"),
        ({"beam_size": 2.0}, "beam_size: expected int, got 2.0"),
        ({"beam_size": True}, "beam_size: expected int, got True"),
        ({"nbest": 3, "beam_size": 2}, "nbest: must be between 1 and beam_size (2), got 3"),
        ({"nbest": 0}, "nbest: must be between 1 and beam_size (5), got 0"),
        ({"length_penalty": math.nan}, "length_penalty: must be a finite number, got nan"),
        ({"length_penalty": -INF}, "length_penalty: must be a finite number, got -inf"),
        ({"length_penalty": -0.5}, "length_penalty: must be >= 0 and <= 10, got -0.5"),
        ({"length_penalty": 300.0}, "length_penalty: must be >= 0 and <= 10, got 300.0"),
        ({"max_len_a": math.nan}, "max_len_a: must be a finite number, got nan"),
        ({"max_len_a": 1e300}, "max_len_a: must be >= 0 and <= 1000, got 1e+300"),
        ({"max_len_b": -1}, "max_len_b: must be >= 0 and <= 1000000, got -1"),
        ({"max_len_a": 0, "max_len_b": 0}, "max_len_b: max_len_a and max_len_b are both 0: every output would be empty"),
        ({"min_len": -1}, "min_len: must be >= 0, got -1"),
        ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size: must be >= 0, got -2"),
        ({"temperature": 0.0}, "temperature: must be >= 0.0001 and <= 10000.0, got 0.0"),
        ({"temperature": 1e-38}, "temperature: must be >= 0.0001 and <= 10000.0, got 1e-38"),
        ({"temperature": math.nan}, "temperature: must be a finite number, got nan"),
        ({"top_k": -1}, "top_k: must be >= 0, got -1"),
        ({"top_p": 0.0}, "top_p: must be > 0 and <= 1, got 0.0"),
        ({"top_p": 1.5}, "top_p: must be > 0 and <= 1, got 1.5"),
        ({"seed": -1}, "seed: must be >= 0 and <= 9223372036854775807, got -1"),
        ({"seed": "7"}, "seed: expected int or None, got '7'"),
        ({"seed": 10**400}, f"seed: must be >= 0 and <= 9223372036854775807, got {10**400}"),  # no OverflowError
        ({"sampling": True, "nbest": 2}, "nbest: sampling draws one translation per sentence: must be 1, got 2"),
        ({"sampling": "yes"}, "sampling: expected bool, got 'yes'"),
    ],
)
def test_search_config_refuses_bad_values_naming_the_field(options, message):
    with pytest.raises(ConfigError) as caught:
        SearchConfig(**options)
    assert str(caught.value) == message
    assert caught.value.field == message.split(":")[0]


def test_search_config_defaults_and_the_model_check():
    assert SearchConfig() == SearchConfig(beam_size=5, nbest=1, length_penalty=0.6, max_len_a=1.5, max_len_b=10)
    SearchConfig(max_len_a=0.5, max_len_b=0)  # floor(0.5 * len) may be 0 for a 1-token source: allowed
    SearchConfig(sampling=True, beam_size=1, top_k=0, top_p=1.0, seed=0)
    SearchConfig(beam_size=4).check_model(vocab_size=8, max_positions=64)
    with pytest.raises(ConfigError, match="beam_size: 5 needs a vocabulary of at least 10 tokens; this model has 8"):
        SearchConfig(beam_size=5).check_model(vocab_size=8, max_positions=64)
    SearchConfig(beam_size=5, sampling=True).check_model(vocab_size=8, max_positions=64)  # no beam to rank
    SearchConfig(min_len=63).check_model(vocab_size=64, max_positions=64)  # BOS + 63 tokens: the longest output
    with pytest.raises(ConfigError, match=r"min_len: 1000 is more tokens than this model writes in an output "
                                          r"\(max_positions - 1 = 63\)"):
        SearchConfig(min_len=1000).check_model(vocab_size=64, max_positions=64)


def test_decode_dispatches_to_the_three_searches():
    model = RunningSumModel(seed=5)
    beam = decode(model, RANDOM_SOURCES, SearchConfig(beam_size=3, nbest=2, **MEDIUM), **IDS)
    assert beam == beam_search(model, RANDOM_SOURCES, SearchConfig(beam_size=3, nbest=2, **MEDIUM), **IDS)
    assert all(len(hyps) == 2 for hyps in beam)
    best = decode(model, RANDOM_SOURCES, SearchConfig(beam_size=1, **MEDIUM), **IDS)
    assert best == [[h] for h in greedy(model, RANDOM_SOURCES, SearchConfig(**MEDIUM), **IDS)]
    drawn = decode(model, RANDOM_SOURCES, SearchConfig(sampling=True, seed=3, **MEDIUM), **IDS)
    again = sample(model, RANDOM_SOURCES, SearchConfig(**MEDIUM), generator=torch.Generator().manual_seed(3), **IDS)
    assert drawn == [[h] for h in again]  # the seed makes the generator
    with pytest.raises(ConfigError, match="needs a vocabulary of at least"):
        decode(model, RANDOM_SOURCES, SearchConfig(beam_size=7, **MEDIUM), **IDS)
