r"""SubRip (.srt) subtitles in, subtitles out: every cue's number, timings and position kept, its text
translated as one segment (its lines joined, split into sentences as plain text is) and broken back
into as many lines as it had, at the spaces that make them most even.

A cue's text is read as players read it (VLC's subsdec, FFmpeg's SubRip decoder): a tag is "<", a name,
anything up to ">"; players apply <i>, <b>, <u>, <s>, <font ...> and hide any other tag that is closed
(<c.yellow>...</c>, <span style=...>...</span>); they hide an override in braces ({\an8}, {\i1}, {y:i}); the
rest is text, "&" and "&lt;" included (SubRip has no entities), and so is a tag never closed that they show
("x<y and y>z"). Tags opened and closed are carried to the words of the translation as HTML's inline elements
are (seq2seq/text/markup.py, by the word alignments); an override, or a tag applied unclosed, stays where it was
among the words, as it is. What the translation says is written so that no player reads markup in it: an
override, or a tag players would apply or hide, gets a word joiner after its first character (U+2060:
invisible, and no tag name or override starts with it). A dialogue cue (every line starts with a dash) has
each line translated apart, its dashes kept. A cue without a number gets the one after the cue before it. Line
ends are the file's (CRLF or LF). Parsing and writing are the `srt` library's; what it cannot read, or text
that is no cue (after a blank line, where a cue ended), is a ValueError naming the line.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

import srt
from bs4 import Comment, NavigableString, Tag
from bs4.element import PageElement

from seq2seq.text.markup import Markup, Splitter
from seq2seq.text.placement import Aligned

# What players read as markup: a tag ("<" name, then all up to the next ">", as VLC reads it) or an override in
# braces ({\an8}, {y:i})
MARKUP = re.compile(r"<\s*(/?)\s*([A-Za-z][A-Za-z0-9_]*)[^>]*>|\{(?:\\[^{}]*|[^{}\\]:[^{}]*)\}")
SHOWN = frozenset({"i", "b", "u", "s", "font", "br"})  # tags players apply even unclosed
# Where a player may start reading markup: "<" then a name (VLC reads a tag up to the next ">", whatever lies
# between), or an override's "{\" or "{x:"
START = re.compile(r"<\s*/?\s*([A-Za-z][A-Za-z0-9_]*)|\{(?=\\|[^{}\\]:)")
WORD_JOINER = "\u2060"
DASH = re.compile(r"^\s*([-\u2010-\u2015]\s*)")  # a dialogue line's speaker dash
TIMING = re.compile(r"-->")


@dataclass
class _Cue:
    subtitle: srt.Subtitle
    index: int  # its number (one more than the cue before where the file gives none)
    lines: int  # its lines of text, into which the translation is broken again
    dashes: list[str] | None  # dialogue (every line starts with a dash): each line's dash, each line apart
    parts: list[tuple[Tag, Markup]]  # its text (or each dialogue line), as a tree and what to translate in it

    @property
    def sentences(self) -> list[str]:
        return [sentence for _, part in self.parts for sentence in part.sentences]


class SrtDocument:
    """A .srt file's cues; `sentences` is what the model reads, `render` puts the translations back."""

    def __init__(self, text: str, *, split: Splitter) -> None:
        _check_blocks(text)
        try:
            subtitles = list(srt.parse(text))
        except srt.SRTParseError as error:
            unmatched = text[error.expected_start : error.actual_start]  # what lies where a cue should start
            skipped = len(unmatched) - len(unmatched.lstrip())
            raise ValueError(_not_a_cue(text, error.expected_start + skipped)) from None
        self.eol = "\r\n" if "\r\n" in text else "\n"
        self.cues: list[_Cue] = []
        for subtitle in subtitles:
            index = subtitle.index if subtitle.index is not None else (self.cues[-1].index + 1 if self.cues else 1)
            self.cues.append(self._cue(subtitle, index, split=split))
        self.sentences = [sentence for cue in self.cues for sentence in cue.sentences]
        self.needs_alignments = any(part.needs_alignments for cue in self.cues for _, part in cue.parts)

    @staticmethod
    def _cue(subtitle: srt.Subtitle, index: int, *, split: Splitter) -> _Cue:
        content = subtitle.content.replace("\r\n", "\n")
        lines = [line.strip() for line in content.split("\n") if line.strip()]

        def part(text: str) -> tuple[Tag, Markup]:
            root = cue_tree(text)
            return root, Markup(root, split=split)

        dashes = [match.group(1) if (match := DASH.match(line)) else "" for line in lines]
        if len(lines) > 1 and all(dashes):
            return _Cue(subtitle, index, len(lines), dashes,
                        [part(line[len(dash):]) for line, dash in zip(lines, dashes, strict=True)])
        return _Cue(subtitle, index, max(1, len(lines)), None, [part(" ".join(lines))])

    def render(self, translations: Sequence[Aligned]) -> str:
        """The file with each cue's text replaced by its translation, in as many lines as it had."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences but {len(translations)} translations")
        at = 0
        subtitles = []
        for cue in self.cues:
            texts = []
            for root, part in cue.parts:
                part.fill(translations[at : at + len(part.sentences)])
                at += len(part.sentences)
                texts.append(write(root.contents))
            content = ("\n".join(dash + " ".join(text.split()) for dash, text in zip(cue.dashes, texts, strict=True))
                       if cue.dashes is not None else wrap(texts[0], lines=cue.lines))
            subtitles.append(srt.Subtitle(cue.index, cue.subtitle.start, cue.subtitle.end, content,
                                          cue.subtitle.proprietary))
        return srt.compose(subtitles, reindex=False, eol=self.eol)


def cue_tree(text: str) -> Tag:
    """A cue's text as a tree Markup reads: each tag opened and closed an inline element (a <span> holding the
    tag's own text), an override or a tag never closed a comment holding it (kept where it is), the rest text."""
    tokens = list(MARKUP.finditer(text))
    closes: dict[int, int] = {}  # open tag token -> its close tag token
    opened: list[int] = []
    for k, token in enumerate(tokens):
        if token.group(2) is None:
            continue
        name = token.group(2).lower()
        if not token.group(1):
            opened.append(k)
        else:
            mine = next((i for i in reversed(range(len(opened))) if tokens[opened[i]].group(2).lower() == name), None)
            if mine is not None:  # the tags it closes over are never closed: they stay as they are
                closes[opened[mine]] = k
                del opened[mine:]
    root = Tag(name="p")
    stack: list[Tag] = [root]
    ends: dict[int, Tag] = {}  # close tag token -> the element it ends
    cursor = 0
    for k, token in enumerate(tokens):
        if token.start() > cursor:
            stack[-1].append(NavigableString(text[cursor : token.start()]))
        cursor = token.end()
        if k in closes:
            element = Tag(name="span", attrs={"data-open": token.group(0), "data-close": tokens[closes[k]].group(0)})
            stack[-1].append(element)
            stack.append(element)
            ends[closes[k]] = element
        elif k in ends:
            while stack.pop() is not ends[k]:
                pass
        elif token.group(2) is None or token.group(2).lower() in SHOWN:  # an override; a tag players apply alone
            stack[-1].append(Comment(token.group(0)))
        else:  # a tag never closed that players show as it is ("x<y and y>z"): text
            stack[-1].append(NavigableString(token.group(0)))
    if cursor < len(text):
        stack[-1].append(NavigableString(text[cursor:]))
    return root


