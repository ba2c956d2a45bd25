"""Rewards: verify a completion against its task.

The built-in reward pays 1 for a correct final answer and a format bonus on top
only when that answer is also inside <answer></answer>. Both shortcuts fail on
SmolLM2-135M: a tag-only reward is 0 for whole groups (no gradient), and a
bonus for the tag alone is learned as "tag a wrong answer". So the tag earns
nothing without correctness.

The final answer is the last tagged answer when the reply has one, else the
last number in the reply. `pass` = correct final answer, `strict` = correct and
tagged.

A reward function is any callable `(task, completion_text)` returning a float,
a `Score`, or an awaitable of either. Floats become `Score(reward, passed=reward > 0)`.
The contract (`Scorer`): every reward is finite or it is a counted failure (reward 0):
one that raises, returns anything else (NaN, inf, a string), or takes longer than
`controller.reward_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import math
import pickle
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_aio.reward_pool import RewardPool, RewardPoolBroken
from areal_aio.tasks import Task

TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True, slots=True)
class Score:
    """What a reward function says of one completion."""

    reward: float
    passed: bool  # the final answer is correct
    strict: bool = False  # correct and inside the answer tag
    failed: bool = False  # the reward function raised or timed out (reward 0, counted)


def final_answer(text: str) -> tuple[str | None, bool]:
    """(final answer, whether it was tagged); (None, False) when the reply has no answer."""
    tags = TAG.findall(text)
    if tags:
        inner = tags[-1].strip()
        numbers = NUMBER.findall(inner)
        return (numbers[-1] if numbers and not _is_number(inner) else inner), True
    numbers = NUMBER.findall(text)
    return (numbers[-1] if numbers else None), False


def _is_number(text: str) -> bool:
    return _as_number(text) is not None


def _as_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(given: str, reference: str) -> bool:
    """Numbers compare by value (7 == 7.0 == +7), anything else by trimmed, case-folded text."""
    a, b = _as_number(given), _as_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return given.strip().casefold() == reference.strip().casefold()


@dataclass(frozen=True, slots=True)
class AnswerReward:
    """Correctness reward with a format bonus gated on correctness (picklable: runs in a process pool)."""

    format_bonus: float = 0.2

    def __call__(self, task: Task, completion: str) -> Score:
        answer, tagged = final_answer(completion)
        correct = answer is not None and same_answer(answer, task.answer)
        bonus = self.format_bonus if correct and tagged else 0.0
        return Score(reward=float(correct) + bonus, passed=correct, strict=correct and tagged)


def as_score(value: Any) -> Score:
    """Normalize what a user's reward function returned; TypeError unless its reward is finite."""
    if isinstance(value, Score):
        if not _finite(value.reward):
            raise TypeError(f"a Score's reward must be a finite number, got {value.reward!r}")
        return value if type(value.reward) is float else dataclasses.replace(value, reward=float(value.reward))
    if not _finite(value):
        raise TypeError(f"a reward function must return a finite float or a Score, got {value!r}")
    return Score(reward=float(value), passed=value > 0)


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


FAILED = Score(reward=0.0, passed=False, strict=False, failed=True)


class Scorer:
    """Runs a reward function with a timeout; every result is finite or a counted failure.

    Where each kind of reward function runs:
      * async: awaited on the loop, cancelled at the timeout;
      * sync and picklable, `procs` > 0: in the reward pool (`reward_pool.py`); a call past
        the timeout has its process killed and replaced; a pool that keeps breaking raises
        RewardPoolBroken, which stops the run;
      * sync, not picklable (a lambda, a closure) or `procs` = 0: in a daemon thread of its
        own; past the timeout the thread is abandoned (a thread cannot be killed), which
        keeps it from delaying the process's exit;
      * the built-in AnswerReward with `procs` = 0: inline on the caller's thread (it takes
        microseconds; a thread or pool hop would cost more than it saves).
    """

    def __init__(self, fn: Any, *, timeout_s: float, procs: int, log_path: Path | None = None) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.failures = 0
        self._pool: RewardPool | None = None
        self._inline = procs == 0 and type(fn) is AnswerReward
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__)
        if self._async or self._inline or procs == 0:
            return
        try:
            pickle.dumps(fn)
        except Exception:  # noqa: BLE001 - lambdas and closures go to a thread instead
            return
        self._pool = RewardPool(fn, procs=procs, timeout_s=timeout_s, log_path=log_path)

    @property
    def inline(self) -> bool:
        """True when `score_inline` may be used: the built-in reward with procs = 0."""
        return self._inline

    @property
    def pool(self) -> RewardPool | None:
        return self._pool

    def score_inline(self, task: Task, completion: str) -> Score:
        """Score on the caller's thread (no task, no pool hop); failures score 0 and are counted."""
        try:
            return as_score(self.fn(task, completion))
        except Exception:  # noqa: BLE001 - a failing reward scores 0 and is counted
            return self._failed()

    async def score(self, task: Task, completion: str) -> Score:
        """The reward of one completion; RewardPoolBroken when the pool cannot go on."""
        if self._inline:
            return self.score_inline(task, completion)
        try:
            if self._async:
                value = await asyncio.wait_for(self.fn(task, completion), self.timeout_s)
            elif self._pool is not None:
                value = await self._pool.call(task, completion)
            else:
                value = await asyncio.wait_for(_in_thread(self.fn, task, completion), self.timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return as_score(value)
        except (asyncio.CancelledError, RewardPoolBroken):
            raise
        except BaseException:  # noqa: BLE001 - a failing reward scores 0 and is counted
            return self._failed()

    def _failed(self) -> Score:
        self.failures += 1
        return FAILED

    async def aclose(self) -> None:
        """Kill and reap the pool's processes (a thread left in a hung call is a daemon: abandoned)."""
        if self._pool is not None:
            await self._pool.aclose()


def _in_thread(fn: Any, task: Task, completion: str) -> asyncio.Future:
    """fn(task, completion) in a daemon thread of its own: unlike asyncio.to_thread (the loop's
    executor, joined at loop close and at exit), one that never returns is left behind."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            result = (True, fn(task, completion))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed while this call hung
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(target=work, name="reward", daemon=True).start()
    return future
