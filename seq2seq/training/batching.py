"""Token-budget batches: a batch sampler for Lightning and the collate function.

A pair costs max(len(src), len(tgt) + 1) padded positions; a batch of B pairs costs B times its
largest pair, and that product is ≤ max_tokens, so neither src nor tgt_in/tgt_out holds more than
max_tokens positions. Batches (dicts):
  src      (B, S) long   source ids as the tokenizer encodes them (ours: no BOS/EOS; Marian's: + EOS)
  tgt_in   (B, T) long   BOS + y (BOS: the id the decoder starts from, Marian's pad)
  tgt_out  (B, T) long   y + EOS
  target_positions  (N,) long   where tgt_out's N real (non-pad) tokens are in tgt_out.flatten(), in order
padded with the tokenizer's pad id; with text (validation/test) also src_text, ref_text and index (B,), and
direction (B,) where the data has several.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from seq2seq.training.directions import epoch_rows


class TokenBatchSampler:
    """Lists of row indices whose padded size fits `max_tokens` (see the module docstring).

    Training: a permutation drawn from (seed, epoch) is cut into windows of `shuffle_window` pairs;
    each window is sorted by size and cut greedily into batches, and the batches are shuffled. With
    `groups` (each row's direction of a multilingual run) and their `shares`, the permutation is of rows
    drawn in those shares instead (training/directions.py: some repeated, some left out this epoch), so
    that a batch mixes directions.
    Evaluation: the whole split sorted by size, the same batches in the same order every time.
    Each rank then takes every world_size-th batch of the list, padded to a multiple of world_size
    by repeating its first batches. The batch count may differ slightly between epochs (windows
    pack differently); Lightning reads `len` once per loader, so the data module has it build one each epoch.

    With `epoch_sizes` (BPE-dropout: a pair's pieces, so its size, change by epoch), training batches are planned
    on epoch e's sizes and yielded as (e, row) keys.

    Resumable: `state_dict` is (epoch, batches already trained on this epoch); after
    `load_state_dict` the next iteration yields the rest of that epoch, the same batches in the same
    order as a run that never stopped (ResumableLoader in training/data.py says who counts the batches).
    """

    def __init__(
        self,
        sizes: np.ndarray,  # (N,) padded positions of each pair, max(len(src), len(tgt) + 1)
        *,
        max_tokens: int,
        shuffle: bool,
        shuffle_window: int = 100_000,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        groups: np.ndarray | None = None,  # (N,) each pair's direction, an index into shares
        shares: np.ndarray | None = None,  # (directions,) each direction's share of an epoch's pairs
        epoch_sizes: Callable[[int], np.ndarray] | None = None,  # epoch -> (N,) sizes, where pieces change by epoch
    ) -> None:
        if len(sizes) and int(sizes.max()) > max_tokens:
            raise ValueError(f"a pair needs {int(sizes.max())} positions but max_tokens is {max_tokens}")
        if (groups is None) != (shares is None) or (groups is not None and len(groups) != len(sizes)):
            raise ValueError("groups (one a pair) and shares (one a group) go together")
        if epoch_sizes is not None and not shuffle:
            raise ValueError("epoch_sizes (pieces that change by epoch) are for training batches (shuffle)")
        self.groups, self.shares, self.epoch_sizes = groups, shares, epoch_sizes
        self.sizes, self.max_tokens, self.shuffle = np.asarray(sizes), max_tokens, shuffle
        self.shuffle_window, self.seed, self.rank, self.world_size = shuffle_window, seed, rank, world_size
        self.epoch = 0
        self._skip = 0  # batches of this epoch trained before a resume: the next iteration starts after them
        self._cached: tuple[int, Plan] | None = None  # (epoch, this rank's batches)

    @property
    def sampler(self) -> TokenBatchSampler:
        # Lightning calls `set_epoch` on `dataloader.sampler` and `dataloader.batch_sampler.sampler`,
        # never on the batch sampler itself (lightning.fabric.utilities.data._set_sampler_epoch).
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._skip = epoch, 0

    def __iter__(self) -> Iterator[list[int] | list[tuple[int, int]]]:
        """Each batch's rows; with epoch_sizes, (epoch, row) keys, which training/resplit.py's dataset reads (the
        epoch travels with the rows: a loader worker has no other way to learn it)."""
        skip, self._skip = self._skip, 0  # only the first iteration after a resume skips
        plan, epoch = self._plan(), self.epoch  # made here, at the first `next` (a generator)
        for start, end in zip(plan.starts[skip:].tolist(), plan.ends[skip:].tolist(), strict=True):
            rows = plan.rows[start:end].tolist()
            yield rows if self.epoch_sizes is None else [(epoch, row) for row in rows]

    def state_dict(self, *, batches_done: int) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches_done": batches_done, **self._order()}

    def _order(self) -> dict[str, Any]:
        """What decides the batches and their order, besides the epoch (a single direction's run: no shares)."""
        order: dict[str, Any] = {"seed": self.seed, "world_size": self.world_size, "max_tokens": self.max_tokens,
                                 "shuffle_window": self.shuffle_window, "pairs": len(self.sizes)}
        if self.shares is not None:
            order["shares"] = [round(float(share), 9) for share in self.shares]
        if self.epoch_sizes is not None:
            order["resplit"] = True  # (BPE-dropout on)
        return order

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; a finished epoch continues with the next one."""
        order = self._order()
        keys = [*order, *(key for key in state if key not in order and key not in ("epoch", "batches_done"))]
        changed = [f"{key} {state.get(key)} -> {order.get(key)}" for key in keys if state.get(key) != order.get(key)]
        if changed:
            warnings.warn(f"the data order changed since the checkpoint ({', '.join(changed)}): training goes on, "
                          "but not on the batches the first run would have seen", stacklevel=2)
        self.epoch, self._skip = state["epoch"], state["batches_done"]
        if self._skip >= len(self):
            self.epoch, self._skip = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self._plan().starts)

    def _plan(self) -> Plan:
        if self._cached is None or self._cached[0] != self.epoch:
            plan = self._all_batches()
            if self.world_size > 1:
                count = len(plan.starts)
                total = math.ceil(count / self.world_size) * self.world_size
                mine = (np.arange(total) % count)[self.rank :: self.world_size]
                plan = Plan(plan.rows, plan.starts[mine], plan.ends[mine])
            self._cached = (self.epoch, plan)
        return self._cached[1]

    def _all_batches(self) -> Plan:
        if not self.shuffle:
            rows = np.argsort(self.sizes, kind="stable")
            starts = _pack(self.sizes[rows], self.max_tokens)
            return Plan(_compact(rows), starts[:-1], starts[1:])
        sizes = self.sizes if self.epoch_sizes is None else np.asarray(self.epoch_sizes(self.epoch))
        if self.epoch_sizes is not None and (len(sizes) != len(self.sizes) or int(sizes.max(initial=0)) > self.max_tokens):
            raise ValueError(f"epoch {self.epoch}'s sizes: {len(sizes)} pairs (of {len(self.sizes)}), the largest "
                             f"{int(sizes.max(initial=0))} positions (max_tokens {self.max_tokens})")
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.groups is None or self.shares is None:
            order = rng.permutation(len(sizes))
        else:
            order = epoch_rows(self.groups, shares=self.shares, rng=rng)
        windows, cuts = [], []
        for start in range(0, len(order), self.shuffle_window):
            window = order[start : start + self.shuffle_window]
            window = window[np.argsort(sizes[window], kind="stable")]
            windows.append(window)
            cuts.append(start + _pack(sizes[window], self.max_tokens))
        rows = np.concatenate(windows) if windows else order
        starts = np.concatenate([c[:-1] for c in cuts]) if cuts else np.zeros(0, dtype=np.int64)
        ends = np.concatenate([c[1:] for c in cuts]) if cuts else np.zeros(0, dtype=np.int64)
        shuffled = rng.permutation(len(starts))
        return Plan(_compact(rows), starts[shuffled], ends[shuffled])


class Plan(NamedTuple):
    """An epoch's batches as arrays: batch k is rows[starts[k]:ends[k]]. Lists of Python ints would take ~39
    bytes a pair (1.6 GiB at 40M pairs, in every rank); this takes 4 (8 past 2**31 pairs)."""

    rows: np.ndarray  # (N,) row indices, each batch's rows together
    starts: np.ndarray  # (batches,)
    ends: np.ndarray  # (batches,)


def _compact(rows: np.ndarray) -> np.ndarray:
    return rows.astype(np.int32) if len(rows) < 2**31 else rows


def _pack(sizes: np.ndarray, max_tokens: int) -> np.ndarray:
    """Cut pairs of ascending `sizes` greedily into batches of B pairs with B * largest ≤ max_tokens: the
    offsets where batches start, then len(sizes). A loop over batches, not pairs: from a batch's first
    pair, at most max_tokens // its size can follow, and the first that does not fit is found at once."""
    cuts, i, n = [0], 0, len(sizes)
    while i < n:
        window = sizes[i : i + max(1, min(n - i, max_tokens // max(int(sizes[i]), 1)))]
        over = np.arange(1, len(window) + 1) * window > max_tokens  # B * largest, sizes ascending
        i += max(1, int(over.argmax())) if over.any() else len(window)  # the first pair always fits
        cuts.append(i)
    return np.array(cuts, dtype=np.int64)


def collate(rows: list[dict], *, with_text: bool, bos: int, eos: int, pad: int) -> dict:
    """Rows of a tokenised split → a padded batch (keys in the module docstring); the ids: the tokenizer's."""

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        tensors = [torch.tensor(s, dtype=torch.long) for s in seqs]
        return pad_sequence(tensors, batch_first=True, padding_value=pad)

    batch: dict[str, Any] = {
        "src": padded([r["src_ids"] for r in rows]),  # (B, S)
        "tgt_in": padded([[bos, *r["tgt_ids"]] for r in rows]),  # (B, T)
        "tgt_out": padded([[*r["tgt_ids"], eos] for r in rows]),  # (B, T)
    }
    # Found here, on the CPU (in a loader worker, when there are workers), so that the training step need not:
    # selecting them on a GPU (a boolean mask, nonzero) waits for the device to learn how many there are.
    batch["target_positions"] = (batch["tgt_out"] != pad).flatten().nonzero().squeeze(1)  # (N,)
    if with_text:
        batch["src_text"] = [r["src"] for r in rows]
        batch["ref_text"] = [r["tgt"] for r in rows]
        batch["index"] = torch.tensor([r["index"] for r in rows], dtype=torch.long)  # (B,)
        if "direction" in rows[0]:  # (several directions: each row's, an index into the data's directions)
            batch["direction"] = torch.tensor([r["direction"] for r in rows], dtype=torch.long)  # (B,)
    return batch
