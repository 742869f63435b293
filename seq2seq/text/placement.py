"""Where the inline markup of a source sentence goes in its translation: the arithmetic of seq2seq/text/markup.py,
apart from any tree (markup.py turns HTML, and seq2seq/text/subtitles.py a cue, into a `Run`, and builds the pieces
this module returns into nodes again).

A run is the text of consecutive inline content with, for each of its characters, the chain of inline
elements around it (`Stack`: element numbers, outermost first); the nodes the model does not read (a
comment, an image, a script, a footnote marker) are `Anchor`s between its characters; an element whose
content is kept as it is (`<code>`, `translate="no"`) holds its characters as `verbatim` ones, which the
model reads but which are written back as the element itself.

Every element, anchor and verbatim node of the source is written exactly once:

- Each translation word takes the chain of the source word it is aligned to (the most deeply marked one if
  several), a word aligned to nothing what its neighbours share. Then, from the outermost element in, each
  element gets one stretch of consecutive words of its parent's stretch: its aligned words and those between
  them, less what a sibling took first (an element that continues past the sentence reaches its edge); one
  whose words were all taken takes a free word where its first word would go, and one with no word left at
  all is written there empty. So no element is split in two, and none is lost.
- A verbatim element is written in place of the first translation word aligned to its words; the others
  aligned to them are dropped (the element holds them already). Unaligned, it is an anchor where it was.
- An anchor goes beside the translation of the word it touches (a footnote marker after "book" goes after
  "Buch", before the full stop if it was before one), or of the word before it, with the spaces it had.
- A source word's letterless edge inside elements of its own ("city<sup>[1]</sup>" is an anchor; but
  `<span>"</span>Hi`) goes to the same edge of its translation, once.
- A translation without alignments places by position: source word i of n goes to translation word i x m / n.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

Stack = tuple[int, ...]


class Aligned(Protocol):
    """What the placement needs of a sentence's translation (seq2seq.inference.documents.Translation has it)."""

    @property
    def text(self) -> str: ...

    @property
    def alignment(self) -> list[tuple[int, int]] | None: ...


class Empty:
    """A piece that holds no text: an element written empty, because the translation has no word left for it."""


EMPTY = Empty()
Piece = tuple[object, Stack]  # (text: a str exactly, a node to write as it is, or EMPTY; the elements around it)


@dataclass(frozen=True)
class Anchor:
    """A node the model does not read, between the run's characters `at - 1` and `at`; `glued_left` and
    `glued_right`: no space between it and the text on that side. `stack`: the elements around it in the source."""

    at: int
    node: object
    stack: Stack
    glued_left: bool
    glued_right: bool


@dataclass
class Run:
    """Consecutive inline content as the placement reads it (markup.py builds it). `verbatim[i]`: the verbatim
    node (an index into `verbatims`) holding character i, -1 for none. `parents[e]`: element e's parent
    element in the run (None at the top)."""

    text: str = ""  # (made by close(); `add` keeps the pieces: a string grown piece by piece is quadratic)
    pieces: list[str] = field(default_factory=list)
    marks: list[Stack] = field(default_factory=list)
    verbatim: list[int] = field(default_factory=list)
    anchors: list[Anchor] = field(default_factory=list)
    verbatims: list[object] = field(default_factory=list)
    parents: dict[int, int | None] = field(default_factory=dict)
    links: set[int] = field(default_factory=set)  # the <a> elements: a browser ends one at another inside it
    linked: set[int] = field(default_factory=set)  # id() of the nodes (anchors, verbatim ones) that hold an <a>
    first: dict[int, int] = field(default_factory=dict)  # element -> its first character
    last: dict[int, int] = field(default_factory=dict)  # element -> its last character

    def add(self, text: str, stack: Stack, *, verbatim: int = -1) -> None:
        if not text:
            return
        at = len(self.marks)
        for element in stack:
            self.first.setdefault(element, at)
            self.last[element] = at + len(text) - 1
        self.pieces.append(text)
        self.marks += [stack] * len(text)
        self.verbatim += [verbatim] * len(text)

    def ends_in_text(self) -> bool:
        """Whether the characters so far end in one that is not a space (what follows is glued to it)."""
        return bool(self.pieces) and not self.pieces[-1][-1].isspace()

    def anchor(self, node: object, stack: Stack) -> None:
        self.anchors.append(Anchor(len(self.marks), node, stack, False, False))

    def close(self) -> None:
        """Once every character is in: the text, and each anchor's glue, now that what follows it is known."""
        self.text = text = "".join(self.pieces)
        self.anchors = [Anchor(a.at, a.node, a.stack, a.at > 0 and not text[a.at - 1].isspace(),
                               a.at < len(text) and not text[a.at].isspace()) for a in self.anchors]


