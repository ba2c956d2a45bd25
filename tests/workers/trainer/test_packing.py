"""workers/trainer/packing.py: the budget holds, every sequence appears once, order is kept."""

from __future__ import annotations

import random

import pytest

from areal_aio.workers.trainer.packing import micro_batches, padded_tokens


def test_worked_example() -> None:
    assert micro_batches([7, 3, 9, 2], 16) == [[0, 1], [2], [3]]


def test_padding_to_the_longest_counts_against_the_budget() -> None:
    # 4 + 4 = 8 fits 10 unpadded, but padded it is 2 * 6 = 12
    assert micro_batches([2, 6], 10) == [[0], [1]]
    assert micro_batches([5, 5], 10) == [[0, 1]]


def test_a_sequence_longer_than_the_budget_travels_alone() -> None:
    assert micro_batches([3, 50, 3, 3], 16) == [[0], [1], [2, 3]]


def test_empty_and_zero_length() -> None:
    assert micro_batches([], 8) == []
    assert micro_batches([0, 0, 4], 12) == [[0, 1, 2]]


def test_bad_budget_and_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        micro_batches([1], 0)
    with pytest.raises(ValueError):
        micro_batches([1, -2], 8)


@pytest.mark.parametrize("seed", range(20))
def test_random_invariants(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 60))]
    cap = rng.randint(16, 600)
    batches = micro_batches(lengths, cap)
    flat = [i for b in batches for i in b]
    assert flat == list(range(len(lengths)))  # each exactly once, order kept
    for b in batches:
        assert b
        assert padded_tokens(lengths, b) <= cap or len(b) == 1
    # greedy: the next sequence would not have fitted into the previous micro-batch
    for prev, nxt in zip(batches, batches[1:], strict=False):
        assert padded_tokens(lengths, [*prev, nxt[0]]) > cap
