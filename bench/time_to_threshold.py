"""Time to threshold: matched runs of one settings file in each mode, wall seconds to an eval pass rate.

    python bench/time_to_threshold.py [--settings settings.toml] [--set k=v ...]
        [--modes sync,one_step,areal] [--objectives ppo,decoupled_ppo] [--seeds 0,1,2]
        [--threshold 0.75] [--report-at 0.7] [--max-wall-s S] [--out DIR] [--quick] [--report-only]

Every (mode, objective, seed) cell is one real run (`Orchestrator` with its two worker
subprocesses), the runs strictly one after another; the runs of one seed differ only in
mode (and objective), so they are matched: same tasks, model init, rewards, batch sizes.
Wall time is the controller's, counted after both workers are ready, and a run stops at
the first eval whose pass rate (greedy, held-out) is >= --threshold.

--threshold 0.75 by default: on the default task (two-term one-digit + and -), SmolLM2-135M-
Instruct starts well below it and a run that learns the task passes it, so the time measures
learning rather than the starting point; the table shows each mode's step-0 pass rate next to
its final one so a threshold the base model already meets (time 0 everywhere) is easy to see.
Times are eval-granular: a threshold is noticed at the first eval at or after it
(task.eval_every), stamped with the wall time its weights were committed. --report-at adds
tables for lower thresholds, read off the same runs' eval curves (a 64-prompt eval moves in
1.6-point steps and wanders by several points, so one threshold alone is a noisy finish line).

speedup_vs_sync = mean sync time / mean time of this mode, both over the seeds where BOTH runs
reached the threshold (paired by seed); null when no seed pair did. Seeds that did not reach it
count in `reached` only. The baseline is the sync run with the same objective, else the first
sync objective run.

areal mode takes eta from controller.max_staleness (4 in settings.toml); -1 (unbounded) is
bounded by controller.max_in_flight (see bench/staleness_ablation.py).

The grid resumes: finished cells (DIR/runs/<mode>-<objective>-s<seed>/summary.json without error,
same settings) are reused; an interrupted one is deleted and rerun.
--quick: tiny-random, 4 steps, 2 groups of 4, 8 new tokens, 8 eval prompts, seed 0 (a smoke run:
tiny-random never reaches the threshold, so the null-time path runs end to end).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.settings import MODES, OBJECTIVES, load_settings  # noqa: E402
from bench.common import (  # noqa: E402
    TINY_BATCH,
    Cell,
    command_line,
    eval_curve,
    final_pass_rate,
    first_reaching,
    fmt,
    grid_parser,
    initial_pass_rate,
    mean,
    parse_list,
    print_table,
    pyplot,
    run_grid,
    run_loop,
    save_figure,
    shown_path,
    stats,
    write_json,
)

DEFAULT_THRESHOLD = 0.75
QUICK = (*TINY_BATCH, "run.max_steps=4")
QUICK_THRESHOLD = 0.5
"""Out of tiny-random's reach (its pass rate is ~0): the quick run exercises the null time."""
BASELINE = "sync"
SPEEDUP_RULE = ("speedup_vs_sync = mean(sync time_to_threshold_s) / mean(this time_to_threshold_s) "
                "over the seeds where both the sync run (same objective, else the first sync "
                "objective) and this run reached the threshold; null when no seed pair did or "
                "this mean is 0")
SUMMARY_MEANS = ("reward_per_1k_tokens", "gen_tokens_per_s", "train_tokens_per_s",
                 "rollout_idle_frac", "trainer_idle_frac", "wall_s", "steps", "max_staleness_trained",
                 "stale_drop_frac")


def cells(modes: list[str], objectives: list[str | None], seeds: list[int], settings_path: Path | None,
          overrides: list[str]) -> list[Cell]:
    """One cell per (mode, objective, seed); objective None = the mode's own (file or preset).

    Seed-major order: the matched runs of one seed run back to back, so a machine whose
    background load drifts over hours shifts every mode of a seed alike.
    """
    out = []
    for seed in seeds:
        for mode in modes:
            for objective in objectives:
                dims = [f"run.mode={mode}"] + ([f"trainer.objective={objective}"] if objective else [])
                resolved = load_settings(settings_path, [*overrides, *dims]).trainer.objective
                out.append(Cell(f"{mode}-{resolved}-s{seed}", (*dims, f"run.seed={seed}"),
                                {"mode": mode, "objective": resolved, "seed": seed}))
    return out


def time_at(summary: dict, threshold: float) -> float | None:
    """Wall seconds of the first eval (by step) with pass rate >= threshold, else None: a lower
    threshold than the one a run stopped at, read off its eval curve."""
    row = first_reaching(eval_curve(summary), threshold)
    return None if row is None else row["wall_s"]


