"""Several rollout workers behind one WorkerClient: the controller holds one client per role.

    controller --send--> RolloutPool --route--> worker 0 .. worker N-1
        Generate(s) of one call (a group, a batch of continuations, one eval request)
                          -> whole to the least-loaded worker (fewest requests outstanding)
        Abort             -> the worker holding that request (an unknown id is dropped: a
                             worker ignores it too, its Completion is already on the way)
        UpdateWeights, anything else -> every worker (each interrupts and reloads on its own)
    controller <--recv-- one queue <-- one reader task per worker (a Completion frees its slot)

Admission and staleness stay in the controller: the pool only decides where a request runs.
The death of any worker (Error, end of stream, or a send that fails) is handed on as it is
and named by `failure` ("rollout 1"); the controller then stops the run and `stop` stops them
all. A pool of one worker is that worker under its plain name, read directly (the controller
holds a pool however many workers the role has). Worker i gets Init rank i, world N and its
own device in settings' rollout.device.
Per worker, the pool keeps the time it had a request out (`busy`, for its idle fraction) and
says which worker sent what `recv` returned last (`source`): the controller's per-worker counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from areal_aio import wire
from areal_aio.fleet.busy import Busy
from areal_aio.fleet.client import WorkerClient, WorkerFailed


class RolloutPool:
    """N rollout clients as one; `devices[i]` (optional) is worker i's rollout.device."""

    role = "rollout"

    def __init__(self, workers: Sequence[WorkerClient], devices: Sequence[str] | None = None) -> None:
        if devices is not None and len(devices) != len(workers):
            raise ValueError(f"{len(workers)} rollout workers, {len(devices)} devices")
        self.workers = list(workers)
        self.devices = list(devices) if devices is not None else None
        self.readies: list[wire.Ready] = []  # per worker, once started (the controller logs each)
        self._load = [0] * len(self.workers)  # requests outstanding per worker
        self.busy = [Busy() for _ in self.workers]  # up while its load is above 0
        self._owner: dict[str, int] = {}  # request id -> the worker it runs on
        self._inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._readers: list[asyncio.Task] = []
        self._source = 0  # the worker whose message `recv` returned last

    @classmethod
    def of(cls, client: WorkerClient) -> RolloutPool:
        """`client` as a pool: itself if it is one, else a pool of that one worker."""
        return client if isinstance(client, cls) else cls([client])

    def name(self, i: int) -> str:
        """How worker i is named in a failure: "rollout 1"; the only worker plain "rollout"."""
        return self.role if len(self.workers) == 1 else f"{self.role} {i}"

    @property
    def pids(self) -> list[int | None]:
        """Each worker's process id; None for a worker with no process of its own (a fake)."""
        return [getattr(w, "pid", None) for w in self.workers]

    async def prepare(self, model: str) -> float | None:
        """The workers share the model files: made ready once."""
        return await self.workers[0].prepare(model)

    async def start(self, init: wire.Init) -> wire.Ready:
        """Start every worker at once; one Ready: the slowest load, the devices joined."""
        world = len(self.workers)
        inits = [dataclasses.replace(init, rank=i, world=world, settings=self._settings(init.settings, i))
                 for i in range(world)]
        results = await asyncio.gather(*(w.start(x) for w, x in zip(self.workers, inits, strict=True)),
                                       return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                raise self._named(i, result) if isinstance(result, WorkerFailed) else result
        self.readies = list(results)
        if len({r.version for r in self.readies}) > 1:
            raise WorkerFailed(self.role, f"workers started at versions {[r.version for r in self.readies]}")
        if world > 1:  # the only worker is read by `recv` itself: no task, no queue hop
            self._readers = [asyncio.create_task(self._read(i), name=f"{self.name(i)} reader")
                             for i in range(world)]
        first = self.readies[0]
        return wire.Ready(role=self.role, pid=first.pid, load_s=max(r.load_s for r in self.readies),
                          device=", ".join(r.device for r in self.readies), version=first.version)

    def _settings(self, settings: dict, i: int) -> dict:
        if self.devices is None:
            return settings
        return {**settings, "rollout": {**settings["rollout"], "device": self.devices[i]}}

    async def send(self, msg: Any) -> None:
        await self.send_many([msg])

    async def send_many(self, msgs: list[Any]) -> None:
        """Route each message (module docstring), then write each worker's share in one go."""
        shares: dict[int, list[Any]] = {}
        target = None  # the Generates of one call stay together
        generates = 0
        for msg in msgs:
            match msg:
                case wire.Generate(request_id=rid):
                    if target is None:
                        target = min(range(len(self.workers)), key=self._load.__getitem__)
                    self._owner[rid] = target
                    generates += 1
                    shares.setdefault(target, []).append(msg)
                case wire.Abort(request_id=rid):
                    if (owner := self._owner.get(rid)) is not None:
                        shares.setdefault(owner, []).append(msg)
                case _:
                    for i in range(len(self.workers)):
                        shares.setdefault(i, []).append(msg)
        if generates:
            self._load[target] += generates
            self.busy[target].up(generates)
        # one after another: a pipe with room never yields (a cancel can cut a call that spans
        # workers short: WorkerClient.send_many)
        for i, share in shares.items():
            try:
                await self.workers[i].send_many(share)
            except WorkerFailed as exc:
                raise self._named(i, exc) from None

    async def _read(self, i: int) -> None:
        """Worker i's messages into the shared inbox, until its end (None or Error)."""
        worker = self.workers[i]
        while True:
            try:
                msg = await worker.recv()
            except Exception as exc:  # noqa: BLE001 - a broken pipe is the controller's to raise
                await self._inbox.put((i, exc))
                return
            self._arrived(i, msg)
            await self._inbox.put((i, msg))
            if msg is None or isinstance(msg, wire.Error):
                return

    def _arrived(self, i: int, msg: Any) -> None:
        """A Completion frees its slot on worker i."""
        if isinstance(msg, wire.Completion) and self._owner.pop(msg.request_id, None) is not None:
            self._load[i] -= 1
            self.busy[i].down()

    async def recv(self) -> Any | None:
        """The next message of any worker; None or an Error: that worker is gone (`failure`)."""
        if len(self.workers) == 1:
            msg = await self.workers[0].recv()
            self._arrived(0, msg)
            return msg
        self._source, msg = await self._inbox.get()
        if isinstance(msg, Exception):
            raise msg
        return msg

    @property
    def source(self) -> int:
        """The index of the worker whose message `recv` returned last."""
        return self._source

    def failure(self, msg: Any) -> WorkerFailed:
        """The failure of the worker whose message `recv` returned last, named by its index."""
        return self._named(self._source, self.workers[self._source].failure(msg))

    def _named(self, i: int, exc: WorkerFailed) -> WorkerFailed:
        return WorkerFailed(self.name(i), exc.message, exc.traceback)

    async def stop(self) -> None:
        """Stop every worker at once, then their readers: nothing outlives this call."""
        try:
            await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)
        finally:
            for task in self._readers:
                task.cancel()
            await asyncio.gather(*self._readers, return_exceptions=True)
            self._readers = []
