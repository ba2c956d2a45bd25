"""Staleness ablation: final eval pass rate and training throughput against the staleness bound eta.

    python bench/staleness_ablation.py [--settings settings.toml] [--set k=v ...]
        [--etas 0,1,2,4,8,16,-1] [--objectives ppo,decoupled_ppo] [--seeds 0]
        [--steps 40] [--max-wall-s S] [--out DIR] [--quick] [--report-only]

The small-scale analogue of AReaL's Table 2 / Figure 5: every cell is one real run in `areal`
mode (interruptible generation) with `controller.max_staleness = eta` (-1 = unbounded) and
`trainer.objective` = ppo (clip against the behaviour policy) or decoupled_ppo (clip against
the proximal policy). All cells train the same number of steps (--steps, default 40: the
default settings' batch of 32 samples x 40 steps, ~1280 trajectories per cell, long enough
to move the eval pass rate, short enough for 14 cells in a few hours on CPU), so the final
pass rate (the last eval, greedy on the held-out set) shows what staleness costs in learning
and `train_tokens_per_s` (completion tokens trained / wall seconds) what it buys in speed.

"Unbounded" (-1) runs as max_staleness = the run's step count: no trained sample can be older
than that, so the bound never binds (unbounded in effect), and the rate rule still limits what
is started to (steps + 1) batches ahead. --literal-unbounded runs max_staleness = -1 instead,
where only controller.max_in_flight (auto: 8 batches) limits admission.

The grid resumes like bench/time_to_threshold.py (DIR/runs/eta<eta>-<objective>-s<seed>).
--quick: tiny-random, etas 0,2,-1, 3 steps, 2 groups of 4, 8 new tokens (a smoke run).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.settings import UNBOUNDED, load_settings  # noqa: E402
from bench.common import (  # noqa: E402
    TINY_BATCH,
    Cell,
    command_line,
    final_pass_rate,
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
    stats,
    write_json,
)

ETAS = (0, 1, 2, 4, 8, 16, UNBOUNDED)
QUICK_ETAS = (0, 2, UNBOUNDED)
OBJECTIVES = ("ppo", "decoupled_ppo")
DEFAULT_STEPS = 40
QUICK_STEPS = 3
QUICK = TINY_BATCH


def parse_eta(text: str) -> int:
    """'4' -> 4; '-1', 'inf' or 'unbounded' -> -1 (no bound)."""
    return UNBOUNDED if text.lower() in ("inf", "unbounded", "none") else int(text)


def eta_label(eta: int) -> str:
    return "inf" if eta == UNBOUNDED else str(eta)


def cells(etas: list[int], objectives: list[str], seeds: list[int], unbounded_as: int = UNBOUNDED) -> list[Cell]:
    """One areal-mode cell per (seed, eta, objective), in that order, so the objectives of
    one eta run back to back (matched in time) and a cut-short grid still holds pairs;
    eta -1 runs as max_staleness = unbounded_as."""
    return [Cell(f"eta{eta_label(eta)}-{objective}-s{seed}",
                 ("run.mode=areal", f"controller.max_staleness={unbounded_as if eta == UNBOUNDED else eta}",
                  f"trainer.objective={objective}", f"run.seed={seed}"),
                 {"eta": eta, "objective": objective, "seed": seed})
            for seed in seeds for eta in etas for objective in objectives]


def aggregate(records: list[dict]) -> dict[str, Any]:
    """One row per (objective, eta): final pass rate (mean, min, max over seeds), throughputs,
    staleness actually trained on, and training throughput relative to eta = 0."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    failed = []
    for rec in records:
        s = rec["summary"]
        if rec.get("status") == "failed" or s.get("error") is not None:
            failed.append({"cell": rec.get("cell"), "error": s.get("error")})
            continue
        rows.setdefault((rec["objective"], rec["eta"]), {"objective": rec["objective"], "eta": rec["eta"],
                                                        "runs": []})["runs"].append(rec)
    out = []
    for (_, eta), row in rows.items():
        runs = row.pop("runs")
        final = stats([final_pass_rate(r["summary"]) for r in runs])
        row.update(eta_label=eta_label(eta), seeds=[r["seed"] for r in runs],
                   final_pass_mean=final["mean"], final_pass_min=final["min"], final_pass_max=final["max"],
                   **{f"{k}": mean([r["summary"].get(k) for r in runs]) for k in
                      ("train_tokens_per_s", "gen_tokens_per_s", "wall_s", "steps", "rollout_idle_frac",
                       "trainer_idle_frac", "samples_dropped_stale", "interrupts")},
                   max_staleness_trained=max(r["summary"].get("max_staleness_trained", 0) for r in runs))
        out.append(row)
    for row in out:
        base = next((r for r in out if r["objective"] == row["objective"] and r["eta"] == 0), None)
        row["throughput_vs_eta0"] = (row["train_tokens_per_s"] / base["train_tokens_per_s"]
                                     if base and base["train_tokens_per_s"] else None)
    order = {e: i for i, e in enumerate(sorted({r["eta"] for r in out}, key=_eta_order))}
    out.sort(key=lambda r: (r["objective"], order[r["eta"]]))
    return {"rows": out, "failed": failed}


