"""Glossaries: the source terms a text holds, found in time linear in the text, and the target terms they force.

    glossary = Glossary({"small mother": "Omi", "mother": "Mama", "doctor": "Ärztin"})
    glossary.terms_in("The small mother helps the doctor.")   # ["Omi", "Ärztin"]

A glossary is checked and compiled once (a CLI run, a server request, a Translator call, a whole
translate_stream), then matched against every sentence: one Aho-Corasick automaton over all the source
terms (pyahocorasick, in C) reads a sentence once, whatever the number of terms, where a regular
expression per term per sentence costs time in proportion to the glossary's size.

A term applies where it is a whole word: no letter, digit or "_" of a script written with spaces next
to it. Scripts written without spaces (`unspaced`: 東京 in 我去東京了, Tokyo in Tokyoに) mark no edge, so a
term edged by one of their letters needs none there (without a word segmenter, it is also found inside
a longer word). Of terms that overlap, the leftmost wins, and of those starting there the longest:
"small mother" is one term, so the "mother" and "small" inside it are not forced besides. Terms and
texts are compared in Unicode NFC, so "café" typed precomposed matches "cafe" + U+0301 and the
other way round; matching stays case-sensitive.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import ahocorasick

UNSPACED_SCRIPTS = ("CJK ", "IDEOGRAPHIC ", "HIRAGANA", "KATAKANA", "HALFWIDTH KATAKANA", "BOPOMOFO", "HANGUL",
                    "HALFWIDTH HANGUL", "THAI ", "LAO ", "KHMER ", "MYANMAR ", "TIBETAN ", "YI ")
"""Unicode name prefixes of the letters of scripts whose words are not separated by spaces (Chinese,
Japanese, Thai, Lao, Khmer, Burmese, Tibetan, Yi), and of Hangul, whose particles join the word before
them (서울에서: in Seoul)."""


def unspaced(char: str) -> bool:
    """Whether `char` is a letter of a script whose words are not separated by spaces (UNSPACED_SCRIPTS):
    a word boundary there is not marked in the text, so none is required next to it."""
    return unicodedata.name(char, "").startswith(UNSPACED_SCRIPTS)


def spaced_word_char(char: str) -> bool:
    """Whether `char` goes on a word of a script written with spaces: a term next to it is not a whole word."""
    return (char.isalnum() or char == "_") and not unspaced(char)


def continues_word(piece: str) -> bool:
    """Whether a sentencepiece piece goes on with the word before it: no leading "▁", and a letter or digit first
    (or a byte of a character the vocabulary lacks); punctuation does not, nor a letter of a script written
    without spaces (`unspaced`: に after 東京 is the next word). What may not follow a placed term or constraint."""
    return not piece.startswith("\u2581") and ((piece[:1].isalnum() and not unspaced(piece[0]))
                                              or piece.startswith("<0x"))


def normal_term(text: str) -> str:
    """A term as glossaries compare them: NFC, runs of whitespace made one space, none at the ends
    (" dog " and "dog" are one term). seq2seq/translate.py's read_glossary checks a file's lines with it."""
    return " ".join(unicodedata.normalize("NFC", text).split())


class Entry(NamedTuple):
    """What the automaton holds for a source term: what a match of it needs checked, and what it brings."""

    length: int
    target: str
    open_start: bool
    """Its first letter is of a script without spaces: no word edge is needed before it."""
    open_end: bool
    """Likewise its last letter, after it."""


def automaton(entries: Mapping[str, Entry]) -> ahocorasick.Automaton:
    """The Aho-Corasick automaton over the source terms: the one costly step of a glossary, in one place
    (built once per glossary; tests count the calls)."""
    built = ahocorasick.Automaton()
    for source, entry in entries.items():
        built.add_word(source, entry)
    built.make_automaton()
    return built


class Glossary:
    """Source term -> target term, checked, NFC-normalised and compiled once, for matching many texts."""

    def __init__(self, terms: Mapping[str, str]) -> None:
        """A TypeError for a term that is not text; a ValueError for an empty one, or for a source term
        given two different target terms (after normalising: " dog " and "dog" are one)."""
        if not isinstance(terms, Mapping):
            raise TypeError(f"the glossary is a mapping of source term -> target term, not a {type(terms).__name__}")
        checked: dict[str, str] = {}
        for source, target in terms.items():
            if not isinstance(source, str) or not isinstance(target, str):
                raise TypeError(f"the glossary maps text to text, not {type(source).__name__} to "
                                f"{type(target).__name__}")
            source, target = normal_term(source), normal_term(target)
            if not source or not target:
                raise ValueError(f"the glossary has an empty {'source' if not source else 'target'} term")
            if checked.get(source, target) != target:
                raise ValueError(f"the glossary gives {source!r} two target terms ({checked[source]!r} and "
                                 f"{target!r}); keep one")
            checked[source] = target
        # Read-only: the automaton is built from these once, and a change would not reach it
        self.terms: Mapping[str, str] = MappingProxyType(checked)
        # What building it costs grows with, and what a server's --max-glossary-chars bounds
        self.characters = sum(len(source) + len(target) for source, target in self.terms.items())
        # pyahocorasick cannot search an automaton of no keys, and an empty glossary matches nothing anyway
        self._automaton = automaton({source: Entry(len(source), target, unspaced(source[0]), unspaced(source[-1]))
                                     for source, target in self.terms.items()}) if self.terms else None

    def __len__(self) -> int:
        return len(self.terms)

    def __repr__(self) -> str:
        return f"Glossary({len(self)} terms, {self.characters} characters)"

    def terms_in(self, text: str) -> list[str]:
        """The target terms of the source terms `text` holds as whole words, each once, in the order the
        text first has them; of overlapping terms the leftmost, then the longest, is the one matched.

        One pass of the automaton over the text (NFC), then work per match found: time linear in the text
        plus its matches, whatever the glossary's size."""
        if self._automaton is None:
            return []
        text = unicodedata.normalize("NFC", text)
        longest: dict[int, tuple[int, str]] = {}  # start -> (end, target) of the longest whole-word term there
        for last, (length, target, open_start, open_end) in self._automaton.iter(text):
            start, end = last + 1 - length, last + 1
            if ((open_start or start == 0 or not spaced_word_char(text[start - 1]))
                    and (open_end or end == len(text) or not spaced_word_char(text[end]))
                    and longest.get(start, (0, ""))[0] < end):
                longest[start] = (end, target)
        found: dict[str, None] = {}  # an ordered set
        covered = 0  # the end of the last term matched: what starts before it lies inside that term
        for start in sorted(longest):
            if start >= covered:
                covered, target = longest[start]
                found[target] = None
        return list(found)


def as_glossary(glossary: Glossary | Mapping[str, str]) -> Glossary:
    """`glossary` itself if it is a Glossary, else the Glossary of the mapping (checked and compiled now)."""
    return glossary if isinstance(glossary, Glossary) else Glossary(glossary)
