"""SubRip (.srt) subtitles in, subtitles out: every cue's number, timings and position kept, its text
translated as one segment (its lines joined, split into sentences as plain text is) and broken back
into as many lines as it had, at the spaces that make them most even.

A cue with markup (<i>, <b>, <u>, <font color>, which players show) goes through seq2seq/markup.py,
so its tags are carried to the words of the translation ("&" and "<" in its text stay as they are:
subtitles are not HTML). ASS override tags at a cue's start ({\an8}) are kept; a dialogue cue (every
line starts with a dash) has each line translated apart, its dashes kept. Line ends are the file's
(CRLF or LF). Parsing and writing are the `srt` library's (a file it cannot read is a ValueError
naming the line).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

import srt

from seq2seq.markup import Aligned, HtmlDocument, Splitter
from seq2seq.sentences import Paragraphs

TAG = re.compile(r"<\s*/?\s*(?:i|b|u|s|font)\b[^>]*>", re.IGNORECASE)  # what players show: italics, bold, colour
OVERRIDE = re.compile(r"^(?:\{\\[^}]*\}\s*)+")  # ASS override tags at a cue's start ({\an8}: the top): kept
DASH = re.compile(r"^\s*([-\u2010-\u2015]\s*)")  # a dialogue line's speaker dash


@dataclass
class _Cue:
    subtitle: srt.Subtitle
    lines: int  # its lines of text, into which the translation is broken again
    prefix: str  # override tags at its start, kept as they are
    dashes: list[str] | None  # dialogue (every line starts with a dash): each line's dash, each line apart
    parts: list[Paragraphs | HtmlDocument]  # its text (or each dialogue line), as a document

    @property
    def sentences(self) -> list[str]:
        return [sentence for part in self.parts for sentence in part.sentences]


class SrtDocument:
    """A .srt file's cues; `sentences` is what the model reads, `render` puts the translations back."""

    def __init__(self, text: str, *, split: Splitter) -> None:
        try:
            subtitles = list(srt.parse(text))
        except srt.SRTParseError as error:
            unmatched = text[error.expected_start : error.actual_start]  # what lies where a cue should start
            skipped = len(unmatched) - len(unmatched.lstrip())
            line = text.count("\n", 0, error.expected_start + skipped) + 1
            first = unmatched.strip().splitlines()[0][:60] if unmatched.strip() else ""
            raise ValueError(f"line {line} is not an SRT cue (a number, then start --> end, then text): "
                             f"{first!r}") from None
        self.eol = "\r\n" if "\r\n" in text else "\n"
        self.cues = [self._cue(subtitle, split=split) for subtitle in subtitles]
        self.sentences = [sentence for cue in self.cues for sentence in cue.sentences]
        self.needs_alignments = any(part.needs_alignments for cue in self.cues for part in cue.parts)

    @staticmethod
    def _cue(subtitle: srt.Subtitle, *, split: Splitter) -> _Cue:
        content = subtitle.content.replace("\r\n", "\n")
        override = OVERRIDE.match(content)
        prefix = override.group(0) if override else ""
        lines = [line.strip() for line in content[len(prefix):].split("\n") if line.strip()]

        def part(text: str) -> Paragraphs | HtmlDocument:
            return HtmlDocument(text, split=split) if TAG.search(text) else Paragraphs(text, split=split)

        dashes = [match.group(1) if (match := DASH.match(line)) else "" for line in lines]
        if len(lines) > 1 and all(dashes):
            return _Cue(subtitle, len(lines), prefix, dashes,
                        [part(line[len(dash):]) for line, dash in zip(lines, dashes, strict=True)])
        return _Cue(subtitle, max(1, len(lines)), prefix, None, [part(" ".join(lines))])

    def render(self, translations: Sequence[Aligned]) -> str:
        """The file with each cue's text replaced by its translation, in as many lines as it had."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences but {len(translations)} translations")
        at = 0
        subtitles = []
        for cue in self.cues:
            texts = []
            for part in cue.parts:
                own = translations[at : at + len(part.sentences)]
                at += len(part.sentences)
                # Subtitles are not HTML: "&" and "<" stay as they are
                texts.append(part.render(own, escape=False) if isinstance(part, HtmlDocument) else part.render(own))
            content = ("\n".join(dash + " ".join(text.split()) for dash, text in zip(cue.dashes, texts, strict=True))
                       if cue.dashes is not None else wrap(texts[0], lines=cue.lines))
            subtitles.append(srt.Subtitle(cue.subtitle.index, cue.subtitle.start, cue.subtitle.end,
                                          cue.prefix + content, cue.subtitle.proprietary))
        return srt.compose(subtitles, reindex=False, eol=self.eol)


def wrap(text: str, *, lines: int) -> str:
    """`text` in `lines` lines (fewer if it has fewer words), broken at the spaces outside tags nearest an
    even share of the text a viewer sees."""
    text = " ".join(text.split())
    inside = [False] * len(text)
    for match in TAG.finditer(text):
        inside[match.start() : match.end()] = [True] * (match.end() - match.start())
    spaces = [i for i, c in enumerate(text) if c == " " and not inside[i]]
    breaks = min(lines - 1, len(spaces))
    if breaks <= 0:
        return text
    visible = [0]  # characters a viewer sees up to each position (tags take no room)
    for i in range(len(text)):
        visible.append(visible[-1] + (not inside[i]))
    # Break k (of `breaks`) at the space nearest its even share of the visible text, after break k - 1
    # and leaving a space for each break still to come.
    at = [visible[i] for i in spaces]  # increasing
    total, chosen, lowest = visible[-1], [], 0
    for k in range(1, breaks + 1):
        share, highest = total * k / (breaks + 1), len(spaces) - (breaks - k)  # options: lowest .. highest - 1
        n = bisect.bisect_left(at, share, lowest, highest)
        best = min((m for m in (n - 1, n) if lowest <= m < highest), key=lambda m: abs(at[m] - share))
        chosen.append(spaces[best])
        lowest = best + 1
    out, previous = [], 0
    for i in chosen:
        out.append(text[previous:i])
        previous = i + 1
    out.append(text[previous:])
    return "\n".join(out)
