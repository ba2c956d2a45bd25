"""Counter-based sampling randomness: every random number is a pure function of (seed, counter).

    controller: seed of a training rollout = sample_seed(run.seed, group id, sample index, retry)
                seed of a process-reward continuation = continuation_seed(run.seed, group id,
                sample index, retry, step i, continuation j)
    engine:     uniform for the j-th completion token of a request = uniform(seed, j)

A shared random stream would hand each row whatever number comes next, so the tokens a request
gets would depend on which other requests happened to share its decode steps (pipe timing);
two identical runs then train on different samples and a resumed run cannot repeat the
uninterrupted one. With a number per (request, token) the draws are the same however requests
are batched, interrupted or re-dispatched after a resume.

splitmix64 (Steele, Lea, Flood 2014) is the mixer: a bijection on 64-bit words whose outputs
pass BigCrush even for counter inputs. Here it runs in Python ints (exact 64-bit arithmetic, no
overflow care), the reference; the engine computes the same words in int64 tensor ops on its
device, all rows of a decode step at once (workers/rollout/sampling.py, equal bit for bit). No torch
here, so the controller can compute seeds.
"""

from __future__ import annotations

import functools

MASK64 = (1 << 64) - 1
UNIFORM_BITS = 24
"""Bits of a uniform: a multiple of 2**-24 is exact in float32 and at most 1 - 2**-24, so
u * total mass stays below the total and inverse-CDF sampling never runs past the last token."""
SEED_BITS = 63
"""Seeds stay below 2**63: a signed 64-bit integer everywhere (JSON, torch)."""


def mix64(x: int) -> int:
    """splitmix64's finalizer of x + golden gamma: a 64-bit bijection with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derive(*parts: int) -> int:
    """A seed from a tuple of non-negative integers (order matters), below 2**SEED_BITS."""
    return _chain(0, parts) >> (64 - SEED_BITS)


def _chain(h: int, parts: tuple[int, ...]) -> int:
    """derive's 64-bit state after `parts`, starting from state h."""
    for part in parts:
        h = mix64(h ^ (part & MASK64))
    return h


@functools.lru_cache(maxsize=1024)
def _group_state(run_seed: int, group_id: int) -> int:
    """The state the seeds of one group's samples share (computed once per group, not per sample)."""
    return _chain(0, (run_seed, group_id))


def sample_seed(run_seed: int, group_id: int, index: int, retry: int) -> int:
    """The sampling seed of one training rollout: sample `index` of group `group_id`, attempt
    `retry`; equal to derive(run_seed, group_id, index, retry)."""
    return _chain(_group_state(run_seed, group_id), (index, retry)) >> (64 - SEED_BITS)


def continuation_seed(run_seed: int, group_id: int, index: int, retry: int, step: int, j: int) -> int:
    """The sampling seed of continuation `j` from step prefix `step` of one training rollout
    (areal_aio.rewards.process); six parts, so it never equals a rollout's four-part seed by design."""
    return derive(run_seed, group_id, index, retry, step, j)


def uniform(seed: int, counter: int) -> float:
    """The counter-th uniform in [0, 1) of `seed`, a multiple of 2**-UNIFORM_BITS."""
    return (mix64(seed ^ mix64(counter)) >> (64 - UNIFORM_BITS)) * 2.0 ** -UNIFORM_BITS
