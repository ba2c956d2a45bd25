"""Token-budget micro-batching (AReaL's dynamic batching), padded to the longest member.

A micro-batch is a run of consecutive sequences padded to the longest one, so
its memory is `len(members) * longest` tokens; the packer keeps that product at
or under `max_tokens`. Long and short sequences then share memory well without
a fixed micro-batch size, and gradients accumulate across micro-batches.

    lengths [7, 3, 9, 2], max_tokens 16  ->  [[0, 1], [2], [3]]   (2*7, 1*9, 1*2)

Order is kept (sequence i is never after sequence i+1), every index appears
exactly once, and a single sequence longer than the budget gets a micro-batch
of its own rather than an error.

Why padded and not packed into one row: on CPU the attention kernels that skip
cross-sequence blocks are missing, so one long packed row pays attention over
the whole row (quadratic in its length) while padding to the longest of a few
similar sequences wastes only the gap.
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


def group_micro_batches(prompt_lengths: Sequence[int], completion_lengths: Sequence[Sequence[int]],
                        max_tokens: int) -> list[list[int]]:
    """Group indices packed like `micro_batches`, for groups that share one prompt.

    Group g is one prompt of prompt_lengths[g] tokens followed by its completions
    completion_lengths[g]. A micro-batch of groups costs (groups x longest prompt) +
    (completions x longest completion): the prompt block runs once per group and each
    completion runs once on its group's prompt KV (workers/trainer.py, share_prompts).

        prompts [50, 52], completions [[9]*8, [20]*8], max_tokens 300
            -> [[0], [1]]      (2*52 + 16*20 = 424 > 300)
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(prompt_lengths) != len(completion_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompts but {len(completion_lengths)} completion lists")
    batches: list[list[int]] = []
    current: list[int] = []
    longest_p = longest_c = rows = 0
    for g, (p, cs) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        if p < 0 or any(c < 0 for c in cs):
            raise ValueError(f"group {g} has a negative length")
        grown_p, grown_c = max(longest_p, p), max([longest_c, *cs])
        if current and (len(current) + 1) * grown_p + (rows + len(cs)) * grown_c > max_tokens:
            batches.append(current)
            current, rows, grown_p, grown_c = [], 0, p, max(cs, default=0)
        current.append(g)
        rows += len(cs)
        longest_p, longest_c = grown_p, grown_c
    if current:
        batches.append(current)
    return batches
