"""Process reward: outcome-only vs process-only vs mixed (ProcessThinker, arXiv 2606.11209) from one
cold-start model, each run given the same wall budget.

    python bench/process_reward.py [--settings settings.toml] [--model runs/chain-sft/model]
        [--set k=v ...] [--arms outcome,process,mixed] [--seeds 0,1] [--max-wall-s 1800]
        [--out DIR] [--quick] [--report-only]

Every (arm, seed) cell is one real run (`Orchestrator` with its two worker subprocesses),
strictly one after another, seed-major (the arms of one seed back to back, so a machine whose
load drifts shifts every arm of a seed alike). The runs differ only in `process.mode`, i.e. in
the reward (areal_aio/rewards/process.py): outcome = format + step bonus + correct answer (no
continuations); process = format + step bonus + the rollout-based process score, gated;
mixed = both, weighted 0.5 / 0.5. Same model (--model, by default the folder
`python -m areal_aio sft settings.toml --set task.name=chain --set task.terms=3 --out
runs/chain-sft` writes), tasks (three-term chain sums, CHAIN), seeds and
settings otherwise, and the same wall budget: run.max_wall_s = --max-wall-s (counted after both
workers are ready), no step limit, no threshold, no checkpoints (a checkpoint's pause would
cost the arms unequally).

What it reports, per arm over the seeds: the held-out greedy pass and strict rates at the end
of the budget, the rates at an equal number of generated tokens (training rollouts plus
continuations: the eval curve read at the least any run generated), steps, tokens, and the
cost multiple = (training-rollout tokens + continuation tokens) / training-rollout tokens, the
price of the process reward in generation. The plot: pass and strict rates against wall time and
against generated tokens, one line per run.

The grid resumes like bench/time_to_threshold.py (DIR/runs/<arm>-s<seed>).
--quick: settings.toml, embedded:tiny-random unless --model, 2 steps of 2 groups of 4, 40 new
tokens, M = 2 continuations from at most 2 steps, seed 0 (a smoke run: tiny-random writes no
steps, so its process arms sample nothing; a model that writes steps exercises them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.app.preflight import preflight  # noqa: E402
from areal_aio.settings import SettingsError, load_settings  # noqa: E402
from bench.common import (  # noqa: E402
    DEFAULT_SETTINGS,
    TINY_BATCH,
    Cell,
    command_line,
    eval_curve,
    fmt,
    grid_parser,
    mean,
    parse_list,
    print_table,
    pyplot,
    run_grid,
    run_loop,
    save_figure,
    shown_path,
    write_json,
)

ARMS = ("outcome", "process", "mixed")
CHAIN = ("task.name=chain", "task.terms=3")
"""The task of the comparison (not with --quick): the cold start's, two steps per solution."""
COLD_START_MODEL = "runs/chain-sft/model"
DEFAULT_WALL_S = 1800.0
UNLIMITED_STEPS = 1_000_000
"""The wall budget ends every run; the step limit never does."""
QUICK = (*TINY_BATCH, "rollout.max_new_tokens=40", "run.max_steps=2", "task.eval_every=1",
         "process.continuations=2", "process.max_scored_steps=2")
QUICK_WALL_S = 300.0
QUICK_MODEL = "embedded:tiny-random"


def cells(arms: list[str], seeds: list[int]) -> list[Cell]:
    """One cell per (seed, arm), seed-major."""
    return [Cell(f"{arm}-s{seed}", (f"process.mode={arm}", f"run.seed={seed}"), {"arm": arm, "seed": seed})
            for seed in seeds for arm in arms]


def eval_points(summary: dict, steps: list[dict]) -> list[dict]:
    """The run's eval curve, each point with the tokens generated when its version was committed
    (training rollouts and continuations, from the step rows; 0 at version 0)."""
    at = {0: (0, 0)}
    for row in steps:
        at[row["version"]] = (row.get("gen_tokens", 0), row.get("continuation_tokens", 0))
    points = []
    for e in eval_curve(summary):
        gen, cont = at.get(e["version"], (None, None))
        points.append({"step": e["step"], "version": e["version"], "wall_s": e["wall_s"],
                       "pass_rate": e["pass_rate"], "strict_rate": e.get("strict_rate"),
                       "gen_tokens": gen, "continuation_tokens": cont,
                       "tokens": None if gen is None else gen + cont})
    return points


def rate_at_tokens(points: list[dict], budget: float, key: str = "pass_rate") -> float | None:
    """The rate of the last eval whose version was committed within `budget` generated tokens."""
    within = [p for p in points if p["tokens"] is not None and p["tokens"] <= budget]
    return within[-1][key] if within else None


