"""How long a worker takes to start, spawned fresh against forked from the zygote, side by side.

    python bench/worker_start.py [--rounds 5] [--model embedded:smollm2-135m-instruct] [--run-rounds 3]
        [--out DIR] [--quick]

spawn    in one process, a rollout and a trainer worker started one after another, per round:
         `fresh` (AREAL_AIO_FRESH_WORKERS=1: `python -m areal_aio.workers.<role>`, which imports
         torch and transformers itself) and `forked` (from this process's zygote, already warm)
         in alternating order; each the seconds from the spawn to its Ready (the Init's model
         load included) and Ready's own load_s. The zygote's start (its imports) is timed once,
         apart: it is paid once per controller process.
run      `python -m areal_aio run settings.toml` (the cold start off, the model above) per round,
         fresh and forked alternating: the seconds from the command's start to its first step's
         row in steps.jsonl (settings read, model cache, both workers, the first step); the run
         is then stopped (SIGTERM: a clean stop).

Nothing else may run on the machine meanwhile. Writes DIR/results.json (default
bench/out/worker-start) and prints a table of medians.

--quick: embedded:tiny-random, 1 round of each (a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.common import TINY_BATCH, command_line, fmt, print_table, write_json  # noqa: E402

MODES = ("fresh", "forked")
FIRST_STEP_TIMEOUT_S = 600.0


async def start_once(role: str, model: str, folder: Path, fork: bool) -> dict[str, Any]:
    """One worker of `role`, started fresh or forked, to its Ready; then stopped."""
    from areal_aio import wire
    from areal_aio.fleet.client import PipeWorker
    from areal_aio.fleet.zygote import ForkedProcess
    from areal_aio.settings import build_settings

    settings = build_settings({}, (f"model.path={model}",))
    worker = PipeWorker(role, folder / f"{role}.log", fork=fork)
    t0 = time.perf_counter()
    try:
        ready = await worker.start(wire.Init(role, settings.to_dict(), str(folder)))
        took = time.perf_counter() - t0
    finally:
        await worker.stop()
    return {"ready_s": round(took, 3), "load_s": round(ready.load_s, 3),
            "started": "forked" if isinstance(worker.proc, ForkedProcess) else "fresh"}


def spawn_rounds(args: argparse.Namespace) -> dict[str, Any]:
    from areal_aio.fleet import zygote
    from areal_aio.fleet.client import ensure_model

    asyncio.run(ensure_model(args.model))
    t0 = time.perf_counter()
    parent = zygote.shared()
    zygote_s = time.perf_counter() - t0
    if parent is None:
        raise SystemExit(f"no zygote here: {zygote.state()}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                for role in ("rollout", "trainer"):
                    got = asyncio.run(start_once(role, args.model, Path(tmp), fork=mode == "forked"))
                    rows.append({"round": i, "mode": mode, "role": role, **got})
                    print(f"round {i} {mode:>6} {role:>7}: ready {got['ready_s']:.2f} s (load {got['load_s']:.2f} s)",
                          flush=True)
    zygote.stop()
    return {"zygote_start_s": round(zygote_s, 3), "zygote_import_s": parent.import_s, "rows": rows}


def first_step(args: argparse.Namespace, mode: str, folder: Path) -> float | None:
    """Seconds from `run`'s start to its first row in steps.jsonl; the run is then stopped."""
    env = dict(os.environ)
    env.pop("AREAL_AIO_FRESH_WORKERS", None)
    if mode == "fresh":
        env["AREAL_AIO_FRESH_WORKERS"] = "1"
    sets = [f"model.path={args.model}", "sft.before_run=off", "run.progress=false", "run.max_steps=50",
            *(TINY_BATCH[1:] if args.quick else ())]
    command = [sys.executable, "-m", "areal_aio", "run", str(REPO / "settings.toml"), "--out", str(folder),
               *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = folder / "steps.jsonl"
    took = None
    try:
        while time.perf_counter() - t0 < FIRST_STEP_TIMEOUT_S and proc.poll() is None:
            if steps.exists() and steps.read_bytes().strip():
                took = time.perf_counter() - t0
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
    return None if took is None else round(took, 3)


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.run_rounds):
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                took = first_step(args, mode, Path(tmp) / f"{mode}-{i}")
                rows.append({"round": i, "mode": mode, "first_step_s": took})
                print(f"round {i} {mode:>6} run: first step at {fmt(took)} s", flush=True)
    return rows


def median(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None and all(r[k] == v for k, v in match.items())]
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--run-rounds", type=int, default=3)
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "worker-start"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.run_rounds, args.model = 1, 1, "embedded:tiny-random"
    spawn = spawn_rounds(args)
    runs = run_rounds(args)
    medians = {mode: {"rollout_ready_s": median(spawn["rows"], "ready_s", mode=mode, role="rollout"),
                      "trainer_ready_s": median(spawn["rows"], "ready_s", mode=mode, role="trainer"),
                      "rollout_load_s": median(spawn["rows"], "load_s", mode=mode, role="rollout"),
                      "trainer_load_s": median(spawn["rows"], "load_s", mode=mode, role="trainer"),
                      "run_first_step_s": median(runs, "first_step_s", mode=mode)} for mode in MODES}
    print_table(["mode", "rollout ready s", "trainer ready s", "run to first step s"],
                [[mode, fmt(m["rollout_ready_s"]), fmt(m["trainer_ready_s"]), fmt(m["run_first_step_s"])]
                 for mode, m in medians.items()],
                title=f"medians; the zygote's own start: {spawn['zygote_start_s']:.2f} s "
                      f"(imports {spawn['zygote_import_s']:.2f} s), once per process")
    write_json(Path(args.out) / "results.json",
               {"model": args.model, "medians": medians, "spawn": spawn, "runs": runs},
               command=command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
