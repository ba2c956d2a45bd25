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
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing
import pickle
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

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
    """Normalize what a user's reward function returned."""
    if isinstance(value, Score):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"a reward function must return a finite float or a Score, got {value!r}")
    return Score(reward=float(value), passed=value > 0)


class Scorer:
    """Runs a reward function off the event loop with a timeout; failures score 0 and are counted.

    Sync functions run in a process pool (`procs` > 0 and picklable), else in a
    thread; `procs` = 0 with a picklable sync function scores inline, for rewards
    that take microseconds (the built-in one) where a pool hop costs more than it saves.
    Async functions are awaited on the loop.
    """

    def __init__(self, fn: Any, *, timeout_s: float, procs: int) -> None:
        self.fn = fn
        self.timeout_s = timeout_s
        self.failures = 0
        self._pool: ProcessPoolExecutor | None = None
        self._inline = False
        self._async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__)
        if self._async:
            return
        try:
            pickle.dumps(fn)
            picklable = True
        except Exception:  # noqa: BLE001 - lambdas and closures go to a thread instead
            picklable = False
        if procs > 0 and picklable:
            self._pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"))
        elif procs == 0 and picklable:
            self._inline = True

    @property
    def inline(self) -> bool:
        """True when `score_inline` may be used: a cheap picklable sync function, procs = 0."""
        return self._inline

    def score_inline(self, task: Task, completion: str) -> Score:
        """Score on the caller's thread (no task, no pool hop); failures score 0 and are counted."""
        try:
            return as_score(self.fn(task, completion))
        except Exception:  # noqa: BLE001 - a failing reward scores 0 and is counted
            self.failures += 1
            return Score(reward=0.0, passed=False, strict=False, failed=True)

    async def score(self, task: Task, completion: str) -> Score:
        if self._inline:
            return self.score_inline(task, completion)
        try:
            if self._async:
                value = await asyncio.wait_for(self.fn(task, completion), self.timeout_s)
            elif self._pool is not None:
                loop = asyncio.get_running_loop()
                value = await asyncio.wait_for(
                    loop.run_in_executor(self._pool, self.fn, task, completion), self.timeout_s)
            else:
                value = await asyncio.wait_for(asyncio.to_thread(self.fn, task, completion), self.timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return as_score(value)
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - a failing reward scores 0 and is counted
            self.failures += 1
            return Score(reward=0.0, passed=False, strict=False, failed=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
