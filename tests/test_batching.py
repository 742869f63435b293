"""Tests for seq2seq.batching: the token-budget batch sampler (ranks, epochs, seeds) and collate."""

import math
from collections import Counter

import numpy as np

from seq2seq.batching import TokenBatchSampler, collate
from seq2seq.data import TranslationDataModule
from seq2seq.tokenizer import BOS_ID, EOS_ID


def test_two_ranks_share_an_epoch(multi30k: TranslationDataModule) -> None:
    sizes = multi30k.sizes["train"]
    ranks = [TokenBatchSampler(sizes, max_tokens=4096, shuffle=True, rank=r, world_size=2) for r in (0, 1)]
    whole = TokenBatchSampler(sizes, max_tokens=4096, shuffle=True)
    for sampler in [*ranks, whole]:
        sampler.set_epoch(3)
    batches = [list(sampler) for sampler in ranks]
    assert len(batches[0]) == len(batches[1]) == len(ranks[0]) == math.ceil(len(whole) / 2)
    seen = Counter(i for rank in batches for batch in rank for i in batch)
    assert set(seen) == set(range(len(sizes)))  # every pair
    repeated = sorted(i for i, n in seen.items() if n > 1)
    # Only the padding: when the batch count is odd, the first batch is dealt again.
    assert repeated == (sorted(list(whole)[0]) if len(whole) % 2 else [])


def test_more_ranks_than_batches_still_get_equal_counts() -> None:
    sizes = np.full(10, 5)
    samplers = [TokenBatchSampler(sizes, max_tokens=25, shuffle=True, rank=r, world_size=4) for r in range(4)]
    batches = [list(s) for s in samplers]
    assert [len(b) for b in batches] == [1, 1, 1, 1]
    assert Counter(i for rank in batches for b in rank for i in b).keys() == set(range(10))


def test_order_is_seeded_and_changes_by_epoch(multi30k: TranslationDataModule) -> None:
    sizes = multi30k.sizes["train"]

    def batches(seed: int, epoch: int) -> list[list[int]]:
        sampler = TokenBatchSampler(sizes, max_tokens=4096, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert batches(0, 0) == batches(0, 0)
    assert batches(0, 1) != batches(0, 0)
    assert batches(1, 0) != batches(0, 0)
    assert {i for b in batches(0, 1) for i in b} == set(range(len(sizes)))


def test_collate_pads_with_pad_id() -> None:
    rows = [{"src_ids": [5, 6, 7], "tgt_ids": [8]}, {"src_ids": [9], "tgt_ids": [10, 11]}]
    batch = collate(rows, with_text=False)
    assert batch["src"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["tgt_in"].tolist() == [[BOS_ID, 8, 0], [BOS_ID, 10, 11]]
    assert batch["tgt_out"].tolist() == [[8, EOS_ID, 0], [10, 11, EOS_ID]]
