"""One step's scores, ranked: the logits' log-normaliser and chunk bounds, top-k over rows (exact, with the
bounds that let whole chunks be skipped), the beam step's candidates and the length normalisation. The searches
(seq2seq/decoding/beam.py, sampling.py) call these; they hold no search state."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from seq2seq.model.numerics import exp_

NORMALIZER_CHUNK_BYTES = 2**18
"""`log_normalizer` on CPU works through the rows in blocks of about this many float32 bytes: each block is
read from the logits once and its five passes (max, subtract, clamp, exp, sum) run in the core's cache,
where the whole (R, V) at once (3,000 rows of beam search are 96 MB) would stream through memory five times
(docs/performance/kernels.md#normalizer)."""

TOP_K_CHUNK = 64
"""`top_k_rows` ranks a row's columns in chunks of this many (docs/performance/kernels.md#top-k)."""


def log_normalizer(logits: Tensor) -> Tensor:
    """(R, V) -> (R,) log(sum(exp(logits))) in float32, as log_softmax computes it (max subtracted first),
    for logits of any float dtype (float64 is computed in float32 too).

    `amax` is vectorised where `max` and `logsumexp` are not (on CPU they run far slower here); `exp_`
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
    logits whole once more to find them (docs/performance/kernels.md#top-k)."""
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
    elif k == 1:  # (a max and an amax: faster than torch's topk on a CPU, docs/performance/kernels.md#top-k)
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
    as many rows, the larger part of a beam search step's own work at a few hundred sentences
    (docs/performance/compiled-decoding.md#search-in-step). A sentence is proven where its count-th total is at least
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
