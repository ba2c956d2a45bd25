"""Controller overhead: trajectories/s through the controller alone, with instant fake workers.

    python bench/controller_overhead.py [--steps 100] [--repeats 5] [--mode areal]
        [--profile] [--out DIR] [--quick] [--young-gc N]

The Orchestrator runs in-process against `FakeRollout(tokens=4, instant=True, record=False)`
(each request answered inside the send, no task or token loop) and `FakeTrainer(step_delay_s=0,
record=False)` (neither keeps what it was sent: a real worker keeps nothing in the controller's
process, and records kept would make the garbage collector's walks the fakes' cost), so every
second measured is the controller's own work (plus the fakes' small bookkeeping): dispatch, the built-in answer reward scored inline
(controller.reward_procs = 0), the staleness filter, the replay buffer, batching, the run
log rows. Batches are large (groups of 8, 256 samples per step) and eval is off but for one
prompt at step 0 and at the end, so the rate is

    trajectories/s = summary["samples_accepted"] / summary["wall_s"]

(trained trajectories; the table also shows how many were admitted and dropped stale, since
rollouts generated and then thrown away cost the controller the same work per trajectory).

One short warm-up run first (imports, allocator, caches), then --repeats timed runs; the
median is reported with the largest event-loop lag seen (summary["loop_lag_max_ms"]: how long
the loop was blocked at worst). Target: >= 50k trajectories/s. --profile adds one run under
cProfile and writes the top functions to DIR/profile.txt. The task source is a pre-built list
(cycled) so task generation (reasoning-gym) is not counted.
--quick: 20 steps, 2 repeats. --young-gc N: the runs collect the young generation every N
allocations instead of what a run uses (areal_aio.app.runner.YOUNG_GC_THRESHOLD); 700 is Python's
default.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import pstats
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.app import runner  # noqa: E402
from areal_aio.control.controller import Orchestrator  # noqa: E402
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer  # noqa: E402
from areal_aio.settings import MODES, Settings, build_settings  # noqa: E402
from areal_aio.tasks.arithmetic import arithmetic_prompt  # noqa: E402
from areal_aio.tasks.task import Task  # noqa: E402
from bench.common import print_table, pyplot, run_loop, save_figure, write_json  # noqa: E402

TARGET = 50_000
"""Trajectories/s the controller must sustain so that it is never what a GPU rollout waits on."""
GROUP, BATCH = 8, 256
STEPS, QUICK_STEPS = 100, 20
RUN_WALL_S = 120.0
"""run.max_wall_s of one run: a controller that admits far more than it trains ends here, and the
rate (trained / wall) still says how slow it was."""
REPEATS, QUICK_REPEATS = 5, 2
WARMUP_STEPS = 10
DISTINCT_TASKS = 1000
PROFILE_TOP = 30


def make_settings(steps: int, mode: str = "areal", group: int = GROUP, batch: int = BATCH) -> Settings:
    return build_settings({
        "run": {"mode": mode, "max_steps": steps, "max_wall_s": RUN_WALL_S, "progress": False},
        "model": {"path": "embedded:tiny-random"},
        "task": {"eval_size": 1, "eval_every": 1_000_000},
        "rollout": {"group_size": group},
        "trainer": {"batch_size": batch},
        "controller": {"reward_procs": 0},
    })


def task_list(n: int = DISTINCT_TASKS) -> list[Task]:
    return [Task(f"t{i}", arithmetic_prompt(f"Calculate {i % 10} + {(i * 7) % 10}."), str(i % 10 + (i * 7) % 10))
            for i in range(n)]


async def one_run(settings: Settings, folder: Path) -> dict:
    """One controller run against instant fakes; returns the summary plus the rate."""
    if folder.exists():
        shutil.rmtree(folder)
    tasks = task_list()
    orch = Orchestrator(settings, tasks=itertools.cycle(tasks), eval_set=tasks[:1], out_dir=folder,
                        rollout=FakeRollout(tokens=4, instant=True, record=False),
                        trainer=FakeTrainer(step_delay_s=0, record=False))
    summary = await orch.run()
    summary["trajectories_per_s"] = summary["samples_accepted"] / summary["wall_s"]
    summary["young_gc_threshold"] = gc.get_threshold()[0]  # what the run collected at
    return summary


def profile_run(settings: Settings, folder: Path, path: Path) -> dict[str, Any]:
    """One run under cProfile; writes the top functions (by own time and by cumulative) to `path`
    and returns the top functions and the share of own time per source file."""
    prof = cProfile.Profile()
    prof.enable()
    run_loop(one_run(settings, folder))
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    for key in ("tottime", "cumulative"):
        text.write(f"\n===== sorted by {key} =====\n")
        st.sort_stats(key).print_stats(PROFILE_TOP)
    path.write_text(text.getvalue())
    total = sum(v[2] for v in st.stats.values())  # own time of every function
    by_file: dict[str, float] = {}
    for (f, _, _), v in st.stats.items():
        key = "builtins" if f == "~" else ("asyncio" if "/asyncio/" in f else Path(f).name)
        by_file[key] = by_file.get(key, 0.0) + v[2] / total
    top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:PROFILE_TOP]
    return {"total_s": round(total, 4),
            "by_file": {k: round(v, 4) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1]) if v >= 0.005},
            "top": [{"function": f"{Path(f).name}:{line}({name})", "calls": v[1], "tottime_s": round(v[2], 4),
                     "cumtime_s": round(v[3], 4), "share": round(v[2] / total, 4)}
                    for (f, line, name), v in top]}


def plot(runs: list[dict], median: float, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = range(1, len(runs) + 1)
    axes[0].bar(xs, [r["trajectories_per_s"] for r in runs], color="tab:blue")
    axes[0].axhline(TARGET, color="tab:red", ls="--", label=f"target {TARGET:,}")
    axes[0].axhline(median, color="black", lw=1, label=f"median {median:,.0f}")
    axes[0].set_ylabel("trajectories / s")
    axes[0].legend()
    axes[1].bar(xs, [r["loop_lag_max_ms"] for r in runs], color="tab:orange")
    axes[1].set_ylabel("largest event-loop lag (ms)")
    for ax in axes:
        ax.set_xlabel("timed run")
        ax.set_xticks(list(xs))
    fig.suptitle("controller alone, instant fake workers")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help=f"trainer steps per run (default {STEPS}; --quick {QUICK_STEPS})")
    ap.add_argument("--repeats", type=int, default=None, help=f"timed runs (default {REPEATS}; --quick {QUICK_REPEATS})")
    ap.add_argument("--mode", default="areal", choices=MODES)
    ap.add_argument("--group-size", type=int, default=GROUP)
    ap.add_argument("--batch-size", type=int, default=BATCH)
    ap.add_argument("--profile", action="store_true", help="one more run under cProfile -> DIR/profile.txt")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "controller_overhead")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, {QUICK_REPEATS} repeats")
    ap.add_argument("--young-gc", type=int, default=None, metavar="N",
                    help="collect the young generation every N allocations (default: a run's own)")
    args = ap.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else REPEATS)
    settings = make_settings(steps, args.mode, args.group_size, args.batch_size)
    folder = args.out / "run"
    if args.young_gc is not None:  # the constant, not an argument: controller_ab.sh runs this
        runner.YOUNG_GC_THRESHOLD = args.young_gc  # bench on older packages, whose run_owned takes none

    run_loop(one_run(make_settings(WARMUP_STEPS, args.mode, args.group_size, args.batch_size), folder))
    runs = []
    for i in range(repeats):
        s = run_loop(one_run(settings, folder))
        runs.append({k: s[k] for k in ("samples_accepted", "wall_s", "trajectories_per_s", "loop_lag_max_ms",
                                       "steps", "samples_admitted", "samples_dropped_stale")})
        print(f"  run {i + 1}/{repeats}: {s['trajectories_per_s']:,.0f} trajectories/s, "
              f"loop lag max {s['loop_lag_max_ms']:.1f} ms", file=sys.stderr, flush=True)
    median = statistics.median(r["trajectories_per_s"] for r in runs)
    lag = max(r["loop_lag_max_ms"] for r in runs)
    results: dict[str, Any] = {
        "mode": args.mode, "group_size": args.group_size, "batch_size": args.batch_size, "steps": steps,
        "young_gc_threshold": s["young_gc_threshold"],
        "repeats": repeats, "trajectories_per_s_median": median, "loop_lag_max_ms": lag,
        "target_trajectories_per_s": TARGET, "meets_target": median >= TARGET, "runs": runs}
    if args.profile:
        results["profile"] = profile_run(settings, folder, args.out / "profile.txt")
    # two arguments, the command this process's: controller_ab.sh's old-fakes arm runs this file
    # beside an older bench/common.py, whose write_json takes no command
    write_json(args.out / "results.json", results)

    print_table(["run", "trained", "admitted", "dropped stale", "wall s", "traj/s", "loop lag max ms"],
                [[str(i + 1), str(r["samples_accepted"]), str(r["samples_admitted"]), str(r["samples_dropped_stale"]),
                  f"{r['wall_s']:.3f}", f"{r['trajectories_per_s']:,.0f}", f"{r['loop_lag_max_ms']:.1f}"]
                 for i, r in enumerate(runs)],
                title=f"\ncontroller overhead ({args.mode}, groups of {args.group_size}, batch {args.batch_size}, "
                      f"{steps} steps, instant fakes)")
    print(f"median {median:,.0f} trajectories/s (target {TARGET:,}: {'met' if median >= TARGET else 'MISSED'}); "
          f"largest loop lag {lag:.1f} ms")
    if args.profile:
        prof = results["profile"]
        print("profile, share of own time by file: "
              + ", ".join(f"{k} {v:.0%}" for k, v in list(prof["by_file"].items())[:8]))
        print(f"top 10 functions by own time (top {PROFILE_TOP} and cumulative in {args.out / 'profile.txt'}):")
        for p in prof["top"][:10]:
            print(f"  {p['share']:6.1%}  {p['tottime_s']:7.3f}s  {p['calls']:>8}  {p['function']}")
    plot(runs, median, args.out / "controller_overhead.png")
    shutil.rmtree(folder, ignore_errors=True)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'controller_overhead.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
