"""What a search's hypotheses become for the caller: each one's Translation (inference/documents.py), with its text,
tokens and scores, its word alignment and the constraints it lacks. A multilingual model's tag is the model's, not
the translation's: a source's tag takes no word, and a forced first tag (tags on the decoder side) is dropped."""

from __future__ import annotations

import dataclasses

from seq2seq.decoding.config import Hypothesis
from seq2seq.decoding.constraints import holds
from seq2seq.inference.documents import Translation
from seq2seq.text.tokenizer import Tokenizer


def translations(hyps: list[Hypothesis], *, tokenizer: Tokenizer, source: list[int], source_tags: int,
                 decoder_tag: bool, phrases: tuple[list[str], list[list[int]]] | None,
                 continuing: frozenset[int]) -> list[Translation]:
    """One source's hypotheses as Translations. `source_tags`: how many tag tokens start the source (its positions
    count them); `decoder_tag`: every hypothesis starts with a forced tag; `phrases`: its constraints (texts, ids)."""
    if decoder_tag:  # forced first: its token, score and alignment are not the translation's
        hyps = [dataclasses.replace(h, tokens=h.tokens[1:], token_log_probs=h.token_log_probs and h.token_log_probs[1:],
                                    source_positions=h.source_positions and h.source_positions[1:]) for h in hyps]
    texts = tokenizer.decode([h.tokens for h in hyps])
    return [Translation(text=t, score=h.score, tokens=h.tokens, token_scores=h.token_log_probs,
                        alignment=word_alignment(tokenizer, source, h, source_tags=source_tags),
                        unmet_constraints=None if phrases is None else [
                            text for text, ids in zip(*phrases, strict=True)
                            if not holds(h.tokens, ids, continuing=continuing)])
            for t, h in zip(texts, hyps, strict=True)]


def word_alignment(tokenizer: Tokenizer, source: list[int], hyp: Hypothesis, *,
                   source_tags: int = 0) -> list[tuple[int, int]] | None:
    """The hypothesis' token alignment (each token's most attended source position) as word pairs; a token that
    attended to no text token (a Marian source's eos, a multilingual source's tag) aligns nothing."""
    if hyp.source_positions is None:
        return None
    source_words = [-1] * source_tags + tokenizer.word_indices(source[source_tags: tokenizer.source_tokens(source)])
    target_words = tokenizer.word_indices(hyp.tokens)
    # Pieces the text leaves out (a dropped <unk>, spaces a Marian decode collapses) must not point past it
    words = len(tokenizer.decode([hyp.tokens])[0].split(" "))
    return sorted({(source_words[p], target_words[j]) for j, p in enumerate(hyp.source_positions)
                   if p < len(source_words) and source_words[p] >= 0 and target_words[j] < words})
