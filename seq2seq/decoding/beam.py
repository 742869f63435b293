"""Beam search, plain and under lexical constraints (grid search over the phrases placed so far): the loop over
steps, the live hypotheses, the finished ones, and when a sentence is done. The step's arithmetic is
seq2seq/decoding/ranking.py's; the conventions are seq2seq/decoding/search.py's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from seq2seq.decoding.config import NEG_INF, EncoderDecoder, Hypothesis, SearchConfig, SpecialIds
from seq2seq.decoding.constraints import Phrases, advance, all_met, allocate, met, next_tokens, start
from seq2seq.decoding.ranking import (
    TOP_K_CHUNK,
    BeamStep,
    beam_step_by_rows,
    beam_step_on_bounds,
    length_normalize,
    top_k_rows,
)
from seq2seq.decoding.steps import Live, constrain_, step_logits


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
