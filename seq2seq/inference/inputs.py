"""Texts made ready to decode, once: their source token ids (a line too long for the model cut, with a warning
naming it), the target prefixes' ids, the constraints' phrases and ids (a glossary's terms among them), and what
each costs to decode. `Translator.prepare_inputs` makes them and checks them (the one boundary: every refusal
is a ValueError or TypeError naming the line); `Translator.decode_inputs` decodes them; the server charges a
request's `costs` before it queues it and its batcher decodes several requests' inputs together (`gathered`),
so a text is tokenised once however many checks it passes.
"""

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

from seq2seq.decoding.config import SearchConfig
from seq2seq.text.tokenizer import Tokenizer

MIN_STEPS_CHARGED = 16
"""The fewest decoder steps a sentence is charged (decoding_cost). Every hypothesis holds a vocabulary-wide row of
scores (the logits and the search's temporaries over them) however short its output: about as much memory as 20
cached target positions. Charged less, a client could ask for one-step outputs (max_len_b 0) of thousands of
one-token sentences and hold that many rows at once; and a flood of them is refused by their count alone."""

Phrases = tuple[list[str], list[list[int]]]
"""One text's constraints: the phrases (deduplicated, their spaces made single) and each phrase's target ids."""


def decoding_cost(length: int, search: SearchConfig, *, max_positions: int, at_least: int = 0,
                  forced_steps: int = 0) -> int:
    """The decoder tokens one sentence of `length` source tokens may cost: its hypotheses times its steps (the
    output limit as decoding/steps.py's max_lengths computes it, `forced_steps` more for a decoder-side tag, raised
    to the `at_least` tokens a target prefix and constraints need, plus EOS), at least MIN_STEPS_CHARGED. 0 for a
    sentence with nothing to decode."""
    if length == 0:
        return 0  # an empty line is answered without decoding
    length = min(length, max_positions)  # a longer line is truncated
    limit = min(max(math.floor(search.max_len_a * length + search.max_len_b) + forced_steps, at_least, 0),
                max_positions - 1)
    return search.hypotheses * max(limit + 1, MIN_STEPS_CHARGED)


@dataclass(frozen=True)
class Inputs:
    ids: list[list[int]]
    """Per text its source ids, at most the model's max_positions; [] for a text with nothing to translate
    (empty, or no text token: it translates to nothing, without decoding)."""
    forced: list[list[int]] | None = None
    """Per text its target prefix's ids (the start its translations must have), or None for no prefixes."""
    phrases: list[Phrases] | None = None
    """Per text its constraints (given, and a glossary's terms found in it), or None for no constraints."""
    forced_steps: int = 0
    """The steps every translation spends on a forced tag before its own words (a multilingual model's tags on the
    decoder side: the search gets that many more, Translator's `_decode_batches`)."""

    def __len__(self) -> int:
        return len(self.ids)

    def costs(self, search: SearchConfig, *, max_positions: int) -> list[int]:
        """Each text's decoding_cost under `search`: its output limit raised to hold its prefix and phrases."""
        return [decoding_cost(len(ids), search, max_positions=max_positions, at_least=self.at_least(i),
                              forced_steps=self.forced_steps) for i, ids in enumerate(self.ids)]

    def at_least(self, i: int) -> int:
        """The target tokens text i's translations must hold: its prefix's and its phrases'."""
        forced = len(self.forced[i]) if self.forced is not None else 0
        return forced + (sum(map(len, self.phrases[i][1])) if self.phrases is not None else 0)

    @staticmethod
    def gathered(parts: Iterable[tuple["Inputs", int]]) -> "Inputs":
        """Text `i` of each (inputs, i), in order, as one Inputs: several requests' sentences in one decoder call
        (a part without prefixes or constraints takes none: an empty prefix, no phrases)."""
        chosen = list(parts)
        with_prefixes = any(inputs.forced is not None for inputs, _ in chosen)
        with_phrases = any(inputs.phrases is not None for inputs, _ in chosen)
        none: Phrases = ([], [])
        return Inputs(ids=[inputs.ids[i] for inputs, i in chosen],
                      forced=[inputs.forced[i] if inputs.forced is not None else [] for inputs, i in chosen]
                      if with_prefixes else None,
                      phrases=[inputs.phrases[i] if inputs.phrases is not None else none for inputs, i in chosen]
                      if with_phrases else None,
                      forced_steps=max((inputs.forced_steps for inputs, _ in chosen), default=0))


def as_lines(texts: Iterable[str], *, first_line: int = 1) -> list[str]:
    """Any iterable of str as a list; a bare string (which would translate character by character) is refused.

    A bad item is named by its index in the whole input (`first_line` is the first text's number).
    """
    if isinstance(texts, str | bytes):
        raise TypeError("texts is a single string; pass a list of sentences, e.g. [text]")
    lines = list(texts)
    for i, text in enumerate(lines):
        if not isinstance(text, str):
            raise TypeError(f"texts[{first_line - 1 + i}] is a {type(text).__name__}, not a str")
    return lines


def as_constraint_lists(constraints: Iterable[Sequence[str]]) -> list[Sequence[str]]:
    if isinstance(constraints, str | bytes):
        raise TypeError("constraints is a single string; pass one list of phrases per text")
    return list(constraints)


