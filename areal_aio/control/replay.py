"""The replay buffer: rewarded groups wait here until a batch takes them.

Oldest first (by the oldest token version, then admission: the group id), every
group used once. Admission order rather than arrival order keeps a batch's order
independent of which rollout happened to finish first, so a synchronous run trains
on the same batch, in the same order, every time (and again after a resume). `take` drops groups that became too stale while they waited and returns
them apart, so the caller can count them; a group is kept, dropped and trained
whole, because GRPO normalizes within it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_aio.control.staleness import is_stale


@dataclass(slots=True)
class Group:
    """The samples of one prompt, rewarded, ready to train."""

    group_id: int
    task: Any
    samples: Sequence[Any]  # each has .oldest_version
    oldest_version: int = field(init=False)  # of any token in the group; fixed once rewarded

    def __post_init__(self) -> None:
        self.oldest_version = min(s.oldest_version for s in self.samples)


@dataclass(slots=True)
class ReplayBuffer:
    _heap: list[tuple[int, int, Group]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._heap)

    def groups(self) -> list[Group]:
        """The waiting groups (any order)."""
        return [item[2] for item in self._heap]

    def put(self, group: Group) -> None:
        heapq.heappush(self._heap, (group.oldest_version, group.group_id, group))

    def drop_stale(self, version: int, eta: float) -> list[Group]:
        """Remove and return (oldest first) every group whose staleness at `version` exceeds eta:
        the heap's top is the stalest, so only the dropped ones are looked at."""
        dropped = []
        while self._heap and is_stale(version, self._heap[0][0], eta):
            dropped.append(heapq.heappop(self._heap)[2])
        return dropped

    def take(self, n_groups: int, version: int, eta: float) -> tuple[list[Group], list[Group]]:
        """(batch, dropped): the n oldest fresh groups, or an empty batch if fewer are ready.

        Stale groups are dropped first, so whatever is returned has staleness <= eta at `version`.
        """
        dropped = self.drop_stale(version, eta)
        if len(self._heap) < n_groups:
            return [], dropped
        return [heapq.heappop(self._heap)[2] for _ in range(n_groups)], dropped
