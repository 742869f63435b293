"""Decoding's one entry point, `decode`: greedy decoding, beam search (seq2seq/decoding/beam.py) or sampling
(sampling.py) over an encoder-decoder model, as one SearchConfig (config.py) asks, constraints placed where the
plain search missed them, scores and alignments added by one teacher-forced pass.

The search knows the model only through `encode` and a one-step `decode` with an incremental
`DecoderState` (config.py's `EncoderDecoder` protocol): the source is encoded once, the decoder
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

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch import Tensor

from seq2seq.decoding.beam import beam_search, constrained_beam_search
from seq2seq.decoding.config import EncoderDecoder, Hypothesis, SearchConfig, SpecialIds
from seq2seq.decoding.constraints import Phrases, holds
from seq2seq.decoding.sampling import greedy, sample
from seq2seq.decoding.scoring import alignment_layer, force_decode


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