def aggregate(records: list[dict], threshold: float | None = None) -> dict[str, Any]:
    """Per (mode, objective): per-seed times to threshold, their spread, reached counts, speedup.

    `records`: run_grid's records (mode, objective, seed, status, summary). Failed runs are
    left out of every figure and listed under `failed`. threshold None: each run's own
    time_to_threshold_s; else the time read off its eval curve (`time_at`).
    """
    groups: dict[str, dict[str, Any]] = {}
    failed = []
    for rec in records:
        if rec.get("status") == "failed" or rec["summary"].get("error") is not None:
            failed.append({"cell": rec.get("cell"), "error": rec["summary"].get("error")})
            continue
        key = f"{rec['mode']}/{rec['objective']}"
        groups.setdefault(key, {"mode": rec["mode"], "objective": rec["objective"], "runs": []})
        groups[key]["runs"].append(rec)
    for g in groups.values():
        runs = sorted(g.pop("runs"), key=lambda r: r["seed"])
        times = {str(r["seed"]): (r["summary"].get("time_to_threshold_s") if threshold is None
                                  else time_at(r["summary"], threshold)) for r in runs}
        ttt = stats(list(times.values()))
        g.update(seeds=[r["seed"] for r in runs], time_to_threshold_s=times,
                 reached=sum(t is not None for t in times.values()), n_runs=len(runs),
                 ttt_mean=ttt["mean"], ttt_min=ttt["min"], ttt_max=ttt["max"],
                 final_pass_rate={str(r["seed"]): final_pass_rate(r["summary"]) for r in runs},
                 final_pass_mean=mean([final_pass_rate(r["summary"]) for r in runs]),
                 initial_pass_mean=mean([initial_pass_rate(r["summary"]) for r in runs]),
                 **{f"{k}_mean": mean([_metric(r["summary"], k) for r in runs]) for k in SUMMARY_MEANS})
    for g in groups.values():
        base_key = _baseline_key(g["objective"], groups)
        g["baseline"] = base_key
        g["speedup_vs_sync"], g["speedup_seeds"] = (
            speedup(groups[base_key]["time_to_threshold_s"], g["time_to_threshold_s"])
            if base_key is not None else (None, []))
    return {"speedup_rule": SPEEDUP_RULE, "groups": groups, "failed": failed}


def _metric(summary: dict, key: str) -> float | None:
    if key == "stale_drop_frac":  # generated, then thrown away as too old: work paid for nothing
        admitted = summary.get("samples_admitted")
        return summary.get("samples_dropped_stale", 0) / admitted if admitted else None
    return summary.get(key)


def _baseline_key(objective: str, groups: dict[str, dict]) -> str | None:
    same = f"{BASELINE}/{objective}"
    if same in groups:
        return same
    return next((k for k, g in groups.items() if g["mode"] == BASELINE), None)


def speedup(base: dict[str, float | None], this: dict[str, float | None]) -> tuple[float | None, list[int]]:
    """Ratio of mean times over the seeds where both reached the threshold, and those seeds."""
    paired = [s for s in this if this[s] is not None and base.get(s) is not None]
    if not paired:
        return None, []
    t_this = sum(this[s] for s in paired) / len(paired)
    t_base = sum(base[s] for s in paired) / len(paired)
    return (t_base / t_this if t_this > 0 else None), [int(s) for s in paired]


def print_results(agg: dict, threshold: float) -> None:
    rows = []
    for key, g in agg["groups"].items():
        spread = "-" if g["ttt_min"] is None else f"{g['ttt_min']:.0f}-{g['ttt_max']:.0f}"
        rows.append([key, f"{g['reached']}/{g['n_runs']}", fmt(g["ttt_mean"], ".1f"), spread,
                     fmt(g["speedup_vs_sync"]), f"{fmt(g['initial_pass_mean'])}->{fmt(g['final_pass_mean'])}",
                     fmt(g["reward_per_1k_tokens_mean"]), fmt(g["gen_tokens_per_s_mean"], ".1f"),
                     fmt(g["train_tokens_per_s_mean"], ".1f"), fmt(g["rollout_idle_frac_mean"]),
                     fmt(g["trainer_idle_frac_mean"]), fmt(g["stale_drop_frac_mean"]), fmt(g["wall_s_mean"], ".0f")])
    print_table(["mode/objective", "reached", "ttt s", "min-max", "x sync", "pass 0->end", "rew/1k tok",
                 "gen tok/s", "train tok/s", "idle roll", "idle train", "stale drop", "wall s"], rows,
                title=f"\ntime to eval pass rate >= {threshold} (means over seeds; ttt over seeds that reached it)")
    for f in agg["failed"]:
        print(f"FAILED {f['cell']}: {f['error']}")
    print(agg["speedup_rule"])


