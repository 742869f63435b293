"""Hard lexical constraints: target phrases every output must contain, in any order.

The search (search.constrained_beam_search) is dynamic beam allocation (Post & Vilar 2018, "Fast
Lexically Constrained Decoding with Dynamic Beam Allocation"): at each step every hypothesis may be
extended by its best tokens *and* by each token that makes progress on a constraint (the next token of
the phrase it is inside, or the first token of a phrase not yet placed), so a constraint gets its chance
even where the model would not choose it; the beam is then shared out among banks, a bank per number of
constraint tokens met, so that hypotheses far along their constraints are not crowded out by
unconstrained ones that score better so far. A hypothesis may end (EOS) only once all its constraints
are met. Why this and not a constraint-aware beam per phrase set (grid beam search): the beam stays K
hypotheses per sentence whatever the number of constraints, so it fits the batched beam search as is.

This module holds the small pure functions over one hypothesis' progress; phrases are token ids as
the target side tokenises each phrase alone (a phrase must appear spelled with exactly those pieces).
Like fairseq's, a phrase left unfinished (another token came between its pieces) loses its progress
and can be started again; of two phrases that start with the same token, the first in the list is
begun. A placed phrase must end its word: the token after it may not continue the word (a piece
without sentencepiece's leading space that starts with a letter or digit; punctuation may follow), so
"bricht" is not met by "brichtigen", and is by "bricht.".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Phrases = Sequence[Sequence[int]]


@dataclass(frozen=True)
class Progress:
    """One hypothesis' progress over a sentence's phrases."""

    done: tuple[bool, ...]
    """Per phrase: placed whole."""
    active: int = -1
    """The phrase being placed (-1: none)."""
    matched: int = 0
    """Its tokens placed so far."""
    just_placed: int = -1
    """The phrase the last token completed (-1: none): the next token may not continue its word."""


def start(phrases: Phrases) -> Progress:
    return Progress(done=(False,) * len(phrases))


def met(progress: Progress, phrases: Phrases) -> int:
    """Constraint tokens met: the placed phrases' tokens and the active one's tokens so far (the bank)."""
    return sum(len(p) for p, done in zip(phrases, progress.done, strict=True) if done) + progress.matched


def all_met(progress: Progress) -> bool:
    return all(progress.done)


def advance(progress: Progress, phrases: Phrases, token: int, *, continues_word: bool = False) -> Progress:
    """The progress after `token` is appended; `continues_word`: the token goes on with the word before it
    (a piece without a leading space that is not punctuation), which undoes a phrase placed just before:
    it would not be a whole word (the search bans such tokens there; a forced prefix can bring one)."""
    if progress.just_placed >= 0 and continues_word:
        progress = Progress(done=tuple(d and i != progress.just_placed for i, d in enumerate(progress.done)))
    if progress.active >= 0:
        phrase = phrases[progress.active]
        if phrase[progress.matched] == token:
            if progress.matched + 1 == len(phrase):
                done = tuple(d or i == progress.active for i, d in enumerate(progress.done))
                return Progress(done=done, just_placed=progress.active)
            return Progress(done=progress.done, active=progress.active, matched=progress.matched + 1)
        progress = Progress(done=progress.done)  # the phrase was left unfinished: its progress is lost
    elif progress.just_placed >= 0:
        progress = Progress(done=progress.done)
    for i, phrase in enumerate(phrases):
        if not progress.done[i] and phrase[0] == token:
            if len(phrase) == 1:
                return Progress(done=tuple(d or j == i for j, d in enumerate(progress.done)), just_placed=i)
            return Progress(done=progress.done, active=i, matched=1)
    return progress


def next_tokens(progress: Progress, phrases: Phrases) -> set[int]:
    """The tokens that make progress: the active phrase's next one, and every unplaced phrase's first."""
    wanted = {phrase[0] for phrase, done in zip(phrases, progress.done, strict=True) if not done}
    if progress.active >= 0:
        wanted.add(phrases[progress.active][progress.matched])
    return wanted


def allocate(banks: Sequence[int], *, beam_size: int, num_banks: int) -> list[int]:
    """Which candidates go on: `banks[i]` is candidate i's bank (constraint tokens met), candidates
    best first. Each bank is given beam_size // num_banks places (at least one, the fullest banks first
    where there are more banks than places), filled best first; places a bank leaves empty go to the best
    candidates not yet taken. Returns up to beam_size candidate indices, best first."""
    per_bank = max(1, beam_size // num_banks)
    taken: list[int] = []
    for bank in sorted(set(banks), reverse=True):
        room = min(per_bank, beam_size - len(taken))
        taken += [i for i, b in enumerate(banks) if b == bank][:room]
        if len(taken) == beam_size:
            break
    chosen = set(taken)
    taken += [i for i in range(len(banks)) if i not in chosen][: beam_size - len(taken)]
    return sorted(taken)


def holds(tokens: Sequence[int], phrase: Sequence[int], *, continuing: frozenset[int]) -> bool:
    """Whether `phrase` is in `tokens` as a whole word: a contiguous run not followed by a token that
    continues its word (`continuing`)."""
    phrase, n = list(phrase), len(phrase)
    return any(list(tokens[i : i + n]) == phrase and (i + n == len(tokens) or tokens[i + n] not in continuing)
               for i in range(len(tokens) - n + 1))
