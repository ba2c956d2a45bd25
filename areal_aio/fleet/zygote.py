"""Worker processes forked from one that has already imported torch (workers/zygote.py).

A fresh `python -m areal_aio.workers.<role>` spends 3-6 s of a core importing torch and
transformers before it reads its Init. The zygote pays that once per controller process:
`warm()` starts it in a thread at the top of a command, so its imports overlap the command's
own start-up, and `spawn` (fleet/client.py) then asks it for each worker
(`ForkedProcess.start`), which is ready once its model is loaded. Where the zygote cannot
start or refuses (an import left a thread running, no pidfd, the environment variable
FRESH_ENV set to 1), workers are spawned fresh, as before; `state()` says which, and why.

A forked worker is the zygote's child, not this process's: `ForkedProcess` stands in for
asyncio's Process (pid, stdin, stdout, returncode, wait, terminate, kill). Its end is seen
through a pidfd (readable once the process has exited), its exit status is the zygote's
waitpid, and signals go through the pidfd, so a reused pid is never signalled. The zygote's
stdin is its lifeline: when this process ends, however it ends, the zygote exits at once and
leaves the workers to end on their own pipes, as freshly spawned ones do.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson

FRESH_ENV = "AREAL_AIO_FRESH_WORKERS"
"""Set to 1: every worker is spawned fresh (`python -m`), no zygote."""
CONTROLLER_ENV = "AREAL_AIO_CONTROLLER_PID"
"""The controller's pid, in every worker's environment: a forked worker's parent is the zygote,
and the /dev/shm folder it may have to remove is the controller's (workers/common.py)."""
READY_TIMEOUT_S = 120.0
"""The zygote's imports take seconds; a machine too busy for this one spawns fresh."""
MAX_REPLY = 4096


def worker_env(threads: int) -> dict[str, str]:
    """A worker's environment: this process's, its code first on the path, its cores, this
    process as its controller (fresh or forked alike)."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), **{CONTROLLER_ENV: str(os.getpid())},
                PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


class Zygote:
    """The running zygote: requests go one at a time (a lock), each a blocking exchange of
    milliseconds, so callers on any thread or event loop share it."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, import_s: float) -> None:
        self.proc = proc
        self.sock = sock
        self.import_s = import_s
        self._lock = threading.Lock()

    @classmethod
    def start(cls) -> Zygote:
        """Spawn it and wait for its imports; RuntimeError (the reason) if it refuses or dies."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "areal_aio.workers.zygote", str(theirs.fileno())],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    pass_fds=(theirs.fileno(),), env=worker_env(1), start_new_session=True)
        finally:
            theirs.close()
        ours.settimeout(READY_TIMEOUT_S)
        try:
            first = orjson.loads(ours.recv(MAX_REPLY) or b"{}")
        except (TimeoutError, OSError, orjson.JSONDecodeError) as exc:
            first = {"refused": f"no answer ({type(exc).__name__})"}
        if "ready" not in first:
            ours.close()
            end(proc)
            raise RuntimeError(first.get("refused", "exited during its imports"))
        ours.settimeout(None)
        return cls(proc, ours, first["import_s"])

    def _ask(self, request: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        with self._lock:
            socket.send_fds(self.sock, [orjson.dumps(request)], list(fds))
            data = self.sock.recv(MAX_REPLY)
        if not data:
            raise OSError("the zygote is gone")
        return orjson.loads(data)

    def fork(self, role: str, env: dict[str, str], fds: tuple[int, int, int]) -> int:
        """A worker of `role` with stdin, stdout, stderr on `fds`, in this process's folder: its pid."""
        return self._ask({"op": "fork", "role": role, "env": env, "cwd": os.getcwd()}, fds)["pid"]

    def reap(self, pid: int) -> int | None:
        """The exit status of a child that has exited (blocks until it has); None if it is not
        the zygote's to reap."""
        return self._ask({"op": "reap", "pid": pid})["code"]

    def close(self) -> None:
        self.sock.close()
        end(self.proc)


