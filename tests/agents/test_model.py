"""agents/model.py: what an episode adds is held to its token bound before it reaches the
sample (its ids), the worker (its text) and the record (an excerpt); fake workers."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from areal_aio import wire
from areal_aio.agents.model import (
    RECORD_TEXT_CHARS,
    TURN_BYTES_PER_TOKEN,
    Bounds,
    EpisodeLimit,
    Model,
    excerpt,
)
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from tests.conftest import make_settings, orchestrator


class Watching(FakeRollout):
    """Keeps every Generate that appends turns (`sent`)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent: list[wire.Generate] = []

    async def send(self, msg):
        if isinstance(msg, wire.Generate) and msg.append:
            self.sent.append(msg)
        await super().send(msg)


async def test_a_2mb_tool_turn_is_cut_to_the_token_bound_in_the_sample_the_worker_and_the_record(tmp_path):
    huge = "x" * 2_000_000
    bound, reply = 64, 4

    async def episode(task, model):
        await model.reply()
        model.add_turn("tool", huge)
        await model.reply()
        return 1.0

    trainer, rollout = FakeTrainer(), Watching(tokens=reply)
    settings = make_settings("sync", **{"run.max_steps": 1, "task.episode_tokens": bound})
    summary = await orchestrator(tmp_path, settings, rollout=rollout, trainer=trainer, episode=episode).run()
    assert summary["steps"] == 1
    for s in trainer.batches[0].samples:  # the first reply, then the turn's ids up to the bound
        assert len(s.completion_ids) == bound and s.loss_mask == [1] * reply + [0] * (bound - reply)
    assert rollout.sent and all(len(t["content"].encode()) <= (bound - reply) * TURN_BYTES_PER_TOKEN
                                for m in rollout.sent for t in m.append)
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    tools = [t for r in rows if r["kind"] == "train" for t in r["turns"] if t["role"] == "tool"]
    assert tools and all(t["cut"] and t["tokens"] == bound - reply for t in tools)
    assert all(len(t["text"]) < RECORD_TEXT_CHARS + 100 and "characters left out" in t["text"] for t in tools)
    assert (tmp_path / "run" / "samples.jsonl").stat().st_size < 200_000


async def test_turn_texts_are_cut_together_on_a_character_boundary_and_their_ids_to_the_bound():
    asked = []
    replies = iter([wire.Completion("r0", [1, 2], [7], [-1.0], [0], "a", "stop", 0, 0.0),
                    # the turns rendered as 103 ids, no room left for the reply
                    wire.Completion("r1", [1, 2, 7, *range(100, 203)], [], [], [], "", "length", 0, 0.0)])

    async def request(ask):
        asked.append(ask)
        return next(replies)

    model = Model(Bounds(turns=4, tokens=3, timeout_s=10, max_new_tokens=8), request)
    await model.reply()  # 1 token: 2 left, 256 bytes of turn text
    model.add_turn("tool", "short")
    model.add_turn("user", "é" * 200)  # 400 bytes: cut to the 251 the first left, whole characters
    model.add_turn("tool", "late")
    with pytest.raises(EpisodeLimit, match="no room"):
        await model.reply()
    assert [t["content"] for t in asked[1].append] == ["short", "é" * 125, ""]
    assert [r.get("cut", False) for r in model.transcript.turns[2:4]] == [True, True]
    assert model.transcript.completion_ids == [7, 100, 101] and model.transcript.mask == [1, 0, 0]
    assert model.transcript.turns[1]["tokens"] == 2 and model.transcript.turns[1]["cut"]
    assert model.transcript.turns[-1] == {"role": "assistant", "text": "", "tokens": 0, "trained": True}


async def test_a_reply_in_another_task_cancelled_after_the_episodes_bound_ended_raises_cancelled():
    """As through the endpoint: the reply runs in the call's task, and the episode's end cancels
    that task only after the block of its time bound has exited."""
    asked = asyncio.Event()

    async def request(ask):
        asked.set()
        await asyncio.sleep(3600)

    model = Model(Bounds(turns=4, tokens=64, timeout_s=10, max_new_tokens=8), request)
    async with asyncio.timeout(10) as model.clock:
        call = asyncio.create_task(model.reply())
        await asked.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert model.transcript.last is None and model.replies == 0


def test_the_record_keeps_the_head_and_tail_of_a_long_text():
    assert excerpt("abc") == "abc"
    text = "a" * 5000 + "b" * 5000
    short = excerpt(text)
    half = RECORD_TEXT_CHARS // 2
    assert short.startswith("a" * half) and short.endswith("b" * half)
    assert f"[... {10_000 - 2 * half} characters left out ...]" in short