def write(nodes: Sequence[PageElement]) -> str:
    """A cue's tree as SubRip text: its tags and overrides as they were; and where a player could start reading
    markup in its text (START: an override; a tag it applies, or one whose name another tag of the cue has:
    players hide a tag that is closed), even markup that would run on into the cue's own ("<b " then a tag), a
    word joiner after that first character. A lone "<y and y>" stays as it is: a player shows it."""
    pieces: list[tuple[str, bool]] = []  # (text, whether it is the cue's own markup)
    todo: list[PageElement | tuple[str, bool]] = list(reversed(nodes))
    while todo:
        node = todo.pop()
        if isinstance(node, tuple):
            pieces.append(node)
        elif isinstance(node, Tag):
            pieces.append((str(node.attrs["data-open"]), True))
            todo.append((str(node.attrs["data-close"]), True))
            todo += reversed(node.contents)
        else:
            pieces.append((str(node), isinstance(node, Comment)))  # a comment: a close tag or override as it was
    text = "".join(piece for piece, _ in pieces)
    own = [markup for piece, markup in pieces for _ in piece]  # per character
    starts = list(START.finditer(text))
    names = [m.group(1).lower() for m in starts if m.group(1)]

    def markup(m: re.Match[str]) -> bool:  # what a player would make of it: markup, or a tag over the cue's own
        if m.group(1) is None or m.group(1).lower() in SHOWN or names.count(m.group(1).lower()) > 1:
            return True
        end = text.find(">", m.start())
        return any(own[m.start() : end + 1 if end >= 0 else len(text)])

    breaks = {m.start() for m in starts if not own[m.start()] and markup(m)}
    return "".join(char + WORD_JOINER if i in breaks else char for i, char in enumerate(text))


def _check_blocks(text: str) -> None:
    """Every block of lines between blank lines is a cue (a number, then start --> end, or the timing alone): text
    after a blank line is no part of the cue before it, which the srt library would take in (and translate)."""
    block: list[str] = []
    first = 0
    for number, line in enumerate([*text.replace("\r\n", "\n").split("\n"), ""], start=1):
        if line.strip():
            first = first if block else number
            block.append(line)
            continue
        if block and not (TIMING.search(block[0]) or len(block) > 1 and block[0].strip().isdigit()
                          and TIMING.search(block[1])):
            raise ValueError(f"line {first} is not an SRT cue (a number, then start --> end, then text): "
                             f"{block[0].strip()[:60]!r}")
        block = []


def _not_a_cue(text: str, at: int) -> str:
    line = text.count("\n", 0, at) + 1
    first = text[at:].strip().splitlines()[0][:60] if text[at:].strip() else ""
    return f"line {line} is not an SRT cue (a number, then start --> end, then text): {first!r}"


def wrap(text: str, *, lines: int) -> str:
    """`text` in `lines` lines (fewer if it has fewer words), broken at the spaces outside markup nearest an
    even share of the text a viewer sees."""
    text = " ".join(text.split())
    inside = [False] * len(text)
    for match in MARKUP.finditer(text):
        inside[match.start() : match.end()] = [True] * (match.end() - match.start())
    spaces = [i for i, c in enumerate(text) if c == " " and not inside[i]]
    breaks = min(lines - 1, len(spaces))
    if breaks <= 0:
        return text
    visible = [0]  # characters a viewer sees up to each position (markup takes no room)
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
