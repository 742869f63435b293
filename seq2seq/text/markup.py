"""HTML in, HTML out: the text of a page translated, its markup kept, read and written as a browser reads it.

    document = HtmlDocument(html, split=...)        # parse; document.sentences: what the model reads
    document.render(translations)                    # one Translation per sentence, with word alignments

Parsing is the WHATWG algorithm browsers run, scripting on as in a browser with JavaScript (JustHTML, `parse`),
so that what we take for a comment, a script or an attribute is what a browser takes for one: Python's
html.parser ends a comment at "-- >", where a browser does not, and a page that is one inert comment to a
browser came out with a live <script>. Writing is the standard's serialisation (`serialize`): text and
attribute values escaped (&, <, >, and " in attributes), the content of raw-text elements (<script>, <style>,
...) as it is only where every element above them is HTML's, so a translation saying "<script>" is text and
the output holds no element or attribute the input lacked, as a browser reads either. A fragment (no <html>,
<head>, <body> or doctype) is parsed as a fragment and written back as one. Line ends are the input's (CRLF
or LF).

What is translated: each run of inline content (text and inline elements such as <b>, <a href>, <i>)
between the places a browser breaks text (block elements, <br>) is one segment, split into sentences as
plain text is (a line break inside it is a space, as a browser shows it); and the attributes people read
(alt, title, placeholder, aria-label). Inside a segment, what the model does not read stays in its sentence
as an anchor (seq2seq/text/placement.py): comments, images, scripts, inline elements without text, footnote
markers (an element of digits or marks such as "[1]" or "*" right after a word); and what is kept as it was
but read, to give the sentence its words (<code>, <kbd>, an inline element marked translate="no" or
class="notranslate"), is written back whole. Block elements so marked, <pre>, <script>, <style> and the
like are kept as they are.

Every inline element of the source is written exactly once (placement.py: each gets one stretch of the
translation's words, by the word alignments, SearchConfig alignments).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bs4 import BeautifulSoup, Comment, Doctype, NavigableString, ProcessingInstruction, Tag
from bs4.element import PageElement
from justhtml import Comment as JustComment
from justhtml import Element, Template, Text
from justhtml import ProcessingInstruction as JustInstruction
from justhtml.parser.engine import ParseEngine, compile_raw_engine_plan

from seq2seq.text.placement import (
    EMPTY,
    Aligned,
    Piece,
    Run,
    Stack,
    anchors_by_sentence,
    original,
    place,
    whole_verbatims,
)
from seq2seq.text.sentences import rejoin

# Elements that flow inside a sentence: their text joins the text around them into one segment.
INLINE = frozenset({"a", "abbr", "b", "bdi", "bdo", "big", "cite", "data", "del", "dfn", "em", "font", "i", "ins",
                    "label", "mark", "nobr", "q", "s", "small", "span", "strike", "strong", "sub", "sup", "time",
                    "tt", "u"})
# Inline elements whose text is kept as it is (read by the model, written back whole).
VERBATIM = frozenset({"code", "kbd", "samp", "var"})
# Inline content without words of its own: kept where it is in its sentence, never read by the model.
HIDDEN = frozenset({"img", "wbr", "input", "svg", "math", "canvas", "picture", "audio", "video", "object", "embed",
                    "iframe", "textarea", "script", "style", "template", "noscript"})
# Elements whose content is never translated (code, scripts, raw text, vector graphics and formulas).
KEPT = VERBATIM | HIDDEN | {"pre", "xmp", "plaintext", "noembed", "noframes"}
READABLE_ATTRIBUTES = ("alt", "title", "placeholder", "aria-label")
MARKER = re.compile(r"[\d*†‡§¶#]")  # what a footnote or reference marker holds (and no letter)

# The standard's serialisation: raw-text elements (of the HTML namespace; noscript with scripting on) and void ones
HTML_NAMESPACE = "http://www.w3.org/1999/xhtml"
RAW_TEXT = frozenset({"style", "script", "xmp", "iframe", "noembed", "noframes", "plaintext", "noscript"})
VOID = frozenset({"area", "base", "basefont", "bgsound", "br", "col", "embed", "frame", "hr", "img", "input",
                  "keygen", "link", "meta", "param", "source", "track", "wbr"})
DOCUMENT = re.compile(r"<!doctype|<(?:html|head|body)[\s/>]", re.IGNORECASE)  # a page, not a fragment
MAX_DEPTH = 256  # elements inside elements: the tree is walked recursively (and a page is not that deep)

Splitter = Callable[[str], list[tuple[int, int]]]
"""A text's sentence spans (start, end), as seq2seq.text.sentences cuts them for the model."""


