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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.model.config import ConfigError, check_field_types, check_range

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

    def check_vocabulary(self, vocab_size: int) -> None:
        """Beam search ranks 2 * beam_size candidates among the first step's vocabulary."""
        if not self.sampling and self.beam_size > 1 and 2 * self.beam_size > vocab_size:
            raise ConfigError("beam_size", f"{self.beam_size} needs a vocabulary of at least {2 * self.beam_size} "
                                           f"tokens; this model has {vocab_size}")


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]
    """Generated ids without BOS and without the final EOS (a forced prefix included)."""
    score: float
    """Ranking score: length-normalised log_prob for beam search, log_prob otherwise."""
    log_prob: float
    """Sum of the log-probabilities of all tokens and the final EOS."""


class DecoderState(Protocol):
    @property
    def length(self) -> int: ...

    def reorder(self: _Self, indices: Tensor) -> _Self: ...


_Self = TypeVar("_Self")
State = TypeVar("State", bound=DecoderState)


class ModelConfig(Protocol):
    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class EncoderDecoder(Protocol[State]):
    """What the searches need of a model; generic in its own state type (the Transformer's DecoderState)."""

    @property
    def config(self) -> ModelConfig: ...

    def encode(self, src: Tensor) -> Tensor: ...

    def new_state(self) -> State: ...

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: State | None = None) -> Tensor: ...


# ---------------------------------------------------------------------------------------------
# Small pure functions: one decoding step, the constraints on it, scoring.


