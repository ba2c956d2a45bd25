"""A local judge (areal_aio/control/judging.py): judge.model served by a worker of its own for
the run, the Judge's calls sent to it as greedy Generates and answered by request id."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from areal_aio import wire
from areal_aio.control import judging
from areal_aio.fleet.client import WorkerFailed
from areal_aio.fleet.fakes import FakeRollout
from areal_aio.rewards.judge import Judge
from areal_aio.rewards.scoring import load_rewards
from areal_aio.tasks.task import Task
from tests.conftest import make_settings, orchestrator

TASK = Task(id="t1", prompt="Calculate 2 + 3.", answer="5")


def judged(**sets):
    settings = make_settings(**{"task.reward": "judge", "judge.model": "embedded:tiny-random", **sets})
    return settings, load_rewards(settings.task, settings.judge)


class Grader(FakeRollout):
    """A judge worker that passes a reply holding the right sum, and remembers what it was asked."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.asked: list[wire.Generate] = []

    def answer(self, msg, version):
        self.asked.append(msg)
        return "PASS" if "Reply: 5" in msg.prompt else "FAIL"


async def test_a_local_judge_is_served_by_a_worker_of_its_own(tmp_path):
    settings, reward = judged(**{"judge.max_tokens": 3})
    grader = Grader()
    async with judging.serving(settings, reward, tmp_path / "judge.log", worker=grader) as reader:
        task = asyncio.ensure_future(reader)
        scores = await asyncio.gather(reward.fn(TASK, "5"), reward.fn(TASK, "6"))
        task.cancel()
    assert [s.reward for s in scores] == [1.0, 0.0]
    assert all(m.temperature == 0.0 and m.max_new_tokens == 3 and m.messages[0]["role"] == "user" for m in grader.asked)
    assert [what for _, what, _ in grader.log].count("generate") == 2
    with pytest.raises(WorkerFailed):
        await grader.send(wire.Abort("x"))  # stopped on leaving


async def test_no_local_judge_starts_no_worker(tmp_path):
    settings = make_settings()
    async with judging.serving(settings, load_rewards(settings.task), tmp_path / "judge.log",
                               worker=Grader()) as reader:
        assert reader is None
    url = make_settings(**{"task.reward": "judge", "judge.url": "http://127.0.0.1:9/v1"})
    grader = Grader()
    async with judging.serving(url, load_rewards(url.task, url.judge), tmp_path / "judge.log", worker=grader) as reader:
        assert reader is None and not grader.log


async def test_the_judge_workers_death_ends_its_reader_with_the_failure(tmp_path):
    settings, reward = judged()
    grader = Grader(token_delay_s=0.05)
    async with judging.serving(settings, reward, tmp_path / "judge.log", worker=grader) as reader:
        task = asyncio.ensure_future(reader)
        call = asyncio.ensure_future(reward.fn(TASK, "5"))
        await asyncio.sleep(0.01)
        grader.kill()
        with pytest.raises(WorkerFailed):
            await task
    with pytest.raises(asyncio.CancelledError):  # the call in flight is given up with the worker
        await call


@pytest.mark.slow
async def test_a_run_scores_with_a_tiny_random_judge_in_a_real_worker(tmp_path):
    """The real worker path: tiny-random's verdicts do not parse, so every reply scores 0 and
    is counted, and each unparsed verdict is kept in events.jsonl."""
    settings, _ = judged(**{"run.max_steps": 2, "judge.max_tokens": 4})
    summary = await orchestrator(tmp_path, settings).run()
    assert summary["steps"] == 2 and summary["reward_failures"] > 0
    events = [orjson.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()]
    unparsed = [e for e in events if e["event"] == "judge_unparsed"]
    assert len(unparsed) >= summary["reward_failures"]  # the eval's verdicts are kept too
    assert isinstance(load_rewards(settings.task, settings.judge).fn, Judge)