def whole_verbatims(run: Run, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sentence spans, joined where one verbatim element would be cut across two (it is written once)."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and run.verbatim[out[-1][1] - 1] >= 0 and run.verbatim[out[-1][1] - 1] in run.verbatim[start:end]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def anchors_by_sentence(run: Run, spans: list[tuple[int, int]]) -> tuple[list[list[Anchor]], list[Anchor]]:
    """The anchors inside each sentence (touching its text), and those between sentences, kept where they are."""
    inside: list[list[Anchor]] = [[] for _ in spans]
    between: list[Anchor] = []
    starts = [start for start, _ in spans]
    for anchor in run.anchors:
        k = bisect.bisect_right(starts, anchor.at) - 1  # the last sentence starting at or before it
        if k >= 0 and (anchor.at < spans[k][1] and (anchor.at > spans[k][0] or anchor.glued_right)
                       or anchor.at == spans[k][1] and anchor.glued_left):
            inside[k].append(anchor)
        elif k + 1 < len(spans) and anchor.at == spans[k + 1][0] and anchor.glued_right:
            inside[k + 1].append(anchor)
        else:
            between.append(anchor)
    return inside, between


def original(run: Run, start: int, end: int, anchors: Sequence[Anchor], *, blank: bool = False) -> list[Piece]:
    """Characters start..end as they were (`blank`: written empty, their elements kept), with `anchors` among them."""
    pieces: list[Piece] = []
    waiting = sorted((a for a in anchors if start <= a.at <= end), key=lambda a: a.at)
    k = 0
    for i in range(start, end):
        while k < len(waiting) and waiting[k].at <= i:
            pieces.append((waiting[k].node, waiting[k].stack))
            k += 1
        v = run.verbatim[i]
        if v >= 0:
            if i == start or run.verbatim[i - 1] != v:
                pieces.append((run.verbatims[v], run.marks[i]))
        elif blank:
            pieces.append((EMPTY, run.marks[i]))
        else:
            pieces.append((run.text[i], run.marks[i]))
    pieces += [(a.node, a.stack) for a in waiting[k:]]
    return pieces


@dataclass
class _Word:
    """A source word: its span, the chain around most of its letters (`stack`), its edge segments (letterless
    text inside elements of their own at its start and end: `prefix`, `suffix`) and its verbatim node (or -1);
    and the elements around the punctuation at its start and end."""

    start: int
    end: int
    stack: Stack
    prefix: list[tuple[str, Stack]]
    suffix: list[tuple[str, Stack]]
    verbatim: int
    opening: Stack | None = None  # the elements around its leading punctuation (None: it starts with a letter)
    closing: Stack | None = None  # ... its trailing punctuation


def _word(run: Run, start: int, end: int) -> _Word:
    text, marks = run.text[start:end], run.marks[start:end]
    segments: list[tuple[str, Stack]] = []
    for char, stack in zip(text, marks, strict=True):
        if segments and segments[-1][1] == stack:
            segments[-1] = (segments[-1][0] + char, stack)
        else:
            segments.append((char, stack))
    letters = [i for i, char in enumerate(text) if char.isalpha()] or list(range(len(text)))
    stack = Counter(marks[i] for i in letters).most_common(1)[0][0]  # the first such, on a tie
    verbatims = Counter(run.verbatim[start + i] for i in letters)
    verbatim = max(verbatims, key=lambda v: (v >= 0, verbatims[v]))
    first = next(k for k, (_, s) in enumerate(segments) if s == stack)
    last = max(k for k, (_, s) in enumerate(segments) if s == stack)
    word = _Word(start, end, stack, segments[:first], segments[last + 1:], verbatim,
                 marks[0] if not text[0].isalnum() else None, marks[-1] if not text[-1].isalnum() else None)
    # An edge is one only if it holds no letter and its own elements hold nothing outside it
    for name, side, at in (("prefix", word.prefix, start), ("suffix", word.suffix,
                                                            end - sum(len(s) for s, _ in word.suffix))):
        limit = at + sum(len(s) for s, _ in side)
        if any(c.isalpha() for s, _ in side for c in s) or any(
                not at <= run.first[e] <= run.last[e] < limit for _, s in side for e in _extra(s, stack)):
            setattr(word, name, [])
    return word


def _extra(stack: Stack, around: Stack) -> Stack:
    """The elements of `stack` below what it shares with `around`."""
    return stack[len(_common([stack, around])):]


def _common(stacks: Sequence[Stack]) -> Stack:
    """The elements every stack starts with, outermost first."""
    out: list[int] = []
    for elements in zip(*stacks, strict=False):
        if any(element != elements[0] for element in elements):
            break
        out.append(elements[0])
    return tuple(out)


def place(run: Run, start: int, end: int, anchors: Sequence[Anchor], translation: Aligned) -> list[Piece]:
    """The translation of the sentence run.text[start:end] as pieces, with the sentence's elements, `anchors`
    and verbatim nodes each once."""
    sentence = _Sentence(run, start, end, anchors, translation)
    return sentence.pieces()


class _Sentence:
    def __init__(self, run: Run, start: int, end: int, anchors: Sequence[Anchor], translation: Aligned) -> None:
        self.run, self.start, self.end, self.anchors = run, start, end, list(anchors)
        self.translation = translation
        self.source = [_word(run, start + m.start(), start + m.end()) for m in re.finditer(r"\S+", run.text[start:end])]
        self.target = re.findall(r"[^ ]+", translation.text)
        self.base = _common(run.marks[start:end])
        # The elements around what precedes and what follows the sentence (at the run's edges, its own first and
        # last characters': the sentence's punctuation there stays in what held it)
        self.before = run.marks[start - 1] if start > 0 else run.marks[start]
        self.after = run.marks[end] if end < len(run.text) else run.marks[end - 1]
        # ... and for what the model does not read, at the run's edges: nothing (an image before the first word
        # of a link stays outside it)
        self.edge_before = run.marks[start - 1] if start > 0 else ()
        self.edge_after = run.marks[end] if end < len(run.text) else ()

    def where(self, i: int) -> int:
        """Source word i's place in a translation as long (the fallback without alignments)."""
        return min(len(self.target) - 1, i * len(self.target) // max(1, len(self.source)))

    def pieces(self) -> list[Piece]:
        run, start, end = self.run, self.start, self.end
        plain = (not self.anchors and all(v < 0 for v in run.verbatim[start:end])
                 and all(len(stack) == len(self.base) for stack in run.marks[start:end]))
        if plain:  # no markup in this sentence: nothing to place
            return [(self.translation.text, self.base)] if self.translation.text else []
        if not self.target:  # nothing to hold the markup: the elements written empty, the nodes as they were
            return original(run, start, end, self.anchors, blank=True)
        n, m = len(self.source), len(self.target)
        origin: list[int | None] = [None] * m  # the source word each translation word takes its elements from
        for i, j in self.translation.alignment or []:
            if 0 <= i < n and 0 <= j < m and (
                    origin[j] is None or len(self.source[i].stack) > len(self.source[origin[j]].stack)):  # type: ignore[index]
                origin[j] = i
        self.origin = origin
        self.aligned: dict[int, list[int]] = defaultdict(list)  # source word -> its translation words
        for i, j in sorted(self.translation.alignment or []):
            if 0 <= i < n and 0 <= j < m:
                self.aligned[i].append(j)
        chains: list[Stack | None] = [self.source[i].stack if i is not None else None for i in origin]
        for j in range(m):  # a word aligned to nothing: what its aligned neighbours share
            if chains[j] is None:
                left = next((s for s in reversed(chains[:j]) if s is not None), self.base)
                right = next((s for s in chains[j + 1:] if s is not None), self.base)
                chains[j] = _common([left, right])
        self.chains: list[Stack] = [c if c is not None else self.base for c in chains]
        # Empty elements by slot: "start", "end" (of the sentence), or (word, "before"/"after" its core); each as
        # (its parent's depth, its chain)
        self.empties: dict[object, list[tuple[int, Stack]]] = defaultdict(list)
        edges = {e for word in self.source for side in (word.prefix, word.suffix) for _, s in side
                 for e in _extra(s, word.stack)}
        present = {e for stack in run.marks[start:end] for e in stack} - edges - set(self.base)
        self.kids: dict[int | None, list[int]] = defaultdict(list)
        for element in sorted(present, key=lambda e: run.first[e]):
            self.kids[run.parents[element]].append(element)
        self._arrange(self.base, 0, m - 1)
        return self._pieces()

    # -- one stretch per element ------------------------------------------------------------------

    def _arrange(self, prefix: Stack, lo: int, hi: int) -> None:
        """Give each child element of prefix's last one a stretch of words lo..hi (inclusive), then its children."""
        kids = self.kids[prefix[-1] if prefix else None]
        if not kids:
            self._cut(prefix, lo, hi)
            return
        depth, run = len(prefix), self.run
        words: dict[int, list[int]] = defaultdict(list)
        for j in range(lo, hi + 1):
            if len(self.chains[j]) > depth:
                words[self.chains[j][depth]].append(j)
        opens = {kid: (run.first[kid] < self.start, run.last[kid] >= self.end) for kid in kids}
        # Elements that continue past the sentence first (they must reach its edge), then the tightest
        order = sorted(kids, key=lambda k: (not any(opens[k]), (max(words[k]) - min(words[k])) if words[k] else 0))
        taken: dict[int, tuple[int, int]] = {}
        for kid in order:
            at_start, at_end = opens[kid]
            if words[kid] or at_start or at_end:
                s = lo if at_start else min(words[kid], default=hi)
                e = hi if at_end else max(words[kid], default=lo)
                stretch = self._free(s, e, words[kid], taken.values())
                if stretch is not None and (not at_start or stretch[0] == lo) and (not at_end or stretch[1] == hi):
                    taken[kid] = stretch
        for kid in kids:  # those that got no stretch: a free word, else written empty
            if kid in taken:
                continue
            at_start, at_end = opens[kid]
            want = self._first_word(kid)
            free = [j for j in range(lo, hi + 1) if not any(s <= j <= e for s, e in taken.values())]
            if free and not at_start and not at_end:
                j = min(free, key=lambda j: (abs(j - want), j))
                taken[kid] = (j, j)
            else:  # beside the stretch holding its word: after it if that element came first in the source
                holder = next((k for k, (s, e) in taken.items() if s <= want <= e), None)
                if holder is not None:
                    want = taken[holder][1] + 1 if run.first[holder] < run.first[kid] else taken[holder][0]
                slot = "start" if at_start else "end" if at_end else self._slot(want, lo, hi, taken.values())
                self.empties[slot] += [(len(prefix), leaf) for leaf in self._leaves(prefix + (kid,))]
        for kid, (s, e) in taken.items():
            for j in range(s, e + 1):
                if len(self.chains[j]) <= depth or self.chains[j][depth] != kid:
                    self.chains[j] = prefix + (kid,)
        for j in range(lo, hi + 1):
            element = self.chains[j][depth] if len(self.chains[j]) > depth else None
            if element is not None and taken.get(element, (hi + 1, hi))[0] > j or \
                    element is not None and taken.get(element, (lo, lo - 1))[1] < j:
                self.chains[j] = prefix
        for kid, (s, e) in taken.items():
            self._arrange(prefix + (kid,), s, e)

    def _cut(self, prefix: Stack, lo: int, hi: int) -> None:
        """Words lo..hi sit in `prefix` and in no element below it here."""
        for j in range(lo, hi + 1):
            self.chains[j] = prefix

    @staticmethod
    def _free(s: int, e: int, own: list[int], taken: object) -> tuple[int, int] | None:
        """The part of s..e that no stretch in `taken` covers, holding the most of `own` (the longest, the first)."""
        blocked = sorted(t for t in taken if t[1] >= s and t[0] <= e)  # type: ignore[attr-defined]
        parts, cursor = [], s
        for bs, be in blocked:
            if bs > cursor:
                parts.append((cursor, bs - 1))
            cursor = max(cursor, be + 1)
        if cursor <= e:
            parts.append((cursor, e))
        if not parts:
            return None
        return max(parts, key=lambda p: (sum(p[0] <= j <= p[1] for j in own), p[1] - p[0], -p[0]))

    def _first_word(self, element: int) -> int:
        """Where the element's first source word is in the translation (its first aligned word, or by position)."""
        i = next((i for i, word in enumerate(self.source)
                  if any(element in self.run.marks[c] for c in range(word.start, word.end))), 0)
        return self.aligned[i][0] if self.aligned.get(i) else self.where(i)

    @staticmethod
    def _slot(want: int, lo: int, hi: int, taken: object) -> tuple[int, str]:
        """The place nearest `want` among words lo..hi inside no stretch: before word k's core, or after hi's."""
        inside = [(s, e) for s, e in taken]  # type: ignore[attr-defined]
        slots = [k for k in range(lo, hi + 2) if not any(s < k <= e for s, e in inside)]
        k = min(slots, key=lambda k: (abs(k - want), k))
        return (k, "before") if k <= hi else (hi, "after")

    def _leaves(self, chain: Stack) -> list[Stack]:
        """`chain` and the elements below its last one in this sentence, as the chains of their innermost ones."""
        kids = self.kids[chain[-1]]
        return [leaf for kid in kids for leaf in self._leaves(chain + (kid,))] if kids else [chain]

    # -- the pieces ---------------------------------------------------------------------------------

    def _pieces(self) -> list[Piece]:
        m, target, chains = len(self.target), self.target, self.chains
        replaced: dict[int, int] = {}  # translation word -> the verbatim node written instead of it
        dropped: set[int] = set()
        for j, i in enumerate(self.origin):
            v = self.source[i].verbatim if i is not None else -1
            if v >= 0:
                if v in replaced.values():
                    dropped.add(j)
                else:
                    replaced[j] = v
        kept = [j for j in range(m) if j not in dropped]

        def keep(j: int) -> int:  # a dropped word's place: the word written for its verbatim node
            if j not in dropped:
                return j
            v = self.source[self.origin[j]].verbatim  # type: ignore[index]
            return next(k for k, w in replaced.items() if w == v)

        anchors: dict[tuple[int, str], list[Anchor]] = defaultdict(list)  # (word, before/inside/after)
        for anchor in self.anchors:
            anchors[self._anchor_place(anchor, keep)].append(anchor)
        for v in sorted({self.run.verbatim[c] for c in range(self.start, self.end)} - {-1} - set(replaced.values())):
            at = self.run.verbatim.index(v)  # unaligned: an anchor where it was
            anchor = Anchor(at, self.run.verbatims[v], self.run.marks[at], at > 0 and not self.run.text[at - 1].isspace(),
                            False)
            anchors[self._anchor_place(anchor, keep)].append(anchor)
        leads: dict[int, list[tuple[str, Stack]]] = defaultdict(list)
        tails: dict[int, list[tuple[str, Stack]]] = defaultdict(list)
        for i, word in enumerate(self.source):
            js = self.aligned.get(i) or [self.where(i)]
            leads[keep(js[0])] += [(s, _extra(stack, word.stack)) for s, stack in word.prefix]
            tails[keep(js[-1])] += [(s, _extra(stack, word.stack)) for s, stack in word.suffix]
        trailing = {j: re.fullmatch(r".*?(\W*)", target[j], flags=re.DOTALL).group(1) for j in dropped}  # type: ignore[union-attr]
        pieces: list[Piece] = [(EMPTY, chain) for _, chain in self.empties.get("start", [])]
        for n, j in enumerate(kept):
            chain = chains[j]
            before = chains[kept[n - 1]] if n else self.before
            after = chains[kept[n + 1]] if n + 1 < len(kept) else self.after
            edge_before = chains[kept[n - 1]] if n else self.edge_before
            edge_after = chains[kept[n + 1]] if n + 1 < len(kept) else self.edge_after
            lead, written = _edge(target[j], leads.get(j, []), at_start=True)
            tail, written = _edge(written, tails.get(j, []), at_start=False)
            opening, core, closing = re.fullmatch(r"(\W*)(.*?)(\W*)", written, flags=re.DOTALL).groups()  # type: ignore[union-attr]
            if not core:
                opening, core, closing = "", written, ""
            # Punctuation at a word's edges stays inside an element if it was in the source word ("<code>&lt;</code>"),
            # else only if the word beside it is inside too: "<i>soccer</i>." gives "<i>Fußball</i>.", not
            # "<i>Fußball.</i>" (nor does a full stop the translation adds go into the element of its last word).
            i = self.origin[j]
            source = self.source[i] if i is not None else None
            outside = max(_common([before, chain]), _common([chain, source.opening or ()]) if source else (), key=len)
            inner = max(_common([chain, after]), _common([chain, source.closing or ()]) if source else (), key=len)
            if n:
                pieces.append((" ", _common([before, chain])))
            around = _common([edge_before, chain])
            for anchor in anchors.get((j, "before"), []):
                pieces += [(anchor.node, around)] + ([(" ", around)] if not anchor.glued_right else [])
            # The empty elements of this word's slots (and of the dropped words after it), on the side of its
            # punctuation where their parent holds no element that the punctuation is in
            own = [j, *range(j + 1, kept[n + 1] if n + 1 < len(kept) else m)]
            before_core = [e for k in own for e in self.empties.get((k, "before"), [])]
            after_core = [e for k in own for e in self.empties.get((k, "after"), [])]
            pieces += [(EMPTY, chain) for depth, chain in before_core if len(outside) > depth]
            pieces.append((opening, outside))
            pieces += [(EMPTY, chain) for depth, chain in before_core if len(outside) <= depth]
            pieces += [(s, chain + extra) if extra else (s, outside) for s, extra in lead]
            pieces.append((self.run.verbatims[replaced[j]] if j in replaced else core, chain))
            pieces += [(s, chain + extra) if extra else (s, inner) for s, extra in tail]
            pieces += [(EMPTY, chain) for depth, chain in after_core if len(inner) <= depth]
            pieces += [(anchor.node, chain) for anchor in anchors.get((j, "inside"), [])]
            pieces.append((closing + "".join(trailing.get(k, "") for k in own[1:]), inner))
            pieces += [(EMPTY, chain) for depth, chain in after_core if len(inner) > depth]
            around = _common([chain, edge_after])
            for anchor in anchors.get((j, "after"), []):
                pieces += ([(" ", around)] if not anchor.glued_left else []) + [(anchor.node, around)]
        pieces += [(EMPTY, chain) for _, chain in self.empties.get("end", [])]
        pieces = _out_of_links(pieces, self.run)
        return [(content, stack) for content, stack in pieces if not (type(content) is str and not content)]

    def _anchor_place(self, anchor: Anchor, keep: object) -> tuple[int, str]:
        """(translation word, before/inside/after it) for an anchor of this sentence."""
        words = self.source
        starts = [w.start for w in words]
        k = bisect.bisect_right(starts, anchor.at - 1) - 1  # the word holding or preceding the character before it
        if anchor.glued_left and k >= 0 and anchor.at <= words[k].end:
            rest = self.run.text[anchor.at:words[k].end]
            js = self.aligned.get(k) or [self.where(k)]
            side = "inside" if rest and not any(c.isalnum() for c in rest) else "after"
            return keep(js[-1]), side  # type: ignore[operator]
        following = k + 1 if k + 1 < len(words) else None
        if k < 0 or (anchor.glued_right and following is not None and words[following].start == anchor.at):
            i = following if following is not None else 0
            js = self.aligned.get(i) or [self.where(i)]
            return keep(js[0]), "before"  # type: ignore[operator]
        js = self.aligned.get(k) or [self.where(k)]
        return keep(js[-1]), "after"  # type: ignore[operator]


def _out_of_links(pieces: list[Piece], run: Run) -> list[Piece]:
    """The pieces, with each node that holds a link (an anchor, a verbatim element) that landed inside a link
    moved to just after that link: a browser ends a link at a link inside it, which would split the outer one."""
    out = list(pieces)
    k = 0
    while k < len(out):
        content, stack = out[k]
        outer = next((d for d, element in enumerate(stack) if element in run.links), None)
        if outer is None or id(content) not in run.linked:
            k += 1
            continue
        del out[k]
        end = max(i for i, (_, s) in enumerate(out) if len(s) > outer and s[outer] == stack[outer])
        out.insert(end + 1, (content, stack[:outer]))
    return out


def _edge(word: str, segments: list[tuple[str, Stack]], *, at_start: bool) -> tuple[list[tuple[str, Stack]], str]:
    """A source word's edge segments for its translation `word`: (the pieces to write, what is left of `word`).
    Where the translation has the same characters there ("[1]", ")"), they take the segments' elements in
    place of its own; where it lacks them, segments inside an element of their own are written as they were,
    and plain punctuation is left to the word."""
    text = "".join(string for string, _ in segments)
    if not text:
        return [], word
    if word.startswith(text) if at_start else word.endswith(text):
        return segments, word[len(text):] if at_start else word[: len(word) - len(text)]
    return [(s, extra) for s, extra in segments if extra], word
