"""The run's live stream (areal_aio/control/events.py): on its own, and in a run."""

from __future__ import annotations

import asyncio

from areal_aio.control import events
from areal_aio.control.events import EventStream
from tests.conftest import make_settings, orchestrator


async def read_all(stream: EventStream, seen: list[dict]) -> None:
    async for item in stream.subscribe():
        seen.append(item)


async def test_every_subscriber_gets_every_row_in_order_until_close():
    stream = EventStream()
    seen: tuple[list, list] = ([], [])
    readers = [asyncio.create_task(read_all(stream, s)) for s in seen]
    await asyncio.sleep(0)  # both subscribed
    stream.emit("run_start", mode="areal")
    stream.publish({"kind": "step", "step": 1})
    stream.close()
    await asyncio.wait_for(asyncio.gather(*readers), 5)
    for s in seen:
        assert s == [{"kind": "event", "event": "run_start", "mode": "areal"}, {"kind": "step", "step": 1}]
    stream.publish({"kind": "step", "step": 2})  # nobody subscribed: nothing kept, nothing raised


async def test_a_subscriber_that_falls_behind_loses_the_oldest_and_never_blocks_the_run(monkeypatch):
    monkeypatch.setattr(events, "EVENT_QUEUE", 3)
    stream = EventStream()
    seen: list[dict] = []
    iterator = stream.subscribe()
    first = asyncio.ensure_future(anext(iterator))
    await asyncio.sleep(0)  # subscribed, waiting
    for step in range(6):
        stream.publish({"kind": "step", "step": step})  # never waits on the reader
    seen.append(await first)
    stream.close()
    async for item in iterator:
        seen.append(item)
    assert [item["step"] for item in seen] == [3, 4, 5]  # the newest EVENT_QUEUE rows


async def test_event_stream_yields_steps_and_evals(tmp_path):
    orch = orchestrator(tmp_path, make_settings())
    seen = []

    async def consume():
        async for item in orch.events():
            seen.append(item["kind"])

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0)
    await orch.run()
    await asyncio.wait_for(consumer, 10)
    assert seen.count("step") == 6 and "eval" in seen