@dataclass
class _Segment:
    """A run of inline nodes of one parent, as the placement reads it, and its sentence spans."""

    nodes: list[PageElement]
    run: Run
    spans: list[tuple[int, int]]
    elements: list[int]  # its inline elements (indices into Markup.elements)


@dataclass
class _Attribute:
    tag: Tag
    name: str
    text: str
    spans: list[tuple[int, int]]


class Markup:
    """The text to translate in a tree (a parsed page, or a subtitle cue built as one): `sentences`, and `fill`,
    which puts their translations into the tree in their place."""

    def __init__(self, root: Tag, *, split: Splitter) -> None:
        if _depth(root) > MAX_DEPTH:
            raise ValueError(f"the markup nests elements more than {MAX_DEPTH} deep; flatten it")
        self.split = split
        self.segments: list[_Segment] = []
        self.attributes: list[_Attribute] = []
        self.elements: list[Tag] = []  # the inline elements of the segments; Tag's == and hash compare contents
        self._shapes: dict[int, tuple[bool, bool]] = {}
        self._collect(root)
        self.sentences = [" ".join(part.run.text[a:b].split()) if isinstance(part, _Segment) else
                          " ".join(part.text[a:b].split()) for part in self._parts() for a, b in part.spans]
        self.needs_alignments = any(segment.elements or segment.run.anchors or segment.run.verbatims
                                    for segment in self.segments)  # markup to place

    def _parts(self) -> list[_Segment | _Attribute]:
        # Attributes first: the order `sentences` lists them in
        return [*self.attributes, *self.segments]

    # -- reading the tree ----------------------------------------------------------------------------

    def _collect(self, parent: Tag) -> None:
        pending: list[PageElement] = []
        for child in [*parent.children, None]:
            if child is not None and not self._boundary(child):
                pending.append(child)
                continue
            if pending:
                self._add_segment(pending)
                pending = []
            if isinstance(child, Tag) and _translated(child):
                self._add_attributes(child)
                if child.name not in KEPT:
                    self._collect(child)

    def _boundary(self, node: PageElement) -> bool:
        """Whether a browser breaks the text at `node` (a block element, <br>), or flows it through."""
        if not isinstance(node, Tag):
            return False
        if node.name in HIDDEN:
            return False
        return node.name not in INLINE | VERBATIM or not self._shape(node)[0]

    def _shape(self, tag: Tag) -> tuple[bool, bool]:
        """(whether `tag` holds only inline content, whether it holds text the model reads), once per tag."""
        key = id(tag)
        if key not in self._shapes:
            inline, text = True, False
            for child in tag.children:
                if isinstance(child, Tag):
                    if child.name in HIDDEN:
                        continue
                    child_inline, child_text = self._shape(child) if child.name in INLINE | VERBATIM else (False, False)
                    inline, text = inline and child_inline, text or child_text
                elif type(child) is NavigableString:
                    text = text or bool(child.strip())
            self._shapes[key] = (inline, text)
        return self._shapes[key]

    def _add_segment(self, nodes: list[PageElement]) -> None:
        run = Run()
        first = len(self.elements)
        for node in nodes:
            self._flatten(node, (), run)
        run.close()
        if run.text.strip():
            spans = whole_verbatims(run, self.split(re.sub(r"\s", " ", run.text)))  # a newline is a space here
            # A sentence of verbatim words alone is no sentence: it is written as it is
            spans = [(a, b) for a, b in spans if any(v < 0 for c, v in zip(run.text[a:b], run.verbatim[a:b], strict=True)
                                                     if not c.isspace())]
            self.segments.append(_Segment(nodes, run, spans, list(range(first, len(self.elements)))))

    def _flatten(self, node: PageElement, stack: Stack, run: Run) -> None:
        """`node` into the run: its text with the elements around it, the rest as anchors and verbatim nodes."""
        if type(node) is NavigableString:
            run.add(str(node), stack)
            return
        if not isinstance(node, Tag):  # a comment, a processing instruction: the model reads nothing of it
            run.anchor(node, stack)
            return
        if _translated(node):
            self._add_attributes(node)
        if node.name == "a" or node.find("a") is not None:
            run.linked.add(id(node))  # (an element's own id: placement moves it out of another link)
        if node.name in HIDDEN or not self._shape(node)[1]:
            run.anchor(node, stack)
        elif node.name in VERBATIM or not _translated(node):
            run.verbatims.append(node)
            run.add(node.get_text(), stack, verbatim=len(run.verbatims) - 1)
        elif run.ends_in_text() and _marker(node.get_text()):  # after a word: "city[1]"
            for tag in node.find_all(True):
                if _translated(tag):
                    self._add_attributes(tag)
            run.anchor(node, stack)
        else:
            self.elements.append(node)
            index = len(self.elements) - 1
            run.parents[index] = stack[-1] if stack else None
            if node.name == "a":
                run.links.add(index)
            for child in node.children:
                self._flatten(child, (*stack, index), run)

    def _add_attributes(self, tag: Tag) -> None:
        for name in READABLE_ATTRIBUTES:
            value = tag.attrs.get(name)
            if isinstance(value, str) and value.strip():
                self.attributes.append(_Attribute(tag, name, value, self.split(value)))

    # -- writing the translations in -----------------------------------------------------------------

    def fill(self, translations: Sequence[Aligned]) -> None:
        """Each sentence replaced by its translation (in the order of `sentences`), in the tree itself."""
        if len(translations) != len(self.sentences):
            raise ValueError(f"{len(self.sentences)} sentences but {len(translations)} translations")
        at = 0
        for part in self._parts():
            own = translations[at : at + len(part.spans)]
            at += len(part.spans)
            if isinstance(part, _Attribute):
                part.tag[part.name] = rejoin(part.text, part.spans, [t.text for t in own])
            else:
                self._replace(part, own)

    def _replace(self, segment: _Segment, translations: Sequence[Aligned]) -> None:
        run = segment.run
        inside, between = anchors_by_sentence(run, segment.spans)
        pieces: list[Piece] = []
        cursor = 0
        for (start, end), translation, anchors in zip(segment.spans, translations, inside, strict=True):
            pieces += original(run, cursor, start, between)
            pieces += place(run, start, end, anchors, translation)
            cursor = end
        pieces += original(run, cursor, len(run.text), between)
        parent = segment.nodes[0].parent
        assert parent is not None
        where = parent.index(segment.nodes[0])
        for node in segment.nodes:
            node.extract()
        for index in segment.elements:  # refilled below: each element holds what the pieces put in it
            self.elements[index].clear()
        for k, node in enumerate(self._build(pieces, depth=0, used=set())):
            parent.insert(where + k, node)

    def _build(self, pieces: list[Piece], *, depth: int, used: set[int]) -> list[PageElement]:
        """Nodes for the pieces: a stretch of pieces inside the same element (at `depth`) goes into that element."""
        out: list[PageElement] = []
        text = ""
        i = 0
        while i < len(pieces):
            content, stack = pieces[i]
            if len(stack) <= depth:
                if type(content) is str:  # (a comment is a str too: a node)
                    text += content
                elif content is not EMPTY:
                    if text:
                        out.append(NavigableString(text))
                        text = ""
                    out.append(content)  # type: ignore[arg-type]  # a node kept as it was
                i += 1
                continue
            if text:
                out.append(NavigableString(text))
                text = ""
            index = stack[depth]
            j = i
            while j < len(pieces) and len(pieces[j][1]) > depth and pieces[j][1][depth] == index:
                j += 1
            element = self.elements[index]
            if index in used:  # never by placement.py's construction; were it so, a copy keeps the words
                element = Tag(name=element.name, attrs={k: v for k, v in element.attrs.items() if k not in ("id", "name")})
            used.add(index)
            for node in self._build(pieces[i:j], depth=depth + 1, used=used):
                element.append(node)
            out.append(element)
            i = j
        if text:
            out.append(NavigableString(text))
        return out


