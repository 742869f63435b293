"""HTML in, HTML out: the text of a page translated, its markup kept.

    document = HtmlDocument(html, split=...)        # parse; document.sentences: what the model reads
    document.render(translations)                    # one Translation per sentence, with word alignments

What is translated: each run of inline content (text and inline elements such as <b>, <a href>, <i>)
between block boundaries (<p>, <li>, <td>, <div>, <br>, <img>, ...) is one segment, split into
sentences as plain text is; and the attributes people read (alt, title, placeholder, aria-label).
What is kept as it was: every element and attribute, comments, <script>, <style>, <code>, <pre> and
the like, and whatever is marked translate="no" or class="notranslate" (the HTML standard's and
Google's conventions).

Inline elements are carried to the words of the translation that the word alignments (SearchConfig
alignments) tie to the words they held: a translation word takes the inline elements of the source
word it is aligned to (the most deeply marked one, if several), a word aligned to nothing those
its two neighbours share. An element whose words the translation spreads apart is written once per
stretch (its `id` on the first only); one that no translation word takes is placed by position (the
fallback, also used for a translation without alignments: source word i of n goes to translation
word i x m / n of m); its text is translated all the same.

The output is well-formed whatever the input: BeautifulSoup (html.parser) builds the tree, closing
what the input left open, and writes it out with text escaped, so no tag or attribute appears that
the input lacked (a translation saying "<script>" is text). Entities are read as the characters they
stand for and written as characters (&lt; &gt; &amp; escaped). LibreTranslate's own HTML support
(translatehtml) is BeautifulSoup as well; what it lacks is the alignment-guided placement.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from bs4 import BeautifulSoup, Comment, NavigableString, ParserRejectedMarkup, Tag
from bs4.element import PageElement
from bs4.formatter import HTMLFormatter

from seq2seq.sentences import rejoin

# Elements that flow inside a sentence: their text joins the text around them into one segment.
INLINE = frozenset({"a", "abbr", "b", "bdi", "bdo", "big", "cite", "data", "del", "dfn", "em", "font", "i", "ins",
                    "label", "mark", "q", "s", "small", "span", "strike", "strong", "sub", "sup", "time", "tt", "u"})
# Elements whose content is never translated (code, scripts, raw text, vector graphics and formulas).
UNTRANSLATED = frozenset({"script", "style", "code", "pre", "kbd", "samp", "var", "template", "textarea", "math",
                          "svg", "noscript", "iframe", "object"})
READABLE_ATTRIBUTES = ("alt", "title", "placeholder", "aria-label")

AS_IS = HTMLFormatter(entity_substitution=None)  # text written as it is: "&", "<" too (for subtitles)
MAX_DEPTH = 256  # elements inside elements: the tree is walked recursively (and a page is not that deep)
Stack = tuple[int, ...]  # the inline elements around a character (indices into HtmlDocument.elements), outermost first


class Aligned(Protocol):
    """What render needs of a sentence's translation (seq2seq.translator.Translation has it)."""

    @property
    def text(self) -> str: ...

    @property
    def alignment(self) -> list[tuple[int, int]] | None: ...


Splitter = Callable[[str], list[tuple[int, int]]]
"""A text's sentence spans (start, end), as seq2seq.sentences cuts them for the model."""


@dataclass
class _Run:
    """A segment: consecutive inline nodes of one parent, their text, and the inline elements around each
    of its characters."""

    nodes: list[PageElement]
    text: str
    marks: list[Stack]
    spans: list[tuple[int, int]]


@dataclass
class _Attribute:
    tag: Tag
    name: str
    text: str
    spans: list[tuple[int, int]]


