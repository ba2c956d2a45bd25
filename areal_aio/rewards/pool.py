"""The reward pool: a few processes that run picklable sync reward functions, one call each.

    controller loop                           pool process (python -m areal_aio.rewards.pool)
      call(task, text) --frame (which, task, text, kwargs)-->  main thread: fns[which](task, text, **kwargs)
        wait_for(reply, timeout_s)   <--frame--  ("ok", value) | ("raised", "Type: message")
        timeout:  kill, respawn on next use      reader thread: stdin EOF -> exit at once
        EOF:      a break (counted); respawn     prctl(PR_SET_PDEATHSIG): controller dies -> killed

Why our own pool and not ProcessPoolExecutor: a call that never returns must be killable
on its own (an executor cannot kill one worker, and its hung worker kept the run from
exiting); a dead process must be replaced, not turn every later reward into a silent 0;
and nothing may outlive the controller (an executor's workers and multiprocessing's
resource tracker did). Plain subprocesses with pickled frames on their pipes need no
semaphore, so no resource tracker is started.

A process that dies is a break. A few breaks are healed by respawning; MAX_BREAKS within
BREAK_WINDOW_S stop the run (RewardPoolBroken) instead of training on zeros. A function
the pool processes cannot load (unpicklable there, import error) stops the run at once.
A process is started from the event loop's thread, which must outlive it: Linux sends
the parent-death signal when the spawning thread ends, not only the process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import multiprocessing.spawn
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, BinaryIO

MAX_BREAKS = 3
"""Deaths of pool processes within BREAK_WINDOW_S that stop the run: one is an accident
(an OOM kill, a crash on one odd input) and is healed; three in a minute mean most calls
kill their process, and every reward would be a 0."""
BREAK_WINDOW_S = 60.0
START_TIMEOUT_S = 120.0
"""A new process imports the reward function's module (sympy-based verifiers take seconds)."""
KILL_WAIT_S = 5.0
"""After SIGKILL a process is gone at once; this only bounds a wait on a stuck kernel call."""
HEADER = struct.Struct(">I")
PR_SET_PDEATHSIG = 1
PARENT_ENV = "AREAL_AIO_REWARD_PARENT"


class RewardCallFailed(Exception):
    """One call failed (raised, timed out, or its process died): a counted failure, reward 0."""


class RewardPoolBroken(RuntimeError):
    """The pool cannot score: its processes keep dying, or cannot load the reward function."""


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _write(stream: BinaryIO, obj: Any) -> None:
    stream.write(_frame(obj))
    stream.flush()


def _read(stream: BinaryIO) -> Any | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


