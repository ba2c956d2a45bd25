"""Code that learns on CPU cores: a warm start on the reference solutions of generated function
problems, then RL on those problems; HumanEval pass@1 (greedy, the 164) of the base model, the
warm-started one and the RL-trained one, and the held-out function pass curve.

    python bench/code_learns.py [--seed 0] [--max-wall-s 2400] [--sft-steps 40] [--eval-every 10]
        [--set K=V ...] [--out DIR] [--quick] [--report-only]

The recipe is one command: `python -m areal_aio run settings.toml --set task.name=functions
--set rollout.max_new_tokens=192 --set sft.steps=40` (its cold start, sft.before_run = auto,
tunes on the generated problems' reference solutions, app/sft.py; then RL on the same stream of
problems; the held-out variants of each family are never trained). Around it, each a
`python -m areal_aio eval` process on both cores (rollout.threads = 2): the base model on the
held-out functions, and HumanEval (task.name = humaneval, its 164 problems, 384 new tokens) of
the base model, of <run>/sft/model and of the run's last model.

Read off:
  * HumanEval pass@1 of the three models and the standard error of each, sqrt(p (1 - p) / 164);
    per pair of models the problems only one passes (b, c), the paired difference (c - b) / 164
    and its standard error sqrt(b + c) / 164 (McNemar's: the noise of the comparison).
  * How long HumanEval's reference solutions are (lines of code) against each model's replies,
    what each model passed of the problems whose reference is one line, and how many replies RL
    changed.
  * The held-out function pass curve (greedy), its last eval against its first (the
    warm-started model) problem by problem, as above.
  * Reward spread at T = 0.7: the share of groups whose rewards are not all equal (a group
    without spread gives no gradient), of all-pass and of no-pass groups, the training pass
    rate, over the first and the last EDGE steps and per step.

A finished cell (its eval file, its summary.json) is reused. --quick: tiny-random, 2 sft steps,
4 RL steps, 8 new tokens (a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.control.stats import group_fields  # noqa: E402
from bench.cold_start import QUICK, run_cell  # noqa: E402
from bench.common import fmt, grid_parser, print_table, read_run, set_args, shown_path, write_json  # noqa: E402

EDGE = 5
"""Trained steps at each end of the run that the spread is read over."""
CODE = ("controller.reward_timeout_s=15",)
"""What every code process here sets: a sandbox run of 6 tests may take seconds on a busy CPU."""
FUNCTIONS = ("task.name=functions", "rollout.max_new_tokens=192", *CODE)
HUMANEVAL = ("task.name=humaneval", "rollout.max_new_tokens=384", *CODE)


def run_command(args: argparse.Namespace, folder: Path) -> list[str]:
    sets = [*FUNCTIONS, "sft.before_run=on", f"sft.steps={args.sft_steps}", f"run.seed={args.seed}",
            "run.max_steps=1000", f"run.max_wall_s={args.max_wall_s}", f"task.eval_every={args.eval_every}",
            *(QUICK if args.quick else ()), *args.overrides]
    return ["-m", "areal_aio", "run", str(shown_path(args.settings)), "--out", str(shown_path(folder)), *set_args(sets)]


def eval_command(model: str, args: argparse.Namespace, target: Path, humaneval: bool) -> list[str]:
    sets = [*(HUMANEVAL if humaneval else FUNCTIONS), "rollout.threads=2", *(QUICK if args.quick else ()),
            *args.overrides]
    return ["-m", "areal_aio", "eval", model, str(shown_path(args.settings)), "--out", str(shown_path(target)),
            *set_args(sets)]


def read_eval(path: Path) -> dict[str, Any] | None:
    """An eval file's pass rate, its size and the ids of the problems it passed."""
    try:
        result = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    passed = sorted(s["task_id"] for s in result["samples"] if s["pass"])
    return {"pass_rate": result["pass_rate"], "n": result["n"], "passed": passed,
            "se": round(math.sqrt(result["pass_rate"] * (1 - result["pass_rate"]) / result["n"]), 4),
            "seconds": result["seconds"]}


def code_lines(text: str) -> int:
    """Lines of a program that are neither blank nor a comment (a reply's fences left out)."""
    return sum(1 for line in text.splitlines()
               if line.strip() and not line.strip().startswith(("#", "```")))


