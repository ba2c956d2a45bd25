"""What bench/loss_menu.sh and bench/rollout_arms.sh share: each (arm, seed) cell is a
time_to_threshold.py grid folder, OUT/ARM/sSEED (OUT/ARM alone in folders written before: one
grid per arm, its results.json rewritten by every seed); its runs are read into rows (time and
first eval step at each pass level), and an arm's rows into medians over the seeds that reached
each level; and the two figure panels both reports draw (held-out pass against wall time, each
arm's times to each level)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import write_json


def first(curve: list[dict], level: float) -> tuple[float | None, int | None]:
    """(wall s, step) of the first eval at or above `level`, or (None, None)."""
    hit = next((e for e in sorted(curve, key=lambda e: e["step"]) if e["pass_rate"] >= level), None)
    return (hit["wall_s"], hit["step"]) if hit else (None, None)


def runs(out: Path, arm: str, levels: list[float], pattern: str = "*-s*") -> Iterator[tuple[dict, list, dict]]:
    """(summary.json, steps.jsonl rows, row) of each run of `arm`, seed order; the row holds what
    both scripts report, the caller adds its own columns. A run still going (no summary.json yet)
    is left out."""
    cells = {c.name: c for c in (out / arm / "runs").glob(pattern)}
    cells |= {c.name: c for c in (out / arm).glob(f"s*/runs/{pattern}")}  # a seed run again: its newer run
    for cell in sorted(cells.values(), key=lambda c: (len(c.name), c.name)):  # seed 10 after seed 9
        if not (cell / "summary.json").exists():
            continue
        s = json.loads((cell / "summary.json").read_text())
        steps = [json.loads(x) for x in (cell / "steps.jsonl").read_text().splitlines()] \
            if (cell / "steps.jsonl").exists() else []
        curve = s["eval_curve"]
        row = {"arm": arm, "seed": s["seed"], "steps": s["steps"], "wall_s": s["wall_s"],
               "initial_pass": curve[0]["pass_rate"] if curve else None,
               "final_pass": curve[-1]["pass_rate"] if curve else None,
               "trainer_idle_frac": s["trainer_idle_frac"], "rollout_idle_frac": s["rollout_idle_frac"],
               "eval_curve": [{"step": e["step"], "wall_s": e["wall_s"], "pass_rate": e["pass_rate"]}
                              for e in curve]}
        for level in levels:
            row[f"time_to_{level:.2f}_s"], row[f"step_to_{level:.2f}"] = first(curve, level)
        yield s, steps, row


def median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def arm_summary(rows: list[dict], levels: list[float]) -> dict[str, Any]:
    """Seeds, and per level how many reached it and the median time and step of those that did."""
    out: dict[str, Any] = {"seeds": len(rows)}
    for level in levels:
        times = [r[f"time_to_{level:.2f}_s"] for r in rows if r[f"time_to_{level:.2f}_s"] is not None]
        out[f"reached_{level:.2f}"] = len(times)
        out[f"median_s_{level:.2f}"] = median(times)
        out[f"median_step_{level:.2f}"] = median([r[f"step_to_{level:.2f}"] for r in rows])
    return out


def draw_pass(ax: Any, rows: list[dict], colors: dict[str, Any], levels: list[float]) -> None:
    """Held-out pass against wall time, one line per run, coloured by arm; the levels dotted."""
    for r in rows:
        curve = r["eval_curve"]
        ax.step([e["wall_s"] for e in curve], [e["pass_rate"] for e in curve], where="post",
                color=colors[r["arm"]], alpha=0.7, label=r["arm"])
    for level in levels:
        ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
    handles = {h.get_label(): h for h in ax.get_lines() if not h.get_label().startswith("_")}
    ax.legend(handles.values(), handles.keys(), fontsize=8)
    ax.set(xlabel="wall s", ylabel="held-out pass (greedy, 64 prompts)", title="held-out pass, each seed")


def draw_times(ax: Any, rows: list[dict], arms: list[str], colors: dict[str, Any], levels: list[float],
               max_wall_s: float) -> None:
    """Per arm and level: the median time over the seeds that reached it (bar), each seed's (dot),
    each seed that did not (a red x at the cap)."""
    width = 0.8 / len(levels)
    for j, level in enumerate(levels):
        for i, arm in enumerate(arms):
            x = i + (j - (len(levels) - 1) / 2) * width
            times = [r[f"time_to_{level:.2f}_s"] for r in rows if r["arm"] == arm]
            reached = [t for t in times if t is not None]
            if reached:
                ax.bar(x, statistics.median(reached), width * 0.9, color=colors[arm], alpha=0.35 + 0.4 * j)
            ax.scatter([x] * len(reached), reached, color="black", s=10, zorder=3)
            missed = len(times) - len(reached)
            ax.scatter([x] * missed, [max_wall_s] * missed, color="red", marker="x", s=20, zorder=3)
    ax.set_xticks(range(len(arms)), arms, rotation=30, fontsize=8)
    ax.set(ylabel="wall s", title=f"to {' (light), '.join(f'{lv:.2f}' for lv in levels)} (dark): "
                                  "median; dots seeds, x missed")


def report_args(doc: str, arms: str, threshold: float, max_wall_s: float) -> argparse.Namespace:
    """The command line both reports take: OUT, then the grid's --threshold, --seeds, --arms and
    --max-wall-s as the grid's script ran them, the --command to record, and the levels read off
    the runs (0.70 and the threshold)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--threshold", type=float, default=threshold)
    ap.add_argument("--seeds", default="0 1 2")
    ap.add_argument("--arms", default=arms)
    ap.add_argument("--max-wall-s", type=float, default=max_wall_s)
    ap.add_argument("--command", default=None,
                    help="the command line the results file records (the grid's script passes its own; "
                         "default this one)")
    args = ap.parse_args()
    args.levels = sorted({0.70, args.threshold})
    return args


def grid_command(script: str, args: argparse.Namespace) -> str:
    """The command that runs the grid `args` describes (the results file's `command`)."""
    return (f'MAX_WALL_S={args.max_wall_s:g} THRESHOLD={args.threshold:g} bash bench/{script} OUT '
            f'"{args.seeds}" "{args.arms}"')


def save_report(args: argparse.Namespace, name: str, data: dict[str, Any], rows: list[dict],
                plot: Callable[[Path], None]) -> None:
    """OUT/<name>.json (`data` and its provenance, the command args.command or this one),
    OUT/<name>.png (`plot(path)`, when there are runs), the summary on stdout."""
    write_json(args.out / f"{name}.json", data, command=args.command)
    if rows:
        plot(args.out / f"{name}.png")
    print(json.dumps(data["summary"], indent=1))
    print(f"wrote {args.out / name}.json and {name}.png", file=sys.stderr)
