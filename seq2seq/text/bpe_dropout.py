"""BPE-dropout (Provilkov et al. 2020, "BPE-Dropout: Simple and Effective Subword Regularization"): each epoch
splits the training pairs into other pieces of the same vocabulary, so that the model sees a word spelled in its
parts as well as whole, while validation and translation keep the tokenizer's own (deterministic) pieces.

BPE splits every word on its own: it starts from the word's characters and merges, step by step, the adjacent pair
whose merged piece came earliest in training (the highest score). BPE-dropout skips each candidate pair with
probability p at each step, and stops when a step has none left.

Why not sentencepiece's own sampling (`enable_sampling=True, alpha=p`): in sentencepiece 0.2.x its draws ignore
`set_random_generator_seed`, so two processes split the same text differently (seen with 0.2.3). Training needs an
epoch's pieces to be a function of (seed, epoch, pair): every loader worker and DDP rank must agree with the batch
plan made from their lengths, and a resumed run must train on what an unbroken run would have.

How, cheaply enough to redo every epoch: the pairs' deterministic pieces are cut into words (a piece starting with
"▁" begins one); each word type gets, once, a pool of segmentations drawn with dropout (`max_samples` of them, fewer
for rare words: 4 + its count), after its deterministic one; an epoch picks one of the pool for each occurrence
of the word by a hash of (seed, epoch, occurrence). Picking is a few numpy gathers, so an epoch of Multi30k is
resplit in milliseconds; the pools cost a few seconds of Python once per run. A frequent word's pool of 32 draws
stands in for fresh draws per occurrence (a split that happens in fewer than ~1/32 of draws may be missing from it).

A word keeps its deterministic pieces whenever dropout does not apply to it: it holds a piece that is not an
ordinary one (a language tag, a byte of byte fallback, <unk>), or the merges, with no dropout, do not give the
tokenizer's own pieces for it (none on Multi30k; `Resegmenter` refuses a tokenizer where most words differ, and a
unigram model before that, by its scores). A side whose resplit would exceed `max_len` pieces keeps its
deterministic pieces that epoch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from seq2seq.text.tokenizer import Tokenizer

SPACE = "\u2581"  # sentencepiece's mark of a space, at the start of a word's first piece


def split_word(chars: Sequence[str], *, ranks: dict[str, int], p: float, rng: random.Random) -> list[str]:
    """A word's pieces by BPE merges in the order of `ranks` (piece → its merge's rank, 0 first), each candidate
    merge dropped with probability `p` at each step; p = 0 is plain BPE. Ties go to the leftmost pair, as in
    sentencepiece."""
    symbols = list(chars)
    while len(symbols) > 1:
        best, best_rank = -1, len(ranks)
        for i in range(len(symbols) - 1):
            rank = ranks.get(symbols[i] + symbols[i + 1])
            if rank is not None and rank < best_rank and (p == 0 or rng.random() >= p):
                best, best_rank = i, rank
        if best < 0:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    return symbols


class Resegmenter:
    """An epoch's BPE-dropout pieces of a fixed list of id sequences (one side of the training pairs).

    `sequences[i]` are the tokenizer's own ids of sequence i; `lengths(epoch)` and `ids(epoch, rows)` give epoch
    `epoch`'s, the same in every process for the same arguments.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], *, tokenizer: Tokenizer, p: float, seed: int,
                 max_len: int, max_samples: int = 32) -> None:
        if not 0 < p < 1:
            raise ValueError(f"BPE-dropout's probability must be in (0, 1), got {p}")
        if tokenizer.kind != "joint":
            raise ValueError("BPE-dropout needs a tokenizer trained here (one joint sentencepiece BPE model); an "
                             "imported Marian model's tokenizer is not one")
        self.seed, self.max_len = seed, max_len
        pieces = tokenizer.pieces()
        ordinary = np.array([tokenizer.is_ordinary(i) for i in range(len(pieces))])
        # Merge ranks from the scores: sentencepiece scores a BPE model's pieces -0, -1, -2, ... in the order they
        # were learnt, the first merge highest; a unigram model's are log-probabilities.
        scores = [tokenizer.score(i) for i in range(len(pieces))]
        if not all(float(scores[i]).is_integer() for i in range(len(pieces)) if ordinary[i]):
            raise ValueError("the tokenizer's pieces are not scored in BPE's merge order (a unigram model?): "
                             "BPE-dropout needs a BPE tokenizer (tokenizer_model_type: bpe)")
        order = sorted((i for i in range(len(pieces)) if ordinary[i] and len(pieces[i]) > 1), key=lambda i: -scores[i])
        ranks = {pieces[i]: rank for rank, i in enumerate(order)}
        index = {pieces[i]: i for i in range(len(pieces)) if ordinary[i]}

        # Words: each sequence cut before every piece that starts with "▁" or is not ordinary (and after those).
        flat = np.fromiter((i for s in sequences for i in s), dtype=np.int64)
        self.row_starts = np.zeros(len(sequences) + 1, dtype=np.int64)  # (N+1,) offsets into `flat`
        np.cumsum([len(s) for s in sequences], out=self.row_starts[1:])
        starts_word = np.array([p.startswith(SPACE) for p in pieces])[flat] | ~ordinary[flat]
        starts_word[self.row_starts[:-1][np.diff(self.row_starts) > 0]] = True
        starts_word[1:] |= ~ordinary[flat[:-1]]
        word_starts = np.flatnonzero(starts_word)  # (W,) where each word occurrence starts in `flat`
        word_ends = np.append(word_starts[1:], len(flat))
        types: dict[tuple[int, ...], int] = {}
        self.occurrence_type = np.array(
            [types.setdefault(tuple(flat[a:b].tolist()), len(types)) for a, b in zip(word_starts, word_ends, strict=True)],
            dtype=np.int64,
        )  # (W,)
        # (N+1,) offsets of each sequence's words into occurrence_type
        self.row_words = np.searchsorted(word_starts, self.row_starts)
        counts = np.bincount(self.occurrence_type, minlength=len(types))

        # Pools: a type's segmentations, its deterministic one first, as runs of a flat id array.
        rng = random.Random(seed)
        pool_ids: list[int] = []
        pool_starts: list[int] = []
        pool_lens: list[int] = []
        self.pool_first = np.zeros(len(types), np.int64)  # (types,) each type's first entry in the pool
        self.pool_size = np.zeros(len(types), np.int64)  # (types,) its draws with dropout (after the first)
        differing = 0
        for word, t in types.items():
            self.pool_first[t] = len(pool_starts)
            segmentations = [list(word)]
            if all(ordinary[i] for i in word):
                text = "".join(pieces[i] for i in word)
                if all(c in index for c in text) and [index[s] for s in split_word(text, ranks=ranks, p=0,
                                                                                   rng=rng)] == list(word):
                    n = min(max_samples, 4 + int(counts[t])) if len(text) > 1 else 0
                    segmentations += [[index[s] for s in split_word(text, ranks=ranks, p=p, rng=rng)]
                                      for _ in range(n)]
                else:
                    differing += 1
            for segmentation in segmentations:
                pool_starts.append(len(pool_ids))
                pool_lens.append(len(segmentation))
                pool_ids.extend(segmentation)
            self.pool_size[t] = len(segmentations) - 1  # draws with dropout, after the deterministic one
        if types and differing > len(types) // 2:
            raise ValueError(f"{differing} of {len(types)} word types do not split into the tokenizer's own pieces "
                             "by BPE merges: BPE-dropout needs a BPE tokenizer (tokenizer_model_type: bpe)")
        self.mismatched = differing  # word types the merges split otherwise than the tokenizer: kept whole
        self.pool_ids = np.array(pool_ids, dtype=np.int64)
        self.pool_starts, self.pool_lens = np.array(pool_starts, np.int64), np.array(pool_lens, np.int64)
        self.word_types = len(types)
        self.pool_entries = len(pool_starts)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def _choices(self, epoch: int, occurrences: np.ndarray) -> np.ndarray:
        """(W',) the pool entry of each of `occurrences` (indices into occurrence_type) in `epoch`."""
        types = self.occurrence_type[occurrences]
        draw = _hash(np.uint64(self.seed), np.uint64(epoch), occurrences.astype(np.uint64))
        size = self.pool_size[types]
        pick = np.where(size > 0, 1 + (draw % np.maximum(size, 1).astype(np.uint64)).astype(np.int64), 0)
        return self.pool_first[types] + pick

    def lengths(self, epoch: int) -> np.ndarray:
        """(N,) each sequence's length in pieces in `epoch` (its deterministic length where the split's is over
        max_len)."""
        entries = self._choices(epoch, np.arange(len(self.occurrence_type)))
        lens = np.add.reduceat(np.append(self.pool_lens[entries], 0), self.row_words[:-1]) if len(entries) else \
            np.zeros(len(self), np.int64)
        lens = np.where(self.row_words[:-1] == self.row_words[1:], 0, lens)  # (empty sequences: no words)
        return np.where(lens > self.max_len, np.diff(self.row_starts), lens)

    def ids(self, epoch: int, rows: Sequence[int]) -> list[list[int]]:
        """Sequence `rows`' ids in `epoch`."""
        out = []
        for row in rows:
            occurrences = np.arange(self.row_words[row], self.row_words[row + 1])
            entries = self._choices(epoch, occurrences)
            if self.pool_lens[entries].sum() > self.max_len:
                entries = self.pool_first[self.occurrence_type[occurrences]]  # deterministic pieces
            out.append([i for e in entries.tolist()
                        for i in self.pool_ids[self.pool_starts[e] : self.pool_starts[e] + self.pool_lens[e]].tolist()])
        return out


def _hash(seed: np.uint64, epoch: np.uint64, x: np.ndarray) -> np.ndarray:
    """(W',) uint64 SplitMix64 of (seed, epoch, x): independent-looking draws that any process can recompute for
    any subset of occurrences (numpy's generators draw in sequence, so a subset would need the whole epoch's)."""
    with np.errstate(over="ignore"):
        z = x + (seed * np.uint64(0x9E3779B97F4A7C15)) + (epoch * np.uint64(0xD1B54A32D192ED03))
        for _ in range(2):
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
    return z
