"""Requests whose Completion a coroutine awaits, by request id: `expect` one, and the reader that
gets every Completion `deliver`s it (a guided member's tokens in control/groups.py, a local
judge's verdicts in control/judging.py)."""

from __future__ import annotations

import asyncio

from areal_aio import wire


class Awaited:
    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future] = {}

    def expect(self, request_id: str) -> asyncio.Future:
        """The future `request_id`'s Completion is delivered to."""
        future = self._futures[request_id] = asyncio.get_running_loop().create_future()
        return future

    def deliver(self, msg: wire.Completion) -> bool:
        """Hand a Completion to its waiter (True), or leave one nobody awaits (False)."""
        future = self._futures.pop(msg.request_id, None)
        if future is None:
            return False
        if not future.done():
            future.set_result(msg)
        return True

    def forget(self, request_id: str) -> bool:
        """No longer awaited; True when its Completion had not come (a request still out)."""
        future = self._futures.pop(request_id, None)
        return future is not None and not future.done()

    def cancel(self) -> None:
        """Every waiter ends (CancelledError): no Completion will come."""
        for future in self._futures.values():
            future.cancel()