async def _read_async(reader: asyncio.StreamReader) -> Any:
    """The next reply; IncompleteReadError when the process is gone."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class RewardPool:
    """`procs` processes, started on first use; `call` runs a function in one of them with a
    timeout. `fn`: one function, or a list of them (every process holds them all; several
    rewards of one run share the pool)."""

    def __init__(self, fn: Any, *, procs: int, timeout_s: float, log_path: Path | None = None) -> None:
        fns = tuple(fn) if isinstance(fn, (list, tuple)) else (fn,)
        self._fn = pickle.dumps(fns, protocol=pickle.HIGHEST_PROTOCOL)
        # what multiprocessing's spawn hands a child: sys.path, cwd and the main module, so a
        # function defined in the user's script unpickles there as it would in an executor
        self._prep = multiprocessing.spawn.get_preparation_data("areal_aio-reward")
        self._prep["authkey"] = bytes(self._prep["authkey"])  # pickles only as plain bytes
        self.procs = procs
        self.timeout_s = timeout_s
        self.log_path = log_path
        self.breaks: collections.deque[float] = collections.deque()
        self._idle: asyncio.Queue | None = None
        self._live: set[asyncio.subprocess.Process] = set()
        self._broken: str | None = None
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._live if p.returncode is None]

    async def call(self, task: Any, text: str, *, which: int = 0, kwargs: dict | None = None) -> Any:
        """fns[which](task, text, **kwargs) in a pool process. Raises RewardCallFailed (count it,
        score 0) or RewardPoolBroken (stop the run)."""
        if self._broken is not None:
            raise RewardPoolBroken(self._broken)
        if self._closed:
            raise RewardCallFailed("the reward pool is closed")
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.procs):
                self._idle.put_nowait(None)  # a slot; its process starts when first used
        proc = await self._idle.get()
        try:
            if self._broken is not None:
                raise RewardPoolBroken(self._broken)
            if proc is not None and proc.returncode is not None:
                self._drop(proc)
                code, proc = proc.returncode, None
                self._broke(f"a reward process exited with code {code} while idle")
            if proc is None:
                proc = await self._start()
            try:
                proc.stdin.write(_frame((which, task, text, kwargs or {})))
                await proc.stdin.drain()
                reply = await asyncio.wait_for(_read_async(proc.stdout), self.timeout_s)
            except TimeoutError:
                await self._kill(proc)
                proc = None
                raise RewardCallFailed(f"timed out after {self.timeout_s:g}s (process killed)") from None
            except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
                code = await self._kill(proc)
                proc = None
                if self._closed:
                    raise RewardCallFailed("the reward pool was closed during the call") from None
                self._broke(f"a reward process died (exit code {code}) during a call")
                raise RewardCallFailed(f"the reward process died (exit code {code})") from None
            except BaseException:  # cancelled mid-call: its reply would answer the next call
                await asyncio.shield(self._kill(proc))
                proc = None
                raise
        finally:
            if self._idle is not None:
                self._idle.put_nowait(proc)
        kind, value = reply
        if kind == "raised":
            raise RewardCallFailed(value)
        return value

    def close(self) -> None:
        """Kill every process now (nothing they compute is wanted any more)."""
        self._closed = True
        for proc in list(self._live):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def __aenter__(self) -> RewardPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """close, then reap the processes while the loop still runs (their pipes close with them;
        a call in progress sees the end of its pipe and returns)."""
        procs = list(self._live)
        self.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), KILL_WAIT_S)
        await asyncio.sleep(0)  # let the pipes' end-of-file callbacks run

    # ------------------------------------------------------------------ internals

    def _broke(self, what: str) -> None:
        now = time.monotonic()
        self.breaks.append(now)
        while self.breaks and now - self.breaks[0] > BREAK_WINDOW_S:
            self.breaks.popleft()
        if len(self.breaks) >= MAX_BREAKS:
            self._broken = (f"reward pool broke {len(self.breaks)} times within {BREAK_WINDOW_S:g}s "
                            f"(last: {what}); stopping instead of training on zeros")
            raise RewardPoolBroken(self._broken)

    async def _start(self) -> asyncio.subprocess.Process:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())},
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - handed to the child
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "areal_aio.rewards.pool", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        finally:
            if log:
                log.close()
        self._live.add(proc)
        try:
            proc.stdin.write(_frame((self._prep, self._fn)))
            await proc.stdin.drain()
            kind, value = await asyncio.wait_for(_read_async(proc.stdout), START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
            code = await self._kill(proc)
            self._broke(f"a reward process died (exit code {code}) while starting")
            raise RewardCallFailed(f"the reward process died while starting (exit code {code})") from None
        except TimeoutError:
            await self._kill(proc)
            self._broken = f"a reward process did not start within {START_TIMEOUT_S:g}s"
            raise RewardPoolBroken(self._broken) from None
        except BaseException:
            await asyncio.shield(self._kill(proc))
            raise
        if kind != "ready":
            await self._kill(proc)
            self._broken = f"the reward function cannot be loaded in a pool process: {value}"
            raise RewardPoolBroken(self._broken)
        return proc

    async def _kill(self, proc: asyncio.subprocess.Process) -> int | None:
        """Kill, reap, and close its pipes (communicate reads them to their end)."""
        self._drop(proc)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(proc.communicate(), KILL_WAIT_S)
        return proc.returncode

    def _drop(self, proc: asyncio.subprocess.Process) -> None:
        self._live.discard(proc)


# ---------------------------------------------------------------------- the pool process


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (however it dies); elsewhere
    the stdin reader's EOF is the only signal. Then check the parent did not die first."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def main() -> int:
    die_with_parent(int(os.environ.get(PARENT_ENV, os.getppid())))
    stdin = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a print in the reward goes to the log, never into the reply pipe
    sys.stdout = sys.stderr
    init = _read(stdin)
    if init is None:
        return 0
    prep, fn_bytes = init
    try:
        multiprocessing.spawn.prepare(prep)
        fns = pickle.loads(fn_bytes)
    except BaseException as exc:  # noqa: BLE001 - reported to the controller, which stops the run
        _write(out, ("error", f"{type(exc).__name__}: {exc}"))
        return 1
    _write(out, ("ready", os.getpid()))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while (item := _read(stdin)) is not None:
            inbox.put(item)
        os._exit(0)  # the controller closed the pipe or died: a call in progress is not wanted

    threading.Thread(target=read, name="pipe-reader", daemon=True).start()
    while True:
        which, task, text, kwargs = inbox.get()
        try:
            data = _frame(("ok", fns[which](task, text, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - a failing reward is a counted failure
            traceback.print_exc()  # into the run folder's reward.log: why the rewards fail
            data = _frame(("raised", f"{type(exc).__name__}: {exc}"))
        out.write(data)
        out.flush()


if __name__ == "__main__":
    raise SystemExit(main())
