"""HTML read back as a browser reads it (JustHTML's tree, never ours): what an output adds that its input did not
have, and what in it would run. The markup, subtitle and server tests check our output with these."""

import re
from collections import Counter
from typing import Any

from justhtml import Comment as JustComment
from justhtml import Element, JustHTML, Template, Text

from seq2seq.text.markup import DOCUMENT, READABLE_ATTRIBUTES, HtmlDocument


def normal(html: str) -> str:
    """html as it is written back untranslated (quotes, entities, closed tags): the form the output comes in."""
    return HtmlDocument(html, split=lambda text: []).render([])


RAW = {"script", "style", "xmp", "iframe", "noembed", "noframes", "plaintext", "noscript", "textarea"}


def browser(html: str) -> Counter:
    """What a browser builds of `html` (JustHTML's own tree, scripting on: not the tree markup.py rebuilds, nor
    its writing): every element with its name and attributes (a readable one's value aside: it is translated),
    the text of raw-text elements, and every comment. (Not the namespace: a parse that puts an element under a
    MathML one may make it MathML's when read again, as the serialisation standard warns; what is an element
    and what is text stays.)"""
    seen: Counter = Counter()
    todo = [JustHTML(html, fragment=not DOCUMENT.search(html), sanitize=False, scripting_enabled=True).root]
    while todo:
        node = todo.pop()
        if isinstance(node, JustComment):
            seen["<!--", node.data] += 1
        elif isinstance(node, Element):
            attributes = tuple(sorted((k, "(translated)" if k in READABLE_ATTRIBUTES else v) for k, v in node.attrs.items()))
            raw = "".join(c.data or "" for c in node.children if isinstance(c, Text)) if node.name in RAW else None
            seen[node.name, attributes, raw] += 1
            if isinstance(node, Template) and node.template_content is not None:
                todo.append(node.template_content)
        todo += [child for child in getattr(node, "children", None) or [] if not isinstance(child, Text)]
    return seen


def tree(html: str) -> Any:
    return JustHTML(html, fragment=not DOCUMENT.search(html), sanitize=False).root


def elements(html: str, name: str) -> list[Any]:
    """The elements named `name`, in document order."""
    out, todo = [], [tree(html)]
    while todo:
        node = todo.pop()
        if isinstance(node, Element) and node.name == name:
            out.append(node)
        todo += reversed([c for c in getattr(node, "children", None) or [] if not isinstance(c, Text)])
    return out


def text(node: Any) -> str:
    return node.data or "" if isinstance(node, Text) else "".join(text(c) for c in getattr(node, "children", None) or [])


def within(html: str, word: str) -> list[str]:
    """The names of the elements around `word` (up to its <p>), innermost first."""
    todo = [(tree(html), [])]
    while todo:
        node, chain = todo.pop()
        if isinstance(node, Text) and re.search(rf"\b{word}\b", node.data or ""):
            return chain[::-1][: chain[::-1].index("p")]
        todo += [(c, [*chain, node.name]) for c in getattr(node, "children", None) or []]
    raise AssertionError(f"{word} is not in {html}")


def live(html: str) -> set[str]:
    """The elements a browser would run or load from, with the attributes that would: scripts, handlers, frames."""
    out = set()
    for (local, *rest), _ in browser(html).items():
        if local == "<!--":
            continue
        attributes = dict(rest[0])
        if local in ("script", "iframe", "object", "embed", "img", "svg") or any(k.startswith("on") for k in attributes):
            out.add(f"{local} {sorted(attributes)}")
    return out


def added(out: str, html: str) -> Counter:
    """What a browser reads in `out` that it does not read in `html`: elements, attributes, comments, raw text."""
    return browser(out) - browser(html)