class HtmlDocument:
    """An HTML text (a page or a fragment) split into the sentences to translate; `render` puts their
    translations back."""

    def __init__(self, html: str, *, split: Splitter) -> None:
        self.html, self.split, self.rendered = html, split, False
        self.runs: list[_Run] = []
        self.attributes: list[_Attribute] = []
        self.elements: list[Tag] = []  # the inline elements of the runs; Tag's == and hash compare contents
        try:
            self.soup = BeautifulSoup(html, "html.parser")
            if _depth(self.soup) > MAX_DEPTH:
                raise ValueError(f"the HTML nests elements more than {MAX_DEPTH} deep; flatten it")
            self._collect(self.soup, split=split)
        except ParserRejectedMarkup:  # bs4's message suggests other parsers, which we do not offer
            raise ValueError("the HTML parser cannot read this markup (a stray \"<![\" or \"<!\" is the usual "
                             "cause); fix or escape it") from None
        self.sentences = [" ".join(part.text[a:b].split()) for part in self._parts() for a, b in part.spans]
        self.needs_alignments = bool(self.elements)  # inline elements to place

    def _parts(self) -> list[_Run | _Attribute]:
        # Attributes first: a run's inline elements are copied when it is rendered, translated attributes and all.
        return [*self.attributes, *self.runs]

    def _collect(self, parent: Tag, *, split: Splitter) -> None:
        pending: list[PageElement] = []
        for child in [*parent.children, None]:
            if child is not None and _inline(child):
                pending.append(child)
                continue
            if pending:
                self._add_run(pending, split=split)
                pending = []
            if isinstance(child, Tag) and _translated(child):
                self._add_attributes(child, split=split)
                self._collect(child, split=split)

    def _add_run(self, nodes: list[PageElement], *, split: Splitter) -> None:
        text, marks = "", []
        for node in nodes:
            for string, stack in self._strings(node, ()):
                text += string
                marks += [stack] * len(string)
            if isinstance(node, Tag):
                for tag in [node, *node.find_all(True)]:
                    self._add_attributes(tag, split=split)
        if text.strip():
            self.runs.append(_Run(nodes, text, marks, split(text)))

    def _add_attributes(self, tag: Tag, *, split: Splitter) -> None:
        for name in READABLE_ATTRIBUTES:
            value = tag.attrs.get(name)
            if isinstance(value, str) and value.strip():
                self.attributes.append(_Attribute(tag, name, value, split(value)))

    def _strings(self, node: PageElement, stack: Stack) -> list[tuple[str, Stack]]:
        """The text in `node`, each string with the inline elements around it."""
        if isinstance(node, NavigableString):
            return [(str(node), stack)]
        assert isinstance(node, Tag)
        self.elements.append(node)
        inner = (*stack, len(self.elements) - 1)
        return [item for child in node.children for item in self._strings(child, inner)]

    def render(self, translations: Sequence[Aligned], *, escape: bool = True) -> str:
        """The document with each sentence replaced by its translation (in the order of `sentences`);
        `escape` False writes text as it is, "&" and "<" too (subtitles, which are not HTML)."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences but {len(translations)} translations")
        if self.rendered:  # rendering fills the tree in: a second rendering (an alternative) starts afresh
            return HtmlDocument(self.html, split=self.split).render(translations, escape=escape)
        self.rendered = True
        at = 0
        for part in self._parts():
            own = translations[at : at + len(part.spans)]
            at += len(part.spans)
            if isinstance(part, _Attribute):
                part.tag[part.name] = rejoin(part.text, part.spans, [t.text for t in own])
            else:
                self._replace(part, own)
        return self.soup.decode(formatter="minimal" if escape else AS_IS)

    def _replace(self, run: _Run, translations: Sequence[Aligned]) -> None:
        pieces: list[tuple[str, Stack]] = []
        cursor = 0
        for (start, end), translation in zip(run.spans, translations, strict=True):
            pieces += _original(run, cursor, start)
            pieces += _placed(run, start, end, translation)
            cursor = end
        pieces += _original(run, cursor, len(run.text))
        anchor = run.nodes[0]
        built = _build(self.soup, self.elements, pieces, depth=0, copies=Counter())
        anchor.insert_before(*built)
        for node in run.nodes:
            node.extract()


def _inline(node: PageElement) -> bool:
    """Text, or an inline element holding only text and inline elements (nothing kept untranslated)."""
    if isinstance(node, Comment) or (isinstance(node, NavigableString) and type(node) is not NavigableString):
        return False  # comments, CDATA, doctypes, processing instructions: kept where they are, as boundaries
    if isinstance(node, NavigableString):
        return True
    # An inline element without text (an anchor, an icon) has no words to follow: it stays where it is.
    return (isinstance(node, Tag) and node.name in INLINE and _translated(node) and bool(node.get_text().strip())
            and all(_inline(child) for child in node.children))


def _depth(root: Tag) -> int:
    """How deep elements nest under `root`, counted without recursion."""
    deepest, todo = 0, [(root, 0)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        todo += [(child, depth + 1) for child in node.children if isinstance(child, Tag)]
    return deepest


def _translated(tag: Tag) -> bool:
    classes: list[str] | str = tag.get("class") or []
    return (tag.name not in UNTRANSLATED and str(tag.get("translate", "")).lower() != "no"
            and "notranslate" not in classes)


def _original(run: _Run, start: int, end: int) -> list[tuple[str, Stack]]:
    """The run's characters start..end (the space between sentences) as they were, with their elements."""
    return [(run.text[i], run.marks[i]) for i in range(start, end)]


