"""Tool use that learns: calculator episodes on sums and products the model cannot do in its head,
a cold start on generated worked episodes, then RL; the tool-call rate, the share of valid
calls, and held-out pass with the tool against the same model without it.

    python bench/tool_use.py [--seeds 0,1,2] [--digits 3] [--operators +,*] [--max-wall-s 600]
        [--set K=V ...] [--out DIR] [--quick] [--report-only]

Per seed, one `python -m areal_aio run settings.toml --set task.name=calculator` process (its
cold start, sft.before_run = auto: the generated episodes that call `<calc>` on the question and
answer its value, app/sft.py; then RL on calculator episodes for --max-wall-s), then
`python -m areal_aio eval` of the trained model on the same held-out problems without the tool
(task.name = arithmetic: one reply, the answer instruction). Once, the base model is evaluated
both ways. Read off each run: the pass rate, the tool-call rate (episodes with at least one
tool turn) and the share of valid calls (tool turns that carry a value, not "error: ...") over
the first and the last EDGE trained steps and at the first and the last held-out eval (greedy
episodes, the tool's turns included).

A finished cell (its summary.json, its eval file) is reused. --quick: tiny-random, 2 sft steps,
4 RL steps, seed 0 (a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.cold_start import QUICK, run_cell  # noqa: E402
from bench.common import (  # noqa: E402
    fmt,
    grid_parser,
    parse_list,
    print_table,
    read_run,
    set_args,
    shown_path,
    write_json,
)

EDGE = 5
"""Trained steps at each end of a run that the training-side rates are read over."""


def task_sets(args: argparse.Namespace) -> list[str]:
    ops = ",".join(f'"{op}"' for op in parse_list(args.operators))
    return [f"task.digits={args.digits}", f"task.operators=[{ops}]", *(QUICK if args.quick else ()), *args.overrides]


def run_command(seed: int, args: argparse.Namespace, folder: Path) -> list[str]:
    sets = ["task.name=calculator", "sft.before_run=on", f"run.seed={seed}", "run.max_steps=1000",
            f"run.max_wall_s={args.max_wall_s}", *task_sets(args)]
    return ["-m", "areal_aio", "run", str(shown_path(args.settings)), "--out", str(shown_path(folder)),
            *set_args(sets)]


def eval_command(model: str, args: argparse.Namespace, target: Path, tool: bool) -> list[str]:
    sets = [f"task.name={'calculator' if tool else 'arithmetic'}", *task_sets(args)]
    return ["-m", "areal_aio", "eval", model, str(shown_path(args.settings)), "--out", str(shown_path(target)),
            *set_args(sets)]


def window(rows: list[dict]) -> dict[str, Any]:
    """Pass rate, tool-call rate, valid-call share, replies and tokens per episode of `rows`."""
    if not rows:
        return {"episodes": 0}
    tools = [t for r in rows for t in r.get("turns") or [] if t["role"] == "tool"]
    valid = [t for t in tools if not t["text"].startswith("error:")]
    return {"episodes": len(rows), "pass_rate": round(sum(bool(r["pass"]) for r in rows) / len(rows), 4),
            "tool_call_rate": round(sum(any(t["role"] == "tool" for t in r.get("turns") or []) for r in rows)
                                    / len(rows), 4),
            "calls": len(tools), "valid_call_share": round(len(valid) / len(tools), 4) if tools else None,
            "replies_per_episode": round(statistics.mean(
                sum(t["role"] == "assistant" for t in r["turns"]) if r.get("turns") else 1 for r in rows), 3),
            "tokens_per_episode": round(statistics.mean(r["tokens"] for r in rows), 1)}


def run_record(folder: Path) -> dict[str, Any]:
    """What one tool run measured (module docstring), read off its folder."""
    run = read_run(folder)
    trained, curve = run.trained, run.curve
    steps = sorted({r["step"] for r in trained})
    return {"steps": run.summary.get("steps"), "wall_s": run.summary.get("wall_s"), "sft_s": run.sft.get("wall_s"),
            "episode_failures": run.summary.get("episode_failures", 0),
            "first_steps": window([r for r in trained if r["step"] in steps[:EDGE]]),
            "last_steps": window([r for r in trained if r["step"] in steps[-EDGE:]]),
            "first_eval": window([r for r in run.evals if curve and r["step"] == curve[0]["step"]]),
            "last_eval": window([r for r in run.evals if curve and r["step"] == curve[-1]["step"]]),
            "eval_curve": [{k: e[k] for k in ("step", "wall_s", "pass_rate", "strict_rate")} for e in curve]}


def pass_rate(eval_file: Path) -> float | None:
    try:
        return orjson.loads(eval_file.read_bytes())["pass_rate"]
    except (OSError, orjson.JSONDecodeError, KeyError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "tool_use")
    ap.set_defaults(max_wall_s=600.0)  # run.max_wall_s of each RL run
    ap.add_argument("--seeds", default=None, help="comma-separated run seeds (default 0,1,2; --quick 0)")
    ap.add_argument("--digits", type=int, default=3, help="task.digits: digits per term")
    ap.add_argument("--operators", default="+,*", help="task.operators, comma-separated")
    args = ap.parse_args(argv)
    seeds = parse_list(args.seeds or ("0" if args.quick else "0,1,2"), int)
    base_model = "embedded:tiny-random" if args.quick else "embedded:smollm2-135m-instruct"
    jobs = []  # (name, python arguments, the file that marks it done, the folder it owns)
    for name, tool in (("base-tool", True), ("base-no-tool", False)):
        target = args.out / name / "eval.json"
        jobs.append((name, eval_command(base_model, args, target, tool), target, target.parent))
    for seed in seeds:
        folder = args.out / "runs" / f"tool-s{seed}"
        jobs.append((folder.name, run_command(seed, args, folder), folder / "summary.json", folder))
        target = folder / "eval-no-tool.json"
        jobs.append((f"{folder.name}-no-tool", eval_command(str(shown_path(folder)), args, target, False), target, None))
    for name, command, done, owned in jobs:
        if done.exists() or args.report_only:
            continue
        print(f"{name}: running", file=sys.stderr, flush=True)
        run_cell(command, args.out / "logs" / f"{name}.log", clear=owned)
    record = {"digits": args.digits, "operators": parse_list(args.operators), "max_wall_s": args.max_wall_s,
              "edge_steps": EDGE, "commands": {name: shlex.join(["python", *command]) for name, command, _, _ in jobs},
              "base": {"with_tool": pass_rate(args.out / "base-tool" / "eval.json"),
                       "without_tool": pass_rate(args.out / "base-no-tool" / "eval.json")},
              "runs": {}}
    for seed in seeds:
        folder = args.out / "runs" / f"tool-s{seed}"
        if (folder / "summary.json").exists():
            record["runs"][str(seed)] = {**run_record(folder),
                                         "without_tool": pass_rate(folder / "eval-no-tool.json")}
    write_json(args.out / "results.json", record)
    print_results(record)
    return 0


def print_results(record: dict[str, Any]) -> None:
    rows = []
    for seed, run in record["runs"].items():
        first, last = run["first_eval"], run["last_eval"]
        rows.append([seed, str(run["steps"]), fmt(run["sft_s"], ".0f"),
                     f"{fmt(run['first_steps'].get('tool_call_rate'))} -> {fmt(run['last_steps'].get('tool_call_rate'))}",
                     f"{fmt(run['first_steps'].get('valid_call_share'))} -> "
                     f"{fmt(run['last_steps'].get('valid_call_share'))}",
                     f"{fmt(first.get('pass_rate'))} -> {fmt(last.get('pass_rate'))}",
                     f"{fmt(first.get('tool_call_rate'))} -> {fmt(last.get('tool_call_rate'))}",
                     fmt(run["without_tool"])])
    print_table(["seed", "steps", "sft s", "train: tool calls", "valid calls", "held-out pass (tool)",
                 "held-out tool calls", "pass without tool"], rows,
                title=f"\ncalculator episodes, {record['digits']}-digit {' '.join(record['operators'])}: "
                      f"base model {fmt(record['base']['with_tool'])} with the tool, "
                      f"{fmt(record['base']['without_tool'])} without")


if __name__ == "__main__":
    sys.exit(main())