class HtmlDocument:
    """An HTML text (a page or a fragment) split into the sentences to translate; `render` puts their
    translations back."""

    def __init__(self, html: str, *, split: Splitter) -> None:
        self.html, self.split, self.rendered = html, split, False
        self.soup, self.fragment = parse(html)
        self.markup = Markup(self.soup, split=split)
        self.sentences = self.markup.sentences
        self.needs_alignments = self.markup.needs_alignments

    def render(self, translations: Sequence[Aligned]) -> str:
        """The document with each sentence replaced by its translation (in the order of `sentences`)."""
        if self.rendered:  # rendering fills the tree in: a second rendering (an alternative) starts afresh
            return HtmlDocument(self.html, split=self.split).render(translations)
        self.rendered = True
        self.markup.fill(translations)
        out = serialize(self.soup.contents)
        crlf = self.html.count("\r\n")
        return out.replace("\n", "\r\n") if crlf and crlf >= self.html.count("\n") - crlf else out


# -- parsing and writing as a browser does ---------------------------------------------------------------


NAMESPACES = {"svg": "http://www.w3.org/2000/svg", "math": "http://www.w3.org/1998/Math/MathML"}


class _Copies(Exception):
    pass


class _BoundedEngine(ParseEngine):
    """JustHTML's parser, counting the elements it copies when it reconstructs the active formatting elements:
    formatting tags left open (<b a=1>x<p>y<b a=2>x<p>y...) are copied into every block after them, which makes
    elements by the hundred thousand of a few kilobytes, in time that grows with the square of the page (a
    browser does the same). Past `budget` copies the parse stops."""

    def __init__(self, html: str, *, budget: int, fragment: bool) -> None:
        super().__init__(html, fragment=fragment, fragment_context=None, scripting_enabled=True,
                         plan=compile_raw_engine_plan(fragment, True), collect_errors=False, max_errors=0,
                         iframe_srcdoc=False, track_node_locations=False, track_tag_spans=False,
                         emit_bogus_markup_as_text=False, xml_coercion=False)
        self.budget = budget

    def _reconstruct_active_formatting(self) -> None:
        depth = len(self._stack)
        super()._reconstruct_active_formatting()
        self.budget -= len(self._stack) - depth  # each copy is pushed onto the stack of open elements
        if self.budget < 0:
            raise _Copies


