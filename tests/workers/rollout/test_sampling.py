"""Sampling on the device (workers/rollout/sampling.py): uniforms equal areal_aio.seeds bit for bit; top-p; draw."""

from __future__ import annotations

import random

import torch

from areal_aio import seeds
from areal_aio.seeds import SEED_BITS, uniform
from areal_aio.workers.rollout.sampling import draw, mix64, nucleus, uniforms

EDGES = [0, 1, 2, 3, 2 ** 31 - 1, 2 ** 32, 2 ** 62, 2 ** 63 - 2, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 1,
         2 ** 64 - 2, 2 ** 64 - 1]
"""Words at the ends of int64 and uint64, where a sign bit or a wrap-around would show."""


def _int64(word: int) -> int:
    return word - 2 ** 64 if word >= 2 ** 63 else word


def test_mix64_equals_the_python_reference_on_every_kind_of_word():
    rng = random.Random(0)
    words = EDGES + [rng.getrandbits(64) for _ in range(20_000)] + [rng.getrandbits(20) for _ in range(2000)]
    got = mix64(torch.tensor([_int64(w) for w in words])).tolist()
    assert [g & seeds.MASK64 for g in got] == [seeds.mix64(w) for w in words]


def test_uniforms_equal_seeds_uniform_bit_for_bit():
    rng = random.Random(1)
    n = 20_000
    seed_words = [rng.getrandbits(SEED_BITS) for _ in range(n)] + [2 ** SEED_BITS - 1, 0] * len(EDGES)
    counters = [rng.choice([rng.getrandbits(64), rng.getrandbits(12)]) for _ in range(n)] + EDGES * 2
    got = uniforms(torch.tensor(seed_words), torch.tensor([_int64(c) for c in counters]))
    assert got.dtype == torch.float32
    want = [uniform(s, c) for s, c in zip(seed_words, counters, strict=True)]
    assert got.tolist() == want  # float32 holds each multiple of 2**-24 exactly
    # seeds past SEED_BITS (any uint64 word) too: the engine never makes them, the bits agree
    wide = [rng.getrandbits(64) for _ in range(2000)] + EDGES
    got = uniforms(torch.tensor([_int64(s) for s in wide]), torch.arange(len(wide)))
    assert got.tolist() == [uniform(s, c) for c, s in enumerate(wide)]


def test_top_p_keeps_the_smallest_nucleus():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = nucleus(logp, torch.tensor([0.7, 0.85])).exp()
    assert torch.allclose(kept[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(kept[1], torch.tensor([0.0, 0.15, 0.3, 0.5]) / 0.95)


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    logp = probs.log().expand(20_000, 4)
    u = torch.tensor([uniform(12345, j) for j in range(20_000)])  # one request's token uniforms
    draws = draw(logp, u)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0  # probability 0 (cut by top-p) is never drawn
    assert torch.allclose(freq, probs, atol=0.015)


def test_a_probability_zero_last_token_is_never_drawn_at_the_largest_uniform():
    logp = torch.tensor([[0.6, 0.4, 0.0]]).log()
    assert int(draw(logp, torch.tensor([1 - 2.0 ** -24]))[0]) == 1