def _eta_order(eta: int) -> float:
    return float("inf") if eta == UNBOUNDED else eta


def print_results(agg: dict) -> None:
    rows = [[r["objective"], r["eta_label"], fmt(r["final_pass_mean"]),
             "-" if r["final_pass_min"] is None else f"{r['final_pass_min']:.2f}-{r['final_pass_max']:.2f}",
             fmt(r["train_tokens_per_s"], ".1f"), fmt(r["throughput_vs_eta0"]), fmt(r["gen_tokens_per_s"], ".1f"),
             str(r["max_staleness_trained"]), fmt(r["samples_dropped_stale"], ".0f"), fmt(r["steps"], ".0f"),
             fmt(r["wall_s"], ".0f")] for r in agg["rows"]]
    print_table(["objective", "eta", "final pass", "min-max", "train tok/s", "x eta0", "gen tok/s",
                 "stale max", "dropped", "steps", "wall s"], rows,
                title="\nstaleness ablation (areal mode; means over seeds)")
    for f in agg["failed"]:
        print(f"FAILED {f['cell']}: {f['error']}")


def plot(agg: dict, path: Path) -> None:
    """Two panels against eta (categorical axis, unbounded last): final pass rate, train tokens/s."""
    plt = pyplot()
    etas = sorted({r["eta"] for r in agg["rows"]}, key=_eta_order)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for objective in dict.fromkeys(r["objective"] for r in agg["rows"]):
        sel = sorted((r for r in agg["rows"] if r["objective"] == objective), key=lambda r: _eta_order(r["eta"]))
        xs = [etas.index(r["eta"]) for r in sel]
        line = axes[0].plot(xs, [r["final_pass_mean"] for r in sel], marker="o", label=objective)[0]
        if any(r["final_pass_min"] != r["final_pass_max"] for r in sel):
            axes[0].fill_between(xs, [r["final_pass_min"] for r in sel], [r["final_pass_max"] for r in sel],
                                 color=line.get_color(), alpha=0.15)
        axes[1].plot(xs, [r["train_tokens_per_s"] for r in sel], marker="o", label=objective)
    for ax, label in ((axes[0], "final eval pass rate"), (axes[1], "trained tokens / s")):
        ax.set_xticks(range(len(etas)), [eta_label(e) for e in etas])
        ax.set_xlabel("max staleness eta")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].set_ylim(bottom=0)
    fig.suptitle("staleness ablation (areal mode, interruptible generation)")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = grid_parser(__doc__, "staleness_ablation")
    ap.add_argument("--etas", default=None, help="comma-separated; -1 = unbounded (default 0,1,2,4,8,16,-1)")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--seeds", default="0", help="comma-separated run seeds")
    ap.add_argument("--steps", type=int, default=None, help=f"run.max_steps of every cell (default {DEFAULT_STEPS})")
    ap.add_argument("--literal-unbounded", action="store_true",
                    help="run eta -1 as max_staleness = -1 (admission bounded by controller.max_in_flight alone)")
    args = ap.parse_args(argv)
    etas = parse_list(args.etas, parse_eta) if args.etas else list(QUICK_ETAS if args.quick else ETAS)
    objectives = parse_list(args.objectives)
    if bad := [o for o in objectives if o not in OBJECTIVES]:
        ap.error(f"--objectives: {bad} not in {list(OBJECTIVES)}")
    seeds = parse_list(args.seeds, int)
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    base = [*(QUICK if args.quick else ()), f"run.max_steps={steps}",
            *([f"run.max_wall_s={args.max_wall_s}"] if args.max_wall_s else []), *args.overrides]

    resolved_steps = load_settings(args.settings, base).run.max_steps
    unbounded_as = UNBOUNDED if args.literal_unbounded else resolved_steps
    records = run_loop(run_grid(cells(etas, objectives, seeds, unbounded_as), args.out,
                                settings_path=args.settings, overrides=base,
                                run_missing=not args.report_only))
    agg = aggregate(records)
    results = {"settings": shown_path(args.settings), "overrides": base, "etas": etas, "objectives": objectives,
               "seeds": seeds, "steps": resolved_steps,
               "unbounded_as_max_staleness": unbounded_as, **agg,
               "runs": [{k: r[k] for k in ("cell", "eta", "objective", "seed", "status", "folder")}
                        | {"final_pass_rate": final_pass_rate(r["summary"]),
                           "train_tokens_per_s": r["summary"].get("train_tokens_per_s"),
                           "error": r["summary"].get("error")} for r in records]}
    write_json(args.out / "results.json", results, command=command_line(__file__, argv))
    print_results(agg)
    plot(agg, args.out / "staleness_ablation.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'staleness_ablation.png'}", file=sys.stderr)
    return 1 if agg["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
