"""Worker clients: the controller's handle on one worker, over a pipe or in-process.

The controller sees only `WorkerClient`: prepare (the model files it needs, before start),
start (Init -> Ready), send, send_many (several frames, one wait on the pipe), recv (None at
end of stream), failure, stop. `PipeWorker` runs the real subprocess;
`areal_aio.fleet.ray_workers.RayWorker` runs it in a Ray actor; `areal_aio.fleet.fakes` has in-process
fakes with the same surface, the seam the controller tests and the overhead benchmark use.

A dead worker looks the same through every client: recv gives an Error or None (end of
stream), `failure(msg)` turns that (or any message the caller did not expect) into
WorkerFailed (built by `worker_failed`), and a send to it raises WorkerFailed.

Stopping a subprocess: ask (Shutdown), wait SHUTDOWN_TIMEOUT_S, terminate,
wait KILL_TIMEOUT_S, kill. Workers run in their own session so a Ctrl-C in the
terminal reaches only the controller, which then stops them in that order.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from areal_aio import wire
from areal_aio.fleet import zygote

READY_TIMEOUT_S = 600.0
"""Loading a model (never converting it: that happens before) fits easily in this."""
SHUTDOWN_TIMEOUT_S = 10.0
"""A worker finishes its current chunk or step and exits well within this."""
KILL_TIMEOUT_S = 3.0
LOG_TAIL_BYTES = 4000
SEND_FAILURE_WAIT_S = 10.0
"""How long a failed write waits for the worker's exit code before naming the closed pipe."""


