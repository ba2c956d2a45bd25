"""Token-budget micro-batching (AReaL's dynamic batching): which rows share a micro-batch.

A micro-batch is a run of consecutive rows padded to the longest one, so it
computes `len(members) * longest` token positions; the packer keeps that
product at or under `max_tokens`. Long and short rows then share memory well
without a fixed micro-batch size, and gradients accumulate across micro-batches.
A row is a sample (prompt + completion) or, with shared prompts, a whole group
packed into one row (workers/trainer/microbatch.py builds both): the lengths given here
are what the model computes, so the budget counts the real work.

    lengths [7, 3, 9, 2], max_tokens 16  ->  [[0, 1], [2], [3]]   (2*7, 1*9, 1*2)

Order is kept (sequence i is never after sequence i+1), every index appears
exactly once, and a single sequence longer than the budget gets a micro-batch
of its own rather than an error.

Why rows are padded and not all packed into one: on CPU the attention kernels
that skip cross-sequence blocks are missing, so one long packed row pays
attention over the whole row (quadratic in its length) while padding to the
longest of a few similar rows wastes only the gap.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches whose padded size fits `max_tokens`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        grown = max(longest, n)
        if current and grown * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, grown = [], n
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def padded_tokens(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """Tokens a micro-batch occupies once padded: members x longest member."""
    return len(batch) * max((lengths[i] for i in batch), default=0)


def split(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `costs` dealt to `parts` parts: largest first, each to the part with the least
    so far (ties: the lower index and part); each part's indices in order. Deterministic, so
    every rank of a data-parallel trainer computes the same split without a message; a part
    may get none."""
    shares: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min(range(parts), key=lambda r: (load[r], r))
        shares[part].append(i)
        load[part] += costs[i]
    return [sorted(s) for s in shares]