def end(proc: subprocess.Popen) -> None:
    """The zygote's end, at once: it holds nothing but its imports, and the workers it forked
    live on their own pipes."""
    if proc.stdin:
        proc.stdin.close()
    proc.kill()
    proc.wait()


_lock = threading.Lock()
_started = threading.Event()
_starter: threading.Thread | None = None
_zygote: Zygote | None = None
_why_not: str | None = None


def warm() -> None:
    """Start the zygote in a thread now (once per process), so its imports overlap whatever the
    caller does next; `shared()` waits for it."""
    global _starter
    with _lock:
        if _starter is None:
            _starter = threading.Thread(target=_start, name="zygote-start", daemon=True)
            _starter.start()


def _start() -> None:
    global _zygote, _why_not
    try:
        if os.environ.get(FRESH_ENV) == "1":
            raise RuntimeError(f"{FRESH_ENV}=1")
        if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
            raise RuntimeError("no pidfd on this system")
        os.close(os.pidfd_open(os.getpid()))
        _zygote = Zygote.start()
        atexit.register(_zygote.close)
    except (RuntimeError, OSError) as exc:
        _why_not = str(exc)
    finally:
        _started.set()


def shared() -> Zygote | None:
    """This process's zygote, started if need be; None where workers are spawned fresh."""
    warm()
    _started.wait()
    return _zygote


def state() -> str:
    """How workers start in this process: forked from a zygote, or fresh and why."""
    if not _started.is_set():
        return "not started"
    return f"forked (zygote imports {_zygote.import_s:.1f} s)" if _zygote else f"fresh ({_why_not})"


def stop() -> None:
    """End this process's zygote (the workers it forked are not touched); the next `shared()`
    starts another. For tests, and for embedders that want no process left between runs."""
    global _starter, _zygote, _why_not
    with _lock:
        if _starter is not None:
            _started.wait()
        if _zygote is not None:
            atexit.unregister(_zygote.close)
            _zygote.close()
        _starter, _zygote, _why_not = None, None, None
        _started.clear()


class ForkedProcess:
    """asyncio's Process, for a worker the zygote forked: what PipeWorker and stop_process use."""

    def __init__(self, zygote: Zygote, pid: int, pidfd: int, stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader) -> None:
        self.zygote = zygote
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reaper: asyncio.Task[None] | None = None
        asyncio.get_running_loop().add_reader(pidfd, self._on_exit)

    @classmethod
    async def start(cls, zygote: Zygote, role: str, threads: int, stderr: int) -> ForkedProcess:
        """Fork a `role` worker with `threads` cores, its stderr on the fd `stderr`."""
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            pid = await asyncio.to_thread(zygote.fork, role, worker_env(threads), (in_r, out_w, stderr))
            pidfd = os.pidfd_open(pid)  # the zygote reaps it only when asked: the pid is still its
        except BaseException:
            for fd in (in_w, out_r):
                os.close(fd)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        reader = asyncio.StreamReader(limit=2**20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(out_r, "rb", 0))
        transport, protocol = await loop.connect_write_pipe(_WriteProtocol, os.fdopen(in_w, "wb", 0))
        return cls(zygote, pid, pidfd, asyncio.StreamWriter(transport, protocol, None, loop), reader)

    def _on_exit(self) -> None:
        """The pidfd is readable: the process has exited; its status is fetched once."""
        asyncio.get_running_loop().remove_reader(self._pidfd)
        if self._reaper is None:
            self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        try:
            code = await asyncio.to_thread(self.zygote.reap, self.pid)
        except OSError:
            code = None
        os.close(self._pidfd)
        # None: the zygote is gone, and init reaped the worker; its status is lost
        self.returncode = -signal.SIGKILL if code is None else code
        self._status.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._status)

    def send_signal(self, sig: int) -> None:
        if self._reaper is not None:
            return  # exited: its pid may already be another process's (the pidfd never is)
        signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _WriteProtocol(asyncio.streams.FlowControlMixin, asyncio.Protocol):
    """The write side of the worker's stdin: drain() waits for room, as a subprocess pipe's does."""
