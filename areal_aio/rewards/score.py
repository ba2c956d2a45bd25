"""What a reward says of one completion: `Score` (its own module, so that a reward built on
others, as the judge is, imports it without importing the scorer that loads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Score:
    """What a reward function says of one completion."""

    reward: float
    passed: bool  # the final answer is correct
    strict: bool = False  # correct and inside the answer tag
    failed: bool = False  # the reward function raised or timed out (reward 0, counted)
    components: dict[str, float] | None = None  # several rewards: each one's own (unweighted)
