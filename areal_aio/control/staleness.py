"""The staleness rules: who may start (admission) and who may be trained (acceptance).

    version i    = committed trainer updates (0 = initial weights); only the controller advances it
    staleness    = i - oldest token version of a trajectory, measured when its batch is formed
    admission    = AReaL's rate control: the n-th live rollout (1-based) may start only while
                   floor((n - 1) / B) <= i + eta          (B = batch size in samples)
    acceptance   = at batch formation, staleness > eta -> dropped and counted

Admission alone bounds staleness only if every admitted rollout is trained in
the batch its index names; drops and restarts break that, so acceptance checks
again and no trained sample is ever older than eta. A dropped rollout gives its
admission slot back ("live" = admitted and not dropped), otherwise the batches
it was counted in could never fill and the run would stall. eta = 0 is
synchronous training on the same code path; eta = inf is bounded only by the cap on outstanding rollouts.
"""

from __future__ import annotations

import asyncio
import math


def may_admit(live: int, count: int, batch_size: int, version: int, eta: float,
              outstanding: int = 0, max_outstanding: int = 0) -> bool:
    """May `count` more rollouts start when `live` were admitted so far and not dropped?

    The last of them is rollout number n = live + count; it may start while
    floor((n - 1) / B) <= version + eta. `live` never goes down when a batch is
    trained: that is what makes the rule a bound (at version i at most
    (i + eta + 1) * B rollouts have ever started, i * B of them trained).
    `max_outstanding` > 0 also caps rollouts started but not yet trained, the
    only bound when eta is infinite.
    """
    if max_outstanding and outstanding + count > max_outstanding:
        return False
    if math.isinf(eta):
        return True
    return (live + count - 1) // batch_size <= version + eta


def staleness(version: int, oldest_version: int) -> int:
    """Policy updates between the oldest token of a trajectory and the current weights."""
    return version - oldest_version


def is_stale(version: int, oldest_version: int, eta: float) -> bool:
    return staleness(version, oldest_version) > eta


class Admission:
    """The admission rule's state, its one owner: `live`, `trained`, `version` and the capacity
    event that wakes a dispatcher blocked on the rule.

    Three things change it: `admit` (a group starts: live up), `drop` (rollouts given up: their
    slots come back, live down) and `commit` (a trained batch: version and trained up). Training
    never lowers `live` (see `may_admit`); `drop` and `commit` are what release capacity.
    """

    def __init__(self, batch_size: int, eta: float, max_outstanding: int = 0, *,
                 version: int = 0, trained: int = 0) -> None:
        self.batch_size = batch_size
        self.eta = eta
        self.max_outstanding = max_outstanding
        self.version = version  # committed trainer updates; advanced only by `commit`
        self.trained = trained  # rollouts trained
        self.live = trained  # rollouts ever admitted and not dropped: N_r of the rule
        self._capacity = asyncio.Event()

    @property
    def outstanding(self) -> int:
        """Rollouts admitted and not trained (nor dropped)."""
        return self.live - self.trained

    def may_admit(self, count: int) -> bool:
        return may_admit(self.live, count, self.batch_size, self.version, self.eta,
                         self.outstanding, self.max_outstanding)

    async def wait(self, count: int) -> None:
        """Block until `count` more rollouts may start (a commit or a drop wakes it)."""
        while not self.may_admit(count):
            self._capacity.clear()
            await self._capacity.wait()

    def admit(self, count: int) -> None:
        """`count` rollouts start (the caller waited for the rule, or redoes admitted ones)."""
        self.live += count

    def drop(self, count: int) -> None:
        """`count` admitted rollouts are given up: their slots come back."""
        self.live -= count
        self._capacity.set()

    def commit(self, version: int, trained: int) -> None:
        """The trainer committed `version` from a batch of `trained` rollouts."""
        self.version = version
        self.trained += trained
        self._capacity.set()
