"""The run's live stream: what `Orchestrator.events()` yields to each of its subscribers.

    controller --publish(row)--> EventStream --one bounded queue per subscriber--> subscribe()
        kind "event": run_start, weights_loaded (emit)
        kind "step":  a steps.jsonl row, at each commit
        kind "eval":  an eval row, when the eval is scored
    close() (the run's summary is written) --> None to every queue: each subscriber's loop ends

The run never waits on a subscriber: one more than EVENT_QUEUE items behind loses the oldest.
A subscriber sees what is published after its first read (start it before the run to see all;
app.trackers is one). events.jsonl (runlog.RunLog) is the record; this is only a view of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

EVENT_QUEUE = 10_000
"""Events buffered per subscriber; a subscriber that falls further behind loses the oldest."""


class EventStream:
    def __init__(self) -> None:
        self._subscribers: list[asyncio.Queue] = []

    async def subscribe(self) -> AsyncIterator[dict]:
        """Stream of event, step and eval rows until `close`."""
        queue: asyncio.Queue = asyncio.Queue(EVENT_QUEUE)
        self._subscribers.append(queue)
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._subscribers.remove(queue)

    def emit(self, event: str, **fields: Any) -> None:
        self.publish({"kind": "event", "event": event, **fields})

    def publish(self, item: dict) -> None:
        for queue in self._subscribers:
            _put_latest(queue, item)

    def close(self) -> None:
        """The run has ended: every subscriber's stream ends after what it has not read yet."""
        for queue in self._subscribers:
            _put_latest(queue, None)


def _put_latest(queue: asyncio.Queue, item: Any) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
