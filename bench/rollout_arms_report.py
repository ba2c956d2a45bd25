"""The report of bench/rollout_arms.sh: its arms' runs gathered into OUT/rollout_arms.json and OUT/rollout_arms.png.

    python bench/rollout_arms_report.py OUT [--threshold 0.75] [--seeds "0 1 2"] [--arms "sync areal int8"]
        [--max-wall-s 600]

Per run: the wall seconds and the first eval step at 0.70 and at --threshold held-out pass (None
where the run ended first), the final pass rate, the mean mismatch_kl (the sampler's against the
trainer's log-probs of a version's own tokens), the mean over steps of a batch's mean staleness,
tokens generated per second and both workers' idle shares. Per arm: the medians over the seeds
that reached each level, of those columns too, and each level's median against each baseline arm
in the grid (`speedup_vs_<base>_<level>`, above 1 is faster). The figure: held-out pass against
wall time, and each seed's time to each level with the arm's median.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.arms import (  # noqa: E402
    arm_summary,
    draw_pass,
    draw_times,
    grid_command,
    median,
    report_args,
    save_report,
)
from bench.arms import runs as arm_runs  # noqa: E402
from bench.common import pyplot, save_figure  # noqa: E402

ARMS = "sync areal int8"
BASELINES = ("sync", "areal", "sync-int8", "int8")
"""Arms every other arm's medians are divided by, where the grid has them."""
MEDIANS = ("mismatch_kl_mean", "staleness_mean", "gen_tokens_per_s", "trainer_idle_frac", "rollout_idle_frac",
           "final_pass")


def mean_of(steps: list[dict], key: str) -> float | None:
    values = [r[key] for r in steps if r.get(key) is not None]
    return statistics.mean(values) if values else None


def gather(out: Path, arms: list[str], levels: list[float]) -> tuple[list[dict], dict[str, dict]]:
    """Every run's row and every arm's summary (medians, and the speedups against the baselines)."""
    rows, summary = [], {}
    for arm in arms:
        mine = []
        for s, steps, row in arm_runs(out, arm, levels):
            row.update(mismatch_kl_mean=mean_of(steps, "mismatch_kl"), staleness_mean=mean_of(steps, "staleness_mean"),
                       gen_tokens_per_s=s["gen_tokens_per_s"])
            mine.append(row)
        rows += mine
        summary[arm] = arm_summary(mine, levels)
        for key in MEDIANS:
            summary[arm][f"median_{key}"] = median([r[key] for r in mine])
    for arm, row in summary.items():
        for base in BASELINES:
            if arm == base or base not in summary:
                continue
            for level in levels:
                key = f"median_s_{level:.2f}"
                if summary[base].get(key) and row.get(key):
                    row[f"speedup_vs_{base}_{level:.2f}"] = summary[base][key] / row[key]
    return rows, summary


def plot(rows: list[dict], arms: list[str], levels: list[float], max_wall_s: float, path: Path) -> None:
    plt = pyplot()
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(arms)}
    fig, (pass_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_pass(pass_ax, rows, colors, levels)
    draw_times(time_ax, rows, arms, colors, levels, max_wall_s)
    save_figure(fig, path)


def main() -> None:
    args = report_args(__doc__, ARMS, 0.75, 600.0)
    arms, levels = args.arms.split(), args.levels
    rows, summary = gather(args.out, arms, levels)
    data: dict[str, Any] = {"command": grid_command("rollout_arms.sh", args), "threshold": args.threshold,
                            "max_wall_s": args.max_wall_s, "seeds": args.seeds.split(), "summary": summary,
                            "runs": rows}
    save_report(args, "rollout_arms", data, rows, lambda path: plot(rows, arms, levels, args.max_wall_s, path))


if __name__ == "__main__":
    main()
