"""The trainer side of the controller: what was asked of the trainer worker and what it answered.

    train loop --Train(step)--> trainer --Trained--> [read] --> the step's future --> commit
               --Save(kind)---> trainer --Saved----> [read] --> the save's future
    at a stop (read cancelled): settle() commits a step in flight, save_at_stop() reads its own Saved

The train loop awaits one request at a time; `outstanding` counts the requests the trainer
has not answered yet. A step is the link's from the moment its Train is written until its
Trained is committed (through `commit`): when a stop cancels the train loop while the step is
in flight, a reply that reached the reader (before or after the step was cancelled, or just as
it was) is kept until committed, and `settle` commits it (the trainer holds that version now)
or reads the reply itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_aio import wire
from areal_aio.fleet.busy import Busy
from areal_aio.fleet.client import WorkerClient


class TrainerLink:
    """Owns the trainer's request/reply bookkeeping; `commit(step, trained)` records a step,
    `step` being what the caller handed to `train` for it."""

    def __init__(self, trainer: WorkerClient, busy: Busy, commit: Callable[[Any, wire.Trained], None]) -> None:
        self.trainer = trainer
        self.busy = busy
        self._commit = commit
        self._trained: asyncio.Future | None = None
        self._saved: asyncio.Future | None = None
        self._step: Any = None  # the step whose Train was sent and whose Trained is not committed
        self._taken: wire.Trained | None = None  # that step's Trained, once the reader has it
        self.outstanding = 0  # Train and Save messages the trainer has not answered yet

    async def train(self, msg: wire.Train, step: Any) -> wire.Trained:
        """One Train; its Trained, committed before it is returned."""
        self._trained = asyncio.get_running_loop().create_future()
        self.busy.up()
        # set before sending: once the frame is written, a stop must wait for (and keep) the step
        self._step = step
        self.outstanding += 1
        await self.trainer.send(msg)
        trained: wire.Trained = await self._trained
        self._finish(trained)
        return trained

    async def save(self, kind: str, path: Path, weights: str = "") -> wire.Saved:
        """One Save to the trainer (from the train loop, between steps); its Saved."""
        self._saved = asyncio.get_running_loop().create_future()
        self.busy.up()
        try:
            self.outstanding += 1
            await self.trainer.send(wire.Save(kind, str(path), weights))
            return await self._saved
        finally:
            self.busy.down()

    async def read(self) -> None:
        """The trainer reader (a task of the run): each reply to the request awaiting it."""
        while True:
            msg = await self.trainer.recv()
            match msg:
                case wire.Trained() | wire.Saved():
                    waiter = self._trained if isinstance(msg, wire.Trained) else self._saved
                    if waiter is None or (waiter.done() and not waiter.cancelled()):
                        raise self.trainer.failure(msg)
                    self.outstanding -= 1
                    # a Trained is kept until committed: when a stop cancels the step before it
                    # commits (a late reply is no fault), settle commits it instead
                    if isinstance(msg, wire.Trained):
                        self._taken = msg
                    if not waiter.done():
                        waiter.set_result(msg)
                case _:
                    raise self.trainer.failure(msg)

    async def settle(self) -> None:
        """At a stop (the reader gone): commit a step in flight, and read the replies to
        everything sent before the stop."""
        if self._step is not None and self._taken is not None:  # the reader took its reply
            self._finish(self._taken)
        while self.outstanding:
            await self._reply_at_stop()

    async def save_at_stop(self, kind: str, path: Path, weights: str = "") -> wire.Saved:
        """A Save at a stop, its reply read here (the trainer reader is gone)."""
        self.outstanding += 1
        await self.trainer.send(wire.Save(kind, str(path), weights))
        return await self._reply_at_stop()

    async def _reply_at_stop(self) -> wire.Saved | None:
        """The trainer's next reply at a stop: a step in flight is committed, a Saved returned."""
        msg = await self.trainer.recv()
        match msg:
            case wire.Trained() if self._step is not None:
                self.outstanding -= 1
                self._finish(msg)
                return None
            case wire.Saved():
                self.outstanding -= 1
                return msg
            case _:
                raise self.trainer.failure(msg)

    def _finish(self, trained: wire.Trained) -> None:
        step, self._step, self._taken = self._step, None, None
        self.busy.down()
        self._commit(step, trained)
