"""Several translation directions in one run: what each is, how often its pairs are drawn, the tag that names it.

A multilingual model trains on a list of directions (`Direction`: source and target language, where its pairs
are, a weight). Directions differ in size by orders of magnitude, so an epoch draws each direction's pairs by
temperature (Arivazhagan et al. 2019, "Massively Multilingual Neural Machine Translation in the Wild"): direction
i, with n_i pairs and weight w_i, gets a share p_i proportional to (w_i n_i / sum_j w_j n_j) ** (1 / T). T = 1
keeps the corpus's own proportions; a large T approaches equal shares, so a small direction is seen far more
often than its size alone would give it. An epoch keeps the corpus's total number of pairs, drawn in these
shares: a direction whose share exceeds its size is repeated (every pair as often, then a random rest), a
smaller one is subsampled without repeats.

The target language is named by a tag, `>>xx<<` (text/tokenizer.py's `language_tag`: OPUS-MT's form, so that an
imported multilingual Marian model and ours read their tags the same way), a piece of its own in the tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from seq2seq.text.tokenizer import language_tag


@dataclass(frozen=True)
class Direction:
    """One direction of a multilingual run's data: `src_lang` → `tgt_lang`, read from files or a Hub dataset
    (as the data module's own options: `train_files` [source, target], one .tsv, or Hub-layout files; or
    `hf_name` with its config and data folder), drawn with `weight` times its own share before the temperature."""

    src_lang: str
    tgt_lang: str
    train_files: list[str] | None = None
    valid_files: list[str] | None = None
    test_files: list[str] | None = None
    hf_name: str | None = None
    hf_config: str | None = None
    hf_data_dir: str | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        where = f"direction {self.src_lang}-{self.tgt_lang}"
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"{where}: src_lang and tgt_lang are both {self.src_lang!r}; choose two languages")
        for lang in (self.src_lang, self.tgt_lang):
            language_tag(lang)  # (a code a tag can hold: its error names the code)
        if self.train_files is None and self.hf_name is None:
            raise ValueError(f"{where}: no training data; give train_files or hf_name")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"{where}: weight must be a positive number, got {self.weight}")

    @property
    def name(self) -> str:
        """`de-en`: how logs, metrics and reports name the direction."""
        return f"{self.src_lang}-{self.tgt_lang}"


def check_directions(directions: list[Direction]) -> None:
    """ValueError (one line) for a list a run cannot train on: empty, or a direction twice."""
    if not directions:
        raise ValueError("directions is empty; give at least one direction, or src_lang and tgt_lang")
    names = [d.name for d in directions]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"direction {', '.join(twice)} is listed twice; merge its data into one entry")


def sampling_shares(pairs: list[int], *, weights: list[float], temperature: float) -> np.ndarray:
    """Each direction's share of an epoch's pairs, (directions,), summing to 1 (module docstring). A direction
    with no pairs gets none."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number (1: proportional; 5: near uniform), got {temperature}")
    sized = np.asarray(pairs, dtype=np.float64) * np.asarray(weights, dtype=np.float64)
    if sized.sum() <= 0:
        raise ValueError("no direction has training pairs")
    shares = (sized / sized.sum()) ** (1.0 / temperature)
    return shares / shares.sum()


def epoch_rows(groups: np.ndarray, *, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An epoch's rows in random order, (len(groups),): rows of direction k (where groups == k) drawn in
    `shares[k]` of the total (module docstring). The counts are rounded so that they sum to the total (largest
    remainders first), and a direction with pairs and any share gets at least one."""
    total = len(groups)
    members = [np.flatnonzero(groups == k) for k in range(len(shares))]
    exact = shares * total
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]] += 1
    for k, rows in enumerate(members):  # (a share too small to round to a pair still draws one)
        if len(rows) and shares[k] > 0 and counts[k] == 0:
            counts[k], counts[int(np.argmax(counts))] = 1, counts[int(np.argmax(counts))] - 1
    drawn = []
    for rows, count in zip(members, counts.tolist(), strict=True):
        if not len(rows) or not count:
            continue
        whole, rest = divmod(count, len(rows))
        drawn.append(np.tile(rows, whole))
        drawn.append(rng.choice(rows, size=rest, replace=False))
    order = np.concatenate(drawn) if drawn else np.zeros(0, dtype=np.int64)
    return rng.permutation(order)


def shares_report(directions: list[Direction], *, pairs: np.ndarray, temperature: float) -> str:
    """The data report's line for an epoch's mix: each direction's kept pairs and its share of an epoch."""
    shares = sampling_shares(pairs.tolist(), weights=[d.weight for d in directions], temperature=temperature)
    mix = "; ".join(f"{d.name} {int(n)} pairs, {share:.1%}" for d, n, share in zip(directions, pairs, shares, strict=True))
    return f"train: an epoch draws {int(pairs.sum())} pairs at temperature {temperature:g}: {mix}"
