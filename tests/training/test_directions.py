"""Tests for seq2seq.training.directions: a multilingual run's directions, their temperature shares and an epoch's
rows drawn in them, and the batch sampler over several directions."""

from collections import Counter

import numpy as np
import pytest

from seq2seq.training.batching import TokenBatchSampler
from seq2seq.training.directions import Direction, check_directions, epoch_rows, sampling_shares


def test_temperature_one_keeps_the_corpus_proportions_and_a_large_one_approaches_equal_shares():
    pairs = [90_000, 9_000, 1_000]
    np.testing.assert_allclose(sampling_shares(pairs, weights=[1, 1, 1], temperature=1), [0.9, 0.09, 0.01])
    five = sampling_shares(pairs, weights=[1, 1, 1], temperature=5)
    expected = np.array([0.9, 0.09, 0.01]) ** 0.2
    np.testing.assert_allclose(five, expected / expected.sum())
    assert five[2] > 0.01 * 10  # the smallest direction drawn over ten times its own share
    np.testing.assert_allclose(sampling_shares(pairs, weights=[1, 1, 1], temperature=1e9), [1 / 3] * 3, atol=1e-6)
    # a weight multiplies a direction's size before the temperature; a direction without pairs gets nothing
    np.testing.assert_allclose(sampling_shares([100, 100, 0], weights=[3, 1, 1], temperature=1), [0.75, 0.25, 0])


@pytest.mark.parametrize("temperature", [0, -1, float("nan"), float("inf")])
def test_a_temperature_that_is_no_positive_number_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        sampling_shares([10, 10], weights=[1, 1], temperature=temperature)


def test_an_epoch_draws_each_direction_in_its_share_repeating_the_small_and_subsampling_the_large():
    groups = np.array([0] * 900 + [1] * 90 + [2] * 10)
    shares = sampling_shares([900, 90, 10], weights=[1, 1, 1], temperature=5)
    rows = epoch_rows(groups, shares=shares, rng=np.random.default_rng(0))
    assert len(rows) == len(groups)
    counts = Counter(groups[rows].tolist())
    assert sum(counts.values()) == 1000
    for k in range(3):
        assert abs(counts[k] - shares[k] * 1000) < 1  # rounded to whole pairs, summing to the epoch's
    small = Counter(rows[groups[rows] == 2].tolist())  # drawn ~17 times its size: every pair as often, +-1
    assert set(small) == set(range(990, 1000)) and max(small.values()) - min(small.values()) <= 1
    large = rows[groups[rows] == 0]
    assert len(set(large.tolist())) == len(large)  # subsampled: no pair twice
    again = epoch_rows(groups, shares=shares, rng=np.random.default_rng(0))
    assert np.array_equal(rows, again)  # the same generator, the same epoch
    assert not np.array_equal(rows, epoch_rows(groups, shares=shares, rng=np.random.default_rng(1)))


def test_a_share_too_small_for_a_whole_pair_still_draws_one():
    groups = np.array([0] * 9_999 + [1])
    rows = epoch_rows(groups, shares=np.array([1 - 1e-9, 1e-9]), rng=np.random.default_rng(0))
    assert Counter(groups[rows].tolist()) == {0: 9_999, 1: 1}


def test_the_sampler_mixes_directions_in_batches_in_their_shares_and_resumes_the_same_batches():
    rng = np.random.default_rng(3)
    groups = np.repeat([0, 1], [2_000, 200])
    sizes = rng.integers(4, 40, size=len(groups))
    shares = sampling_shares([2_000, 200], weights=[1, 1], temperature=5)

    def sampler() -> TokenBatchSampler:
        return TokenBatchSampler(sizes, max_tokens=512, shuffle=True, shuffle_window=500, seed=7, groups=groups,
                                 shares=shares)

    first = sampler()
    first.set_epoch(2)
    batches = list(first)
    assert sum(len(batch) for batch in batches) == len(groups)
    assert all(max(sizes[batch]) * len(batch) <= 512 for batch in batches)
    seen = Counter(int(groups[i]) for batch in batches for i in batch)
    assert abs(seen[1] - shares[1] * len(groups)) < 1  # the small direction at its temperature share
    mixed = sum(len({int(groups[i]) for i in batch}) > 1 for batch in batches)
    assert mixed > len(batches) / 2  # most batches hold both directions
    other = sampler()
    other.set_epoch(3)
    assert list(other) != batches  # each epoch draws again
    resumed = sampler()
    resumed.load_state_dict(first.state_dict(batches_done=5))
    assert list(resumed) == batches[5:]


def test_the_sampler_warns_when_a_resume_finds_other_shares():
    groups, sizes = np.repeat([0, 1], [50, 50]), np.full(100, 4)
    before = TokenBatchSampler(sizes, max_tokens=64, shuffle=True, groups=groups, shares=np.array([0.5, 0.5]))
    after = TokenBatchSampler(sizes, max_tokens=64, shuffle=True, groups=groups, shares=np.array([0.7, 0.3]))
    with pytest.warns(UserWarning, match="the data order changed since the checkpoint .*shares"):
        after.load_state_dict(before.state_dict(batches_done=1))


def test_groups_and_shares_go_together():
    with pytest.raises(ValueError, match="groups .* and shares .* go together"):
        TokenBatchSampler(np.full(4, 3), max_tokens=16, shuffle=True, groups=np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match="go together"):
        TokenBatchSampler(np.full(4, 3), max_tokens=16, shuffle=True, groups=np.zeros(3, dtype=int),
                          shares=np.ones(1))


def test_a_direction_names_what_is_wrong_with_it_in_one_line():
    assert Direction(src_lang="de", tgt_lang="en", train_files=["a.de", "a.en"]).name == "de-en"
    for kwargs, message in [
        (dict(src_lang="de", tgt_lang="de", train_files=["a", "b"]), "direction de-de: src_lang and tgt_lang are both"),
        (dict(src_lang="de", tgt_lang="en"), "direction de-en: no training data; give train_files or hf_name"),
        (dict(src_lang="de", tgt_lang="en", hf_name="x", weight=0), "direction de-en: weight must be a positive"),
        (dict(src_lang="de", tgt_lang="e n", hf_name="x"), "'e n' is not a language code a tag can hold"),
    ]:
        with pytest.raises(ValueError, match=message):
            Direction(**kwargs)
    one = Direction(src_lang="de", tgt_lang="en", hf_name="x")
    with pytest.raises(ValueError, match="direction de-en is listed twice"):
        check_directions([one, Direction(src_lang="fr", tgt_lang="en", hf_name="x"), one])
    with pytest.raises(ValueError, match="directions is empty"):
        check_directions([])
