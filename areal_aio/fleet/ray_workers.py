"""Workers as Ray actors: the same worker processes and messages, placed on a Ray cluster.

    controller (on a node of the cluster)            Relay actor (on the node Ray picks)
      RayWorker --write(frames) / load_weights-->      stdin  -> python -m areal_aio.workers.<role>
                <--read(): stdout, stderr bytes--      stdout <-   (the worker PipeWorker runs)
      frames parsed here, stderr appended to <run>/<role>.log

A Relay is the pipe at a distance: it runs the worker subprocess on its node, writes what the
controller sends to the worker's stdin and hands back what the worker writes, unparsed. The
worker loops, the wire and the controller do not know about Ray.

Weights. The trainer's actors (every rank) are pinned to the controller's node
(NodeAffinitySchedulingStrategy), so v<N>.safetensors in the weight store, model/, best/ and
checkpoints are written where the controller reads and removes them, as in a local run. A
rollout actor on another node (every rollout actor with ray.ship_weights = "always") has a
store folder of its own on its node: on UpdateWeights(version, path), sent only after the
controller committed the version, its client asks the trainer's actor for the file (the bytes
go into Ray's object store on the controller's node and from there to the rollout node; only a
file under Ray's inline limit, 100 KiB, passes through the controller), the rollout actor
writes them as v<version> in its folder and sends its worker UpdateWeights with that path. It keeps KEPT_VERSIONS files and removes the folder
when it stops.

Stopping: the actor stops its worker as PipeWorker does (Shutdown, wait, terminate, kill),
then the client kills the actor. An actor that dies (killed, its node lost) ends the client's
stream: recv gives None, failure() says that the actor died. Ray kills the processes a dead
actor started, so its worker goes with it, and so does the worker's own cleanup: the client
removes a dead actor's store folder on the controller's node; on another node the next run's
store sweeps it there (its owner, the actor, is gone).

Ray is one connection per process (ray.init): the first RayWorker to start connects (ray.address
= "local" starts a private cluster), the last to stop disconnects (a private cluster shuts down).
A running cluster's address is first probed (`unreachable`: one TCP connection, the check
preflight makes too), then joined in a thread of its own within CONNECT_TIMEOUT_S: ray.init keeps
retrying an address where no cluster answers, and would hold the event loop (and its SIGTERM)
meanwhile. ray.init in the main thread installs a SIGTERM handler of its own (sys.exit): the
one it replaced is put back, so SIGTERM stops a run on Ray as it stops a local one.
areal_aio must be installed on every node (a checkout on PYTHONPATH alone lacks areal_aio.workers,
which the installation maps to its workers/ folder), and model.path valid on each (an embedded
model or a hub id is prepared on each node when its actor starts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import mmap
import os
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from areal_aio import wire
from areal_aio.fleet.client import (
    KILL_TIMEOUT_S,
    READY_TIMEOUT_S,
    SHUTDOWN_TIMEOUT_S,
    WorkerFailed,
    ensure_model,
    log_tail,
    spawn,
    stop_process,
    worker_failed,
)
from areal_aio.settings import Settings
from areal_aio.store.weights import WeightStore

KEPT_VERSIONS = 2
"""Weight files a rollout actor keeps: the newest and the one before, which its worker may hold
as pending but not yet opened when the newest arrives (it then loads the newest instead)."""
STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S + 2 * KILL_TIMEOUT_S
"""An actor stops its worker (ask, terminate, kill) within this; then it is killed itself."""
READ_BYTES = 1 << 20
PROBE_TIMEOUT_S = 5.0
"""One TCP connection to a cluster's address: a node on the same network answers in milliseconds."""
CONNECT_TIMEOUT_S = 30.0
"""Joining a running cluster (ray.init): seconds when it answers; past this it is not going to
(ray.init itself retries for minutes, then again)."""