@dataclass
class _Word:
    """A source word: the elements around its letters, and the segments at its edges that hold no letter
    and sit in other elements (a footnote link "city<sup>[1]</sup>", brackets "(<a>link</a>)"), which
    keep their own elements beside the translation of the word."""

    stack: Stack
    prefix: list[tuple[str, Stack]]
    suffix: list[tuple[str, Stack]]
    stacks: list[Stack]  # the elements around each of its characters, each chain once

    @property
    def elements(self) -> set[int]:
        return {element for stack in self.stacks for element in stack}


def _word(text: str, marks: list[Stack]) -> _Word:
    segments: list[tuple[str, Stack]] = []
    for char, stack in zip(text, marks, strict=True):
        if segments and segments[-1][1] == stack:
            segments[-1] = (segments[-1][0] + char, stack)
        else:
            segments.append((char, stack))
    letters = [stack for char, stack in zip(text, marks, strict=True) if char.isalpha()]
    stack = Counter(letters or marks).most_common(1)[0][0]  # the first such, on a tie
    first = next(k for k, (string, s) in enumerate(segments) if s == stack)
    last = max(k for k, (string, s) in enumerate(segments) if s == stack)
    prefix = segments[:first] if not any(c.isalpha() for string, _ in segments[:first] for c in string) else []
    suffix = segments[last + 1 :] if not any(c.isalpha() for string, _ in segments[last + 1 :] for c in string) else []
    return _Word(stack, prefix, suffix, list(dict.fromkeys(marks)))