def humaneval_shape(evals: dict[str, dict[str, Any] | None], files: dict[str, Path]) -> dict[str, Any]:
    """How long HumanEval's reference solutions are against the replies each model wrote, and
    what each model passed of the problems whose reference is one line."""
    from areal_aio.tasks.code_tasks import humaneval_rows

    lines = {row["task_id"]: code_lines(row["canonical_solution"]) for row in humaneval_rows()}
    one_line = {k for k, n in lines.items() if n == 1}
    shape: dict[str, Any] = {"reference_lines_median": statistics.median(lines.values()),
                             "one_line_problems": len(one_line)}
    replies = {}
    for name in ("base", "warm", "rl"):
        if evals[f"{name}_humaneval"] is None:
            continue
        samples = orjson.loads(files[f"{name}_humaneval"].read_bytes())["samples"]
        replies[name] = {s["task_id"]: s["reply"] for s in samples}
        shape[name] = {"reply_lines_mean": round(statistics.mean(code_lines(s["reply"]) for s in samples), 2),
                       "passed_one_line": len(one_line & set(evals[f"{name}_humaneval"]["passed"]))}
    if "warm" in replies and "rl" in replies:
        shape["replies_changed_by_rl"] = sum(replies["rl"][k] != text for k, text in replies["warm"].items())
    return shape


def paired(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """`after` against `before` on the same problems: the problems only one of them passes, the
    difference in pass rate and its standard error (sqrt(b + c) / n, McNemar's)."""
    if before is None or after is None or not before["n"]:
        return None
    was, now, n = set(before["passed"]), set(after["passed"]), before["n"]
    lost, gained = len(was - now), len(now - was)
    return {"gained": gained, "lost": lost, "diff": round((gained - lost) / n, 4),
            "se": round(math.sqrt(gained + lost) / n, 4)}


def eval_at(rows: list[dict], step: int) -> dict[str, Any]:
    """The in-run eval of `step` (its samples.jsonl rows) as read_eval gives an eval file."""
    at = [r for r in rows if r["step"] == step]
    return {"n": len(at), "passed": sorted(r["task_id"] for r in at if r["pass"])}


def spread(rows: list[dict]) -> dict[str, Any]:
    """The groups of `rows` (trained samples) by whether their rewards differ and their replies
    pass (stats.group_fields), and the rows' pass rate."""
    if not rows:
        return {"groups": 0}
    g = group_fields((r["group"], r["reward"], bool(r["pass"])) for r in rows)
    return {"groups": g["groups"], "samples": len(rows), "spread_share": round(g["spread_frac"], 4),
            "pass_rate": round(sum(bool(r["pass"]) for r in rows) / len(rows), 4),
            "all_pass_share": round(g["solved_frac"], 4), "none_pass_share": round(g["unsolved_frac"], 4)}


def run_record(folder: Path) -> dict[str, Any]:
    """What the RL run measured (module docstring), read off its folder."""
    run = read_run(folder)
    steps = sorted({r["step"] for r in run.trained})
    per_step = [{"step": s, **spread([r for r in run.trained if r["step"] == s])} for s in steps]
    return {"steps": run.summary.get("steps"), "wall_s": run.summary.get("wall_s"), "ended": run.summary.get("ended"),
            "sft_s": run.sft.get("wall_s"), "sft_loss": [run.sft.get("loss_first"), run.sft.get("loss_last")],
            "reward_failures": run.summary.get("reward_failures", 0),
            "first_steps": spread([r for r in run.trained if r["step"] in steps[:EDGE]]),
            "last_steps": spread([r for r in run.trained if r["step"] in steps[-EDGE:]]),
            "per_step": [{k: row.get(k) for k in ("step", "spread_share", "pass_rate")} for row in per_step],
            "held_out_last_vs_first": paired(eval_at(run.evals, run.curve[0]["step"]),
                                             eval_at(run.evals, run.curve[-1]["step"])) if len(run.curve) > 1 else None,
            "eval_curve": [{k: e.get(k) for k in ("step", "wall_s", "pass_rate")} for e in run.curve]}


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "code_learns")
    ap.set_defaults(max_wall_s=2400.0)  # run.max_wall_s of the RL run
    ap.add_argument("--seed", type=int, default=0, help="run.seed of the run")
    ap.add_argument("--sft-steps", type=int, default=40, help="sft.steps of the warm start")
    ap.add_argument("--eval-every", type=int, default=10, help="task.eval_every of the run")
    args = ap.parse_args(argv)
    base = "embedded:tiny-random" if args.quick else "embedded:smollm2-135m-instruct"
    folder = args.out / "run"
    warm = folder / "sft" / "model"
    files = {"base_functions": args.out / "base" / "functions.json",
             "base_humaneval": args.out / "base" / "humaneval.json",
             "warm_humaneval": folder / "humaneval-warm.json",
             "rl_humaneval": folder / "humaneval-rl.json"}
    jobs = [("base-functions", eval_command(base, args, files["base_functions"], False), files["base_functions"]),
            ("base-humaneval", eval_command(base, args, files["base_humaneval"], True), files["base_humaneval"]),
            ("run", run_command(args, folder), folder / "summary.json"),
            ("warm-humaneval", eval_command(str(shown_path(warm)), args, files["warm_humaneval"], True),
             files["warm_humaneval"]),
            ("rl-humaneval", eval_command(str(shown_path(folder)), args, files["rl_humaneval"], True),
             files["rl_humaneval"])]
    for name, command, done in jobs:
        if done.exists() or args.report_only:
            continue
        print(f"{name}: running", file=sys.stderr, flush=True)
        run_cell(command, args.out / "logs" / f"{name}.log", clear=folder if name == "run" else None)
    evals = {name: read_eval(path) for name, path in files.items()}
    record = {"seed": args.seed, "sft_steps": args.sft_steps, "max_wall_s": args.max_wall_s,
              "commands": {name: shlex.join(["python", *command]) for name, command, _ in jobs},
              "functions_base": evals["base_functions"],
              "humaneval": {k: evals[f"{k}_humaneval"] for k in ("base", "warm", "rl")},
              "humaneval_paired": {"warm_vs_base": paired(evals["base_humaneval"], evals["warm_humaneval"]),
                                   "rl_vs_warm": paired(evals["warm_humaneval"], evals["rl_humaneval"]),
                                   "rl_vs_base": paired(evals["base_humaneval"], evals["rl_humaneval"])},
              "humaneval_shape": humaneval_shape(evals, files) if evals["base_humaneval"] else None,
              "run": run_record(folder) if (folder / "summary.json").exists() else None}
    write_json(args.out / "results.json", record)
    print_results(record)
    return 0


