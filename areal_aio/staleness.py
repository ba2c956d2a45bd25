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
synchronous training on the same code path; eta = inf never blocks.
"""

from __future__ import annotations

import math


def may_admit(live: int, count: int, batch_size: int, version: int, eta: float) -> bool:
    """May `count` more rollouts start when `live` are admitted and not dropped?

    The last of them is rollout number n = live + count; it may start while
    floor((n - 1) / B) <= version + eta.
    """
    if math.isinf(eta):
        return True
    return (live + count - 1) // batch_size <= version + eta


def staleness(version: int, oldest_version: int) -> int:
    """Policy updates between the oldest token of a trajectory and the current weights."""
    return version - oldest_version


def is_stale(version: int, oldest_version: int, eta: float) -> bool:
    return staleness(version, oldest_version) > eta