def aggregate(runs: list[dict]) -> dict[str, Any]:
    """Per arm over its seeds. `runs`: {arm, seed, cell, status, summary, points} each; failed
    runs are listed under `failed` and left out. The equal-token budget is the least that any
    run generated by its last eval."""
    ok = [r for r in runs if r["status"] != "failed" and r["summary"].get("error") is None and r["points"]]
    failed = [{"cell": r["cell"], "error": r["summary"].get("error")} for r in runs if r not in ok]
    finals = [r["points"][-1]["tokens"] for r in ok if r["points"][-1]["tokens"] is not None]
    budget = min(finals) if finals else None
    arms: dict[str, dict[str, Any]] = {}
    for r in ok:
        arms.setdefault(r["arm"], {"runs": []})["runs"].append(r)
    for arm, g in arms.items():
        rs = sorted(g.pop("runs"), key=lambda r: r["seed"])
        s = [r["summary"] for r in rs]

        def per_seed(values: list[Any], rs: list[dict] = rs) -> dict[str, Any]:
            return {str(r["seed"]): v for r, v in zip(rs, values, strict=True)}

        final_pass = [r["points"][-1]["pass_rate"] for r in rs]
        final_strict = [r["points"][-1]["strict_rate"] for r in rs]
        pass_at = [rate_at_tokens(r["points"], budget) if budget is not None else None for r in rs]
        strict_at = [rate_at_tokens(r["points"], budget, "strict_rate") if budget is not None else None for r in rs]
        g.update(arm=arm, seeds=[r["seed"] for r in rs], n_runs=len(rs),
                 initial_pass_mean=mean([r["points"][0]["pass_rate"] for r in rs]),
                 final_pass=per_seed(final_pass), final_pass_mean=mean(final_pass),
                 final_strict=per_seed(final_strict), final_strict_mean=mean(final_strict),
                 best_pass_mean=mean([max(p["pass_rate"] for p in r["points"]) for r in rs]),
                 pass_at_tokens=per_seed(pass_at), pass_at_tokens_mean=mean(pass_at),
                 strict_at_tokens_mean=mean(strict_at),
                 steps_mean=mean([x.get("steps") for x in s]), wall_s_mean=mean([x.get("wall_s") for x in s]),
                 gen_tokens_mean=mean([x.get("gen_tokens") for x in s]),
                 continuation_tokens_mean=mean([x.get("continuation_tokens") for x in s]),
                 cost_multiple_mean=mean([x.get("cost_multiple") for x in s]),
                 continuation_s_frac_mean=mean([x["continuation_s"] / x["wall_s"] if x.get("wall_s") else None
                                                for x in s]),
                 gated_frac_mean=mean([x["process_gated"] / x["samples_generated"]
                                       if x.get("samples_generated") else None for x in s]))
    return {"token_budget": budget, "arms": {a: arms[a] for a in ARMS if a in arms}, "failed": failed}


def print_results(agg: dict) -> None:
    rows = [[arm, str(g["n_runs"]), fmt(g["steps_mean"], ".0f"),
             f"{fmt(g['initial_pass_mean'])}->{fmt(g['final_pass_mean'])}", fmt(g["final_strict_mean"]),
             fmt(g["best_pass_mean"]), fmt(g["pass_at_tokens_mean"]), fmt(g["strict_at_tokens_mean"]),
             fmt(g["gen_tokens_mean"], ".0f"), fmt(g["continuation_tokens_mean"], ".0f"),
             fmt(g["cost_multiple_mean"]), fmt(g["continuation_s_frac_mean"]), fmt(g["gated_frac_mean"]),
             fmt(g["wall_s_mean"], ".0f")]
            for arm, g in agg["arms"].items()]
    print_table(["arm", "runs", "steps", "pass 0->end", "strict end", "best pass", "pass@tok", "strict@tok",
                 "train-rollout tok", "continuation tok", "cost x", "cont. time", "gated", "wall s"], rows,
                title=f"\nsame wall budget per run (means over seeds); @tok = at {fmt(agg['token_budget'], '.0f')} "
                      "generated tokens (training rollouts + continuations)")
    for f in agg["failed"]:
        print(f"FAILED {f['cell']}: {f['error']}")


