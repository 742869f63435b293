"""The training pairs under BPE-dropout (text/bpe_dropout.py): each epoch's pieces, read by (epoch, row) keys.

TokenBatchSampler, given this dataset's `sizes` as its `epoch_sizes`, plans each epoch's batches on that epoch's
sizes and yields (epoch, row) keys; this dataset answers them with that epoch's pieces. The epoch travels in the
keys because a loader worker (another process) has no other way to learn it, and both sides compute the same
pieces from (seed, epoch, row) alone, so the plan's sizes are the batches' sizes in every worker and rank, and a
resumed run sees what an unbroken one would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset

from seq2seq.text.bpe_dropout import Resegmenter


class ResplitPairs(Dataset):
    """Rows {"src_ids", "tgt_ids"} (what training's collate reads) of epoch e's pieces, by (e, row) keys."""

    def __init__(self, *, src: Resegmenter, tgt: Resegmenter) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"{len(src)} source sequences but {len(tgt)} target sequences")
        self.src, self.tgt = src, tgt

    def __len__(self) -> int:
        return len(self.src)

    def sizes(self, epoch: int) -> np.ndarray:
        """(N,) each pair's padded positions in `epoch`: max(len(src), len(tgt) + 1), as batching.py counts."""
        return np.maximum(self.src.lengths(epoch), self.tgt.lengths(epoch) + 1)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, list[int]]:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> list[dict[str, list[int]]]:
        """A batch's rows (the DataLoader hands a batch's keys at once): one epoch's, as the sampler yields them."""
        epochs = {epoch for epoch, _ in keys}
        if len(epochs) > 1:
            raise ValueError(f"one batch's keys are of epochs {sorted(epochs)}")
        rows = [row for _, row in keys]
        epoch = epochs.pop() if epochs else 0
        src, tgt = self.src.ids(epoch, rows), self.tgt.ids(epoch, rows)
        return [{"src_ids": s, "tgt_ids": t} for s, t in zip(src, tgt, strict=True)]