def step_log_probs(
    model: EncoderDecoder[Any], tgt_in: Tensor, memory: Tensor, src_mask: Tensor, state: Any
) -> Tensor:
    """Feed one new token per row (R, 1); float32 log-probabilities (R, V) of the next one."""
    logits = model.decode(tgt_in, memory, src_mask, state=state)  # (R, 1, V), maybe bf16 under autocast
    return F.log_softmax(logits[:, -1].float(), dim=-1)


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
    padded = torch.full((batch, width), pad, dtype=torch.long)
    for i, p in enumerate(prefix):
        padded[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
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


def constrain(
    log_probs: Tensor, tokens: Tensor, limits: Limits, *, bos: int, eos: int, pad: int, min_len: int,
    no_repeat_ngram_size: int,
) -> Tensor:
    """Mask (-inf) what may not come next. log_probs (N, K, V), tokens (N, K, T) generated so far.

    Allowed values keep the model's log-probability (no renormalisation), so scores stay the model's.
    Precedence: a forced prefix token wins over everything; at max_len only EOS (even below min_len).
    """
    step, vocab = tokens.size(-1), log_probs.size(-1)
    banned = torch.zeros(vocab, dtype=torch.bool, device=log_probs.device)
    banned[[bos, pad]] = True
    if step < min_len:
        banned[eos] = True
    banned = banned.expand_as(log_probs)  # (N, K, V)
    if no_repeat_ngram_size > 0:
        banned = banned | repeated_ngram_mask(tokens, n=no_repeat_ngram_size, vocab_size=vocab)
    only_eos = torch.ones(vocab, dtype=torch.bool, device=log_probs.device)
    only_eos[eos] = False
    banned = torch.where((limits.max_len <= step)[:, None, None], only_eos, banned)
    out = log_probs.masked_fill(banned, NEG_INF)
    if step < limits.prefix.size(1):
        forced = (step < limits.prefix_len)[:, None, None]  # (N, 1, 1)
        not_forced_token = F.one_hot(limits.prefix[:, step], vocab)[:, None, :] == 0  # (N, 1, V)
        out = torch.where(forced, log_probs.masked_fill(not_forced_token, NEG_INF), out)
    return out


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


def beam_step(scores: Tensor, log_probs: Tensor, *, beam_size: int, eos: int) -> BeamStep:
    """scores (N, K_cur) cumulative log_prob of the live beams, log_probs (N, K_cur, V) of their next token.

    fairseq's rule: take the 2K best extensions over all beams, so that up to K of them (at most one
    EOS per beam) can finish while K others still go on. EOS candidates ranked in the top K finish;
    those below are dropped; the first K non-EOS candidates form the next beam. K_cur is 1 on the
    first step (every beam would be the same BOS), K after. Rows at -inf are dead beams (a forced
    prefix leaves one live beam): they go on at -inf and never finish.
    """
    batch, k_cur, vocab = log_probs.shape
    num_cand = 2 * beam_size
    if num_cand > k_cur * vocab:
        raise ValueError(f"beam_size {beam_size} needs a vocabulary of at least {num_cand} tokens, got {vocab}")
    total = (scores[:, :, None] + log_probs).view(batch, k_cur * vocab)
    cand_scores, flat = total.topk(num_cand, dim=1)  # (N, 2K), best first
    cand_beams, cand_tokens = flat // vocab, flat % vocab
    is_eos = cand_tokens == eos
    rank = torch.arange(num_cand, device=scores.device)
    finished = is_eos & (rank < beam_size) & cand_scores.isfinite()
    # Push EOS candidates behind all others; the K smallest keys are then the K best non-EOS, in order.
    keep = (rank + is_eos.long() * num_cand).topk(beam_size, dim=1, largest=False).indices  # (N, K)
    next_beams, next_tokens, next_scores = (x.gather(1, keep) for x in (cand_beams, cand_tokens, cand_scores))
    return BeamStep(cand_scores, cand_tokens, cand_beams, finished, next_beams, next_tokens, next_scores)


# ---------------------------------------------------------------------------------------------
# The searches, and the one entry point that picks among them.


def decode(
    model: EncoderDecoder[Any],
    src: Tensor,
    config: SearchConfig,
    *,
    bos: int,
    eos: int,
    pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
) -> list[list[Hypothesis]]:
    """Per source sentence (B, S) its hypotheses, best first: `nbest` of them, or one for greedy and sampling.

    Sampling draws with `generator`, or with a new one seeded from `config.seed`; a caller decoding
    many batches passes one generator so that the batches draw different numbers.
    """
    config.check_vocabulary(model.config.vocab_size)
    if config.sampling:
        if generator is None and config.seed is not None:
            generator = torch.Generator(device=src.device).manual_seed(config.seed)
        hyps = sample(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix, generator=generator)
        return [[h] for h in hyps]
    if config.beam_size == 1:
        return [[h] for h in greedy(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix)]
    return beam_search(model, src, config, bos=bos, eos=eos, pad=pad, prefix=prefix)


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder[Any],
    src: Tensor,
    config: SearchConfig,
    *,
    bos: int,
    eos: int,
    pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
) -> list[list[Hypothesis]]:
    """Beam search over a batch of sources (B, S), right-padded; per sentence its n-best, best first.

    K = config.beam_size. All B*K hypotheses advance in one decoder call per step. Hypotheses are ranked by the
    length-normalised `score` (`length_penalty` is GNMT's alpha; 0 ranks by raw log_prob).

    Stopping (fairseq's rule, not an exact one): a sentence is done as soon as K hypotheses have
    finished, or at its max_len. A live hypothesis could still have overtaken the worst finished one
    (with alpha > 0 a longer one can score better), but proving it cannot would mean searching on
    to max_len for most sentences.
    """
    beam_size, length_penalty = config.beam_size, config.length_penalty
    if src.size(0) == 0:
        return []
    src_mask = src != pad  # (B, S)
    memory = model.encode(src)  # (B, S, D), once; the decoder projects it once into the state
    limits = make_limits(src_mask, prefix, pad=pad, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
                         max_positions=model.config.max_positions)
    batch, device = src.size(0), src.device
    state = model.new_state()
    sentence = torch.arange(batch, device=device)  # (N,) input index of each live sentence
    tokens = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)  # (N, K_cur, T)
    scores = torch.zeros(batch, 1, device=device)  # (N, K_cur)
    num_finished = torch.zeros(batch, dtype=torch.long, device=device)  # (N,)
    tgt_in = torch.full((batch, 1), bos, dtype=torch.long, device=device)  # (N*K_cur, 1)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]

    while True:
        live, k_cur, step = tokens.shape
        log_probs = step_log_probs(model, tgt_in, memory, src_mask, state).view(live, k_cur, -1)  # (N, K_cur, V)
        log_probs = constrain(log_probs, tokens, limits, bos=bos, eos=eos, pad=pad, min_len=config.min_len,
                              no_repeat_ngram_size=config.no_repeat_ngram_size)
        cand = beam_step(scores, log_probs, beam_size=beam_size, eos=eos)
        _collect_finished(finished, cand, tokens, sentence, beam_size=beam_size, alpha=length_penalty)

        num_finished = (num_finished + cand.finished.sum(dim=1)).clamp(max=beam_size)
        done = (num_finished >= beam_size) | (limits.max_len <= step) | cand.next_scores[:, 0].isneginf()
        keep = (~done).nonzero()[:, 0]  # (N',)
        if keep.numel() == 0:
            break
        rows = (keep[:, None] * k_cur + cand.next_beams.index_select(0, keep)).view(-1)  # (N'*K,) rows to go on
        state = state.reorder(rows)
        if keep.numel() < live or k_cur != beam_size:
            # Rows changed sentence (one dropped, or the beam opened): memory follows. Reordering
            # beams within a sentence needs nothing: its rows share one memory.
            memory, src_mask = memory.index_select(0, rows), src_mask.index_select(0, rows)
        next_tokens = cand.next_tokens.index_select(0, keep)  # (N', K)
        tokens = torch.cat((tokens.view(live * k_cur, step)[rows], next_tokens.view(-1, 1)), dim=1)
        tokens = tokens.view(keep.numel(), beam_size, step + 1)
        scores = cand.next_scores.index_select(0, keep)
        sentence, num_finished, limits = sentence[keep], num_finished[keep], limits.select(keep)
        tgt_in = next_tokens.view(-1, 1)

    return [sorted(hyps, key=lambda h: h.score, reverse=True)[: config.nbest] for hyps in finished]


