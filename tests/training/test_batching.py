"""Tests for seq2seq.training.batching: the token-budget batch sampler (ranks, epochs, seeds) and collate."""

import math
from collections import Counter

import numpy as np

from seq2seq.text.tokenizer import BOS_ID, EOS_ID
from seq2seq.training.batching import TokenBatchSampler, collate
from seq2seq.training.data import TranslationDataModule


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


def reference_batches(sizes: np.ndarray, *, max_tokens: int, shuffle: bool, shuffle_window: int, seed: int,
                      epoch: int, rank: int, world_size: int) -> list[list[int]]:
    """The batch plan as the sampler made it before it was held in arrays: pair by pair, in lists."""

    def pack(order: np.ndarray) -> list[list[int]]:
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

    if not shuffle:
        batches = pack(np.argsort(sizes, kind="stable"))
    else:
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(len(sizes))
        batches = []
        for start in range(0, len(order), shuffle_window):
            window = order[start : start + shuffle_window]
            batches += pack(window[np.argsort(sizes[window], kind="stable")])
        batches = [batches[i] for i in rng.permutation(len(batches))]
    if world_size > 1:
        total = math.ceil(len(batches) / world_size) * world_size
        batches = [batches[i % len(batches)] for i in range(total)][rank::world_size]
    return batches


def test_the_batch_plan_is_the_pair_by_pair_one() -> None:
    """Held in arrays and cut a batch (not a pair) at a time: the same batches in the same order as the
    lists of the pair-by-pair loop, so that a run resumed across the change continues on its batches."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(0, 3000))
        max_tokens = int(rng.choice([8, 64, 300, 4096]))
        sizes = rng.integers(1, max_tokens + 1, n) if trial % 3 else np.minimum(rng.geometric(0.05, n), max_tokens)
        options = {"max_tokens": max_tokens, "shuffle": bool(trial % 2), "shuffle_window": int(rng.choice([7, 500, 10**5])),
                   "seed": trial, "world_size": int(rng.choice([1, 2, 3]))}
        for rank in range(options["world_size"]):
            sampler = TokenBatchSampler(sizes, rank=rank, **options)
            sampler.set_epoch(trial % 4)
            expected = reference_batches(sizes, epoch=trial % 4, rank=rank, **options)
            assert list(sampler) == expected, (trial, rank, options)
            assert len(sampler) == len(expected)


def test_collate_pads_with_pad_id() -> None:
    rows = [{"src_ids": [5, 6, 7], "tgt_ids": [8]}, {"src_ids": [9], "tgt_ids": [10, 11]}]
    batch = collate(rows, with_text=False, bos=2, eos=3, pad=0)
    assert batch["src"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["tgt_in"].tolist() == [[BOS_ID, 8, 0], [BOS_ID, 10, 11]]
    assert batch["tgt_out"].tolist() == [[8, EOS_ID, 0], [10, 11, EOS_ID]]
