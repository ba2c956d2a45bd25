"""The default recipe as a user runs it: `python -m areal_aio run settings.toml`, its cold start
(sft.before_run) and then RL, against the same run without the cold start, to a held-out threshold.

    python bench/cold_start.py [--arms cold,plain] [--seeds 0,1,2] [--threshold 0.9]
        [--report-at 0.8,0.85] [--max-wall-s 1800] [--set K=V ...] [--out DIR] [--quick] [--report-only]

Each cell is one `python -m areal_aio run` process (the command itself, so the cold start runs
exactly as a user's does), the cells strictly one after another: arm `cold`, 20 steps on the
task's reference replies (`sft.data=generated`), arm `cold4` the same for 4 steps, arms `sampled`
and `sampled4`, 20 and 4 steps on the model's own passing replies (`sft.data=sampled`) drawn at
temperature 1.0, arm `sampled07` 20 steps on replies drawn at 0.7 (the rollouts' own), arm
`plain` with `sft.before_run=off`, arm `guided` without a cold start and with `task.guide=tag`
(a group's correct untagged reply gets a tagged copy as a member: the tag taught inside RL),
`guided_both` with `task.guide=both` (and the reference reply for a group that failed); the seed is run.seed, the threshold
run.threshold (the run stops at the first eval at or above it), --max-wall-s run.max_wall_s.

Per cell: the cold start's wall time (sft/sft.json `wall_s`: the trainer worker's start, the
tuning and the save), the RL run's wall seconds to each threshold (its eval curve: seconds after
both workers are ready, stamped when the eval's weights were committed) and the recipe's time,
their sum; the pass and strict (tagged) rates of the first and the last eval; the process's
whole wall time (worker starts and model loads too). A cell whose folder holds a summary.json
is reused; an unfinished one is deleted and run again.

--quick: tiny-random, 2 sft steps, 4 RL steps, 8 new tokens, seed 0 (a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.common import (  # noqa: E402
    TINY_BATCH,
    first_reaching,
    fmt,
    grid_parser,
    parse_list,
    print_table,
    read_run,
    set_args,
    shown_path,
    write_json,
)

ARMS = {"cold": ("sft.before_run=on", "sft.data=generated", "sft.steps=20", "task.guide=off"),
        "cold4": ("sft.before_run=on", "sft.data=generated", "sft.steps=4", "task.guide=off"),
        "sampled": ("sft.before_run=on", "sft.data=sampled", "sft.steps=20", "sft.temperature=1.0", "task.guide=off"),
        "sampled4": ("sft.before_run=on", "sft.data=sampled", "sft.steps=4", "sft.temperature=1.0", "task.guide=off"),
        "sampled07": ("sft.before_run=on", "sft.data=sampled", "sft.steps=20", "sft.temperature=0.7",
                      "task.guide=off"),
        "plain": ("sft.before_run=off", "task.guide=off"),
        "guided": ("sft.before_run=off", "task.guide=tag"),
        "guided_both": ("sft.before_run=off", "task.guide=both")}
"""Each arm's cold start and guide, pinned whatever sft.data, sft.steps and task.guide default to."""
QUICK = (*TINY_BATCH, "run.max_steps=4", "sft.steps=2", "sft.batch_size=4", "trainer.bf16=off")


def cell_command(arm: str, seed: int, args: argparse.Namespace, folder: Path) -> list[str]:
    """The cell's `python` arguments, run in the repository (paths in it relative to it)."""
    sets = [*ARMS[arm], f"run.seed={seed}", f"run.threshold={args.threshold}", "run.max_steps=1000",
            *([f"run.max_wall_s={args.max_wall_s}"] if args.max_wall_s else []),
            *(QUICK if args.quick else ()), *args.overrides]
    return ["-m", "areal_aio", "run", str(shown_path(args.settings)), "--out", str(shown_path(folder)),
            *set_args(sets)]


def run_cell(command: list[str], log: Path, clear: Path | None = None) -> float:
    """Run one cell's `python` process in the repository, its output into `log` (the folder
    `clear` deleted first: a cell's unfinished leftovers); its wall seconds."""
    if clear is not None and clear.exists():
        shutil.rmtree(clear)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        done = subprocess.run([sys.executable, *command], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} exited {done.returncode}; see {log}")
    return time.perf_counter() - t0


