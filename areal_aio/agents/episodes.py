"""Playing episodes: which episode a run plays (task.episode, or the calculator's for task.name =
calculator), loading it, and playing one under its wall bound, for training and the held-out eval.

What an episode talks to (`Model`), its bounds and the sequence it trains are agents/model.py's.
The loop builds them through this module as well (`episodes.Model`, `episodes.Bounds`,
`episodes.ReplyRequest`), so `__all__` names them.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from areal_aio import wire
from areal_aio.agents import endpoint
from areal_aio.agents.model import Bounds, Episode, Model, ReplyRequest
from areal_aio.rewards.scoring import FAILED, Score, as_score, import_reward
from areal_aio.settings import Settings, SettingsError
from areal_aio.tasks.task import Task

__all__ = ["CALCULATOR", "KEY", "Bounds", "Episode", "Model", "NoReply", "ReplyRequest", "Sequence", "episode_spec",
           "load_episode", "name_of", "no_reply", "play", "sequences", "why_failed"]

KEY = "task.episode"
CALCULATOR = "areal_aio.agents.calculator:episode"
"""What task.name = calculator runs when task.episode is empty."""


class NoReply(RuntimeError):
    """The episode ended without a reply of the model: nothing of it can be trained, and it
    cannot pass, whatever it returned."""


def episode_spec(settings: Settings) -> str:
    """The episode function a run uses: task.episode, the calculator's for task.name =
    calculator, or "" (one reply per task)."""
    if settings.task.episode:
        return settings.task.episode
    return CALCULATOR if settings.task.name == "calculator" else ""


def load_episode(spec: str) -> Episode:
    """The `async def episode(task, model)` that "package.module:function" names; SettingsError
    naming task.episode when it cannot be imported or is not such a function."""
    fn = import_reward(spec, key=KEY)
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise SettingsError(f"{KEY}: {spec!r} is not an async function; write `async def episode(task, model)`")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise SettingsError(f"{KEY}: {spec!r} takes {inspect.signature(fn)}, but an episode is called "
                            f"as fn(task, model)") from None
    except ValueError:  # no signature to read: trust it
        pass
    return fn


async def play(episode: Episode, task: Task, model: Model, timeout_s: float) -> tuple[Score | None, Exception | None]:
    """Run one episode under its wall bound: (its own Score, or None to let task.reward score the
    last reply; None), or (FAILED, why) when it raised, timed out, passed a bound, returned
    something that is not a reward or ended without a reply (NoReply). Training and the
    held-out eval both play episodes here."""
    try:
        async with asyncio.timeout(timeout_s) as model.clock:  # stopped during replies (Model.reply)
            with endpoint.served(model):  # its base URL, while it plays (endpoint.enabled)
                result = await episode(task, model)
        model.abandon()  # a sequence begun and never answered: the one before it is the last again
        if model.transcript.last is None:
            raise NoReply("ended without a reply (none in its last sequence: it never awaited model.reply())")
        return (None if result is None else as_score(result)), None
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: its failure scores 0, counted
        return FAILED, exc


def no_reply(request_id: str, prompt_ids: list[int] | None = None) -> wire.Completion:
    """What an episode that never replied leaves: no token (the prompt's ids, when known, so it
    can sit in its group's batch and count in the group's advantages)."""
    return wire.Completion(request_id=request_id, prompt_ids=list(prompt_ids or []), completion_ids=[],
                           logprobs=[], versions=[], text="", finish="abort", interrupts=0, gen_s=0.0)


@dataclass(frozen=True, slots=True)
class Sequence:
    """One sequence a sample trains: its place among its episode's sequences (`index` of `of`;
    0 of 1 for a one-reply sample), its whole completion, loss mask and turns' record."""

    index: int
    of: int
    completion: wire.Completion
    mask: list[int] | None
    turns: list[dict] | None


def sequences(completion: wire.Completion, mask: list[int] | None, model: Model | None,
              fresh: Callable[[wire.Completion], bool]) -> list[Sequence]:
    """What a sample trains: its own sequence, after those its episode left when a call through
    the endpoint rewrote its history (Model.earlier), each its own sample with the episode's
    reward and group: GRPO's mean and std are then over the group's sequences, so an episode
    that branched k times counts k times in them. An earlier sequence whose oldest token is not
    `fresh` (staleness past eta now) is left out."""
    if model is None:
        return [Sequence(0, 1, completion, mask, None)]
    n = len(model.earlier) + 1
    earlier = [Sequence(k, n, t.completion(), t.mask, t.turns) for k, t in enumerate(model.earlier)]
    return [*(q for q in earlier if fresh(q.completion)), Sequence(n - 1, n, completion, mask, model.transcript.turns)]


def name_of(episode: Episode) -> str:
    """"package.module:function" of an episode function (what task.episode would name)."""
    fn = episode if inspect.isfunction(episode) or inspect.ismethod(episode) else type(episode)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def why_failed(failure: Exception) -> str:
    """An episode's failure in a few words, for one line."""
    if isinstance(failure, NoReply):
        return str(failure)
    if isinstance(failure, TimeoutError):
        return "timed out (task.episode_timeout_s)"
    return f"raised {type(failure).__name__}: {failure}"[:300]
