"""How a command that owns the process runs a job and ends: the loop it runs on (uvloop, its
signals), and the exit code and the one line it prints when the job stops or fails. The CLI's
`run` and `eval`, `sft`, and the bench scripts all end through here.

Nothing here needs the console: `run | tee` whose tee the same Ctrl-C ended leaves a stdout
(or stderr) that raises BrokenPipeError. A line it cannot take goes to the run folder
(control.progress.say), and `close_console` lets such a stream go before Python's own flush at
exit would turn the exit code into 120."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import sys
import traceback
from pathlib import Path

from areal_aio.control.progress import GONE, say
from areal_aio.control.stats import cause as one_line

ERROR_LOG = "error.log"


def write_error_log(exc: BaseException, folder: Path) -> str:
    """The full traceback (and a worker's own, and its log tail) into <run>/error.log; returns
    where to look, for the one line."""
    text = "".join(traceback.format_exception(exc))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ERROR_LOG).write_text(text)
    except OSError as err:
        return f"the traceback could not be written to {folder / ERROR_LOG} ({err.strerror or err})"
    return f"see {folder / ERROR_LOG}"


YOUNG_GC_THRESHOLD = 10_000
"""Python's default is 700. The controller allocates tracked objects for every trajectory (its
messages, their token lists, the sample); most die young by reference counting, and the rest
are walked by every collection they live through. Collections of every generation come in
proportion to the young ones, so all become 14x rarer. What it buys: `bash
bench/young_gc_ab.sh` (docs/benchmarks/components.md)."""


STOPPING = ("\nareal_aio: already stopping (finishing what the run keeps, stopping its workers); "
            "this ends on its own, within the shutdown timeouts")
"""Printed at each Ctrl-C or SIGTERM after the first."""


async def _owning_process(coro, received: list[int]):
    """The caller owns the process: the first Ctrl-C or SIGTERM cancels the job (its signal goes
    into `received`); any later one only says that the stop is under way. A second signal that
    cancelled again would cut the stop short (workers, /dev/shm files and half-written folders
    left behind); the stop is bounded by its own timeouts instead."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal(signum: int) -> None:
        if received:
            say(STOPPING)
            return
        received.append(signum)
        task.cancel()

    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        for signum in signals:
            loop.add_signal_handler(signum, on_signal, signum)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals
        for signum in signals:
            loop.remove_signal_handler(signum)
        return await coro
    try:
        return await coro
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
            if received:  # the process is ending: a later signal must not kill it before it
                signal.signal(signum, signal.SIG_IGN)  # exits with its code (kept past finalization)


def exit_code(exc: BaseException, folder: Path) -> int:
    """How a command that ran workers for a run folder ends on `exc`: Ctrl-C 130, SIGTERM 143
    (the workers were stopped either way), any other failure one line here and the traceback in
    `folder`/error.log, 1. A BaseException that is none of these is raised again. The line goes
    to `folder`/console.log when stderr is gone."""
    if isinstance(exc, KeyboardInterrupt):
        say(f"\ninterrupted; workers stopped, partial results in {folder}", folder=folder)
        return 130
    if isinstance(exc, asyncio.CancelledError):
        say(f"\nterminated; workers stopped, partial results in {folder}", folder=folder)
        return 143
    if not isinstance(exc, Exception):
        raise exc
    say(f"\nerror: {one_line(exc)}; {write_error_log(exc, folder)}", folder=folder)
    return 1


def close_console() -> None:
    """Flush stdout and stderr as a command ends. One that is gone (`run | head`, a `tee` the
    same Ctrl-C ended) is pointed at /dev/null, so that Python's own flush at exit finds nothing
    to fail on: it would print a traceback and turn the exit code into 120 (the Python docs'
    "Note on SIGPIPE")."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except GONE:
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)


def run_owned(coro):
    """Run `coro` on a fresh uvloop loop as the process's main job: Ctrl-C raises
    KeyboardInterrupt and SIGTERM raises CancelledError here, each after the coroutine's own
    cleanup ran (for an Orchestrator: workers stopped, /dev/shm folder removed); signals after
    the first do not interrupt that cleanup (_owning_process). Used by the CLI and the bench scripts.

    Everything alive before the run (imported modules, settings, tasks) is moved out of the
    garbage collector's sight first (gc.freeze), so a full collection does not walk it again,
    one event-loop stall at a time; while the run lasts, the young generation is collected
    every YOUNG_GC_THRESHOLD allocations (the threshold is restored after)."""
    received: list[int] = []
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        uvloop = None
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *threshold[1:])
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop else None) as runner:
            return runner.run(_owning_process(coro, received))
    except asyncio.CancelledError:
        if received and received[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise
    finally:
        gc.set_threshold(*threshold)
