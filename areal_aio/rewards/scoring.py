"""Rewards: verify a completion against its task.

The built-in reward pays 1 for a correct final answer and a format bonus on top
only when that answer is also inside <answer></answer>. Both shortcuts fail on
SmolLM2-135M: a tag-only reward is 0 for whole groups (no gradient), and a
bonus for the tag alone is learned as "tag a wrong answer". So the tag earns
nothing without correctness.

The final answer is the last tagged answer when the reply has one, else the
last number in the reply. `pass` = correct final answer, `strict` = correct,
tagged, and the tag ends the reply (only whitespace after it): the instruction asks
for the answer alone in the tag, and a bonus paid whatever follows the tag was
learned as "tag, then ramble to the token limit" (three times the tokens per reply,
docs/benchmarks/cold-start.md).

A reward function is any callable `(task, completion_text, **columns)` returning a
float, a `Score`, or an awaitable of either; `columns` are the task row's extra columns
its signature names (all of them with **kwargs). Floats become `Score(reward, passed=reward > 0)`.
The contract (`Scorer`): every reward is a finite number within +-REWARD_LIMIT or it is a
counted failure (reward 0): one that raises, returns anything else (NaN, inf, 1e308, a string),
or takes longer than `controller.reward_timeout_s`. Several rewards (a list of `Reward`,
task.reward as a list) are each scored under that contract, at once; the reward is their
weighted sum, held to the same range. An episode's own reward goes through `as_score` too.

`load_rewards` turns task.reward into rewards: "answer" is the built-in AnswerReward,
"package.module:function" is imported (from the environment or the current folder) and its
signature checked, so a name that cannot be used fails at `check` time, not in the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import os
import pickle
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_aio.rewards.pool import RewardPool, RewardPoolBroken
from areal_aio.rewards.score import Score
from areal_aio.settings import (
    CODE_REWARD,
    CODE_TASKS,
    JudgeSettings,
    SettingsError,
    TaskSettings,
    not_moved,
    reward_parts,
)
from areal_aio.tasks.task import Task, as_number, same_answer

KEY = "task.reward"
P = inspect.Parameter

REWARD_LIMIT = 1e6
"""The largest |reward| a run trains on. Verifiable rewards are a few units; one past a million
is a bug in the reward (an overflow, a sentinel such as sys.float_info.max), not a signal.
Finite is not enough: advantages that are not divided by a std (trainer.advantage = drgrpo)
carry the reward into float32 losses, and 1e308 there overflows to inf and NaN, which would
poison every weight. Outside the range a reward is a counted failure, exactly as NaN is."""

TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def overlong_penalty(tokens: int, max_tokens: int, buffer: int, most: float) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly
    to -most at max_tokens (buffer 0: off)."""
    if buffer <= 0 or tokens <= max_tokens - buffer:
        return 0.0
    return -most * min(tokens - (max_tokens - buffer), buffer) / buffer


def shaped(score: Score, penalty: float) -> Score:
    """`score` with `penalty` (<= 0) added to its reward and kept as its "overlong" component
    (0 too: reward/overlong is then a mean over every shaped reply); a failed score stays a 0."""
    if score.failed:
        return score
    components = {**(score.components or {}), "overlong": penalty}
    return dataclasses.replace(score, reward=score.reward + penalty, components=components)


@dataclass(frozen=True, slots=True)
class Reward:
    """One reward function with its weight and the task columns it takes as keywords."""

    name: str  # logged as reward/<name> when several rewards are summed
    fn: Callable[..., Any]
    weight: float = 1.0
    columns: tuple[str, ...] | None = ()  # Task.extra keys it accepts; None: all (**kwargs)
    required: tuple[str, ...] = ()  # the columns it cannot do without

    def kwargs(self, task: Task) -> dict[str, Any]:
        if self.columns is None:
            return dict(task.extra)
        return {key: task.extra[key] for key in self.columns if key in task.extra}


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
    return as_number(text) is not None


