"""Greedy decoding and sampling (temperature, top-k and top-p filters): one hypothesis per sentence, a token a
step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.decoding.config import NEG_INF, EncoderDecoder, Hypothesis, SearchConfig, SpecialIds
from seq2seq.decoding.ranking import top_k_rows
from seq2seq.decoding.steps import Live, constrain_, step_logits


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
