"""Teacher forcing: the model's log-probability of given target sequences, token by token, and where
each target token read the source.

What the searches report about their outputs when `SearchConfig.token_scores` or `alignments` asks
(search.decode calls `force_decode` on the finished hypotheses: one batched pass, nothing added to the
search's own steps), and what `python -m seq2seq.score` reports about given translations. Either way
the numbers are the same function of (source, target): a translation scored by `seq2seq.score` gets
the token scores its search reported, up to the rounding of the model's precision (int8 moves them most),
when its text encodes back to the pieces the search wrote (a search may spell a word in pieces the
tokenizer would not choose: `score` then scores the tokenizer's spelling).

The log-probabilities are the model's own (log_softmax in float32, or the model's float64, over the whole
vocabulary), as `Hypothesis.log_prob` sums them: no renormalisation over what a search may have banned.
A model whose alignments are asked for has `decode_with_attention` (the Transformer's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

LOGITS_CHUNK = 1 << 23
"""Elements of logits (rows x positions x vocabulary) one decoder call may hold: 32 MB in float32."""


@dataclass(frozen=True)
class Forced:
    """One target sequence, teacher-forced."""

    token_log_probs: list[float]
    """log P(token | source, the tokens before) for every target token, then for the final EOS."""
    source_positions: list[int] | None
    """Per target token (not EOS): the source position the alignment layer attended to most; None if not asked."""

    @property
    def log_prob(self) -> float:
        return sum(self.token_log_probs)


def alignment_layer(num_decoder_layers: int) -> int:
    """The decoder layer whose cross-attention word alignments are read from: the penultimate one, whose
    attention agrees best with word alignments in models trained without alignment supervision (Garg et
    al. 2019, "Jointly Learning to Align and Translate with Transformer Models"); the only one of one."""
    return max(num_decoder_layers - 2, 0)


@torch.inference_mode()
def force_decode(
    model: Any, memory: Tensor, src_mask: Tensor, targets: Sequence[Sequence[int]], *, bos: int, eos: int,
    pad: int, align_layer: int | None = None,
) -> list[Forced]:
    """Each target (ids without BOS or EOS) teacher-forced against its row of `memory` (N, S, D) and
    `src_mask` (N, S), N = len(targets); `align_layer` (a decoder layer, None: no alignments) also gives
    each target token's most attended source position.

    The rows are decoded in chunks bounded by LOGITS_CHUNK, the longest first, so that a batch's logits
    are never held whole.
    """
    if len(targets) != memory.size(0):
        raise ValueError(f"{len(targets)} targets for {memory.size(0)} memory rows")
    vocab = int(model.config.vocab_size)
    order = sorted(range(len(targets)), key=lambda i: -len(targets[i]))
    out: list[Forced | None] = [None] * len(targets)
    start = 0
    while start < len(order):
        length = len(targets[order[start]]) + 1  # BOS + target in, target + EOS out
        rows = order[start : start + max(1, LOGITS_CHUNK // (length * vocab))]
        tgt_in = torch.full((len(rows), length), pad, dtype=torch.long)
        tgt_out = torch.full((len(rows), length), pad, dtype=torch.long)
        for r, i in enumerate(rows):
            tgt_in[r, : len(targets[i]) + 1] = torch.tensor([bos, *targets[i]], dtype=torch.long)
            tgt_out[r, : len(targets[i]) + 1] = torch.tensor([*targets[i], eos], dtype=torch.long)
        index = torch.tensor(rows, dtype=torch.long, device=memory.device)
        tgt_in, tgt_out = tgt_in.to(memory.device), tgt_out.to(memory.device)
        chunk_memory, chunk_mask = memory.index_select(0, index), src_mask.index_select(0, index)
        if align_layer is None:
            logits, attention = model.decode(tgt_in, chunk_memory, chunk_mask), None  # (n, T, V)
        else:
            logits, attention = model.decode_with_attention(tgt_in, chunk_memory, chunk_mask, layer=align_layer)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the searches: float32 at least
        log_probs = logits.log_softmax(dim=-1).gather(-1, tgt_out[..., None])[..., 0].tolist()  # (n, T)
        positions = attention.argmax(dim=-1).tolist() if attention is not None else None  # (n, T)
        for r, i in enumerate(rows):
            n = len(targets[i])
            out[i] = Forced(token_log_probs=log_probs[r][: n + 1],
                            source_positions=positions[r][:n] if positions is not None else None)
        start += len(rows)
    assert all(forced is not None for forced in out), "every target is decoded once"
    return cast(list[Forced], out)
