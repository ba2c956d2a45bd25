"""Requests awaited by id (areal_aio/control/awaited.py)."""

from __future__ import annotations

import asyncio

import pytest

from areal_aio import wire
from areal_aio.control.awaited import Awaited


def completion(rid: str) -> wire.Completion:
    return wire.Completion(rid, [1], [2], [-0.1], [0], "x", "stop", 0, 0.0)


async def test_a_completion_reaches_its_waiter_once_and_others_are_left():
    awaited = Awaited()
    future = awaited.expect("a")
    assert not awaited.deliver(completion("b")) and not future.done()
    assert awaited.deliver(completion("a")) and (await future).request_id == "a"
    assert not awaited.deliver(completion("a"))  # delivered once
    assert not awaited.forget("a")  # answered: nothing to abort


async def test_forget_says_whether_the_request_is_still_out_and_cancel_ends_every_waiter():
    awaited = Awaited()
    awaited.expect("a")
    assert awaited.forget("a") and not awaited.deliver(completion("a"))
    waiting = awaited.expect("b")
    awaited.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
