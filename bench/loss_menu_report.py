"""The report of bench/loss_menu.sh: its arms' runs gathered into OUT/loss_menu.json and OUT/loss_menu.png.

    python bench/loss_menu_report.py OUT [--threshold 0.80] [--seeds "0 1 2"] [--arms "default dynamic ..."]
        [--max-wall-s 1200]

Per run: the wall seconds and the first eval step at 0.70 and at --threshold held-out pass (None
where the run ended first), the final pass rate, the mean entropy of its last 5 steps, the
samples dynamic sampling skipped, the run's mean mismatch_kl (k3), mismatch_k1 and capped_frac
(the behaviour-policy cap's arms), and its curves (held-out pass per eval; per step the training
reward, entropy, gradient norm, mean reply tokens and overlong penalty). Per arm: the medians
over the seeds that reached each level, and each median against the default's (`vs_default_<level>`, below 1 is faster). The figure draws the same:
held-out pass against wall time, each seed's time to each level with the arm's median, and
the training reward and entropy per step averaged over seeds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.arms import arm_summary, draw_pass, draw_times, grid_command, report_args, save_report  # noqa: E402
from bench.arms import runs as arm_runs  # noqa: E402
from bench.common import pyplot, save_figure  # noqa: E402

ARMS = "default dynamic sequence drgrpo gspo cispo entropy overlong"
LAST = 5
"""Steps at the end of a run whose entropy is averaged (last_entropy)."""
SMOOTH = 5
"""Steps in the running mean of the training-reward and entropy curves."""
MISMATCH = ("mismatch_kl", "mismatch_k1", "capped_frac")
"""steps.jsonl columns of the gap between the generating and the trained policy, averaged per run
(the cap arms: mask or clamp at behav_cap, for int8 generation)."""


def gather(out: Path, arms: list[str], levels: list[float]) -> tuple[list[dict], dict[str, dict]]:
    """Every run's row and every arm's summary (medians, and against the default's)."""
    rows, summary = [], {}
    for arm in arms:
        mine = []
        for s, steps, row in arm_runs(out, arm, levels, "areal-*-s*"):
            entropy = [r["entropy"] for r in steps[-LAST:] if r.get("entropy") is not None]
            row.update(last_entropy=statistics.mean(entropy) if entropy else None,
                       **{f"mean_{key}": run_mean(steps, key) for key in MISMATCH},
                       skipped_uniform=s.get("samples_skipped_uniform", 0),
                       step_curve=[{"step": r["step"], "wall_s": r["wall_s"], "reward_mean": r["reward_mean"],
                                    "entropy": r.get("entropy"), "grad_norm": r.get("grad_norm"),
                                    "reply_tokens": r["tokens"] / r["seqs"] if r.get("seqs") else None,
                                    "overlong": r.get("reward/overlong")} for r in steps])
            mine.append(row)
        rows += mine
        summary[arm] = arm_summary(mine, levels)
    base = summary.get("default", {})
    for arm, row in summary.items():
        if arm == "default":
            continue
        for level in levels:
            key = f"median_s_{level:.2f}"
            if base.get(key) and row.get(key):
                row[f"vs_default_{level:.2f}"] = row[key] / base[key]
    return rows, summary


def run_mean(steps: list[dict], key: str) -> float | None:
    """The mean of a steps.jsonl column over a run's steps that have it."""
    values = [r[key] for r in steps if r.get(key) is not None]
    return statistics.mean(values) if values else None


def running_mean(values: list[float], window: int = SMOOTH) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def per_step_mean(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The mean of `key` over an arm's seeds at each step all of them made."""
    curves = [{p["step"]: p[key] for p in r["step_curve"] if p.get(key) is not None} for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return steps, [statistics.mean(c[s] for c in curves) for s in steps]


def plot(rows: list[dict], arms: list[str], levels: list[float], max_wall_s: float, path: Path) -> None:
    plt = pyplot()
    colors = {arm: plt.get_cmap("tab10")(i % 10) for i, arm in enumerate(arms)}
    fig, ((pass_ax, time_ax), (reward_ax, entropy_ax)) = plt.subplots(2, 2, figsize=(12, 8))
    draw_pass(pass_ax, rows, colors, levels)
    draw_times(time_ax, rows, arms, colors, levels, max_wall_s)

    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        for ax, key in ((reward_ax, "reward_mean"), (entropy_ax, "entropy")):
            steps, means = per_step_mean(mine, key)
            if steps:
                ax.plot(steps, running_mean(means), color=colors[arm], label=arm)
    reward_ax.set(xlabel="step", ylabel=f"training reward (mean over seeds, {SMOOTH}-step mean)",
                  title="training reward")
    entropy_ax.set(xlabel="step", ylabel=f"entropy (mean over seeds, {SMOOTH}-step mean)", title="policy entropy")
    entropy_ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    args = report_args(__doc__, ARMS, 0.80, 1200.0)
    arms, levels = args.arms.split(), args.levels
    rows, summary = gather(args.out, arms, levels)
    data: dict[str, Any] = {"command": grid_command("loss_menu.sh", args), "mode": "areal",
                            "threshold": args.threshold, "max_wall_s": args.max_wall_s,
                            "seeds": args.seeds.split(), "summary": summary, "runs": rows}
    save_report(args, "loss_menu", data, rows, lambda path: plot(rows, arms, levels, args.max_wall_s, path))


if __name__ == "__main__":
    main()