def check_max_tokens(max_tokens: int) -> None:
    """A ValueError unless `max_tokens` (a batch's budget of source tokens) is a positive whole number."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens!r}")


def prefix_ids(prefixes: Iterable[str], count: int, *, tokenizer: Tokenizer, max_positions: int,
               first_line: int) -> list[list[int]]:
    """The target prefixes' ids, one list per line; a ValueError naming the line of one too long to force."""
    prefixes = as_lines(prefixes, first_line=first_line)
    if len(prefixes) != count:
        raise ValueError(f"{len(prefixes)} target prefixes for {count} texts: give one per text (\"\" for none)")
    ids = tokenizer.encode_target([prefix.strip() for prefix in prefixes])
    limit = max_positions - 1  # the decoder reads BOS + at most this many tokens
    for i, prefix in enumerate(ids):
        if len(prefix) > limit:
            raise ValueError(f"the target prefix of line {first_line + i} has {len(prefix)} tokens, more than "
                             f"the model writes ({limit}: max_positions - 1); shorten it")
    return ids


def constraint_ids(constraints: Iterable[Sequence[str]], count: int, *, forced: list[list[int]] | None,
                   tokenizer: Tokenizer, max_positions: int, first_line: int) -> list[Phrases]:
    """Per line, its phrases (deduplicated) and their ids; a ValueError naming the line of an empty
    phrase, or of phrases (and prefix) that together exceed what the model writes."""
    lines = as_constraint_lists(constraints)
    if len(lines) != count:
        raise ValueError(f"{len(lines)} constraint lists for {count} texts: give one per text ([] for none)")
    limit = max_positions - 1
    out = []
    for i, phrases in enumerate(lines):
        if isinstance(phrases, str | bytes) or not all(isinstance(p, str) for p in phrases):
            raise TypeError(f"the constraints of line {first_line + i} must be a list of strings (phrases)")
        texts = list(dict.fromkeys(" ".join(p.split()) for p in phrases))
        if any(not text for text in texts):
            raise ValueError(f"line {first_line + i} has an empty constraint: every phrase needs some text")
        ids = tokenizer.encode_target(texts)
        total = sum(map(len, ids)) + (len(forced[i]) if forced is not None else 0)
        if total > limit:
            raise ValueError(f"the constraints of line {first_line + i} take {total} tokens, more than the model "
                             f"writes ({limit}: max_positions - 1); shorten or drop some")
        out.append((texts, ids))
    return out


def truncated(ids: list[list[int]], *, numbers: Sequence[int], tokenizer: Tokenizer, max_positions: int) -> list[list[int]]:
    """`ids` with each source longer than the model reads cut to `max_positions`, with a warning naming its line."""
    limit = max_positions
    for i, sentence in enumerate(ids):
        if len(sentence) > limit:
            warnings.warn(
                f"input line {numbers[i]} has {len(sentence)} tokens, more than the model's max_positions "
                f"({limit}); translating its first {limit} tokens only",
                stacklevel=3,
            )
            ids[i] = tokenizer.cut_source(sentence, limit)
    return ids


def windows(texts: Iterable[str], *, window: int, prefixes: Iterable[str] | None = None,
            constraints: Iterable[Sequence[str]] | None = None,
            ) -> Iterator[tuple[int, list[str], list[str] | None, list[Sequence[str]] | None]]:
    """`texts` read `window` lines at a time, with their prefixes and constraint lists read alongside: (the window's
    first line number, its texts, prefixes, constraints). A ValueError where prefixes or constraints end before the
    texts, or go on after them; a TypeError for a string where lines are due."""
    if isinstance(texts, str | bytes):
        as_lines(texts)  # the same TypeError as a whole call's
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive number of lines, got {window!r}")
    if isinstance(constraints, str | bytes):
        as_constraint_lists(constraints)  # the TypeError
    iterator, done = iter(texts), 0
    prefix_iterator = iter(prefixes) if prefixes is not None else None
    constraint_iterator = iter(constraints) if constraints is not None else None
    while chunk := list(islice(iterator, window)):
        chunk_prefixes = list(islice(prefix_iterator, len(chunk))) if prefix_iterator is not None else None
        if chunk_prefixes is not None and len(chunk_prefixes) < len(chunk):
            raise ValueError(f"the target prefixes end after line {done + len(chunk_prefixes)}, before the texts "
                             "do: give one per text (an empty one for none)")
        chunk_constraints = list(islice(constraint_iterator, len(chunk))) if constraint_iterator is not None else None
        if chunk_constraints is not None and len(chunk_constraints) < len(chunk):
            raise ValueError(f"the constraints end after line {done + len(chunk_constraints)}, before the texts "
                             "do: give one list per text (an empty one for none)")
        yield done + 1, chunk, chunk_prefixes, chunk_constraints
        done += len(chunk)
    if prefix_iterator is not None and next(prefix_iterator, None) is not None:
        raise ValueError(f"there are more target prefixes than the {done} texts: give one per text")
    if constraint_iterator is not None and next(constraint_iterator, None) is not None:
        raise ValueError(f"there are more constraint lists than the {done} texts: give one per text")