def _collect_finished(
    finished: list[list[Hypothesis]], cand: BeamStep, tokens: Tensor, sentence: Tensor, *, beam_size: int,
    alpha: float,
) -> None:
    """Append this step's complete hypotheses, best first, until a sentence has K (bookkeeping only)."""
    where = cand.finished.nonzero()  # (F, 2) row-major: within a sentence, in rank order
    if where.numel() == 0:
        return
    live, k_cur, step = tokens.shape
    at, rank = where.unbind(dim=1)
    rows = at * k_cur + cand.cand_beams[at, rank]
    hyp_tokens = tokens.view(live * k_cur, step)[rows].tolist()
    log_probs = cand.cand_scores[at, rank].tolist()
    for i, toks, log_prob in zip(sentence[at].tolist(), hyp_tokens, log_probs, strict=True):
        if len(finished[i]) < beam_size:
            score = length_normalize(log_prob, step + 1, alpha=alpha)
            finished[i].append(Hypothesis(tokens=toks, score=float(score), log_prob=log_prob))


@torch.inference_mode()
def greedy(
    model: EncoderDecoder[Any],
    src: Tensor,
    config: SearchConfig,
    *,
    bos: int,
    eos: int,
    pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
) -> list[Hypothesis]:
    """The most likely next token at every step; one hypothesis per source sentence (B, S).

    Uses the config's length limits and constraints; beam, n-best and sampling fields do not apply.
    """
    return _one_per_row(model, src, config, pick=lambda log_probs: log_probs.argmax(dim=-1), bos=bos, eos=eos,
                        pad=pad, prefix=prefix)


@torch.inference_mode()
def sample(
    model: EncoderDecoder[Any],
    src: Tensor,
    config: SearchConfig,
    *,
    bos: int,
    eos: int,
    pad: int,
    prefix: Sequence[Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """Draw each next token from the model's distribution: tempered, then top-k, then top-p (nucleus).

    `top_k=0` and `top_p=1` switch those filters off. Pass a `generator` (on src's device) to
    reproduce a draw. `log_prob` is the model's (temperature 1, unfiltered) log-probability.
    """

    def pick(log_probs: Tensor) -> Tensor:  # (R, V) -> (R,)
        tempered = F.log_softmax(log_probs / config.temperature, dim=-1)
        filtered = top_p_filter(top_k_filter(tempered, config.top_k), config.top_p)
        return torch.multinomial(filtered.exp(), 1, generator=generator)[:, 0]

    return _one_per_row(model, src, config, pick=pick, bos=bos, eos=eos, pad=pad, prefix=prefix)


def _one_per_row(
    model: EncoderDecoder[Any],
    src: Tensor,
    config: SearchConfig,
    *,
    pick: Callable[[Tensor], Tensor],
    bos: int,
    eos: int,
    pad: int,
    prefix: Sequence[Sequence[int]] | None,
) -> list[Hypothesis]:
    """Greedy and sampling: one hypothesis per sentence, `pick` chooses from constrained log-probs."""
    if src.size(0) == 0:
        return []
    src_mask = src != pad  # (B, S)
    memory = model.encode(src)  # (B, S, D)
    limits = make_limits(src_mask, prefix, pad=pad, max_len_a=config.max_len_a, max_len_b=config.max_len_b,
                         max_positions=model.config.max_positions)
    batch, device = src.size(0), src.device
    state = model.new_state()
    sentence = torch.arange(batch, device=device)  # (N,) input index of each live row
    tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)  # (N, T)
    log_prob = torch.zeros(batch, device=device)  # (N,)
    tgt_in = torch.full((batch, 1), bos, dtype=torch.long, device=device)
    results: dict[int, Hypothesis] = {}

    while True:
        log_probs = step_log_probs(model, tgt_in, memory, src_mask, state)  # (N, V)
        log_probs = constrain(log_probs[:, None], tokens[:, None], limits, bos=bos, eos=eos, pad=pad,
                              min_len=config.min_len, no_repeat_ngram_size=config.no_repeat_ngram_size)[:, 0]
        next_token = pick(log_probs)  # (N,)
        log_prob = log_prob + log_probs.gather(1, next_token[:, None])[:, 0]
        done = next_token == eos  # at max_len EOS is the only choice left
        if done.any():
            for i, toks, lp in zip(sentence[done].tolist(), tokens[done].tolist(), log_prob[done].tolist(),
                                   strict=True):
                results[i] = Hypothesis(tokens=toks, score=lp, log_prob=lp)
            keep = (~done).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            state = state.reorder(keep)
            memory, src_mask, limits = memory[keep], src_mask[keep], limits.select(keep)
            sentence, tokens, log_prob, next_token = sentence[keep], tokens[keep], log_prob[keep], next_token[keep]
        tokens = torch.cat((tokens, next_token[:, None]), dim=1)
        tgt_in = next_token[:, None]

    return [results[i] for i in range(batch)]