def _placed(run: _Run, start: int, end: int, translation: Aligned) -> list[tuple[str, Stack]]:
    """The translation of the sentence at run.text[start:end] as (word or space, elements) pieces."""
    spans = [(start + m.start(), start + m.end()) for m in re.finditer(r"\S+", run.text[start:end])]
    source = [_word(run.text[a:b], run.marks[a:b]) for a, b in spans]
    target = translation.text.split(" ")
    if not any(word.elements for word in source):  # no markup in this sentence: nothing to place
        return [(translation.text, ())] if translation.text else []
    base = _common([stack for a, b in spans for stack in run.marks[a:b]])  # around every character of it
    origin: list[int | None] = [None] * len(target)  # the source word each translation word takes its elements from
    for i, j in translation.alignment or []:
        if i < len(source) and j < len(target) and (
                origin[j] is None or len(source[i].stack) > len(source[origin[j]].stack)):  # type: ignore[index]
            origin[j] = i
    stacks: list[Stack | None] = [source[i].stack if i is not None else None for i in origin]
    for j, stack in enumerate(stacks):  # a word aligned to nothing: what its aligned neighbours share
        if stack is None:
            before = next((s for s in reversed(stacks[:j]) if s is not None), base)
            after = next((s for s in stacks[j + 1 :] if s is not None), base)
            stacks[j] = _common([before, after])
    placed: list[Stack] = [s if s is not None else base for s in stacks]
    alignment = translation.alignment if translation.alignment is not None else []
    _place_missing(source, placed, alignment)
    # Each source word's edge segments go beside the first and the last translation word taking its
    # elements, or (none does) the word where it would be in a translation as long.
    first = {i: j for j, i in reversed(list(enumerate(origin))) if i is not None}
    last = {i: j for j, i in enumerate(origin) if i is not None}
    leads: dict[int, list[tuple[str, Stack]]] = {}
    tails: dict[int, list[tuple[str, Stack]]] = {}
    for i, held in enumerate(source):
        where = min(len(target) - 1, i * len(target) // len(source))
        leads.setdefault(first.get(i, where), []).extend(held.prefix)
        tails.setdefault(last.get(i, where), []).extend(held.suffix)
    pieces: list[tuple[str, Stack]] = []
    for j, (word, stack) in enumerate(zip(target, placed, strict=True)):
        before = placed[j - 1] if j else base
        after = placed[j + 1] if j + 1 < len(placed) else base
        if j:
            pieces.append((" ", _common([before, stack])))
        lead = _edge(word, leads.get(j, []), stack, at_start=True)
        tail = _edge(word, tails.get(j, []), stack, at_start=False)
        if lead is not None and tail is not None and len(lead[1]) + len(tail[1]) > len(word):
            tail = (tail[0], "") if any(len(s) > len(stack) for _, s in tail[0]) else None  # they would overlap
        if lead is not None:
            word = word[len(lead[1]):]
        if tail is not None:
            word = word[: len(word) - len(tail[1])]
        # Punctuation at a word's edges stays inside an element only if the word beside it is inside too:
        # "<i>soccer</i>." gives "<i>Fußball</i>.", not "<i>Fußball.</i>".
        opening, core, closing = re.fullmatch(r"([^\w]*)(.*?)([^\w]*)", word, flags=re.DOTALL).groups()  # type: ignore[union-attr]
        if not core:
            opening, core, closing = "", word, ""
        pieces += [*(lead[0] if lead else []), (opening, _common([before, stack])), (core, stack),
                   (closing, _common([stack, after])), *(tail[0] if tail else [])]
    return [(text, stack) for text, stack in pieces if text]


def _edge(word: str, segments: list[tuple[str, Stack]], stack: Stack, *,
          at_start: bool) -> tuple[list[tuple[str, Stack]], str] | None:
    """A source word's edge segments for its translation `word`: (the pieces to write, the part of
    `word` they replace). Where the translation has the same characters there ("[1]", ")"), they take
    the segments' elements; where it lacks them, segments inside an element the word is not in (a
    footnote link) are written as they were, and the rest (plain punctuation) is left to the word."""
    text = "".join(string for string, _ in segments)
    if not text:
        return None
    if word.startswith(text) if at_start else word.endswith(text):
        return segments, text
    if any(len(s) > len(stack) for _, s in segments):
        return segments, ""
    return None


def _place_missing(source: list[_Word], placed: list[Stack], alignment: list[tuple[int, int]]) -> None:
    """An element of the source that no translation word took (it held part of a word, or the words it
    held were aligned elsewhere) goes on a translation word aligned to the first word it held, or where
    that word would be in a translation as long, if that word is not inside other elements there."""
    kept = {element for stack in placed for element in stack}
    kept |= {element for word in source for segments in (word.prefix, word.suffix) for _, s in segments for element in s}
    for i, word in enumerate(source):
        for element in sorted(word.elements - kept):
            # the element's own chain: the stack of a character of this word that holds it
            chain = next(s for s in word.stacks if element in s)
            chain = chain[: chain.index(element) + 1]
            aligned = [j for a, j in alignment if a == i and j < len(placed)]
            for j in [*aligned, min(len(placed) - 1, i * len(placed) // len(source))]:
                if chain[: len(placed[j])] == placed[j]:  # the word sits in the element's parents, or outside
                    placed[j] = chain
                    kept.update(chain)
                    break


def _common(stacks: Sequence[Stack]) -> Stack:
    """The elements every stack starts with, outermost first."""
    out: list[int] = []
    for elements in zip(*stacks, strict=False):
        if any(element != elements[0] for element in elements):
            break
        out.append(elements[0])
    return tuple(out)


def _build(soup: BeautifulSoup, elements: list[Tag], pieces: list[tuple[str, Stack]], *, depth: int,
           copies: Counter[int]) -> list[PageElement]:
    """Nodes for the pieces: a run of pieces inside the same element (at `depth`) becomes a copy of it."""
    out: list[PageElement] = []
    text = ""
    i = 0
    while i < len(pieces):
        string, stack = pieces[i]
        if len(stack) <= depth:
            text += string
            i += 1
            continue
        if text:
            out.append(NavigableString(text))
            text = ""
        index = stack[depth]
        element = elements[index]
        j = i
        while j < len(pieces) and len(pieces[j][1]) > depth and pieces[j][1][depth] == index:
            j += 1
        attrs = {name: list(value) if isinstance(value, list) else value for name, value in element.attrs.items()
                 if not (copies[index] and name in ("id", "name"))}  # the same id twice would not be one
        copies[index] += 1
        copy = soup.new_tag(element.name, attrs=attrs)  # type: ignore[arg-type]  # bs4 keeps class as a list
        for node in _build(soup, elements, pieces[i:j], depth=depth + 1, copies=copies):
            copy.append(node)
        out.append(copy)
        i = j
    if text:
        out.append(NavigableString(text))
    return out