@dataclass(frozen=True, slots=True)
class AnswerReward:
    """Correctness reward with a format bonus gated on correctness and on the tag ending the
    reply (picklable: runs in a process pool)."""

    format_bonus: float = 0.2

    def __post_init__(self) -> None:
        if not _sane(self.format_bonus):  # its Scores skip as_score's check when scored inline
            raise ValueError(f"AnswerReward's format_bonus must be a finite number within "
                             f"+-{REWARD_LIMIT:g}, got {self.format_bonus!r}")

    def __call__(self, task: Task, completion: str) -> Score:
        answer, tagged = final_answer(completion)
        correct = answer is not None and same_answer(answer, task.answer)
        strict = correct and tagged and ends_with_tag(completion)
        return Score(reward=float(correct) + (self.format_bonus if strict else 0.0), passed=correct, strict=strict)


def ends_with_tag(text: str) -> bool:
    """Whether the reply ends at its last closing answer tag (whitespace after it aside)."""
    end = text.lower().rfind("</answer>")
    return end >= 0 and not text[end + len("</answer>"):].strip()


def as_score(value: Any) -> Score:
    """Normalize what a user's reward function (or episode) returned; TypeError unless its
    reward is a finite number within +-REWARD_LIMIT."""
    if isinstance(value, Score):
        if not _sane(value.reward):
            raise TypeError(f"a Score's reward must be a finite number within +-{REWARD_LIMIT:g}, "
                            f"got {value.reward!r}")
        return value if type(value.reward) is float else dataclasses.replace(value, reward=float(value.reward))
    if not _sane(value):
        raise TypeError(f"a reward function must return a finite float within +-{REWARD_LIMIT:g} "
                        f"or a Score, got {value!r}")
    return Score(reward=float(value), passed=value > 0)


def _sane(value: Any) -> bool:
    """A real number (not a bool), finite and within +-REWARD_LIMIT."""
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and abs(value) <= REWARD_LIMIT)


FAILED = Score(reward=0.0, passed=False, strict=False, failed=True)


def component_means(scores: list[Score | None]) -> dict[str, float]:
    """reward/<name>: each reward's own mean over the scores of a weighted set ({} otherwise)."""
    parts = [s.components for s in scores if s is not None and s.components]
    if not parts:
        return {}
    names = dict.fromkeys(name for p in parts for name in p)  # a part without one counts it 0
    return {f"reward/{name}": sum(p.get(name, 0.0) for p in parts) / len(parts) for name in names}


