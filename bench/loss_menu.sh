#!/usr/bin/env bash
# The loss and sampling options against the default, areal mode: time and steps to 0.70 and to
# THRESHOLD held-out pass, each arm one time_to_threshold.py grid (it resumes: finished cells are
# reused). Arms go one after another, seed by seed, so a drift of the machine's load falls on all.
#
#     bash bench/loss_menu.sh [OUT] [SEEDS] [ARMS]     # default bench/out/loss-menu, seeds "0 1 2", every arm
#     MAX_WALL_S=600 THRESHOLD=0.80 bash bench/loss_menu.sh OUT "0" "default dynamic gspo"
#     EXTRA=--quick bash bench/loss_menu.sh OUT "0"   # a smoke run on tiny-random
#
# Last, OUT/loss_menu.json gathers the arms: per seed the time and first eval step at 0.70 and at
# THRESHOLD, the final pass rate, the mean entropy of the last 5 steps and the skipped samples;
# per arm the medians over the seeds that reached each (README, Loss and sampling options).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out/loss-menu}"
SEEDS="${2:-0 1 2}"
ARMS="${3:-default dynamic sequence drgrpo gspo cispo entropy overlong}"
MAX_WALL_S="${MAX_WALL_S:-1200}"
THRESHOLD="${THRESHOLD:-0.80}"
EXTRA="${EXTRA:-}"

sets() {  # the settings of one arm (the others are the file's)
    case "$1" in
        default) ;;
        dynamic) echo "--set controller.dynamic_sampling=true" ;;
        sequence) echo "--set trainer.loss_agg=sequence" ;;
        drgrpo) echo "--set trainer.advantage=drgrpo --set trainer.loss_agg=constant" ;;
        gspo) echo "--set trainer.objective=gspo --set trainer.clip_eps=3e-4 --set trainer.clip_eps_high=4e-4" ;;
        cispo) echo "--set trainer.objective=cispo" ;;
        entropy) echo "--set trainer.entropy_coef=0.001" ;;
        overlong) echo "--set task.overlong_buffer=16" ;;
        *) echo "unknown arm $1" >&2; exit 2 ;;
    esac
}

for seed in $SEEDS; do
    for arm in $ARMS; do
        # shellcheck disable=SC2046
        python bench/time_to_threshold.py --modes areal --seeds "$seed" --threshold "$THRESHOLD" \
            --max-wall-s "$MAX_WALL_S" $EXTRA $(sets "$arm") --out "$OUT/$arm"
    done
done
python - "$OUT" "$THRESHOLD" "$SEEDS" "$ARMS" "$MAX_WALL_S" <<'PY'
import json, statistics, sys
from pathlib import Path

from bench.arms import arm_summary, runs as arm_runs

out, top, seeds, arms = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
max_wall_s = float(sys.argv[5])
levels = sorted({0.70, top})

runs, summary = [], {}
for arm in arms:
    mine = []
    for s, steps, row in arm_runs(out, arm, levels, "areal-*-s*"):
        entropy = [r["entropy"] for r in steps[-5:] if r.get("entropy") is not None]
        row.update(last_entropy=statistics.mean(entropy) if entropy else None,
                   skipped_uniform=s.get("samples_skipped_uniform", 0))
        mine.append(row)
    runs += mine
    summary[arm] = arm_summary(mine, levels)
base = summary.get("default", {})
for arm, row in summary.items():
    if arm == "default":
        continue
    for level in levels:
        key = f"median_s_{level:.2f}"
        if base.get(key) and row.get(key):
            row[f"vs_default_{level:.2f}"] = row[key] / base[key]
(out / "loss_menu.json").write_text(json.dumps(
    {"command": f'MAX_WALL_S={sys.argv[5]} THRESHOLD={sys.argv[2]} bash bench/loss_menu.sh OUT "{sys.argv[3]}" '
                f'"{sys.argv[4]}"', "mode": "areal", "threshold": top, "max_wall_s": max_wall_s, "seeds": seeds,
     "summary": summary, "runs": runs}, indent=1))
print(json.dumps(summary, indent=1))
print(f"wrote {out / 'loss_menu.json'}", file=sys.stderr)
PY
