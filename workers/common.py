"""What both worker processes share: the pipe, the process rules, the error path.

A worker is started by the controller as `python -m areal_aio.workers.<role>` (a fresh
interpreter), or forked from the controller's zygote (workers/zygote.py: an interpreter that
has imported the workers' modules and touched no device; never a fork after CUDA), with
stdin/stdout as its pipe.

    fd 0 (stdin)  <- frames from the controller, read by a reader thread into a queue
    fd 1 (stdout) -> frames to the controller; at start the original fd 1 is
                     duplicated for frames and fd 1 itself is pointed at stderr,
                     so a stray print (Python or C) can never corrupt the pipe
    fd 2 (stderr) -> the worker's log (the controller sends it to a file)

`serve(role, Worker)` reads Init, builds the worker, sends Ready, and hands
every later message to the worker. Any exception becomes an Error frame with
the traceback, then exit 1. End of stdin (controller gone) ends the worker, at
its next look at the pipe (the rollout worker: within a chunk; the trainer: after
its current step); a controller that died without a Shutdown (kill -9) cannot
remove its /dev/shm folder, so the worker that finds itself orphaned does. Once
serve() returns, the process ends at once (`exit_now`), without unloading torch.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

from areal_aio import wire
from areal_aio.store.weights import pid_alive

EOF = object()
"""Put on the inbox when the controller's end of the pipe closes."""
CONTROLLER_ENV = "AREAL_AIO_CONTROLLER_PID"
"""The controller's pid (areal_aio.fleet.zygote sets it for fresh and forked workers alike)."""
ORPHAN_WAIT_S = 1.0
"""After an end of pipe without a Shutdown, how long to wait for this process to be reparented:
a dying controller closes its files before the kernel hands its children to another parent."""


class Channel:
    """The worker's end of the pipe: a reader thread fills `inbox`; `send` writes frames."""

    def __init__(self, fd_in: int = 0, fd_out: int = 1) -> None:
        out = os.dup(fd_out)
        os.dup2(2, fd_out)  # from here on, anything printed goes to stderr, not the pipe
        sys.stdout = sys.stderr
        self._out = os.fdopen(out, "wb", buffering=0)
        self._in = os.fdopen(fd_in, "rb", buffering=0)
        self._lock = threading.Lock()
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.closed_without_shutdown = False  # the pipe ended with no Shutdown before: the controller died?
        self._reader = threading.Thread(target=self._read, name="pipe-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        shutdown = False
        try:
            while (msg := wire.read_message(self._in)) is not None:
                shutdown = shutdown or isinstance(msg, wire.Shutdown)
                self.inbox.put(msg)
        except Exception as exc:  # noqa: BLE001 - handed to the main thread
            self.inbox.put(exc)
        self.closed_without_shutdown = not shutdown
        self.inbox.put(EOF)

    def recv(self, timeout: float | None = None) -> Any:
        """Next message (blocking), None on timeout, EOF when the pipe closed."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def poll(self) -> Any:
        """Next message if one is waiting, else None (never blocks)."""
        try:
            item = self.inbox.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def send(self, msg: Any) -> None:
        data = wire.encode(msg)
        with self._lock:
            self._out.write(data)


class Worker(Protocol):
    """What `serve` drives. `run` owns the loop until Shutdown or EOF."""

    device: str
    version: int

    def run(self, channel: Channel) -> None: ...


def configure_torch(device: str, threads: int) -> None:
    """Give this process its own cores (CPU) or its own device; call before loading a model."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set once in this process
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:  # plain "cuda" is the current device
        torch.cuda.set_device(dev)


def name_process(name: str) -> None:
    """The name `ps -o comm`, top and /proc/<pid>/comm show (15 bytes at most): `areal-rollout`,
    `areal-trainer`, `areal-zygote`; a forked worker's command line is the zygote's."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass  # not Linux, or /proc read-only: the name stays python's


def serve(role: str, build: Any) -> int:
    """Process main of a worker: Init -> build(init) -> Ready -> worker.run(channel)."""
    name_process(f"areal-{role}")
    t0 = time.perf_counter()
    parent = os.getppid()  # the controller, or the zygote it forked this worker from
    controller = int(os.environ.get(CONTROLLER_ENV, parent))
    channel = Channel()
    init = None
    try:
        init = channel.recv()
        if init is EOF:
            return 0
        if not isinstance(init, wire.Init):
            raise wire.WireError(f"{role}: expected Init first, got {type(init).__name__}")
        worker = build(init)
        channel.send(wire.Ready(role=role, pid=os.getpid(), load_s=time.perf_counter() - t0,
                                device=worker.device, version=worker.version))
        worker.run(channel)
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure reaches the controller
        if isinstance(exc, KeyboardInterrupt):
            return 130  # the controller's Ctrl-C reached us too; it cleans up
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        try:
            channel.send(wire.Error(role=role, message=f"{type(exc).__name__}: {exc}", traceback=tb))
        except OSError:
            pass  # controller already gone
        return 1
    finally:
        if isinstance(init, wire.Init) and channel.closed_without_shutdown:
            remove_orphaned_store(init.shm_dir, parent, controller)


def exit_now(code: int) -> None:
    """End the worker process with `code` once serve() has returned, skipping the interpreter's
    teardown: torch's and transformers' modules take about 2 s of a core to unload, which every
    run's stop (and the other worker, on a CPU) would wait for. Everything a worker writes is
    written and closed before serve() returns; its streams are flushed here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def remove_orphaned_store(shm_dir: str, parent: int, controller: int) -> None:
    """The run's /dev/shm folder, removed once the controller that owns it is surely gone (this
    process was reparented: its parent was the controller, or the zygote, which exits with it;
    or, forked, the controller's pid is gone) and the folder is the controller's (owner.pid):
    both workers may try."""
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while os.getppid() == parent and not (controller != parent and not pid_alive(controller)):
        if time.monotonic() > deadline:
            return  # the controller lives: it closed the pipe and removes the folder itself
        time.sleep(0.01)
    try:
        owner = int((Path(shm_dir) / "owner.pid").read_text().strip())
    except (OSError, ValueError):
        owner = None  # gone: a sweep by the next run is removing the folder, or removed it while
        # this worker was still writing a version into it; finish the job (the name is its own)
    if owner in (controller, None):
        shutil.rmtree(shm_dir, ignore_errors=True)
