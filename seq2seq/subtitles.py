"""SubRip (.srt) subtitles in, subtitles out: every cue's number, timings and position kept, its text
translated as one segment (its lines joined, split into sentences as plain text is) and broken back
into as many lines as it had, at the spaces that make them most even.

A cue with markup (<i>, <b>, <font color>, which players show) goes through seq2seq/markup.py, so
its tags are carried to the words of the translation. Parsing and writing are the `srt` library's
(a file it cannot read is a ValueError naming the line).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import srt

from seq2seq.markup import Aligned, HtmlDocument, Splitter
from seq2seq.sentences import rejoin

TAG = re.compile(r"<\s*/?\s*[a-zA-Z][^>]*>")


@dataclass
class _Cue:
    subtitle: srt.Subtitle
    lines: int
    text: str  # the cue's lines joined by spaces
    spans: list[tuple[int, int]]  # plain cues: the text's sentences
    markup: HtmlDocument | None  # cues with tags


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
        self.cues = []
        for subtitle in subtitles:
            lines = subtitle.content.split("\n")
            joined = " ".join(line.strip() for line in lines if line.strip())
            markup = HtmlDocument(joined, split=split) if TAG.search(joined) else None
            self.cues.append(_Cue(subtitle, max(1, len([x for x in lines if x.strip()])), joined,
                                  [] if markup else split(joined), markup))
        self.sentences = [sentence for cue in self.cues for sentence in self._sentences(cue)]
        self.needs_alignments = any(cue.markup is not None and cue.markup.needs_alignments for cue in self.cues)

    @staticmethod
    def _sentences(cue: _Cue) -> list[str]:
        if cue.markup is not None:
            return cue.markup.sentences
        return [" ".join(cue.text[a:b].split()) for a, b in cue.spans]

    def render(self, translations: Sequence[Aligned]) -> str:
        """The file with each cue's text replaced by its translation, in as many lines as it had."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences but {len(translations)} translations")
        at = 0
        subtitles = []
        for cue in self.cues:
            count = len(self._sentences(cue))
            own = translations[at : at + count]
            at += count
            text = (cue.markup.render(own) if cue.markup is not None
                    else rejoin(cue.text, cue.spans, [t.text for t in own]))
            subtitles.append(srt.Subtitle(cue.subtitle.index, cue.subtitle.start, cue.subtitle.end,
                                          wrap(text, lines=cue.lines), cue.subtitle.proprietary))
        return srt.compose(subtitles, reindex=False)


def wrap(text: str, *, lines: int) -> str:
    """`text` in `lines` lines (fewer if it has fewer words), broken at spaces outside tags so that the
    longest line is as short as it can be."""
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
    # The break after each of `breaks` lines at the space nearest its even share of the visible text.
    total, chosen, start = visible[-1], [], 0
    for k in range(1, breaks + 1):
        options = [i for i in spaces if i > start and len(spaces) - spaces.index(i) >= breaks - k + 1]
        if not options:
            break
        best = min(options, key=lambda i: abs(visible[i] - total * k / (breaks + 1)))
        chosen.append(best)
        start = best
    out, previous = [], 0
    for i in chosen:
        out.append(text[previous:i])
        previous = i + 1
    out.append(text[previous:])
    return "\n".join(out)
