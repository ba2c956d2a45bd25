"""A worker's busy time: how long it had work in hand, however many pieces at once (the idle
fractions of a run's summary), and when it starts and stops having any (the `busy` events a
report's timeline draws). A RolloutPool keeps one per rollout worker; the controller one per
role."""

from __future__ import annotations

import time
from collections.abc import Callable


class Busy:
    """Integrates the time a worker has work in hand (for idle fractions); `on_change(busy)` is
    called when it starts or stops having work (the `busy` events a report's timeline draws)."""

    def __init__(self, on_change: Callable[[bool], None] = lambda busy: None) -> None:
        self.active = 0
        self.total = 0.0
        self._since = 0.0
        self._on_change = on_change

    def up(self, n: int = 1) -> None:
        """`n` more pieces of work in hand."""
        if n and self.active == 0:
            self._since = time.perf_counter()
            self._on_change(True)
        self.active += n

    def down(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += time.perf_counter() - self._since
            self._on_change(False)

    def seconds(self) -> float:
        return self.total + (time.perf_counter() - self._since if self.active else 0.0)