class Scorer:
    """Runs reward functions with a timeout; every result is finite or a counted failure.

    `fn`: one reward function, a `Reward`, or a list of `Reward` (scored at once; the Score is
    their weighted sum with each one's reward in `components`, pass and strict the first one's).
    Where each kind of reward function runs:
      * async: awaited on the loop, cancelled at the timeout;
      * sync and picklable, `procs` > 0: in the reward pool (`reward_pool.py`, one pool for all
        of them); a call past the timeout has its process killed and replaced; a pool that
        keeps breaking raises RewardPoolBroken, which stops the run;
      * sync, not picklable (a lambda, a closure) or `procs` = 0: in a daemon thread of its
        own; past the timeout the thread is abandoned (a thread cannot be killed), which
        keeps it from delaying the process's exit;
      * the built-in AnswerReward with `procs` = 0: inline on the caller's thread (it takes
        microseconds; a thread or pool hop would cost more than it saves).
    """

    def __init__(self, fn: Any, *, timeout_s: float, procs: int, log_path: Path | None = None) -> None:
        self.fn = fn
        self.combined = isinstance(fn, list)
        self.rewards: list[Reward] = fn if self.combined else [fn if isinstance(fn, Reward) else Reward("reward", fn)]
        self.timeout_s = timeout_s
        self.failures = 0
        self._pool: RewardPool | None = None
        self._inline = procs == 0 and all(type(r.fn) is AnswerReward and r.columns == () for r in self.rewards)
        self._async = [_is_async(r.fn) for r in self.rewards]
        self._in_pool: list[int | None] = [None] * len(self.rewards)  # index among the pool's functions
        if self._inline or procs == 0:
            return
        pooled = []
        for i, r in enumerate(self.rewards):
            if self._async[i]:
                continue
            try:
                pickle.dumps(r.fn)
            except Exception:  # noqa: BLE001 - lambdas and closures go to a thread instead
                continue
            self._in_pool[i] = len(pooled)
            pooled.append(r.fn)
        if pooled:
            self._pool = RewardPool(pooled, procs=procs, timeout_s=timeout_s, log_path=log_path)

    @property
    def inline(self) -> bool:
        """True when `score_inline` may be used: only built-in rewards, procs = 0."""
        return self._inline

    @property
    def pool(self) -> RewardPool | None:
        return self._pool

    def score_inline(self, task: Task, completion: str) -> Score:
        """Score on the caller's thread (no task, no pool hop); failures score 0 and are counted.
        Only built-in rewards without columns come here (`inline`): each returns a finite Score."""
        parts = []
        for r in self.rewards:
            try:
                parts.append(r.fn(task, completion))
            except Exception:  # noqa: BLE001 - a failing reward scores 0 and is counted
                parts.append(self._failed())
        return self._combine(parts)

    async def score(self, task: Task, completion: str) -> Score:
        """The reward of one completion; RewardPoolBroken when the pool cannot go on."""
        if self._inline:
            return self.score_inline(task, completion)
        if len(self.rewards) == 1:
            return self._combine([await self._score_one(0, task, completion)])
        calls = [asyncio.ensure_future(self._score_one(i, task, completion)) for i in range(len(self.rewards))]
        try:
            return self._combine(list(await asyncio.gather(*calls)))
        finally:  # one raised (a broken pool) or the caller was cancelled: the others stop too
            for call in calls:
                call.cancel()

    async def _score_one(self, i: int, task: Task, completion: str) -> Score:
        r = self.rewards[i]
        try:
            kwargs = r.kwargs(task)
            if self._async[i]:
                value = await asyncio.wait_for(r.fn(task, completion, **kwargs), self.timeout_s)
            elif self._in_pool[i] is not None:
                value = await self._pool.call(task, completion, which=self._in_pool[i], kwargs=kwargs)
            else:
                call = functools.partial(r.fn, **kwargs) if kwargs else r.fn
                value = await asyncio.wait_for(_in_thread(call, task, completion), self.timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return as_score(value)
        except (asyncio.CancelledError, RewardPoolBroken):
            raise
        except BaseException:  # noqa: BLE001 - a failing reward scores 0 and is counted
            return self._failed()

    def _combine(self, parts: list[Score]) -> Score:
        """The weighted result (`_weighted`), a counted failure when the weights take it out of
        +-REWARD_LIMIT (each part was within it)."""
        score = self._weighted(parts)
        return score if score.failed or _sane(score.reward) else self._failed()

    def _weighted(self, parts: list[Score]) -> Score:
        """One reward: its Score (weighted); several: the weighted sum, pass and strict the first's."""
        if not self.combined:
            weight = self.rewards[0].weight
            return parts[0] if weight == 1.0 else dataclasses.replace(parts[0], reward=weight * parts[0].reward)
        first = parts[0]
        return Score(reward=float(sum(r.weight * p.reward for r, p in zip(self.rewards, parts, strict=True))),
                     passed=first.passed, strict=first.strict, failed=any(p.failed for p in parts),
                     components={r.name: p.reward for r, p in zip(self.rewards, parts, strict=True)})

    def _failed(self) -> Score:
        self.failures += 1
        return FAILED

    async def aclose(self) -> None:
        """Kill and reap the pool's processes (a thread left in a hung call is a daemon: abandoned)."""
        if self._pool is not None:
            await self._pool.aclose()


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


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


# ---------------------------------------------------------------- rewards named in settings


def only_answer_check(rewards: Reward | list[Reward]) -> bool:
    """Whether task.reward is the built-in answer check alone (AnswerReward: correctness, and
    strict = the tagged answer), not a user's function."""
    return all(type(r.fn) is AnswerReward for r in (rewards if isinstance(rewards, list) else [rewards]))


def load_rewards(task: TaskSettings, judge: JudgeSettings | None = None) -> Reward | list[Reward]:
    """The reward(s) task.reward names: one `Reward` for a string, a list for a list. Each
    function is imported and its signature checked; SettingsError naming task.reward if one
    cannot be used (`judge`: the [judge] settings a "judge" reward is built from)."""
    rewards = [_load(name, spec, weight, task, judge) for name, spec, weight in reward_parts(KEY, task.reward)]
    return rewards if isinstance(task.reward, list) else rewards[0]


def _load(name: str, spec: str, weight: float, task: TaskSettings, judge: JudgeSettings | None) -> Reward:
    if spec == "judge":
        from areal_aio.rewards.judge import Judge

        if judge is None or not (judge.url or judge.model):
            raise SettingsError(f"{KEY}: \"judge\" needs judge.url (a server) or judge.model (a local judge)")
        return Reward(name, Judge(judge), weight)
    if spec == "answer" and task.name in CODE_TASKS:
        spec = CODE_REWARD
    if spec == "answer":
        return Reward(name, AnswerReward(task.format_bonus), weight)
    fn = import_reward(spec)
    columns, required = reward_columns(spec, fn)
    return Reward(name, fn, weight, columns, required)


def import_reward(spec: str, key: str = KEY) -> Callable[..., Any]:
    """The callable that "package.module:attr" names (the current folder is searched too, as
    `python -m` does); SettingsError naming `key` saying why it cannot be had."""
    not_moved(key, spec)
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # also what the reward pool's processes get
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise SettingsError(f"{key}: cannot import {module_name!r} (no module named {exc.name!r}); "
                                f"install it or run from the folder that holds it") from None
        raise SettingsError(f"{key}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, one line naming it
        raise SettingsError(f"{key}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            close = difflib.get_close_matches(part, [n for n in dir(fn) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingsError(f"{key}: {spec!r}: {module_name!r} has no {attr!r}{hint}")
        fn = getattr(fn, part)
    if inspect.isclass(fn):
        raise SettingsError(f"{key}: {spec!r} is a class; name a function (or a callable instance)")
    if not callable(fn):
        raise SettingsError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_columns(spec: str, fn: Callable[..., Any]) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """(columns fn takes as keywords or None for **kwargs, those it requires) from its signature;
    SettingsError unless it can be called as fn(task, completion, **columns)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust (task, completion)
        return (), ()
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    called = f"{spec!r} takes {sig}, but a reward is called as fn(task, completion, **columns)"
    if {"prompts", "completions"} & {p.name for p in positional[:2]}:
        raise SettingsError(f"{KEY}: {called} for one completion (a TRL reward takes lists and returns "
                            f"a list: score one completion and return a float)")
    if len(positional) < 2 and not any(p.kind is P.VAR_POSITIONAL for p in params):
        raise SettingsError(f"{KEY}: {called}")
    rest = positional[2:] + [p for p in params if p.kind is P.KEYWORD_ONLY]
    stuck = [p.name for p in rest if p.kind is P.POSITIONAL_ONLY and p.default is P.empty]
    if stuck:
        raise SettingsError(f"{KEY}: {called}; its positional-only {stuck[0]!r} cannot be given")
    named = [p for p in rest if p.kind is not P.POSITIONAL_ONLY]
    required = tuple(p.name for p in named if p.default is P.empty)
    columns = None if any(p.kind is P.VAR_KEYWORD for p in params) else tuple(p.name for p in named)
    return columns, required


def check_columns(rewards: Reward | list[Reward], tasks: list[Task] | None,
                  generated: tuple[str, ...] = ()) -> None:
    """Every column a reward requires is in every task row; `generated`: the columns generated
    tasks (tasks None) give (none for arithmetic and chain, CODE_COLUMNS for code tasks)."""
    for r in rewards if isinstance(rewards, list) else [rewards]:
        for column in r.required:
            if tasks is None and column in generated:
                continue
            if tasks is None:
                given = f"columns {', '.join(generated)}" if generated else "no columns"
                raise SettingsError(f"{KEY}: {r.name!r} requires a {column!r} argument, and generated "
                                    f"tasks have {given} beyond prompt and answer")
            lacking = next((t for t in tasks if column not in t.extra), None)
            if lacking is not None:
                have = ", ".join(sorted(lacking.extra)) or "none"
                raise SettingsError(f"{KEY}: {r.name!r} requires a {column!r} argument, and task "
                                    f"{lacking.id!r} has no such column (its extra columns: {have})")
