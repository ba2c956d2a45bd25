"""Command line: `python -m areal_aio run|check SETTINGS [--set section.key=value ...] [--out DIR]`.

`run` owns the process, so it owns the loop (uvloop where available) and its
signals: Ctrl-C or SIGTERM cancels the run, which shuts both workers down and
removes the run's /dev/shm folder before exiting 130 / 143.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys

import orjson

from areal_aio.client import WorkerFailed
from areal_aio.settings import SettingsError, describe, load_settings

SUMMARY_KEYS = ("mode", "max_staleness", "steps", "final_version", "wall_s", "cold_start_s",
                "time_to_threshold_s", "samples_generated", "samples_accepted",
                "samples_dropped_stale", "samples_dropped_interrupt", "max_staleness_trained",
                "gen_tokens_per_s", "train_tokens_per_s", "rollout_idle_frac", "trainer_idle_frac")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m areal_aio", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "train with these settings"), ("check", "validate and print the resolved settings")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("settings", help="settings TOML file")
        cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                         help="override one key (repeatable); wins over the file and the mode presets")
        if name == "run":
            cmd.add_argument("--out", default=None, help="run folder (default: run.out_dir/<name>)")
    sub.add_parser("keys", help="list every settings key with its default and meaning")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "keys":
        print(describe())
        return 0
    try:
        settings = load_settings(args.settings, args.overrides)
    except SettingsError as exc:
        print(f"settings error: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(settings.to_toml(), end="")
        return 0
    return _run(settings, args.out)


def _run(settings, out: str | None) -> int:
    from areal_aio.controller import Orchestrator

    orchestrator = Orchestrator(settings, out_dir=out)
    try:
        summary = run_owned(orchestrator.run())
    except KeyboardInterrupt:
        print(f"\ninterrupted; workers stopped, partial results in {orchestrator.folder}", file=sys.stderr)
        return 130
    except asyncio.CancelledError:
        print(f"\nterminated; workers stopped, partial results in {orchestrator.folder}", file=sys.stderr)
        return 143
    except WorkerFailed as exc:
        print(f"\nerror: {exc}\nrun folder: {orchestrator.folder}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    print(orjson.dumps({k: summary.get(k) for k in SUMMARY_KEYS}, option=orjson.OPT_INDENT_2).decode())
    print("eval curve (step, wall_s, pass, strict):")
    for row in summary["eval_curve"]:
        print(f"  {row['step']:4d} {row['wall_s']:8.1f}s  {row['pass_rate']:.3f}  {row['strict_rate']:.3f}")
    print(f"run folder: {orchestrator.folder}")
    return 0


async def _owning_process(coro):
    """The caller owns the process: SIGTERM cancels the run (Ctrl-C already does, via the runner)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals
        return await coro
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def run_owned(coro):
    """Run `coro` on a fresh uvloop loop as the process's main job: Ctrl-C raises
    KeyboardInterrupt and SIGTERM raises CancelledError here, each after the coroutine's own
    cleanup ran (for an Orchestrator: workers stopped, /dev/shm folder removed). Used by the
    CLI and the bench scripts.

    Everything alive before the run (imported modules, settings, tasks) is moved out of the
    garbage collector's sight first (gc.freeze): the controller keeps tens of thousands of
    samples alive, and each full collection would otherwise walk the whole heap again, one
    event-loop stall at a time."""
    gc.collect()
    gc.freeze()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; Windows lacks it
        return asyncio.run(_owning_process(coro))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_owning_process(coro))