def print_results(record: dict[str, Any]) -> None:
    he, pairs = record["humaneval"], record["humaneval_paired"]
    rows = [[name, fmt((he[key] or {}).get("pass_rate"), ".3f"), fmt((he[key] or {}).get("se"), ".3f"),
             "" if pairs.get(versus) is None else
             f"{pairs[versus]['diff']:+.3f} +- {pairs[versus]['se']:.3f} (+{pairs[versus]['gained']} -{pairs[versus]['lost']})"]
            for name, key, versus in (("base", "base", ""), ("warm start", "warm", "warm_vs_base"),
                                      ("after RL", "rl", "rl_vs_warm"))]
    print_table(["model", "HumanEval pass@1", "se", "against the row above"], rows, title="\nHumanEval, greedy")
    run = record["run"]
    if run:
        curve = ", ".join(f"{e['step']}: {e['pass_rate']:.3f}" for e in run["eval_curve"])
        print(f"\nheld-out functions: base {fmt((record['functions_base'] or {}).get('pass_rate'))}; "
              f"run (step: pass) {curve}")
        if (held := run["held_out_last_vs_first"]) is not None:
            print(f"held-out functions, last eval against the first: {held['diff']:+.3f} +- {held['se']:.3f} "
                  f"(+{held['gained']} -{held['lost']})")
        print(f"groups with reward spread: first {EDGE} steps {fmt(run['first_steps'].get('spread_share'))}, "
              f"last {EDGE} {fmt(run['last_steps'].get('spread_share'))}; train pass "
              f"{fmt(run['first_steps'].get('pass_rate'))} -> {fmt(run['last_steps'].get('pass_rate'))}; "
              f"{run['steps']} RL steps, cold start {fmt(run['sft_s'], '.0f')} s")


if __name__ == "__main__":
    sys.exit(main())
