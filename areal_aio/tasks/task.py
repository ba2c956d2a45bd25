"""The task: one prompt with its verifiable answer, and a task source as one async stream."""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt with its reference answer; `id` is unique within a source.

    `prompt` is the user message, or a chat: a list of {"role", "content"} turns ending with a
    user turn (the rollout worker applies the model's chat template to the whole list).
    `extra` holds a file row's other columns (JSON values), handed to the reward as keywords."""

    id: str
    prompt: str | list[dict[str, str]]
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The turns of a chat task; None for a plain prompt."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def text(self) -> str:
        """The prompt as one text: itself, or a chat's last user turn (what tables show)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]


async def task_stream(tasks: Iterable[Task] | AsyncIterable[Task], skip: int = 0) -> AsyncIterator[Task]:
    """Any iterable or async iterable of tasks as one async stream, its first `skip` left out
    (a resumed run's source: the tasks the run had already taken)."""
    if isinstance(tasks, AsyncIterable):
        async for task in tasks:
            if skip:
                skip -= 1
                continue
            yield task
    else:
        for task in itertools.islice(tasks, skip, None):
            yield task


def as_number(text: str) -> float | None:
    """`text` as a finite number ("1,234" and " +7 " too), else None."""
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(given: str, reference: str) -> bool:
    """Numbers compare by value (7 == 7.0 == +7), anything else by trimmed, case-folded text."""
    a, b = as_number(given), as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return given.strip().casefold() == reference.strip().casefold()