def plot(records: list[dict], agg: dict, threshold: float, path: Path) -> None:
    """Eval pass rate vs wall time and vs step; a line per mode/objective (seed mean over steps),
    each seed a thin line, the seeds' min-max as a band."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, key in enumerate(agg["groups"]):
        color = colors[k % len(colors)]
        curves = [eval_curve(r["summary"]) for r in records
                  if f"{r['mode']}/{r['objective']}" == key and r["summary"].get("error") is None
                  and r["summary"].get("eval_curve")]
        by_step: dict[int, list[tuple[float, float]]] = {}
        for curve in curves:
            for ax, x in ((axes[0], "wall_s"), (axes[1], "step")):
                ax.plot([e[x] for e in curve], [e["pass_rate"] for e in curve], color=color, lw=0.8, alpha=0.4)
            for e in curve:
                by_step.setdefault(e["step"], []).append((e["wall_s"], e["pass_rate"]))
        steps = sorted(by_step)
        lo = [min(p for _, p in by_step[s]) for s in steps]
        hi = [max(p for _, p in by_step[s]) for s in steps]
        avg = [sum(p for _, p in by_step[s]) / len(by_step[s]) for s in steps]
        wall = [sum(w for w, _ in by_step[s]) / len(by_step[s]) for s in steps]
        for ax, xs in ((axes[0], wall), (axes[1], steps)):
            ax.plot(xs, avg, color=color, lw=2, marker="o", ms=3, label=key)
            if len(curves) > 1:
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15)
    for ax, label in ((axes[0], "wall seconds (after workers ready)"), (axes[1], "trainer step")):
        ax.axhline(threshold, color="gray", ls="--", lw=1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("eval pass rate (greedy, held out)")
    axes[0].legend()
    fig.suptitle(f"eval pass rate; threshold {threshold} dashed; band = seeds' min-max, thin = one seed")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "time_to_threshold")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    ap.add_argument("--objectives", default="",
                    help=f"comma-separated, any of {','.join(OBJECTIVES)}; default: each mode's own")
    ap.add_argument("--seeds", default=None, help="comma-separated run seeds (default 0,1,2; --quick: 0)")
    ap.add_argument("--threshold", type=float, default=None,
                    help=f"eval pass rate that stops a run (default {DEFAULT_THRESHOLD}; --quick {QUICK_THRESHOLD})")
    ap.add_argument("--report-at", default="",
                    help="comma-separated lower thresholds also reported, read off the same runs' eval curves")
    args = ap.parse_args(argv)
    modes = parse_list(args.modes)
    objectives = parse_list(args.objectives) or [None]
    for name, given, allowed in (("--modes", modes, MODES), ("--objectives", objectives, (*OBJECTIVES, None))):
        if bad := [x for x in given if x not in allowed]:
            ap.error(f"{name}: {bad} not in {[a for a in allowed if a]}")
    seeds = parse_list(args.seeds or ("0" if args.quick else "0,1,2"), int)
    threshold = args.threshold if args.threshold is not None else (QUICK_THRESHOLD if args.quick else DEFAULT_THRESHOLD)
    base = [*(QUICK if args.quick else ()), f"run.threshold={threshold}",
            *([f"run.max_wall_s={args.max_wall_s}"] if args.max_wall_s else []), *args.overrides]
    grid = cells(modes, objectives, seeds, args.settings, base)

    records = run_loop(run_grid(grid, args.out, settings_path=args.settings, overrides=base,
                                run_missing=not args.report_only))
    agg = aggregate(records)
    extra = [t for t in parse_list(args.report_at, float) if t < threshold]
    also = {str(t): aggregate(records, t) for t in extra}
    results = {"settings": shown_path(args.settings), "overrides": base, "threshold": threshold, "modes": modes,
               "also_at": {t: {k: {"time_to_threshold_s": g["time_to_threshold_s"], "reached": g["reached"],
                                   "ttt_mean": g["ttt_mean"], "speedup_vs_sync": g["speedup_vs_sync"],
                                   "speedup_seeds": g["speedup_seeds"]} for k, g in a["groups"].items()}
                           for t, a in also.items()},
               "objectives": [o or "own" for o in objectives], "seeds": seeds, **agg,
               "runs": [{k: r[k] for k in ("cell", "mode", "objective", "seed", "status", "folder")}
                        | {"time_to_threshold_s": r["summary"].get("time_to_threshold_s"),
                           "final_pass_rate": final_pass_rate(r["summary"]),
                           "wall_s": r["summary"].get("wall_s"), "steps": r["summary"].get("steps"),
                           "error": r["summary"].get("error")} for r in records]}
    write_json(args.out / "results.json", results, command=command_line(__file__, argv))
    print_results(agg, threshold)
    for t, a in also.items():
        print_results(a, float(t))
    plot(records, agg, threshold, args.out / "time_to_threshold.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'time_to_threshold.png'}", file=sys.stderr)
    return 1 if agg["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