class WorkerFailed(RuntimeError):
    """A worker sent an Error, died, or closed its pipe; carries its traceback."""

    def __init__(self, role: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{role} worker failed: {message}" + (f"\n{traceback}" if traceback else ""))
        self.role = role
        self.message = message
        self.traceback = traceback


def worker_failed(role: str, msg: Any, code: int | None = None, log_tail: str = "") -> WorkerFailed:
    """The failure for a message that means the worker is gone (Error, or None: end of stream)
    or that its reader did not expect; `code`: the process's exit status when known."""
    if isinstance(msg, wire.Error):
        return WorkerFailed(role, msg.message, msg.traceback)
    what = f"exited with code {code}" if code is not None else "closed its pipe"
    if msg is not None:
        what = f"sent an unexpected {type(msg).__name__}"
    return WorkerFailed(role, what, log_tail)


class WorkerClient(Protocol):
    role: str

    async def prepare(self, model: str) -> float | None:
        """Make the model's files ready before `start`: seconds spent, None if it needs none."""
        ...

    async def start(self, init: wire.Init) -> wire.Ready: ...

    async def send(self, msg: Any) -> None: ...

    async def send_many(self, msgs: list[Any]) -> None:
        """The frames go to the worker in order once this is called, even when the caller is
        cancelled while it waits (for the pipe's room, for an earlier send): a stop counts an
        eval's request or a Train as sent once asked for, and waits for its reply. A PipeWorker
        writes them before its first wait; a RayWorker hands them to a task of their own. A
        RolloutPool keeps this for a call to one worker; a call that spans workers (a broadcast,
        aborts) is written one worker after another, and a cancel can cut it short: nothing
        counts those frames, and only a stop cancels them (its Shutdown reaches every worker)."""
        ...

    async def recv(self) -> Any | None:
        """The next message; None at the end of the stream. A read cancelled halfway through a
        frame loses nothing: the next read goes on with it (wire.FrameReader)."""
        ...

    def failure(self, msg: Any) -> WorkerFailed: ...

    async def stop(self) -> None: ...


class PipeWorker:
    """A worker process: forked from this process's zygote, which has already imported torch
    (areal_aio.fleet.zygote), or, where there is none, a fresh `python -m areal_aio.workers.<role>`."""

    def __init__(self, role: str, log_path: Path | None = None, threads: int = 1, fork: bool = True) -> None:
        self.role = role
        self.log_path = log_path
        self.threads = threads
        self.fork = fork  # False: spawned fresh even where there is a zygote
        self.proc: asyncio.subprocess.Process | zygote.ForkedProcess | None = None
        self._frames: wire.FrameReader | None = None  # its stdout, one per process

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def prepare(self, model: str) -> float:
        return await ensure_model(model)

    async def start(self, init: wire.Init) -> wire.Ready:
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - handed to the child
        try:
            self.proc = await spawn(self.role, self.threads, log if log else asyncio.subprocess.DEVNULL, self.fork)
            self._frames = wire.FrameReader(self.proc.stdout)
        finally:
            if log:
                log.close()
        await self.send(init)
        try:
            msg = await asyncio.wait_for(self.recv(), READY_TIMEOUT_S)
        except TimeoutError:
            raise WorkerFailed(self.role, f"not ready after {READY_TIMEOUT_S:.0f}s", self.log_tail()) from None
        if isinstance(msg, wire.Ready):
            return msg
        raise self.failure(msg)

    def failure(self, msg: Any) -> WorkerFailed:
        """The error to raise for a message that means the worker is gone (Error or EOF)."""
        return worker_failed(self.role, msg, self.proc.returncode if self.proc else None, self.log_tail())

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    async def send(self, msg: Any) -> None:
        await self.send_many([msg])

    async def send_many(self, msgs: list[Any]) -> None:
        """Write several frames, then wait for the pipe once."""
        assert self.proc is not None and self.proc.stdin is not None
        stdin = self.proc.stdin
        if stdin.is_closing():  # an earlier write found the pipe closed (uvloop raises on another)
            raise await self.send_failure()
        try:
            stdin.write(b"".join([wire.encode(msg) for msg in msgs]))
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise await self.send_failure() from None

    async def send_failure(self) -> WorkerFailed:
        """A write found the pipe closed: the worker is exiting or gone. Name its exit code, as
        the reader would, once the process has it (a dying process closes its pipe first)."""
        assert self.proc is not None
        try:
            await asyncio.wait_for(self.proc.wait(), SEND_FAILURE_WAIT_S)
        except TimeoutError:
            return WorkerFailed(self.role, "pipe closed while sending", self.log_tail())
        return worker_failed(self.role, None, self.proc.returncode, self.log_tail())

    async def recv(self) -> Any | None:
        assert self._frames is not None
        return await self._frames.read()

    async def stop(self) -> None:
        """Ask, wait, terminate, kill: no worker outlives this call."""
        if self.proc is not None:
            await stop_process(self.proc)


async def spawn(role: str, threads: int, stderr: Any, fork: bool = True) -> Any:
    """A `role` worker with `threads` cores, its pipe on stdin/stdout, in a session of its own:
    forked from the zygote when `fork` and there is one (stderr a file or DEVNULL), else a
    fresh `python -m areal_aio.workers.<role>` of this installation. Either way an object with
    asyncio Process's surface (pid, stdin, stdout, returncode, wait, terminate, kill)."""
    if fork and stderr is not asyncio.subprocess.PIPE and (parent := await asyncio.to_thread(zygote.shared)):
        fd = os.open(os.devnull, os.O_WRONLY) if stderr is asyncio.subprocess.DEVNULL else os.dup(stderr.fileno())
        try:
            return await zygote.ForkedProcess.start(parent, role, threads, fd)
        except OSError:
            await asyncio.to_thread(zygote.stop)  # the zygote died: this worker starts fresh, the next a new one
        finally:
            os.close(fd)
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", f"areal_aio.workers.{role}", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=stderr, env=zygote.worker_env(threads), start_new_session=True)


async def stop_process(proc: asyncio.subprocess.Process | zygote.ForkedProcess) -> None:
    """Ask (Shutdown, then end of pipe), wait SHUTDOWN_TIMEOUT_S, terminate, wait
    KILL_TIMEOUT_S, kill: a worker process that outlives this call does not exist."""
    if proc.returncode is not None:
        return
    try:
        proc.stdin.write(wire.encode(wire.Shutdown()))
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError, RuntimeError, AttributeError):
        pass
    for action, timeout in ((None, SHUTDOWN_TIMEOUT_S), (proc.terminate, KILL_TIMEOUT_S), (proc.kill, None)):
        if action is not None:
            try:
                action()
            except ProcessLookupError:
                pass
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout)
            return
        except TimeoutError:
            continue


def log_tail(path: Path | None) -> str:
    """The end of a worker's log (its traceback, when it died of one)."""
    if not path or not path.exists():
        return ""
    return path.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")


async def ensure_model(spec: str) -> float:
    """Download/convert an embedded model before the workers start; returns seconds spent.

    Runs `python -m areal_aio.workers.models prepare` in a subprocess that prints what it
    does, so this process never imports torch. A cached model costs nothing.
    """
    from areal_aio.store.model_cache import is_cached

    if is_cached(spec):
        return 0.0
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "areal_aio.workers.models", "prepare", spec)
    try:
        code = await proc.wait()
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    if code != 0:
        raise RuntimeError(f"model.path: could not prepare {spec!r} (see the message above)")
    return time.perf_counter() - t0
