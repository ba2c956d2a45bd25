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