def plot(runs: list[dict], agg: dict, path: Path) -> None:
    """Pass and strict rates against wall seconds and against generated tokens; a line per run
    (arm = colour, seed = line style)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharey="row")
    colors = dict(zip(ARMS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    styles = ("-", "--", ":", "-.")
    seeds = sorted({r["seed"] for r in runs})
    labelled = set()
    for r in runs:
        if r["arm"] not in agg["arms"] or r["summary"].get("error") is not None or not r["points"]:
            continue
        g = agg["arms"][r["arm"]]
        label = None if r["arm"] in labelled else f"{r['arm']} (cost x{fmt(g['cost_multiple_mean'])})"
        labelled.add(r["arm"])
        pts = [p for p in r["points"] if p["tokens"] is not None]
        for row, key in enumerate(("pass_rate", "strict_rate")):
            for col, (x, xs) in enumerate((("wall_s", r["points"]), ("tokens", pts))):
                axes[row][col].plot([p[x] for p in xs], [p[key] for p in xs], color=colors[r["arm"]],
                                    ls=styles[seeds.index(r["seed"]) % len(styles)], marker="o", ms=3,
                                    label=label if row == col == 0 else None)
    for row, name in enumerate(("pass rate", "strict rate")):
        axes[row][0].set_ylabel(f"held-out {name} (greedy)")
        for col, xlabel in enumerate(("wall seconds (after workers ready)",
                                      "generated tokens (training rollouts + continuations)")):
            ax = axes[row][col]
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
    if agg["token_budget"]:
        for row in range(2):
            axes[row][1].axvline(agg["token_budget"], color="gray", ls="--", lw=1)
    axes[0][0].legend()
    fig.suptitle("outcome vs process vs mixed reward, same wall budget; line style = seed, "
                 "dashed gray = equal-token budget")
    save_figure(fig, path, dpi=110)


def read_steps(folder: Path) -> list[dict]:
    try:
        return [orjson.loads(x) for x in (folder / "steps.jsonl").read_bytes().splitlines() if x.strip()]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "process_reward")
    ap.set_defaults(settings=None)
    ap.add_argument("--model", default=None,
                    help=f"starting model of every run (default {COLD_START_MODEL}; --quick: {QUICK_MODEL})")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, any of " + ",".join(ARMS))
    ap.add_argument("--seeds", default=None, help="comma-separated run seeds (default 0,1; --quick: 0)")
    args = ap.parse_args(argv)
    arms = parse_list(args.arms)
    if bad := [a for a in arms if a not in ARMS]:
        ap.error(f"--arms: {bad} not in {list(ARMS)}")
    seeds = parse_list(args.seeds or ("0" if args.quick else "0,1"), int)
    settings_path = args.settings or DEFAULT_SETTINGS
    model = args.model or (QUICK_MODEL if args.quick else COLD_START_MODEL)
    wall = args.max_wall_s or (QUICK_WALL_S if args.quick else DEFAULT_WALL_S)
    base = [*(QUICK if args.quick else (*CHAIN, f"run.max_steps={UNLIMITED_STEPS}")),
            f"model.path={orjson.dumps(str(model)).decode()}", f"run.max_wall_s={wall}", "run.threshold=0",
            "run.checkpoint_every=0", *args.overrides]
    grid = cells(arms, seeds)
    if not args.report_only:
        try:  # one line now, not a failed cell per run
            preflight(load_settings(settings_path, [*base, *grid[0].overrides]), args.out)
        except SettingsError as exc:
            hint = (f" (make it with: python -m areal_aio sft settings.toml --set task.name=chain "
                    f"--set task.terms=3 --out {Path(COLD_START_MODEL).parent})") if "model.path" in str(exc) and model == COLD_START_MODEL else ""
            ap.error(f"{exc}{hint}")

    records = run_loop(run_grid(grid, args.out, settings_path=settings_path, overrides=base,
                                run_missing=not args.report_only))
    runs = [{**r, "points": eval_points(r["summary"], read_steps(args.out / r["folder"]))} for r in records]
    agg = aggregate(runs)
    results = {"settings": shown_path(settings_path), "model": shown_path(model) if Path(model).exists() else model,
               "overrides": base, "wall_budget_s": wall, "arms_run": arms, "seeds": seeds, **agg,
               "runs": [{k: r[k] for k in ("cell", "arm", "seed", "status", "folder", "points")}
                        | {k: r["summary"].get(k) for k in ("steps", "wall_s", "gen_tokens", "continuation_tokens",
                                                            "continuation_requests", "continuation_s",
                                                            "cost_multiple", "process_gated", "error")}
                        for r in runs]}
    write_json(args.out / "results.json", results, command=command_line(__file__, argv))
    print_results(agg)
    plot(runs, agg, args.out / "process_reward.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'process_reward.png'}", file=sys.stderr)
    return 1 if agg["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
