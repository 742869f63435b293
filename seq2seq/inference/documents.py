"""What a translation is (`Translation`), and documents: text to translate sentence by sentence and put back
together (paragraphs, HTML, subtitles), the search a document needs, and its sentences' results cut out per
document. The Translator (translator.py) and the server (seq2seq/serve/app.py) both translate documents through
these.
"""

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from seq2seq.decoding.config import SearchConfig
from seq2seq.text.sentences import Paragraphs


@dataclass(frozen=True)
class Translation:
    text: str
    score: float
    """The search's ranking score (length-normalised log-probability for beam search)."""
    tokens: list[int]
    token_scores: list[float] | None = None
    """SearchConfig.token_scores: the log-probability of each token, then of the final EOS."""
    unmet_constraints: list[str] | None = None
    """With constraints: the phrases this translation lacks; [] when it has them all (a sentence whose phrases
    the constrained search could not place is translated without them, and says so here)."""
    alignment: list[tuple[int, int]] | None = None
    """SearchConfig.alignments: (source word, translation word) pairs, numbered from 0 as `text.split(" ")`
    numbers them (runs of characters other than " "), sorted: Pharaoh's `i-j`. A word may have several partners, or none."""


class Document(Protocol):
    """Text to translate sentence by sentence and put back together: plain paragraphs, HTML, subtitles."""

    sentences: list[str]
    needs_alignments: bool  # render places markup by the sentences' word alignments

    def render(self, translations: Sequence[Translation]) -> str: ...


T = TypeVar("T")
EMPTY = Translation(text="", score=0.0, tokens=[])  # what an empty sentence translates to


def document_of(text: str, *, format: str, split: Callable[[str], list[tuple[int, int]]]) -> Document:
    """`text` as a document of `format`: "text" (paragraphs), "html" or "srt"; a ValueError for markup or
    subtitles that cannot be read. The HTML and SubRip readers are imported when a document needs them: their
    parsers are a part of every translating process's start-up that plain text never uses."""
    if format == "html":
        from seq2seq.text.markup import HtmlDocument

        return HtmlDocument(text, split=split)
    if format == "srt":
        from seq2seq.text.subtitles import SrtDocument

        return SrtDocument(text, split=split)
    return Paragraphs(text, split=split)


def text_only(search: SearchConfig) -> SearchConfig:
    """`search` for a caller that returns text alone: a greedy search without scores, which it then does not
    compute (the same tokens; SearchConfig.scores). Other searches compute them anyway and are left as they
    are; anything else is passed on for translate_nbest to refuse."""
    if isinstance(search, SearchConfig) and search.beam_size == 1 and not search.sampling:
        return dataclasses.replace(search, scores=False)
    return search


def search_for(documents: Sequence[Document], search: SearchConfig) -> SearchConfig:
    """`search` for translating `documents`: text only (a rendered document shows no scores), with word
    alignments if any of them places markup by them."""
    search = text_only(search)
    return dataclasses.replace(search, alignments=True) if any(d.needs_alignments for d in documents) else search


def per_document(documents: Sequence[Document], items: Sequence[T]) -> list[Sequence[T]]:
    """`items`, one per sentence of the documents in order, cut into each document's."""
    bounds = list(itertools.accumulate((len(d.sentences) for d in documents), initial=0))
    return [items[a:b] for a, b in itertools.pairwise(bounds)]
