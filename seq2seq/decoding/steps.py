"""What every search shares: the sentences still live (their decoder state, limits, tokens and scores), the
limits a step obeys (min and max length, a forced prefix), its masks (repeated n-grams, forced tokens) and the
step's logits and log-normaliser."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

from seq2seq.decoding.config import (
    NEG_INF,
    EncoderDecoder,
    SearchConfig,
    SpecialIds,
    StepDecoder,
    is_step_decoder,
)
from seq2seq.decoding.ranking import TOP_K_CHUNK, log_normalizer, normalizer_and_bounds


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
