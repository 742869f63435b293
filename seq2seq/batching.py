"""Token-budget batches: a batch sampler for Lightning and the collate function.

A pair costs max(len(src), len(tgt) + 1) padded positions; a batch of B pairs costs B times its
largest pair, and that product is ≤ max_tokens, so neither src nor tgt_in/tgt_out holds more than
max_tokens positions. Batches (dicts):
  src      (B, S) long   source ids, no BOS/EOS
  tgt_in   (B, T) long   BOS + y
  tgt_out  (B, T) long   y + EOS
padded with PAD_ID; with text (validation/test) also src_text, ref_text and index (B,).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from seq2seq.tokenizer import BOS_ID, EOS_ID, PAD_ID


class TokenBatchSampler:
    """Lists of row indices whose padded size fits `max_tokens` (see the module docstring).

    Training: a permutation drawn from (seed, epoch) is cut into windows of `shuffle_window` pairs;
    each window is sorted by size and cut greedily into batches, and the batches are shuffled.
    Evaluation: the whole split sorted by size, the same batches in the same order every time.
    Each rank then takes every world_size-th batch of the list, padded to a multiple of world_size
    by repeating its first batches. The batch count may differ slightly between epochs (windows
    pack differently); Lightning reads `len` once, at the first epoch.

    Resumable: `state_dict` is (epoch, batches already trained on this epoch); after
    `load_state_dict` the next iteration yields the rest of that epoch, the same batches in the same
    order as a run that never stopped (ResumableLoader in data.py says who counts the batches).
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
    ) -> None:
        if len(sizes) and int(sizes.max()) > max_tokens:
            raise ValueError(f"a pair needs {int(sizes.max())} positions but max_tokens is {max_tokens}")
        self.sizes, self.max_tokens, self.shuffle = np.asarray(sizes), max_tokens, shuffle
        self.shuffle_window, self.seed, self.rank, self.world_size = shuffle_window, seed, rank, world_size
        self.epoch = 0
        self._skip = 0  # batches of this epoch trained before a resume: the next iteration starts after them
        self._cached: tuple[int, list[list[int]]] | None = None  # (epoch, this rank's batches)

    @property
    def sampler(self) -> TokenBatchSampler:
        # Lightning calls `set_epoch` on `dataloader.sampler` and `dataloader.batch_sampler.sampler`,
        # never on the batch sampler itself (lightning.fabric.utilities.data._set_sampler_epoch).
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._skip = epoch, 0

    def __iter__(self) -> Iterator[list[int]]:
        skip, self._skip = self._skip, 0  # only the first iteration after a resume skips
        yield from self._batches()[skip:]  # a generator: batches are made at the first `next`

    def state_dict(self, *, batches_done: int) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": batches_done, **self._order()}

    def _order(self) -> dict[str, int]:
        """What decides the batches and their order, besides the epoch."""
        return {"seed": self.seed, "world_size": self.world_size, "max_tokens": self.max_tokens,
                "shuffle_window": self.shuffle_window, "pairs": len(self.sizes)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue where `state` left off; a finished epoch continues with the next one."""
        changed = [f"{key} {state.get(key)} -> {value}" for key, value in self._order().items() if state.get(key) != value]
        if changed:
            warnings.warn(f"the data order changed since the checkpoint ({', '.join(changed)}): training goes on, "
                          "but not on the batches the first run would have seen", stacklevel=2)
        self.epoch, self._skip = state["epoch"], state["batches_done"]
        if self._skip >= len(self._batches()):
            self.epoch, self._skip = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self._batches())

    def _batches(self) -> list[list[int]]:
        if self._cached is None or self._cached[0] != self.epoch:
            batches = self._all_batches()
            if self.world_size > 1:
                total = math.ceil(len(batches) / self.world_size) * self.world_size
                batches = [batches[i % len(batches)] for i in range(total)][self.rank :: self.world_size]
            self._cached = (self.epoch, batches)
        return self._cached[1]

    def _all_batches(self) -> list[list[int]]:
        if not self.shuffle:
            return _pack(np.argsort(self.sizes, kind="stable"), self.sizes, self.max_tokens)
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.sizes))
        batches = []
        for start in range(0, len(order), self.shuffle_window):
            window = order[start : start + self.shuffle_window]
            batches += _pack(
                window[np.argsort(self.sizes[window], kind="stable")], self.sizes, self.max_tokens
            )
        return [batches[i] for i in rng.permutation(len(batches))]


def _pack(order: np.ndarray, sizes: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Cut `order` (ascending size) greedily into batches of B pairs with B * largest ≤ max_tokens."""
    batches: list[list[int]] = []
    batch: list[int] = []
    largest = 0
    for i, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        if batch and (len(batch) + 1) * max(largest, size) > max_tokens:
            batches.append(batch)
            batch, largest = [], 0
        batch.append(i)
        largest = max(largest, size)
    return [*batches, batch] if batch else batches


def collate(rows: list[dict], *, with_text: bool) -> dict:
    """Rows of a tokenised split → a padded batch (keys in the module docstring)."""

    def pad(seqs: list[list[int]]) -> torch.Tensor:
        tensors = [torch.tensor(s, dtype=torch.long) for s in seqs]
        return pad_sequence(tensors, batch_first=True, padding_value=PAD_ID)

    batch: dict[str, Any] = {
        "src": pad([r["src_ids"] for r in rows]),  # (B, S)
        "tgt_in": pad([[BOS_ID, *r["tgt_ids"]] for r in rows]),  # (B, T)
        "tgt_out": pad([[*r["tgt_ids"], EOS_ID] for r in rows]),  # (B, T)
    }
    if with_text:
        batch["src_text"] = [r["src"] for r in rows]
        batch["ref_text"] = [r["tgt"] for r in rows]
        batch["index"] = torch.tensor([r["index"] for r in rows], dtype=torch.long)  # (B,)
    return batch
