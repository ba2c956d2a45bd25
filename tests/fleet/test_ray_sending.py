"""RayWorker's send path (areal_aio/fleet/ray_workers.py) against a stand-in for its actor: no cluster."""

from __future__ import annotations

import asyncio
import gc

import pytest

from tests.conftest import need

need("ray")

from areal_aio import wire  # noqa: E402
from areal_aio.fleet.client import WorkerFailed  # noqa: E402
from areal_aio.fleet.ray_workers import RayWorker  # noqa: E402
from areal_aio.settings import build_settings  # noqa: E402


class Actor:
    """The Relay actor's handle as send uses it: each write.remote is a call the test answers."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, asyncio.Future]] = []
        self.write = self  # actor.write.remote(data)

    def remote(self, data: bytes) -> asyncio.Future:
        call = asyncio.get_running_loop().create_future()
        self.calls.append((data, call))
        return call


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_send_cancelled_while_it_waits_for_its_turn_still_goes_in_order():
    """One actor call at a time (Ray may run an actor's calls in any order); a caller cancelled
    while its frames wait for their turn has still sent them, as a pipe write would have: a stop
    counts an eval's request as sent once asked for, and waits for its answer."""
    worker = RayWorker("rollout", 0, build_settings({}, ["ray.address=local"]))
    worker.actor = actor = Actor()
    first = asyncio.ensure_future(worker.send(wire.Abort("first")))
    await settle()
    second = asyncio.ensure_future(worker.send(wire.Abort("second")))
    await settle()
    assert len(actor.calls) == 1  # the second waits for the first call to return
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    actor.calls[0][1].set_result(None)
    await first
    await settle()
    assert len(actor.calls) == 2
    actor.calls[1][1].set_result(None)
    frames = asyncio.StreamReader()
    frames.feed_data(b"".join(data for data, _ in actor.calls))
    frames.feed_eof()
    reader = wire.FrameReader(frames)
    assert [await reader.read(), await reader.read()] == [wire.Abort("first"), wire.Abort("second")]


async def test_a_failed_send_is_raised_to_its_caller_and_to_nobody_else():
    worker = RayWorker("rollout", 0, build_settings({}, ["ray.address=local"]))
    worker.actor = actor = Actor()
    sending = asyncio.ensure_future(worker.send(wire.Abort("x")))
    await settle()
    actor.calls[0][1].set_exception(ray_error())
    with pytest.raises(WorkerFailed, match="rollout worker failed"):
        await sending
    reported = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: reported.append(context))
    abandoned = asyncio.ensure_future(worker.send(wire.Abort("y")))
    await settle()
    abandoned.cancel()  # its caller is gone: the failure is nobody's to read, and not an unread one
    actor.calls[1][1].set_exception(ray_error())
    await settle()
    del abandoned
    gc.collect()
    assert reported == []


def ray_error() -> Exception:
    from ray.exceptions import RayActorError

    return RayActorError()