@ray.remote
class Relay:
    """One worker process on this actor's node, its pipe and its log relayed to a RayWorker."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.store: WeightStore | None = None
        self.out, self.err = bytearray(), bytearray()
        self.news = asyncio.Event()
        self.pumps: list[asyncio.Task] = []

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def start(self, role: str, threads: int, model: str, store: str) -> str:
        """Make `model` ready on this node, create a weight-store folder named `store` here
        ("" = none: the worker reads the controller's), start the worker; returns the folder."""
        await ensure_model(model)
        if store:
            self.store = WeightStore.create(store)
        self.proc = await spawn(role, threads, asyncio.subprocess.PIPE, fork=False)
        self.pumps = [asyncio.create_task(self._pump(stream, buf))
                      for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        return str(self.store.root) if self.store else ""

    async def _pump(self, stream: asyncio.StreamReader, buf: bytearray) -> None:
        while chunk := await stream.read(READ_BYTES):
            buf += chunk
            self.news.set()
        self.news.set()

    async def read(self) -> tuple[bytes, bytes, int | None]:
        """What the worker wrote to stdout and stderr since the last read (waits for something);
        once both are closed and handed over: its exit status, else None."""
        await self.news.wait()
        ended = all(p.done() for p in self.pumps)
        if not ended:
            self.news.clear()
        out, err = bytes(self.out), bytes(self.err)
        self.out.clear()
        self.err.clear()
        if out or err or not ended:
            return out, err, None
        return b"", b"", await self.proc.wait()

    async def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def load_weights(self, version: int, data: np.ndarray) -> None:
        """Store shipped weights as v<version> on this node, then hand the worker their path."""
        path = await asyncio.to_thread(self.store.put, version, data)
        self.store.retain(range(version - KEPT_VERSIONS + 1, version + 1))
        await self.write(wire.encode(wire.UpdateWeights(version, str(path))))

    async def read_file(self, path: str) -> np.ndarray:
        """A published weight file's bytes (the trainer's actor, on the controller's node), as a
        uint8 array mapped from the file: Ray copies it into the object store once, with no
        read into this process and no pickling, and the receiving actor reads it from there
        without a copy (bytes took longer: docs/scale-out.md)."""
        with open(path, "rb") as fh:
            return np.frombuffer(mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ), dtype=np.uint8)

    async def stop(self) -> None:
        if self.proc is not None:
            await stop_process(self.proc)
            await asyncio.gather(*self.pumps)
        if self.store is not None:
            self.store.close()


class RayWorker:
    """A WorkerClient whose worker runs in a Relay actor: worker `index` of `role`.

    Asks Ray for rollout.threads / trainer.threads CPUs, and one GPU for a cuda device (which
    the worker then sees as "cuda": Ray makes it the only one visible)."""

    def __init__(self, role: str, index: int, settings: Settings, log_path: Path | None = None) -> None:
        self.role, self.index, self.log_path = role, index, log_path
        devices = settings.rollout_devices if role == "rollout" else settings.trainer_devices
        self.threads = settings.rollout.threads if role == "rollout" else settings.trainer.threads
        self.gpu = str(devices[index]).startswith("cuda")
        self.gpus = gpu_share(devices[index], settings) if self.gpu else 0.0
        self.address, self.ship = settings.ray.address, settings.ray.ship_weights
        self.cpus = (len(settings.rollout_devices) * settings.rollout.threads
                     + len(settings.trainer_devices) * settings.trainer.threads)
        self.actor: Any = None
        self.pid: int | None = None  # the worker process's, on the actor's node
        self.shipped = False  # this rollout worker gets weights through the object store
        self.code: int | None = None
        self._gone = ""  # why the stream ended, when the actor died
        self._joined = False
        self._stream: asyncio.StreamReader | None = None
        self._frames: wire.FrameReader | None = None
        self._relay: asyncio.Task | None = None
        self._sending = asyncio.Lock()
        self._source: Any = None
        self._own_store = ""  # the actor's store folder when it is on this node (removed at stop)

    async def prepare(self, model: str) -> None:
        """Nothing here: each actor makes the model ready on its own node when it starts."""
        return None

    async def start(self, init: wire.Init) -> wire.Ready:
        await Cluster.join(self.address, self.cpus)
        self._joined = True
        try:
            return await asyncio.wait_for(self._start(init), READY_TIMEOUT_S)
        except TimeoutError:
            raise WorkerFailed(self.role, f"not ready after {READY_TIMEOUT_S:.0f}s (a Ray actor waits "
                                          "for a node with the CPUs and GPUs it asks for)",
                               self.log_tail()) from None

    async def _start(self, init: wire.Init) -> wire.Ready:
        here = ray.get_runtime_context().get_node_id()
        options: dict[str, Any] = {"num_cpus": self.threads, "num_gpus": self.gpus}
        if self.role == "trainer":  # rank 0 writes the run folder and the store; every rank
            # reads the store folder and a resume's checkpoint there: all on the controller's node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=False)
            if self.index == 0:
                options["name"] = trainer_name(init.shm_dir)
        self.actor = Relay.options(**options).remote()
        node = await self._call(self.actor.node.remote())
        self.shipped = self.role == "rollout" and (self.ship == "always" or node != here)
        store = f"{Path(init.shm_dir).name}-{self.role}{self.index}" if self.shipped else ""
        shm_dir = await self._call(self.actor.start.remote(self.role, self.threads,
                                                           init.settings["model"]["path"], store))
        self._own_store = shm_dir if node == here else ""
        self._stream = asyncio.StreamReader()
        self._frames = wire.FrameReader(self._stream)
        self._relay = asyncio.create_task(self._read_actor(self.actor), name=f"{self.role}-relay")
        await self.send(_on_actor(init, shm_dir or init.shm_dir, self.gpu))
        msg = await self.recv()
        if not isinstance(msg, wire.Ready):
            raise self.failure(msg)
        self.pid = msg.pid
        return msg

    async def _read_actor(self, actor: Any) -> None:
        """Feed what the actor hands back: stdout into the frame stream, stderr into the log."""
        log = open(self.log_path, "ab", buffering=0) if self.log_path else None  # noqa: SIM115
        try:
            while True:
                out, err, code = await actor.read.remote()
                if err and log:
                    log.write(err)
                if out:
                    self._stream.feed_data(out)
                if code is not None:
                    self.code = code
                    return
        except RayError as exc:
            self._gone = _what_happened(exc)
        finally:
            self._stream.feed_eof()
            if log:
                log.close()

    async def _call(self, ref: Any) -> Any:
        try:
            return await ref
        except RayError as exc:
            raise WorkerFailed(self.role, _what_happened(exc), self.log_tail()) from None

    def failure(self, msg: Any) -> WorkerFailed:
        if msg is None and self._gone:
            return WorkerFailed(self.role, self._gone, self.log_tail())
        return worker_failed(self.role, msg, self.code, self.log_tail())

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    async def send(self, msg: Any) -> None:
        await self.send_many([msg])

    async def send_many(self, msgs: list[Any]) -> None:
        """Frames to the worker, in order, sent as a pipe write is: once this is called, even when
        the caller is cancelled while it waits (a stop counts an eval's request or a Train as sent
        once asked for, and waits for its reply). Ray runs an async actor's calls in any order, so
        one call at a time: each call's frames go in a task of their own that waits for its turn."""
        sending = asyncio.ensure_future(self._send_in_turn(msgs))
        sending.add_done_callback(_seen)  # a caller cancelled meanwhile never reads its outcome
        await asyncio.shield(sending)

    async def _send_in_turn(self, msgs: list[Any]) -> None:
        """A shipped UpdateWeights becomes the file's bytes plus the message (frames sent
        meanwhile wait for the transfer)."""
        async with self._sending:
            actor = self.actor  # the one these frames were sent to, should a stop come meanwhile
            if actor is None:
                raise WorkerFailed(self.role, "stopped", self.log_tail())
            frames = []
            for msg in msgs:
                if isinstance(msg, wire.UpdateWeights) and self.shipped:
                    if frames:
                        await self._call(actor.write.remote(b"".join(frames)))
                        frames = []
                    data = self._weights_source(msg.path).read_file.remote(msg.path)
                    await self._call(actor.load_weights.remote(msg.version, data))
                else:
                    frames.append(wire.encode(msg))
            if frames:
                await self._call(actor.write.remote(b"".join(frames)))

    def _weights_source(self, path: str) -> Any:
        """The trainer's actor, which reads the store on the controller's node."""
        if self._source is None:
            self._source = ray.get_actor(trainer_name(str(Path(path).parent)))
        return self._source

    async def recv(self) -> Any | None:
        return await self._frames.read()

    async def stop(self) -> None:
        """Ask the actor to stop its worker, wait, kill the actor; the last client disconnects."""
        actor, self.actor = self.actor, None
        try:
            if actor is not None:
                with contextlib.suppress(RayError, TimeoutError):
                    await asyncio.wait_for(actor.stop.remote(), STOP_TIMEOUT_S)
                if self._relay is not None:  # the rest of the worker's output and its exit status
                    await asyncio.wait([self._relay], timeout=KILL_TIMEOUT_S)
                    self._relay.cancel()
                with contextlib.suppress(RayError, ValueError):
                    ray.kill(actor)
                if self._own_store:  # the actor died before removing it
                    shutil.rmtree(self._own_store, ignore_errors=True)
        finally:
            if self._joined:
                self._joined = False
                Cluster.leave()


def _seen(task: asyncio.Task) -> None:
    """Mark a send's outcome as read: a failure is also raised to its caller, when it still waits."""
    if not task.cancelled():
        task.exception()


class Cluster:
    """This process's connection to Ray, shared by its RayWorkers: the first to start joins,
    the last to stop leaves. A connection the caller made itself is left as it is."""

    users = 0
    owned = False
    _joining: concurrent.futures.Future | None = None  # a connection being made, in its thread

    @classmethod
    async def join(cls, address: str, cpus: int) -> None:
        """`address` "local": start a private cluster with `cpus` CPUs (what the workers ask for);
        another address: join that running cluster (ClusterUnreachable, naming it, when it does
        not answer within CONNECT_TIMEOUT_S)."""
        if cls.users == 0 and not ray.is_initialized():
            if address == "local":
                _keeping_sigterm(lambda: ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                                                  log_to_driver=False, logging_level="WARNING"))
            else:
                await cls._connect(address)
            cls.owned = True
        cls.users += 1

    @classmethod
    async def _connect(cls, address: str) -> None:
        """ray.init(address) in a daemon thread (the workers starting together share it): the
        loop stays free, and one that never returns is left behind when the process exits."""
        if cls._joining is None or cls._joining.done():
            cls._joining = concurrent.futures.Future()
            threading.Thread(target=_connect_into, args=(address, cls._joining), daemon=True,
                             name="ray-connect").start()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(cls._joining)), CONNECT_TIMEOUT_S)
        except TimeoutError:
            raise ClusterUnreachable(f"ray.address = {address!r}: no Ray cluster answered within "
                                     f"{CONNECT_TIMEOUT_S:.0f}s") from None

    @classmethod
    def leave(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.owned:
            cls.owned = False
            ray.shutdown()


class ClusterUnreachable(ConnectionError):
    """A running Ray cluster that cannot be joined; the message is one line naming the address."""


def unreachable(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing could answer at `address` (a running cluster's: "auto", "host:port"), in words,
    or None when something listens there. "auto" is the cluster Ray itself would find (RAY_ADDRESS,
    else the last one started on this node); "local" needs no probe."""
    if address == "local":
        return None
    if address == "auto":
        found = os.environ.get("RAY_ADDRESS", "")
        if not found or found == "auto":
            try:
                from ray._private.services import canonicalize_bootstrap_address_or_die
            except ImportError:  # a Ray without it: ray.init finds (or not) the cluster itself
                return None
            try:
                found = canonicalize_bootstrap_address_or_die("auto")
            except (ConnectionError, ValueError) as exc:
                return f"no running Ray cluster found on this node ({str(exc).splitlines()[0]})"
        return None if found == "local" else _closed(found, timeout)
    return _closed(address, timeout)


def _closed(address: str, timeout: float) -> str | None:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        return f"{address!r} is not host:port"
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except TimeoutError:
        return f"nothing answered at {host}:{port} within {timeout:.0f}s"
    except OSError as exc:
        return f"nothing listens at {host}:{port} ({exc.strerror or exc})"
    return None


def _connect_into(address: str, done: concurrent.futures.Future) -> None:
    """Probe, then ray.init(address) (a thread's target): the outcome goes into `done`."""
    try:
        problem = unreachable(address)
        if problem is not None:
            raise ClusterUnreachable(f"ray.address = {address!r}: {problem}")
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
        if not done.cancelled():
            done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    else:
        done.set_result(None)


def _keeping_sigterm(start: Any) -> None:
    """Run `start` (ray.init), then put back the SIGTERM handler it replaced with its own."""
    if threading.current_thread() is not threading.main_thread():
        start()
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        start()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def gpu_share(device: str, settings: Settings) -> float:
    """The GPU a worker asks Ray for: 1, or 1/k when k workers of the run name its device (a
    rollout worker and the trainer on one GPU, the usual one-GPU layout, ask for half each)."""
    def same(dev: str) -> str:
        return "cuda:0" if dev == "cuda" else dev

    named = [same(d) for d in (*settings.rollout_devices, *settings.trainer_devices)]
    return 1.0 / named.count(same(device))


def trainer_name(shm_dir: str) -> str:
    """The Ray name of a run's trainer actor (its store folder is unique to the run)."""
    return f"areal_aio-trainer-{Path(shm_dir).name}"


def _on_actor(init: wire.Init, shm_dir: str, gpu: bool) -> wire.Init:
    """Init as the worker in an actor needs it: its store folder; on a GPU the one Ray gave it."""
    settings = init.settings
    if gpu:
        part = settings[init.role]
        settings = {**settings, init.role: {**part, "device": "cuda", "devices": [
            "cuda" if str(d).startswith("cuda") else d for d in part["devices"]]}}
    return dataclasses.replace(init, settings=settings, shm_dir=shm_dir)


def _what_happened(exc: RayError) -> str:
    """A failed actor call in the words of WorkerFailed: the actor died, or a call raised."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"its Ray actor died ({first})" if isinstance(exc, RayActorError) else f"its Ray actor failed: {first}"