def cell_record(folder: Path, thresholds: list[float]) -> dict[str, Any]:
    """What one finished cell measured (module docstring), read off its folder."""
    run = read_run(folder)
    sft, curve = run.sft, run.curve
    sft_s = sft.get("wall_s", 0.0)
    reached = {}
    for threshold in thresholds:
        at = first_reaching(curve, threshold)
        reached[str(threshold)] = None if at is None else {"wall_s": at["wall_s"], "step": at["step"],
                                                           "recipe_s": round(at["wall_s"] + sft_s, 3)}
    first, last = (curve[0], curve[-1]) if curve else ({}, {})
    return {"sft_s": sft_s, "sft_train_s": sft.get("train_s"),
            "sft_loss": [sft["loss_first"], sft["loss_last"]] if sft else None,
            "steps": run.summary.get("steps"), "wall_s": run.summary.get("wall_s"),
            "first_eval": {k: first.get(k) for k in ("pass_rate", "strict_rate")},
            "last_eval": {k: last.get(k) for k in ("step", "wall_s", "pass_rate", "strict_rate")},
            "best_pass": max((r["pass_rate"] for r in curve), default=None),
            "reached": reached, "error": run.summary.get("error"),
            "sampling": sft.get("sampling"),
            "eval_curve": [{k: r[k] for k in ("step", "wall_s", "pass_rate", "strict_rate")} for r in curve],
            "step_curve": step_curve(folder)}


STEP_FIELDS = ("step", "spread_frac", "solved_frac", "unsolved_frac", "entropy", "reward_mean")


def step_curve(folder: Path) -> list[dict[str, Any]]:
    """Per RL step, what says whether the run can still learn: the share of groups with reward
    spread (and all passing, none passing), the policy's entropy per token, the mean reward."""
    path = folder / "steps.jsonl"
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []
    return [{k: r.get(k) for k in STEP_FIELDS} for r in rows]


def print_results(records: list[dict], thresholds: list[float]) -> None:
    rows = []
    for rec in records:
        m = rec["measured"]
        times = [fmt(None if (r := m["reached"][str(t)]) is None else r["recipe_s"], ".0f")
                 + ("" if r is None else f" ({r['step']})") for t in thresholds]
        rows.append([rec["arm"], str(rec["seed"]), fmt(m["sft_s"], ".0f"), *times,
                     f"{fmt(m['first_eval']['pass_rate'])}/{fmt(m['first_eval']['strict_rate'])}",
                     f"{fmt(m['last_eval']['pass_rate'])}/{fmt(m['last_eval']['strict_rate'])}",
                     str(m["steps"]), fmt(rec["process_s"], ".0f")])
    print_table(["arm", "seed", "sft s", *[f"to {t}: s (step)" for t in thresholds], "first pass/strict",
                 "last pass/strict", "steps", "process s"], rows,
                title="\nseconds to a held-out pass rate, the cold start's included (the RL step in brackets)")


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "cold_start")
    ap.set_defaults(max_wall_s=1800.0)  # run.max_wall_s of each RL run
    ap.add_argument("--arms", default="cold,plain")
    ap.add_argument("--seeds", default=None, help="comma-separated run seeds (default 0,1,2; --quick 0)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--report-at", default="0.8,0.85", help="lower thresholds read off the same eval curves")
    args = ap.parse_args(argv)
    arms = parse_list(args.arms)
    if unknown := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: unknown {unknown}; choose from {sorted(ARMS)}")
    seeds = parse_list(args.seeds or ("0" if args.quick else "0,1,2"), int)
    thresholds = sorted({*parse_list(args.report_at, float), args.threshold}) if args.report_at else [args.threshold]
    records, previous = [], _previous(args.out / "results.json")
    for seed in seeds:  # seed-major: a drifting machine load shifts both arms of a seed alike
        for arm in arms:
            folder = args.out / "runs" / f"{arm}-s{seed}"
            command = cell_command(arm, seed, args, folder)
            if (folder / "summary.json").exists():
                process_s = previous.get(folder.name)
            elif args.report_only:
                continue
            else:
                print(f"{folder.name}: running", file=sys.stderr, flush=True)
                process_s = round(run_cell(command, folder.parent / f"{folder.name}.log", clear=folder), 3)
            records.append({"arm": arm, "seed": seed, "cell": folder.name, "command": shlex.join(["python", *command]),
                            "process_s": process_s, "measured": cell_record(folder, thresholds)})
            write_json(args.out / "results.json", {"thresholds": thresholds, "cells": records})
    print_results(records, thresholds)
    return 0


def _previous(path: Path) -> dict[str, float | None]:
    """The process seconds of cells an earlier invocation ran (a reused cell keeps its time)."""
    try:
        return {c["cell"]: c["process_s"] for c in orjson.loads(path.read_bytes())["cells"]}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
