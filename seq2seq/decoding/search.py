"""Greedy decoding, beam search and sampling over an encoder-decoder model.

The search knows the model only through `encode` and a one-step `decode` with an incremental
`DecoderState` (the `EncoderDecoder` protocol below): the source is encoded once, the decoder
projects the cross-attention keys/values on its first call and caches every target position, so
each step feeds one new token per row. Rows are hypotheses; the state's `reorder` follows beams,
duplicates rows when the beam opens, and drops sentences that are done, so a finished sentence
costs nothing more.

Conventions shared by the three searches:

- `Hypothesis.tokens` has no BOS and no final EOS; a forced prefix is included.
- The length of a hypothesis is `len(tokens)`. EOS is forbidden while it is below `min_len`; at
  `max_len` only EOS is allowed, so every hypothesis ends with EOS. `max_len` per sentence is
  `floor(max_len_a * src_len + max_len_b)` (`src_len`: non-pad source tokens), raised to the forced
  prefix's length, capped at `max_positions - 1` (the decoder reads BOS + `max_len` tokens).
- PAD and BOS are never generated.
- `Hypothesis.log_prob` is the sum of the model's log-probabilities (log_softmax in float32) of
  every produced token, the forced prefix and the final EOS included. Sampling reports the model's
  own distribution too, not the tempered or filtered one it drew from.
- `Hypothesis.score` is what hypotheses are ranked by: for beam search the GNMT length-normalised
  score `log_prob / ((5 + n) / 6) ** alpha` with `n = len(tokens) + 1` (EOS counted); for greedy
  and sampling it equals `log_prob`.

Every option lives in one `SearchConfig`, validated once when it is built; `decode` is the one
entry point (validation, Translator, the CLIs and the server call it) and picks the search.
Callers put the model in eval mode; the searches run under `torch.inference_mode()`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple, Protocol, TypeVar, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.decoding.constraints import Phrases, advance, all_met, allocate, holds, met, next_tokens, start
from seq2seq.decoding.scoring import alignment_layer, force_decode
from seq2seq.model.config import ConfigError, check_field_types, check_range
from seq2seq.model.numerics import exp_

NEG_INF = float("-inf")


def _option(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A SearchConfig field; `help` (and an older `flag` spelling) are for the CLIs built from it."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How to decode: beam search (beam_size > 1), greedy (beam_size 1) or sampling.

    Built once (from CLI flags, a server request, a training config) and checked here, so that no
    search function re-validates and a bad value is refused before a model is loaded.
    """

    beam_size: int = _option(5, "hypotheses kept per sentence; 1 is greedy search", flag="--beam")
    nbest: int = _option(1, "translations returned per sentence, best first (<= beam size)")
    length_penalty: float = _option(0.6, "GNMT's alpha for ranking beam hypotheses; 0 ranks by raw log-prob")
    max_len_a: float = _option(1.5, "output length limit a * source tokens + b")
    max_len_b: int = _option(10, "see --max-len-a")
    min_len: int = _option(0, "outputs are at least this many tokens long (EOS forbidden before)")
    no_repeat_ngram_size: int = _option(0, "forbid repeating an n-gram of this size; 0: off", flag="--no-repeat-ngram")
    sampling: bool = _option(False, "draw each token from the model's distribution instead of searching")
    temperature: float = _option(1.0, "sampling: divide the logits by it (< 1 sharper, > 1 flatter)")
    top_k: int = _option(0, "sampling: draw from the k most likely tokens only; 0: all")
    top_p: float = _option(1.0, "sampling: draw from the smallest set of tokens with this much probability")
    seed: int | None = _option(None, "sampling: seed of the random draws, for a reproducible run")
    token_scores: bool = _option(False, "also report each output token's log-probability (then the final EOS's)")
    scores: bool = _option(True, "each translation's score (on by default); off (--no-scores), greedy search "
                                 "skips the normaliser over the vocabulary at every step, as CTranslate2 without "
                                 "return_scores: the same tokens, scores nan (beam search, sampling and a "
                                 "constrained search compute them anyway)")
    alignments: bool = _option(False, "also report word alignments (source word - output word), from the "
                                      "decoder's cross-attention")

    def __post_init__(self) -> None:
        check_field_types(self)
        check_range(self, "beam_size", low=1)
        check_range(self, "length_penalty", low=0, high=10)  # ((5 + n) / 6) ** alpha overflows beyond
        # Bounded above too: a huge float would overflow the int64 length to 0 (every output empty).
        check_range(self, "max_len_a", low=0, high=1000)
        check_range(self, "max_len_b", low=0, high=1_000_000)
        check_range(self, "min_len", low=0)
        check_range(self, "no_repeat_ngram_size", low=0)
        check_range(self, "temperature", low=1e-4, high=1e4)  # beyond, log_probs / T overflows into NaN
        check_range(self, "top_k", low=0)
        check_range(self, "top_p", low=0, high=1, low_open=True)
        check_range(self, "seed", low=0, high=2**63 - 1)
        if self.max_len_a == 0 and self.max_len_b == 0:
            raise ConfigError("max_len_b", "max_len_a and max_len_b are both 0: every output would be empty")
        if self.sampling and self.nbest != 1:
            raise ConfigError("nbest", f"sampling draws one translation per sentence: must be 1, got {self.nbest}")
        if not self.sampling and not 1 <= self.nbest <= self.beam_size:
            raise ConfigError("nbest", f"must be between 1 and beam_size ({self.beam_size}), got {self.nbest}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SearchConfig:
        """The config a dict describes (a checkpoint's stored defaults; absent keys keep theirs); an unknown
        key is a ConfigError."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(unknown[0], f"is not a SearchConfig field (known: {', '.join(sorted(names))})")
        return cls(**values)

    def check_model(self, *, vocab_size: int, max_positions: int) -> None:
        """What the search asks of the model it runs on: beam search ranks 2 * beam_size candidates among the
        first step's vocabulary, and no output is longer than max_positions - 1 tokens (the decoder reads BOS
        too), so a min_len beyond that could never be met."""
        if not self.sampling and self.beam_size > 1 and 2 * self.beam_size > vocab_size:
            raise ConfigError("beam_size", f"{self.beam_size} needs a vocabulary of at least {2 * self.beam_size} "
                                           f"tokens; this model has {vocab_size}")
        if self.min_len > max_positions - 1:
            raise ConfigError("min_len", f"{self.min_len} is more tokens than this model writes in an output "
                                         f"(max_positions - 1 = {max_positions - 1}); ask for at most that")


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]
    """Generated ids without BOS and without the final EOS (a forced prefix included)."""
    score: float
    """Ranking score: length-normalised log_prob for beam search, log_prob otherwise."""
    log_prob: float
    """Sum of the log-probabilities of all tokens and the final EOS."""
    token_log_probs: list[float] | None = None
    """With SearchConfig.token_scores: the log-probability of each token, then of the final EOS."""
    source_positions: list[int] | None = None
    """With SearchConfig.alignments: per token, the source position its alignment layer attended to most."""


@dataclass(frozen=True)
class SpecialIds:
    """The ids the searches treat apart, in one place: every row starts with `bos`, a hypothesis ends
    with `eos`, `pad` fills sources and forced prefixes; `bos` and `pad` are never generated."""

    bos: int
    eos: int
    pad: int


class DecoderState(Protocol):
    @property
    def length(self) -> int: ...

    def reorder(self: _Self, indices: Tensor, *, sentences: Tensor | None = None) -> _Self:
        """Row j becomes row indices[j]; `sentences`, if given, selects the per-sentence rows (memory)."""
        ...


_Self = TypeVar("_Self")
State = TypeVar("State", bound=DecoderState)


class ModelConfig(Protocol):
    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EncoderDecoder(Protocol[State]):
    """What the searches need of a model; generic in its own state type (the Transformer's DecoderState).

    `decode` gets one memory row per sentence (N) and R = N * K target rows, the K hypotheses of a
    sentence adjacent (K = 1 in greedy search and sampling, and on beam search's first step).
    """

    @property
    def config(self) -> ModelConfig: ...

    def encode(self, src: Tensor) -> Tensor: ...

    def new_state(self) -> State: ...

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: State | None = None) -> Tensor: ...


# ---------------------------------------------------------------------------------------------
# Small pure functions: one decoding step, the constraints on it, scoring.


@runtime_checkable
class StepDecoder(Protocol):
    """An EncoderDecoder whose one-token step gives with its logits what `step_logits` would compute from them
    (the compiled decoder: model/compiled.py, computed in the step's generated code): their normaliser or None, the
    maxima of the logits' chunks of `chunk` columns (a ValueError where it computes them over another width) or
    None, and each row's argmax (the first of equal maxima) or None."""

    def decode_step(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: Any, *, chunk: int,
                    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]: ...  # (R, V), (R,), (R, V // chunk), (R,)


@functools.cache
def is_step_decoder(kind: type) -> bool:
    """Whether a decoder of this class is a StepDecoder, asked once a class: a runtime-checkable protocol's
    isinstance inspects the object's members each time, at every step."""
    return issubclass(kind, StepDecoder)


class StepLogits(NamedTuple):
    """What `step_logits` gives for the next token of every row."""

    logits: Tensor  # (R, V) in the model's dtype where narrower than float32 (bf16), else float32
    normalizer: Tensor  # (R,) float32: log-probabilities are logits - normalizer (NaN: not computed)
    bounds: Tensor | None  # (R, V // TOP_K_CHUNK) float32, the rows' chunk maxima for top_k_rows (greedy's; a StepDecoder's)
    argmax: Tensor | None = None  # (R,) long, each row's argmax before any constraint (a StepDecoder's, where it gives it)


def step_logits(
    model: EncoderDecoder[Any], tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: Any, *,
    bounds: bool = False, normalize: bool = True,
) -> StepLogits:
    """Feed one new token per row (R, 1); the next token's logits (R, V), their log-normaliser (R,), and
    with `bounds` the chunk maxima that `top_k_rows` ranks the logits by, read in the normaliser's pass.
    Without `normalize` the normaliser is NaN and no pass over the rows is made (nor bounds taken): for a
    search that ranks the logits alone and reports no scores (greedy with SearchConfig.scores off).

    The logits stay in the model's dtype where it is narrower than float32 (bf16): the searches mask and
    rank them there (masking writes -inf, ranking compares, both exact) and take the few they keep to
    float32, instead of writing and reading a full (R, V) float32 copy; float32 and float64 models give
    float32 logits. Only the normaliser reads every row whole, in float32 (`log_normalizer`).

    A StepDecoder's step (the compiled one) gives the chunk maxima, the normaliser where its rows are beams, and the
    argmax where they are not, from its own code: they are taken from it, bounds whether asked for or not (they
    cost nothing more there).
    """
    if state is not None and is_step_decoder(type(model)):
        logits, normalizer, maxima, argmax = cast(StepDecoder, model).decode_step(  # (R, V), (R,), (R, V / chunk), (R,)
            tgt_in, memory, src_mask, state, chunk=TOP_K_CHUNK)
        if not normalize:
            normalizer = torch.full(logits.shape[:1], math.nan, device=logits.device)
        elif normalizer is None:
            normalizer = log_normalizer(logits)
        return StepLogits(logits, normalizer, maxima, argmax)
    logits = model.decode(tgt_in, memory, src_mask, state=state)[:, -1]  # (R, V)
    if logits.element_size() >= 4:
        logits = logits.float()
    if not normalize:
        return StepLogits(logits, torch.full(logits.shape[:1], math.nan, device=logits.device), None)
    if bounds:
        return StepLogits(logits, *normalizer_and_bounds(logits))
    return StepLogits(logits, log_normalizer(logits), None)


NORMALIZER_CHUNK_BYTES = 2**18
"""`log_normalizer` on CPU works through the rows in blocks of about this many float32 bytes: each block is
read from the logits once and its five passes (max, subtract, clamp, exp, sum) run in the core's cache,
where the whole (R, V) at once (3,000 rows of beam search are 96 MB) would stream through memory five times
(README, "Kernels, chosen by measuring the machine": the measurement that chose it)."""

TOP_K_CHUNK = 64
"""`top_k_rows` ranks a row's columns in chunks of this many (README, "Kernels, chosen by measuring the
machine")."""


def log_normalizer(logits: Tensor) -> Tensor:
    """(R, V) -> (R,) log(sum(exp(logits))) in float32, as log_softmax computes it (max subtracted first),
    for logits of any float dtype (float64 is computed in float32 too).

    `amax` is vectorised where `max` and `logsumexp` are not (on CPU they run ~8x slower here); `exp_`
    avoids the slow path of torch's exp on the vanishing probabilities of a confident model. Blocks change
    no number: torch reduces each row of a block of two rows or more whole, in one thread, as it does in the
    whole tensor, so no block has one row (torch splits a lone long row's sum across threads).
    """
    blocks = _row_blocks(logits)
    if len(blocks) == 1:
        return _log_normalizer(logits.float())
    out = torch.empty(logits.size(0), device=logits.device)
    for first, last in blocks:
        out[first:last] = _log_normalizer(logits[first:last].float())
    return out


def normalizer_and_bounds(logits: Tensor, *, chunk: int = TOP_K_CHUNK) -> tuple[Tensor, Tensor]:
    """`log_normalizer(logits)`, the same numbers, and every row's chunk maxima (R, V // chunk) float32 (a last,
    partial chunk left out): taken from the normaliser's float32 blocks while they are in cache, whose row
    maximum is the maximum of these (and of the partial chunk), so that `top_k_rows` need not read the
    logits whole once more to find them (README, "Kernels, chosen by measuring the machine")."""
    rows, vocab = logits.shape
    chunks = vocab // chunk
    normalizer = torch.empty(rows, device=logits.device)
    bounds = torch.empty(rows, chunks, device=logits.device)
    for first, last in _row_blocks(logits):
        x = logits[first:last].float().contiguous()  # (B, V)
        maxima = chunk_maxima(x, chunk=chunk)  # (B, V/chunk)
        peak = maxima.amax(dim=-1) if chunks else x.amax(dim=-1)  # (B,)
        if 0 < chunks * chunk < vocab:
            peak = torch.maximum(peak, x[:, chunks * chunk :].amax(dim=-1))
        normalizer[first:last] = _log_normalizer(x, peak=peak[:, None])
        bounds[first:last] = maxima
    return normalizer, bounds


def chunk_maxima(x: Tensor, *, chunk: int) -> Tensor:
    """(R, V) contiguous -> (R, V // chunk): the maximum of each row's whole chunks of `chunk` columns (a last,
    partial chunk left out), what `top_k_rows` ranks chunks by, with bounds or without."""
    rows, vocab = x.shape
    return x.as_strided((rows, vocab // chunk, chunk), (x.stride(0), chunk, 1)).amax(dim=-1)


def _row_blocks(logits: Tensor) -> list[tuple[int, int]]:
    """The (first, last) rows of the normaliser's blocks: NORMALIZER_CHUNK_BYTES of float32 each on CPU
    (at least two rows: a lone last row joins the block before), the whole on other devices."""
    rows, vocab = logits.shape
    block = rows if logits.device.type != "cpu" else max(2, NORMALIZER_CHUNK_BYTES // (4 * max(vocab, 1)))
    if rows <= block + 1:
        return [(0, rows)]
    starts = [first for first in range(0, rows, block) if first != rows - 1]
    return list(zip(starts, [*starts[1:], rows], strict=True))


def _log_normalizer(logits: Tensor, *, peak: Tensor | None = None) -> Tensor:  # (R, V) float32 -> (R,)
    if peak is None:  # (the row maxima, when the caller has them)
        peak = logits.amax(dim=-1, keepdim=True)  # (R, 1)
    return exp_(logits - peak).sum(dim=-1).log_() + peak[:, 0]


def top_k_rows(x: Tensor, k: int, *, chunk: int = TOP_K_CHUNK, bounds: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per row of x (R, V) its k largest values, best first, and their columns; k = 1 is argmax.

    torch.topk and argmax over a CPU row of thousands are scalar loops. Here the row is cut into
    chunks of `chunk` columns whose maxima `amax` finds (vectorised); the k largest values lie in
    the k chunks with the largest maxima (a chunk holding one of them has a maximum at least as
    large, and fewer than k values are larger), so only those k * chunk columns are ranked. Equal
    values may come out in another order than topk's; argmax's first-occurrence rule is kept.

    `bounds` (R, V // chunk), the chunk maxima as `normalizer_and_bounds` took them before the search's
    constraints lowered some values to -inf (nothing may have been raised since), stand in for the maxima:
    each is at least its chunk's maximum now. A row's result is proven where its k-th value is above the
    largest bound of the chunks left out; the other rows (a banned best token, a forced one, a tie at the
    top) are ranked again on their exact maxima. The values are then those found without bounds, and for
    k = 1 the column too (argmax's first); for k > 1 topk may order equal values differently, since it is
    given other candidates beside them, which is why beam search takes no bounds.
    """
    rows, vocab = x.shape
    if k * chunk * 4 > vocab:
        return (x.max(dim=-1, keepdim=True) if k == 1 else x.topk(k, dim=-1))  # type: ignore[return-value]
    x = x.contiguous()
    body = vocab // chunk * chunk
    if bounds is None:
        chunk_max = chunk_maxima(x, chunk=chunk)  # (R, V/chunk)
        best = chunk_max.argmax(dim=-1, keepdim=True) if k == 1 else chunk_max.topk(k, dim=-1).indices  # (R, k)
    elif bounds.shape != (rows, body // chunk):
        raise ValueError(f"bounds {tuple(bounds.shape)} are not the chunk maxima of {rows} rows of {vocab} in "
                         f"chunks of {chunk}")
    elif k == 1:  # (a max and an amax: faster than torch's topk on a CPU, README "Dynamo's guards on the frozen...")
        best = bounds.max(dim=-1, keepdim=True).indices  # (R, 1): the chunk to rank
        left_out = bounds.scatter(1, best, -math.inf).amax(dim=-1)  # (R,): the largest bound left out (a tie too)
    else:
        ranked = bounds.topk(k + 1, dim=-1)  # (R, k + 1): the k chunks to rank, and the largest bound left out
        best, left_out = ranked.indices[:, :k], ranked.values[:, k]  # (ties at the top are never proven below)
    if k > 1:
        best = best.sort(dim=-1).values  # candidate columns in increasing order, as in the row itself
    cols = (best[:, :, None] * chunk + torch.arange(chunk, device=x.device)).view(rows, k * chunk)
    if body < vocab:  # the last, partial chunk: always a candidate
        cols = torch.cat((cols, torch.arange(body, vocab, device=x.device).expand(rows, -1)), dim=1)
    values = x.gather(1, cols)  # (R, k * chunk [+ rest])
    top = values.max(dim=-1, keepdim=True) if k == 1 else values.topk(k, dim=-1)
    top_values, top_cols = top.values, cols.gather(1, top.indices)
    if bounds is not None:
        kth = top_values[:, k - 1].float()
        unproven = (~(kth > left_out)).nonzero()[:, 0]
        if unproven.numel():
            exact_values, exact_cols = top_k_rows(x[unproven], k, chunk=chunk)
            top_values = top_values.index_copy(0, unproven, exact_values)
            top_cols = top_cols.index_copy(0, unproven, exact_cols)
    return top_values, top_cols


def length_normalize(log_prob: Tensor | float, length: int, *, alpha: float) -> Tensor | float:
    """GNMT (Wu et al., 2016, eq. 14): log_prob / ((5 + length) / 6) ** alpha; alpha = 0 is raw.

    `length` counts the final EOS: a hypothesis with 3 tokens has length 4.
    """
    return log_prob / ((5 + length) / 6) ** alpha


def max_lengths(
    src_mask: Tensor, *, max_len_a: float, max_len_b: int, max_positions: int, prefix_len: Tensor
) -> Tensor:
    """(B, S) source mask -> (B,) longest output per sentence, in tokens without EOS."""
    longest_prefix = int(prefix_len.max()) if prefix_len.numel() else 0
    if longest_prefix > max_positions - 1:
        raise ValueError(f"a forced prefix of {longest_prefix} tokens does not fit the model's max_positions "
                         f"({max_positions}, BOS included); shorten the prefix")
    src_len = src_mask.sum(dim=1).double()  # double, so a * src_len floors as Python's float would
    limit = (max_len_a * src_len + max_len_b).floor().long().clamp(min=0)
    return torch.maximum(limit, prefix_len).clamp(max=max_positions - 1)


class Limits(NamedTuple):
    """Per-sentence constraints; rows follow the sentences still being decoded."""

    max_len: Tensor  # (N,) longest output, tokens without EOS
    prefix: Tensor  # (N, P) forced first tokens, right-padded
    prefix_len: Tensor  # (N,)

    def select(self, keep: Tensor) -> Limits:
        return Limits(*(x.index_select(0, keep) for x in self))


def make_limits(
    src_mask: Tensor, prefix: Sequence[Sequence[int]] | None, *, pad: int, max_len_a: float, max_len_b: int,
    max_positions: int,
) -> Limits:
    batch, device = src_mask.size(0), src_mask.device
    prefix = prefix if prefix is not None else [[]] * batch
    if len(prefix) != batch:
        raise ValueError(f"prefix has {len(prefix)} entries for {batch} source sentences; give one list per sentence")
    width = max((len(p) for p in prefix), default=0)
    padded = torch.full((batch, width), pad, dtype=torch.long, device="cpu")  # filled row by row on the host
    for i, p in enumerate(prefix):
        padded[i, : len(p)] = torch.tensor(list(p), dtype=torch.long, device="cpu")
    prefix_len = torch.tensor([len(p) for p in prefix], dtype=torch.long, device=device)
    max_len = max_lengths(src_mask, max_len_a=max_len_a, max_len_b=max_len_b, max_positions=max_positions,
                          prefix_len=prefix_len)
    return Limits(max_len, padded.to(device), prefix_len)


def repeated_ngram_mask(tokens: Tensor, *, n: int, vocab_size: int) -> Tensor:
    """(N, K, T) tokens -> (N, K, V) bool: True for each token that would repeat an n-gram of its row."""
    banned = torch.zeros(*tokens.shape[:-1], vocab_size, dtype=torch.bool, device=tokens.device)
    length = tokens.size(-1)
    if n <= 0 or length < n:
        return banned
    # Earlier n-grams start at 0..T-n; one matches when its first n-1 tokens equal the last n-1 tokens.
    matches = torch.ones(*tokens.shape[:-1], length - n + 1, dtype=torch.bool, device=tokens.device)
    for i in range(n - 1):  # n is small: one comparison per context position, each over all rows at once
        matches &= tokens[..., i : length - n + 1 + i] == tokens[..., length - n + 1 + i, None]  # (N, K, T-n+1)
    followers = tokens[..., n - 1 :]  # (N, K, T-n+1): the token that followed each earlier occurrence
    # scatter_add, not scatter: a token may follow both a matching and a non-matching context.
    hits = torch.zeros(banned.shape, dtype=torch.int32, device=tokens.device)
    return hits.scatter_add_(-1, followers, matches.int()) > 0


def constrain_(
    logits: Tensor, tokens: Tensor, limits: Limits, *, ids: SpecialIds, min_len: int, no_repeat_ngram_size: int,
) -> Tensor:
    """In place, -inf on what may not come next. logits (N, K, V) (or log-probabilities), tokens (N, K, T).

    Allowed values are left as they are (no renormalisation), so scores stay the model's.
    Precedence: a forced prefix token wins over everything; at max_len only EOS (even below min_len).
    Constraints that are off cost nothing; the others touch only the columns or rows they ban.
    """
    step, eos = tokens.size(-1), ids.eos
    at_max = limits.max_len <= step  # (N,)
    eos_logits = logits[at_max, :, eos] if bool(at_max.any()) else None  # (N_max, K), before min_len bans EOS
    forced = None
    if step < limits.prefix.size(1):
        forced = (step < limits.prefix_len).nonzero()[:, 0]  # (N_f,)
        forced_tokens = limits.prefix[forced, step][:, None, None].expand(-1, logits.size(1), 1)  # (N_f, K, 1)
        forced_logits = logits[forced].gather(-1, forced_tokens)  # (N_f, K, 1)
    banned_columns = [ids.bos, ids.pad] + ([eos] if step < min_len else [])
    logits[..., banned_columns] = NEG_INF
    if no_repeat_ngram_size > 0:
        logits.masked_fill_(repeated_ngram_mask(tokens, n=no_repeat_ngram_size, vocab_size=logits.size(-1)), NEG_INF)
    if eos_logits is not None:
        logits[at_max] = NEG_INF
        logits[at_max, :, eos] = eos_logits
    if forced is not None and forced.numel():
        logits[forced] = torch.full_like(logits[forced], NEG_INF).scatter_(-1, forced_tokens, forced_logits)
    return logits


def top_k_filter(log_probs: Tensor, k: int) -> Tensor:
    """(R, V) -> (R, V) with all but the k most likely tokens at -inf (ties at the k-th are kept); k <= 0: all."""
    if k <= 0 or k >= log_probs.size(-1):
        return log_probs
    kth = log_probs.topk(k, dim=-1).values[:, -1:]  # (R, 1)
    return log_probs.masked_fill(log_probs < kth, NEG_INF)


def top_p_filter(log_probs: Tensor, p: float) -> Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability sums to >= p.

    log_probs (R, V) need not be normalised (after top-k); the mass is measured after renormalising.
    """
    if p >= 1.0:
        return log_probs
    sorted_lp, order = log_probs.sort(dim=-1, descending=True)  # (R, V)
    probs = sorted_lp.softmax(dim=-1)
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive cumsum; the top token always stays
    drop_sorted = mass_before >= p  # a token is needed only while the kept mass is still below p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
    return log_probs.masked_fill(drop, NEG_INF)


class BeamStep(NamedTuple):
    """One step's 2K candidates per sentence (best first) and what becomes of them."""

    cand_scores: Tensor  # (N, 2K) cumulative log_prob
    cand_tokens: Tensor  # (N, 2K)
    cand_beams: Tensor  # (N, 2K) the current beam each candidate extends
    finished: Tensor  # (N, 2K) bool: EOS among the top K with a finite score: a complete hypothesis
    next_beams: Tensor  # (N, K) the first K non-EOS candidates go on
    next_tokens: Tensor  # (N, K)
    next_scores: Tensor  # (N, K)


def beam_step(
    scores: Tensor, log_probs: Tensor, *, beam_size: int, eos: int, tokens: Tensor | None = None
) -> BeamStep:
    """scores (N, K_cur) cumulative log_prob of the live beams, log_probs (N, K_cur, C) of candidates
    for their next token: the whole vocabulary (C = V, `tokens` None), or each beam's best C >= 2K
    tokens, whose ids `tokens` (N, K_cur, C) gives (the 2K best over all beams are among them).

    fairseq's rule: take the 2K best extensions over all beams, so that up to K of them (at most one
    EOS per beam) can finish while K others still go on. EOS candidates ranked in the top K finish;
    those below are dropped; the first K non-EOS candidates form the next beam. K_cur is 1 on the
    first step (every beam would be the same BOS), K after. Rows at -inf are dead beams (a forced
    prefix leaves one live beam): they go on at -inf and never finish.
    """
    batch, k_cur, width = log_probs.shape
    num_cand = 2 * beam_size
    if num_cand > k_cur * width:
        raise ValueError(f"beam_size {beam_size} needs a vocabulary of at least {num_cand} tokens, got {width}")
    total = (scores[:, :, None] + log_probs).view(batch, k_cur * width)
    cand_scores, flat = total.topk(num_cand, dim=1)  # (N, 2K), best first
    cand_beams = flat // width
    cand_tokens = flat % width if tokens is None else tokens.reshape(batch, k_cur * width).gather(1, flat)
    return next_beams(cand_scores, cand_beams, cand_tokens, beam_size=beam_size, eos=eos)


def next_beams(cand_scores: Tensor, cand_beams: Tensor, cand_tokens: Tensor, *, beam_size: int, eos: int) -> BeamStep:
    """beam_step's rule applied to each sentence's 2K best candidates (N, 2K each, best first): which finish,
    which go on."""
    num_cand = 2 * beam_size
    is_eos = cand_tokens == eos
    rank = torch.arange(num_cand, device=cand_scores.device)
    finished = is_eos & (rank < beam_size) & cand_scores.isfinite()
    # Push EOS candidates behind all others; the K smallest keys are then the K best non-EOS, in order.
    keep = (rank + is_eos.long() * num_cand).topk(beam_size, dim=1, largest=False).indices  # (N, K)
    next_beams, next_tokens, next_scores = (x.gather(1, keep) for x in (cand_beams, cand_tokens, cand_scores))
    return BeamStep(cand_scores, cand_tokens, cand_beams, finished, next_beams, next_tokens, next_scores)


def beam_candidates(scores: Tensor, logits: Tensor, normalizer: Tensor, bounds: Tensor, *, count: int,
                    chunk: int = TOP_K_CHUNK) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each sentence's `count` best extensions over all its beams, ranked on the chunk maxima of the whole
    sentence at once, not row by row: (cand_scores, cand_beams, cand_tokens) (N, count) best first, as
    beam_step finds them, and `proven` (N,), where they are certainly those.

    scores (N, K) cumulative log_prob; logits (N*K, V) float32 or narrower, constrained after `bounds` (N*K,
    V // chunk), their chunk maxima in float32, were taken (as the compiled step gives them); normalizer (N*K,).
    A chunk's bound, score + (maximum - normaliser), is at least the total of each of its tokens (the float
    operations are monotone; constraints only lower logits), so where the count-th best total of the `count`
    chunks whose bounds rank first (and every beam's last, partial chunk: always read) is at least every bound
    left out, those are the sentence's best: only they are read and ranked. top_k_rows ranks each row's 2K
    best chunks, then 2K tokens of each row, then beam_step 2K of the K * 2K: three top-k passes over K times
    as many rows, the larger part of a beam search step's own work at a few hundred sentences (README,
    "Candidates by the sentence"). A sentence is proven where its count-th total is at least
    the largest bound left out (a tie with a chunk left out keeps the token read: the totals are the same); not
    where a constraint lowered logits the bounds of the chunks read were taken from (the caller ranks those
    sentences again, exactly). Of equal totals, other tokens may be kept than beam_step keeps."""
    sentences, beams = scores.shape
    vocab = logits.size(1)
    chunks = vocab // chunk
    body = chunks * chunk
    if bounds.shape != (sentences * beams, chunks):
        raise ValueError(f"bounds {tuple(bounds.shape)} are not the chunk maxima of {sentences * beams} rows of "
                         f"{vocab} in chunks of {chunk}")
    row_normalizer = normalizer.view(sentences, beams)  # (N, K)
    chunk_totals = (scores[:, :, None] + (bounds.view(sentences, beams, chunks)
                                          - row_normalizer[:, :, None])).view(sentences, beams * chunks)
    ranked = chunk_totals.topk(count + 1, dim=1)  # (N, count + 1): the chunks to read, and the best left out
    chosen = ranked.indices[:, :count].sort(dim=1).values  # (N, count): in the order of the sentence's rows
    left_out = ranked.values[:, count]  # (N,)
    cand_beams = (chosen // chunks)[:, :, None].expand(-1, -1, chunk).reshape(sentences, count * chunk)  # (N, M)
    cand_tokens = ((chosen % chunks * chunk)[:, :, None] + torch.arange(chunk, device=logits.device)).view(
        sentences, count * chunk)  # (N, M)
    if body < vocab:  # every beam's last, partial chunk: always read
        tail = vocab - body
        cand_beams = torch.cat((cand_beams, torch.arange(beams, device=logits.device).repeat_interleave(tail)
                                .expand(sentences, -1)), dim=1)
        cand_tokens = torch.cat((cand_tokens, torch.arange(body, vocab, device=logits.device).repeat(beams)
                                 .expand(sentences, -1)), dim=1)
    values = logits.reshape(sentences, beams * vocab).gather(1, cand_beams * vocab + cand_tokens)  # (N, M)
    # beam_step's arithmetic, score + (logit - normaliser), to the bit
    totals = scores.gather(1, cand_beams) + (values.float() - row_normalizer.gather(1, cand_beams))
    top = totals.topk(count, dim=1)  # (N, count)
    return (top.values, cand_beams.gather(1, top.indices), cand_tokens.gather(1, top.indices),
            top.values[:, count - 1] >= left_out)


def beam_step_by_rows(scores: Tensor, logits: Tensor, normalizer: Tensor, bounds: Tensor | None, *, beam_size: int,
                      eos: int, chunk: int = TOP_K_CHUNK) -> BeamStep:
    """beam_step on each row's 2K best tokens (top_k_rows, on the chunk maxima `bounds` where given): scores (N, K),
    logits (N*K, V), normalizer (N*K,)."""
    sentences, beams = scores.shape
    top_logits, top_tokens = top_k_rows(logits, 2 * beam_size, chunk=chunk, bounds=bounds)  # (N*K, 2K)
    log_probs = (top_logits.float() - normalizer[:, None]).view(sentences, beams, -1)
    return beam_step(scores, log_probs, tokens=top_tokens.view(sentences, beams, -1), beam_size=beam_size, eos=eos)


def beam_step_on_bounds(scores: Tensor, logits: Tensor, normalizer: Tensor, bounds: Tensor, *, beam_size: int,
                        eos: int, chunk: int = TOP_K_CHUNK) -> BeamStep:
    """beam_step's step from the logits' chunk maxima (`beam_candidates`); a sentence they do not prove is
    ranked row by row (top_k_rows, on the same bounds), as without them."""
    count = 2 * beam_size
    cand_scores, cand_beams, cand_tokens, proven = beam_candidates(scores, logits, normalizer, bounds, count=count,
                                                                   chunk=chunk)
    unproven = (~proven).nonzero()[:, 0]  # (U,)
    if unproven.numel():
        beams = scores.size(1)
        rows = (unproven[:, None] * beams + torch.arange(beams, device=logits.device)).view(-1)  # (U * K,)
        exact = beam_step_by_rows(scores.index_select(0, unproven), logits.index_select(0, rows),
                                  normalizer.index_select(0, rows), bounds.index_select(0, rows),
                                  beam_size=beam_size, eos=eos, chunk=chunk)
        cand_scores = cand_scores.index_copy(0, unproven, exact.cand_scores)
        cand_beams = cand_beams.index_copy(0, unproven, exact.cand_beams)
        cand_tokens = cand_tokens.index_copy(0, unproven, exact.cand_tokens)
    return next_beams(cand_scores, cand_beams, cand_tokens, beam_size=beam_size, eos=eos)


# ---------------------------------------------------------------------------------------------
# The live batch the searches share, the searches, and the one entry point that picks among them.


@dataclass
class Live:
    """The sentences still being decoded, N of them with K hypotheses (rows) each (K = 1 in greedy search,
    sampling, and beam search's first step): every tensor's first dimension is the sentence, and
    `advance` shrinks them all, with the decoder state's rows, at once."""

    state: Any  # the decoder's incremental state: N * K rows, a sentence's K hypotheses adjacent
    memory: Tensor  # (N, S, D) the encoded source, one row per sentence: its hypotheses share it
    src_mask: Tensor  # (N, S)
    limits: Limits
    sentence: Tensor  # (N,) input index of each live sentence
    tokens: Tensor  # (N, K, T) generated so far: no BOS, a forced prefix included
    scores: Tensor  # (N, K) cumulative log_prob
    tgt_in: Tensor  # (N * K, 1) the token each row feeds the decoder next (BOS first)
    num_finished: Tensor  # (N,) complete hypotheses: up to K in beam search, 0 or 1 in the others
    best_finished: Tensor  # (N, nbest) beam search: best complete scores, best first (float64 as Hypothesis.score)

    @classmethod
    def start(cls, model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, ids: SpecialIds,
              prefix: Sequence[Sequence[int]] | None) -> Live:
        """The set-up every search shares: the sources (B, S) encoded once, their limits, a BOS row each."""
        src_mask = src != ids.pad  # (B, S)
        memory = model.encode(src)  # (B, S, D), once; the decoder projects it once into the state
        limits = make_limits(src_mask, prefix, pad=ids.pad, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
                             max_positions=model.config.max_positions)
        batch, device = src.size(0), src.device
        return cls(state=model.new_state(), memory=memory, src_mask=src_mask, limits=limits,
                   sentence=torch.arange(batch, device=device), scores=torch.zeros(batch, 1, device=device),
                   tokens=torch.zeros(batch, 1, 0, dtype=torch.long, device=device),
                   tgt_in=torch.full((batch, 1), ids.bos, dtype=torch.long, device=device),
                   num_finished=torch.zeros(batch, dtype=torch.long, device=device),
                   best_finished=torch.full((batch, config.nbest), NEG_INF, dtype=torch.float64, device=device))

    def advance(self, tokens: Tensor, scores: Tensor, *, beams: Tensor | None = None,
                keep: Tensor | None = None) -> Live:
        """One step on: hypothesis k of each sentence extends its hypothesis `beams[:, k]` (beam search;
        without `beams`, K = 1) by `tokens[:, k]`, reaching cumulative log_prob `scores[:, k]` (N, K' each);
        then only the sentences `keep` (N',) go on (default: all), in every tensor and the state's rows
        at once. The state is reordered by one `reorder`, and not at all when no row moves."""
        n, k_cur, step = self.tokens.shape
        if beams is None and keep is None:
            return replace(self, tokens=torch.cat((self.tokens, tokens[:, :, None]), dim=2), scores=scores,
                           tgt_in=tokens.view(-1, 1))
        keep = torch.arange(n, device=tokens.device) if keep is None else keep
        dropped = keep.numel() < n
        rows = keep if beams is None else (keep[:, None] * k_cur + beams.index_select(0, keep)).view(-1)  # (N'*K',)
        # Memory stays one row per sentence (the hypotheses share it): the state drops only whole sentences.
        state = self.state.reorder(rows, sentences=keep if dropped else None)

        def kept(x: Tensor) -> Tensor:  # (N, ...) -> (N', ...)
            return x.index_select(0, keep) if dropped else x

        new_tokens = kept(tokens)  # (N', K')
        history = self.tokens.view(n * k_cur, step).index_select(0, rows)  # (N' * K', T)
        return Live(state=state, memory=kept(self.memory), src_mask=kept(self.src_mask),
                    limits=self.limits.select(keep) if dropped else self.limits, sentence=kept(self.sentence),
                    tokens=torch.cat((history, new_tokens.view(-1, 1)), dim=1).view(keep.numel(), -1, step + 1),
                    scores=kept(scores), tgt_in=new_tokens.view(-1, 1), num_finished=kept(self.num_finished),
                    best_finished=kept(self.best_finished))


def decode(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, bos: int, eos: int, pad: int,
    prefix: Sequence[Sequence[int]] | None = None, generator: torch.Generator | None = None,
    constraints: Sequence[Phrases] | None = None, continuing: frozenset[int] = frozenset(),
) -> list[list[Hypothesis]]:
    """Per source sentence (B, S) its hypotheses, best first: `nbest` of them, or one for greedy and sampling.

    Sampling draws with `generator`, or with a new one seeded from `config.seed`; a caller decoding
    many batches passes one generator so that the batches draw different numbers. `constraints`: per
    sentence, target phrases (token ids) its outputs must contain: an output of the plain search that holds
    them all is kept, the others are searched again by `constrained_beam_search` (a sentence whose phrases
    it cannot place keeps its plain output: check with constraints.holds); `continuing`: the tokens that
    continue a word, which may not follow a placed phrase (empty: any may).
    """
    config.check_model(vocab_size=model.config.vocab_size, max_positions=model.config.max_positions)
    if constraints is not None and any(constraints) and config.sampling:
        raise ValueError("lexical constraints need a search (beam_size >= 1), not sampling")
    if config.sampling:
        if generator is None and config.seed is not None:
            generator = torch.Generator(device=src.device).manual_seed(config.seed)
        results = [[h] for h in sample(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix,
                                       generator=generator)]
    elif config.beam_size == 1:
        results = [[h] for h in greedy(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix)]
    else:
        results = beam_search(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix)
    if constraints is not None and any(constraints):
        # Outputs that already hold their phrases stay as they are; the others are searched again under
        # their constraints, and kept as they were (their phrases missing: the caller says so) if that fails.
        redo = [r for r, hyps in enumerate(results) if constraints[r] and not all(
            holds(h.tokens, phrase, continuing=continuing) for h in hyps for phrase in constraints[r])]
        if redo:
            again = constrained_beam_search(
                model, src[redo], config, bos=bos, eos=eos, pad=pad, constraints=[constraints[r] for r in redo],
                prefix=[prefix[r] for r in redo] if prefix is not None else None, continuing=continuing)
            for r, hyps in zip(redo, again, strict=True):
                results[r] = hyps or results[r]
    if config.token_scores or config.alignments:
        results = annotate(model, src, results, ids=SpecialIds(bos=bos, eos=eos, pad=pad),
                           token_scores=config.token_scores, alignments=config.alignments)
    return results


def annotate(model: EncoderDecoder[Any], src: Tensor, results: list[list[Hypothesis]], *, ids: SpecialIds,
             token_scores: bool, alignments: bool) -> list[list[Hypothesis]]:
    """The hypotheses with their token log-probabilities and/or source positions, from one teacher-forced
    pass over all of them (seq2seq/decoding/scoring.py): the search's own steps are left as they are."""
    rows = [i for i, hyps in enumerate(results) for _ in hyps]
    if not rows:
        return results
    # Alignments read a decoder layer's cross-attention: a model with layers (the Transformer's config)
    layer = alignment_layer(cast(Any, model.config).num_decoder_layers) if alignments else None
    with torch.inference_mode():
        sources = src.index_select(0, torch.tensor(rows, dtype=torch.long, device=src.device))  # (H, S)
        forced = force_decode(model, model.encode(sources), sources != ids.pad,
                              [h.tokens for hyps in results for h in hyps], bos=ids.bos, eos=ids.eos, pad=ids.pad,
                              align_layer=layer)
    annotated: list[list[Hypothesis]] = []
    for hyps in results:
        mine, forced = forced[: len(hyps)], forced[len(hyps) :]
        annotated.append([replace(h, token_log_probs=f.token_log_probs if token_scores else None,
                                  source_positions=f.source_positions if alignments else None)
                          for h, f in zip(hyps, mine, strict=True)])
    return annotated


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, bos: int, eos: int, pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
) -> list[list[Hypothesis]]:
    """Beam search over a batch of sources (B, S), right-padded; per sentence its n-best, best first.

    K = config.beam_size. All N*K live hypotheses advance in one decoder call per step (`beam_step`), ranked
    by the length-normalised `score` (`length_penalty` is GNMT's alpha; 0 ranks by raw log_prob).
    A sentence stops, and leaves the batch, at the first of: no live hypothesis can overtake its n-best
    (`cannot_be_overtaken`, exact); K of its hypotheses have finished (fairseq's rule, not exact: with
    alpha > 0 a longer live one could still score better); its max_len; no hypothesis left alive.
    """
    beam_size, alpha = config.beam_size, config.length_penalty
    if src.size(0) == 0:
        return []
    ids = SpecialIds(bos=bos, eos=eos, pad=pad)
    live = Live.start(model, src, config, ids=ids, prefix=prefix)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]

    while True:
        n, k_cur, step = live.tokens.shape
        # Bounds are not asked for (greedy asks): with k > 1, which of several equal logits topk keeps depends on
        # the other candidates it is given, so chunks chosen on bounds the constraints made loose could keep
        # another tied token. A StepDecoder gives them anyway, exact but where constraints lowered a logit.
        logits, normalizer, bounds, _ = step_logits(model, live.tgt_in, live.memory, live.src_mask,
                                                    live.state)  # (N*K_cur, V), (N*K_cur,), chunk maxima or None
        constrain_(logits.view(n, k_cur, -1), live.tokens, live.limits, ids=ids, min_len=config.min_len,
                   no_repeat_ngram_size=config.no_repeat_ngram_size)
        if bounds is not None and logits.element_size() <= 4 and k_cur * (logits.size(1) // TOP_K_CHUNK) > 2 * beam_size:
            cand = beam_step_on_bounds(live.scores, logits, normalizer, bounds, beam_size=beam_size, eos=ids.eos)
        else:  # (float64 bounds would be float32's rounding of them, below some logits: not bounds)
            cand = beam_step_by_rows(live.scores, logits, normalizer, bounds, beam_size=beam_size, eos=ids.eos)
        del logits  # freed now, not once the next step has computed its own: one (R, V) buffer at a time
        _collect_finished(finished, cand, live, beam_size=beam_size, alpha=alpha)

        live.num_finished = (live.num_finished + cand.finished.sum(dim=1)).clamp(max=beam_size)
        now_finished = cand.cand_scores.double().masked_fill(~cand.finished, NEG_INF)  # (N, 2K)
        now_finished = cast(Tensor, length_normalize(now_finished, step + 1, alpha=alpha))
        live.best_finished = torch.cat((live.best_finished, now_finished), dim=1).topk(config.nbest, dim=1).values
        best_live = cand.next_scores[:, 0]  # (N,)
        done = ((live.num_finished >= beam_size) | (live.limits.max_len <= step) | best_live.isneginf()
                | cannot_be_overtaken(live.best_finished[:, -1], best_live, live.limits.max_len, alpha=alpha))
        keep = (~done).nonzero()[:, 0]  # (N',)
        if keep.numel() == 0:
            break
        live = live.advance(cand.next_tokens, cand.next_scores, beams=cand.next_beams, keep=keep)

    return [sorted(hyps, key=lambda h: h.score, reverse=True)[: config.nbest] for hyps in finished]


@torch.inference_mode()
def constrained_beam_search(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, bos: int, eos: int, pad: int,
    constraints: Sequence[Phrases], prefix: Sequence[Sequence[int]] | None = None,
    continuing: frozenset[int] = frozenset(),
) -> list[list[Hypothesis]]:
    """Beam search whose outputs contain every phrase of their sentence's `constraints`, in any order:
    dynamic beam allocation (seq2seq/decoding/constraints.py). Per sentence its n-best, best first; none for a
    sentence whose phrases could not all be placed (the caller says so).

    As beam_search otherwise (the candidates, the length-normalised ranking, the stop rules), with three
    differences: each hypothesis is also extended by every token that makes progress on a constraint;
    the K that go on are shared out among banks of constraint tokens met; EOS is banned until all of a
    hypothesis' phrases are placed. A sentence's max_len is raised to hold its phrases (and its prefix).
    The bookkeeping is per hypothesis in Python: it costs more per step than beam_search, and is used only
    where some sentence has constraints.
    """
    # Beam 1 is greedy search, whose score is the log-probability: the same for a sentence whatever its batch
    beam_size, alpha = config.beam_size, config.length_penalty if config.beam_size > 1 else 0.0
    batch = src.size(0)
    if batch == 0:
        return []
    if len(constraints) != batch:
        raise ValueError(f"constraints has {len(constraints)} entries for {batch} source sentences")
    ids = SpecialIds(bos=bos, eos=eos, pad=pad)
    phrases = [[list(p) for p in sentence] for sentence in constraints]
    if any(not p for sentence in phrases for p in sentence):
        raise ValueError("a constraint is empty: every phrase needs at least one token")
    live = Live.start(model, src, config, ids=ids, prefix=prefix)
    needed = torch.tensor([sum(map(len, p)) for p in phrases], device=src.device) + live.limits.prefix_len
    live.limits = live.limits._replace(max_len=torch.maximum(live.limits.max_len, needed).clamp(
        max=model.config.max_positions - 1))
    num_banks = [sum(map(len, p)) + 1 for p in phrases]
    continues_word = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=src.device)  # (V,)
    continues_word[sorted(continuing)] = True
    progress = [[start(p)] for p in phrases]  # by input sentence: per live hypothesis
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]

    while True:
        n, k_cur, step = live.tokens.shape
        sentences = live.sentence.tolist()
        logits, normalizer, _, _ = step_logits(model, live.tgt_in, live.memory, live.src_mask, live.state)  # (N*K_cur, V)
        rows = logits.view(n, k_cur, -1)
        constrain_(rows, live.tokens, live.limits, ids=ids, min_len=config.min_len,
                   no_repeat_ngram_size=config.no_repeat_ngram_size)
        unmet = torch.tensor([[not all_met(progress[i][b]) for b in range(k_cur)] for i in sentences],
                             dtype=torch.bool, device=logits.device)  # (N, K_cur)
        rows[..., ids.eos] = rows[..., ids.eos].masked_fill(unmet, NEG_INF)  # no end before every phrase is in
        if continuing:  # a phrase just placed ends its word
            placed = [s * k_cur + b for s, i in enumerate(sentences) for b in range(k_cur)
                      if progress[i][b].just_placed >= 0]
            if placed:
                at = torch.tensor(placed, device=logits.device)
                logits[at] = logits[at].masked_fill(continues_word, NEG_INF)
        top_logits, top_tokens = top_k_rows(logits, 2 * beam_size)  # (N*K_cur, 2K)
        top = (top_logits.float() - normalizer[:, None]).tolist()
        wanted = [(s * k_cur + b, token) for s, i in enumerate(sentences) for b in range(k_cur)
                  for token in sorted(next_tokens(progress[i][b], phrases[i]))]
        wanted_log_probs: list[float] = []
        if wanted:
            at = torch.tensor(wanted, device=logits.device)
            wanted_log_probs = (logits[at[:, 0], at[:, 1]].float() - normalizer[at[:, 0]]).tolist()
        scores, top_tokens_list = live.scores.tolist(), top_tokens.tolist()
        candidates: list[dict[tuple[int, int], float]] = [{} for _ in range(n)]  # (beam, token) -> log_prob
        for row, (log_probs, tokens) in enumerate(zip(top, top_tokens_list, strict=True)):
            s, b = divmod(row, k_cur)
            for log_prob, token in zip(log_probs, tokens, strict=True):
                candidates[s][b, token] = scores[s][b] + log_prob
        for (row, token), log_prob in zip(wanted, wanted_log_probs, strict=True):
            s, b = divmod(row, k_cur)
            candidates[s][b, token] = scores[s][b] + log_prob

        next_beams, next_tokens_, next_scores, worst_kept = [], [], [], []
        for s, i in enumerate(sentences):
            ranked = sorted(((score, b, token) for (b, token), score in candidates[s].items() if score > NEG_INF),
                            key=lambda c: -c[0])
            for score, b, token in ranked[:beam_size]:  # EOS among the K best: a complete hypothesis
                if token == ids.eos and len(finished[i]) < beam_size:
                    finished[i].append(Hypothesis(tokens=live.tokens[s, b].tolist(), log_prob=score,
                                                  score=float(length_normalize(score, step + 1, alpha=alpha))))
            going = [(score, b, token) for score, b, token in ranked if token != ids.eos]
            after = [advance(progress[i][b], phrases[i], token, continues_word=token in continuing)
                     for _, b, token in going]
            chosen = allocate([met(p, phrases[i]) for p in after], beam_size=beam_size, num_banks=num_banks[i])
            dead = beam_size - len(chosen)  # rows at -inf: they go on and never finish
            next_beams.append([going[c][1] for c in chosen] + [0] * dead)
            next_tokens_.append([going[c][2] for c in chosen] + [ids.pad] * dead)
            next_scores.append([going[c][0] for c in chosen] + [NEG_INF] * dead)
            progress[i] = [after[c] for c in chosen] + [start(phrases[i])] * dead
            kept = sorted((h.score for h in finished[i]), reverse=True)
            worst_kept.append(kept[config.nbest - 1] if len(kept) >= config.nbest else NEG_INF)
        device = live.scores.device
        scores_ = torch.tensor(next_scores, device=device)  # (N, K)
        num_finished = torch.tensor([len(finished[i]) for i in sentences], device=device)
        best_live = scores_.amax(dim=1)  # allocation orders by bank, not score: the best is anywhere
        done = ((num_finished >= beam_size) | (live.limits.max_len <= step) | best_live.isneginf()
                | cannot_be_overtaken(torch.tensor(worst_kept, dtype=torch.float64, device=device), best_live,
                                      live.limits.max_len, alpha=alpha))
        keep = (~done).nonzero()[:, 0]  # (N',)
        if keep.numel() == 0:
            break
        live = live.advance(torch.tensor(next_tokens_, device=device), scores_,
                            beams=torch.tensor(next_beams, device=device), keep=keep)

    return [sorted(hyps, key=lambda h: h.score, reverse=True)[: config.nbest] for hyps in finished]


def cannot_be_overtaken(worst_kept: Tensor, best_live: Tensor, max_len: Tensor, *, alpha: float) -> Tensor:
    """(N,) True where no live hypothesis can still end above the n-best already finished.

    A live hypothesis of log_prob s <= 0 can only lose log-probability, and its normalised score
    s / ((5 + n) / 6) ** alpha is largest at the longest length it may reach (max_len + 1, EOS
    counted), so that is its bound; with alpha = 0 the bound is s itself. The best live hypothesis
    bounds them all. Stopping there returns exactly what searching on would (an equal score later
    would rank behind, as sorting is stable), as CTranslate2 does for its stopping rule; unlike
    fairseq's rule alone, which searches on until K hypotheses have finished.
    """
    bound = best_live.double() / ((6 + max_len.double()) / 6) ** alpha
    return worst_kept >= bound


def _collect_finished(
    finished: list[list[Hypothesis]], cand: BeamStep, live: Live, *, beam_size: int, alpha: float
) -> None:
    """Append this step's complete hypotheses, best first, until a sentence has K (bookkeeping only)."""
    where = cand.finished.nonzero()  # (F, 2) row-major: within a sentence, in rank order
    if where.numel() == 0:
        return
    n, k_cur, step = live.tokens.shape
    at, rank = where.unbind(dim=1)
    rows = at * k_cur + cand.cand_beams[at, rank]
    hyp_tokens = live.tokens.view(n * k_cur, step)[rows].tolist()
    log_probs = cand.cand_scores[at, rank].tolist()
    for i, toks, log_prob in zip(live.sentence[at].tolist(), hyp_tokens, log_probs, strict=True):
        if len(finished[i]) < beam_size:
            score = length_normalize(log_prob, step + 1, alpha=alpha)
            finished[i].append(Hypothesis(tokens=toks, score=float(score), log_prob=log_prob))


@torch.inference_mode()
def greedy(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, bos: int, eos: int, pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
) -> list[Hypothesis]:
    """The most likely next token at every step; one hypothesis per source sentence (B, S).

    Uses the config's length limits and constraints; beam, n-best and sampling fields do not apply. With
    `config.scores` off the argmax is taken from the logits alone (the same tokens: the normaliser is one
    number per row) and the scores are NaN. Where the decoder's step gives each row's argmax (a StepDecoder's),
    a row whose argmax no constraint lowered keeps it; only the others are ranked here.
    """
    def pick(logits: Tensor, normalizer: Tensor, bounds: Tensor | None,
             argmax: Tensor | None) -> tuple[Tensor, Tensor]:  # (R,), (R,)
        if argmax is None:
            best, token = top_k_rows(logits, 1, bounds=bounds)
            return token[:, 0], best[:, 0].float() - normalizer
        again = (argmax < 0).nonzero()[:, 0]  # (R',): rows whose argmax a constraint lowered
        token = argmax
        if again.numel():
            _, exact = top_k_rows(logits[again], 1, bounds=None if bounds is None else bounds[again])
            token = argmax.index_copy(0, again, exact[:, 0])
        return token, logits.gather(1, token[:, None])[:, 0].float() - normalizer

    return _one_per_row(model, src, config, pick=pick, ids=SpecialIds(bos=bos, eos=eos, pad=pad), prefix=prefix,
                        bounds=config.scores, normalize=config.scores, argmax=True)


@torch.inference_mode()
def sample(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, bos: int, eos: int, pad: int,
    prefix: Sequence[Sequence[int]] | None = None, generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """Draw each next token from the model's distribution: tempered, then top-k, then top-p (nucleus).

    `top_k=0` and `top_p=1` switch those filters off. Pass a `generator` (on src's device) to
    reproduce a draw. `log_prob` is the model's (temperature 1, unfiltered) log-probability.
    """

    def pick(logits: Tensor, normalizer: Tensor, bounds: Tensor | None,
             argmax: Tensor | None) -> tuple[Tensor, Tensor]:  # (R,), (R,)
        log_probs = logits.float() - normalizer[:, None]  # constrained: banned tokens at -inf
        tempered = F.log_softmax(log_probs / config.temperature, dim=-1)
        filtered = top_p_filter(top_k_filter(tempered, config.top_k), config.top_p)
        token = torch.multinomial(filtered.exp(), 1, generator=generator)[:, 0]
        return token, log_probs.gather(1, token[:, None])[:, 0]

    return _one_per_row(model, src, config, pick=pick, ids=SpecialIds(bos=bos, eos=eos, pad=pad), prefix=prefix,
                        bounds=False)


def _one_per_row(
    model: EncoderDecoder[Any], src: Tensor, config: SearchConfig, *, ids: SpecialIds,
    prefix: Sequence[Sequence[int]] | None,
    pick: Callable[[Tensor, Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor]],
    bounds: bool, normalize: bool = True, argmax: bool = False,
) -> list[Hypothesis]:
    """Greedy and sampling: one hypothesis per sentence; `pick` chooses from the constrained logits, their
    normaliser (NaN without `normalize`), (with `bounds`) the chunk maxima `top_k_rows` takes and (with `argmax`,
    where the step gives it) each row's argmax that the constraints left standing, -1 where they lowered it, and
    gives each row's token and its log-probability."""
    if src.size(0) == 0:
        return []
    live = Live.start(model, src, config, ids=ids, prefix=prefix)
    num_live = src.size(0)
    results: dict[int, Hypothesis] = {}

    while True:
        logits, normalizer, chunk_max, best = step_logits(model, live.tgt_in, live.memory, live.src_mask, live.state,
                                                          bounds=bounds, normalize=normalize)  # (N, V), (N,), maxima, (N,)
        best = best if argmax else None
        before = None if best is None else logits.gather(1, best[:, None])  # (N, 1): the argmax's logit, unconstrained
        constrain_(logits[:, None], live.tokens, live.limits, ids=ids, min_len=config.min_len,
                   no_repeat_ngram_size=config.no_repeat_ngram_size)  # lowers logits only: the bounds hold
        unfinished = live.num_finished == 0  # (N,)
        if best is not None and before is not None:
            # The constraints only lower logits: where they left the argmax's as it was it is still the argmax (the
            # first of equal maxima too); elsewhere (a banned or forced token) -1, ranked by pick. A finished row
            # riding along takes token 0 without a look at its logits.
            held = logits.gather(1, best[:, None]).eq(before)[:, 0] | ~unfinished  # (N,)
            best = torch.where(held, best.masked_fill(~unfinished, 0), -1)
        elif num_live < unfinished.numel():
            # A finished row's constraints may ban every token, and multinomial cannot draw from none: its
            # logits become one token's, the first (only its rows are written: a mask over every row read and
            # wrote all the logits), and its chunk maxima say so, which top_k_rows then proves at once (with
            # all its logits 0, as they once were, the row was a tie that it ranked again at every step).
            finished = (~unfinished).nonzero()[:, 0]
            logits.index_fill_(0, finished, -math.inf)
            logits[finished, 0] = 0.0
            if chunk_max is not None:
                chunk_max.index_fill_(0, finished, -math.inf)
                chunk_max[finished, 0] = 0.0
        next_token, next_log_prob = pick(logits, normalizer, chunk_max, best)  # (N,), (N,)
        del logits, chunk_max  # freed now, not once the next step has computed its own
        log_prob = live.scores[:, 0] + next_log_prob  # (N,)
        done = (next_token == ids.eos) & unfinished  # at max_len EOS is the only choice left
        keep = None
        if done.any():
            for i, toks, lp in zip(live.sentence[done].tolist(), live.tokens[done, 0].tolist(),
                                   log_prob[done].tolist(), strict=True):
                results[i] = Hypothesis(tokens=toks, score=lp, log_prob=lp)
            live.num_finished += done
            num_live -= int(done.sum())
            if num_live == 0:
                break
            # Finished rows ride along (one row of wasted compute each) until a quarter of the rows
            # are finished: dropping rows copies every remaining row's cache, which costs far more
            # than a few rows of compute when it happens at every step.
            if num_live <= 0.75 * done.numel():
                keep = (live.num_finished == 0).nonzero()[:, 0]
        live = live.advance(next_token[:, None], log_prob[:, None], keep=keep)

    return [results[i] for i in range(src.size(0))]