def parse(html: str) -> tuple[BeautifulSoup, bool]:
    """The tree a browser builds of `html` (scripting on), and whether `html` is a fragment (parsed in a body).

    JustHTML parses: pure Python, tested against the html5lib-tests of the current standard (html5lib, the older
    reference, predates changes browsers made since 2020: it keeps an HTML <p> from "</p>" inside <svg>, where a
    browser leaves the SVG first, so that a <style> after it is markup to html5lib and text to a browser). Its
    tree is rebuilt as BeautifulSoup's, which markup.py edits; more copies of open formatting tags than half the
    page's characters (_BoundedEngine) is refused."""
    fragment = not DOCUMENT.search(html)
    engine = _BoundedEngine(html.removeprefix("\ufeff"), budget=len(html) // 2 + 1000, fragment=fragment)
    try:
        root = engine.parse()
    except _Copies:
        raise ValueError("the HTML leaves formatting tags (such as <b>) open, which a browser copies into every "
                         "block after them: hundreds of thousands of elements; close them") from None
    soup = BeautifulSoup("", "html.parser")
    todo: list[tuple[Any, Tag]] = [(child, soup) for child in reversed(root.children or [])]
    while todo:  # without recursion: any depth (Markup refuses what is too deep to walk)
        node, parent = todo.pop()
        if isinstance(node, Text):
            parent.append(NavigableString(str(node.data or "")))
        elif isinstance(node, JustComment):
            parent.append(Comment(str(node.data or "")))
        elif isinstance(node, JustInstruction):
            parent.append(ProcessingInstruction(str(node.data or "")))
        elif isinstance(node, Element):
            tag = Tag(name=node.name, attrs={name: value or "" for name, value in node.attrs.items()},
                      namespace=NAMESPACES.get(node.namespace or "html", HTML_NAMESPACE))
            parent.append(tag)
            content = node.template_content if isinstance(node, Template) and node.template_content else node
            todo += [(child, tag) for child in reversed(content.children or [])]
        elif node.name == "!doctype":
            kind = node.data
            parent.append(Doctype.for_name_and_ids(kind.name or "", kind.public_id, kind.system_id))
    return soup, fragment


def serialize(nodes: Sequence[PageElement]) -> str:
    """The nodes as HTML, by the standard's serialisation algorithm (iterative: any depth)."""
    out: list[str] = []
    todo: list[PageElement | str] = list(reversed(nodes))
    while todo:
        node = todo.pop()
        if isinstance(node, str) and not isinstance(node, NavigableString):
            out.append(node)  # an end tag
        elif isinstance(node, Tag):
            html = node.namespace in (None, HTML_NAMESPACE)
            attributes = "".join(f' {name}="{_escape(str(value), attribute=True)}"' for name, value in node.attrs.items())
            out.append(f"<{node.name}{attributes}>")
            if html and node.name == "plaintext":  # the rest of the page is its text: no end tag can follow
                out += [str(child) if type(child) is NavigableString else "" for child in node.contents]
                break
            if html and node.name in VOID:
                continue
            todo.append(f"</{node.name}>")
            todo += reversed(node.contents)
        elif isinstance(node, Comment):
            out.append(f"<!--{node}-->")
        elif isinstance(node, Doctype):
            out.append(f"<!DOCTYPE {node}>")
        elif isinstance(node, ProcessingInstruction):
            out.append(f"<?{node}?>")
        else:
            out.append(str(node) if _raw_text(node) else _escape(str(node)))
    return "".join(out)


def _raw_text(node: PageElement) -> bool:
    """Whether text is written as it is: in a raw-text element (<script>, <style>, ...) that a browser reading the
    output surely parses as one, with no element of another namespace (SVG, MathML) above it. Elsewhere it is
    escaped: an HTML <style> that the parse put under a MathML element would be read back as MathML's, whose
    text is markup (the "namespace confusion" of mutation XSS)."""
    parent = node.parent
    if parent is None or parent.name not in RAW_TEXT:
        return False
    return all(element.namespace in (None, HTML_NAMESPACE) for element in [parent, *parent.parents]
               if isinstance(element, Tag) and not isinstance(element, BeautifulSoup))


def _escape(text: str, *, attribute: bool = False) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace('"', "&quot;") if attribute else text


def _marker(text: str) -> bool:
    """Whether an element's text is a footnote or reference marker: no letter, and a digit or a mark."""
    return not any(c.isalpha() for c in text) and MARKER.search(text) is not None


def _depth(root: Tag) -> int:
    """How deep elements nest under `root`, counted without recursion."""
    deepest, todo = 0, [(root, 0)]
    while todo:
        node, depth = todo.pop()
        deepest = max(deepest, depth)
        todo += [(child, depth + 1) for child in node.children if isinstance(child, Tag)]
    return deepest


def _translated(tag: Tag) -> bool:
    """Whether the tag's words are for translating: not marked translate="no" or class="notranslate"."""
    return str(tag.get("translate", "")).lower() != "no" and "notranslate" not in str(tag.get("class", "")).split()
