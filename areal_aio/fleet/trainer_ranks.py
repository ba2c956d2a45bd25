"""A data-parallel trainer as one client: N trainer ranks, each its own worker subprocess.

    controller --Train-----> every rank         (each forwards its share; gradients summed)
               --Save------> rank 0             (the only rank that writes or publishes)
               --Shutdown--> every rank
    rank 0's Trained (path) + the others' Trained (path "")  -->  one Trained to the controller

The controller keeps one client per role and never learns how many ranks there are: `start`
starts them all at once (one process group at a free local port) and answers rank 0's Ready;
`recv` answers rank 0's replies once every rank has finished the step, and hands over the
first Error or end of stream of any rank as soon as it comes, so a rank that dies while the
others wait in a collective ends the step at once; `failure` names the rank. `stop` stops every
rank at once (ask, terminate, kill: a rank stuck in a collective is killed like any worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from areal_aio import wire
from areal_aio.fleet.client import WorkerClient, WorkerFailed

EVERY_RANK = (wire.Train, wire.Shutdown)
"""What every rank gets; anything else (Save) goes to rank 0 only."""


def free_port() -> int:
    """A local TCP port nobody listens on now (rank 0 opens the process group's store there)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def named(rank: int, exc: WorkerFailed) -> WorkerFailed:
    """`exc` with the rank it came from in its message."""
    return WorkerFailed(exc.role, f"rank {rank}: {exc.message}", exc.traceback)


class TrainerRanks:
    """The client of a data-parallel trainer: `ranks[i]` runs rank i on `devices[i]`."""

    role = "trainer"

    def __init__(self, ranks: list[WorkerClient], devices: list[str]) -> None:
        self.ranks = ranks
        self.devices = devices
        self._inbox: list[deque] = [deque() for _ in ranks]  # replies read, not yet handed over
        self._reads: list[asyncio.Task | None] = [None] * len(ranks)  # one pending recv per rank
        self._ended = [False] * len(ranks)  # the rank's stream ended (None read)
        self._source = 0  # the rank whose message recv returned last (for `failure`)

    @property
    def pids(self) -> list[int | None]:
        return [getattr(r, "pid", None) for r in self.ranks]

    @property
    def pid(self) -> int | None:
        return self.pids[0]

    async def prepare(self, model: str) -> float | None:
        return await self.ranks[0].prepare(model)  # one copy of the files serves every rank

    async def start(self, init: wire.Init) -> wire.Ready:
        """Start every rank at once: rank i on devices[i], all in one process group."""
        addr = f"tcp://127.0.0.1:{free_port()}"  # every rank runs on this machine (Ray: pinned)
        world = len(self.ranks)

        def init_of(i: int) -> wire.Init:
            trainer = {**init.settings["trainer"], "device": self.devices[i]}
            return dataclasses.replace(init, rank=i, world=world, dist_addr=addr,
                                       settings={**init.settings, "trainer": trainer})

        readies = await self._each(range(world), lambda i: self.ranks[i].start(init_of(i)))
        if len({r.version for r in readies}) > 1:
            raise WorkerFailed(self.role, f"ranks started at versions {[r.version for r in readies]}")
        return dataclasses.replace(readies[0], device=",".join(r.device for r in readies))

    async def send(self, msg: Any) -> None:
        await self.send_many([msg])

    async def send_many(self, msgs: list[Any]) -> None:
        """Train and Shutdown to every rank, the rest to rank 0; in order per rank."""
        share = [[m for m in msgs if i == 0 or isinstance(m, EVERY_RANK)] for i in range(len(self.ranks))]
        await self._each([i for i, mine in enumerate(share) if mine],
                         lambda i: self.ranks[i].send_many(share[i]))

    async def recv(self) -> Any | None:
        """Rank 0's next reply (a Trained once every rank sent its own), or the first Error or
        end of stream of any rank. Cancel-safe: the reads in progress are kept for the next call."""
        while True:
            if (at := self._ready()) is not None:
                i, k = at
                msg = self._inbox[i][k]
                del self._inbox[i][k]
                if isinstance(msg, wire.Trained):
                    self._check(msg)
                self._source = i
                return msg
            pending = [t for t in self._reads if t is not None]
            for i, rank in enumerate(self.ranks):
                if self._reads[i] is None and not self._ended[i]:
                    self._reads[i] = asyncio.create_task(rank.recv(), name=f"trainer-rank-{i}-recv")
                    pending.append(self._reads[i])
            if not pending:  # every rank's stream has ended and was handed over
                self._source = 0
                return None
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for i, task in enumerate(self._reads):
                if task is not None and task.done():
                    self._reads[i] = None
                    msg = task.result()
                    self._ended[i] = msg is None
                    self._inbox[i].append(msg)

    def _ready(self) -> tuple[int, int] | None:
        """(rank, position in its inbox) of the message to hand over now, if any: an end of
        stream first, then any other rank's anything but Trained (both even behind a Trained
        the step has not used yet: a dead rank ends the step at once), then rank 0's next reply
        (a Trained only once every rank has sent one)."""
        for i, box in enumerate(self._inbox):
            if (k := next((k for k, m in enumerate(box) if m is None), None)) is not None:
                return i, k
        for i, box in enumerate(self._inbox[1:], start=1):
            if (k := next((k for k, m in enumerate(box) if not isinstance(m, wire.Trained)), None)) is not None:
                return i, k
        head = self._inbox[0]
        if head and (not isinstance(head[0], wire.Trained) or all(self._inbox[1:])):
            return 0, 0
        return None

    def _check(self, trained: wire.Trained) -> None:
        """Take every other rank's Trained of the same step; they must agree with rank 0's."""
        for i, box in enumerate(self._inbox[1:], start=1):
            other = box.popleft()
            if (other.step, other.version) != (trained.step, trained.version):
                raise WorkerFailed(self.role, f"rank {i} trained step {other.step} to version "
                                              f"{other.version}, rank 0 step {trained.step} to {trained.version}")

    def failure(self, msg: Any) -> WorkerFailed:
        """The failure for `msg`, the last thing recv returned, naming the rank it came from."""
        return named(self._source, self.ranks[self._source].failure(msg))

    async def stop(self) -> None:
        """Stop every rank at once; none outlives this call."""
        try:
            await asyncio.gather(*(rank.stop() for rank in self.ranks))
        finally:
            reads = [t for t in self._reads if t is not None]
            for task in reads:
                task.cancel()
            await asyncio.gather(*reads, return_exceptions=True)
            self._reads = [None] * len(self.ranks)

    async def _each(self, indices: Any, call: Callable[[int], Awaitable[Any]]) -> list[Any]:
        """call(i) for each rank index at once, results in order; the first failure (naming its
        rank) cancels the others."""
        async def one(i: int) -> Any:
            try:
                return await call(i)
            except WorkerFailed as exc:
                raise named(i, exc) from None

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(i)) for i in indices]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None
        return [task.result() for task in tasks]
