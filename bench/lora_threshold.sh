#!/usr/bin/env bash
# Time to 0.70 held-out pass, full fine-tuning against LoRA rank 8, areal mode, seeds 0-2.
# The two arms alternate seed by seed, so a drift of the machine's load falls on both.
#
#     bash bench/lora_threshold.sh [OUT]        # default bench/out/lora-threshold; ~40 min on 2 cores
#
# Each arm is bench/time_to_threshold.py's grid (it resumes: finished cells are reused). Last,
# OUT/lora_threshold.json gathers both arms: per seed the time to 0.70, the first eval step at
# or above it, the trainer's and rollout's idle fractions and the eval curve; per arm the
# median and mean time and the median step (docs/lora.md; bench/results/epyc-2core/lora_threshold.json).
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in LORA_LR; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/lora_threshold.sh${*:+ ${*@Q}}"
OUT="${1:-bench/out/lora-threshold}"
LORA_LR="${LORA_LR:-1e-4}"   # the full run's trainer.lr is 1e-5; LoRA's usual is about 10x
for seed in 0 1 2; do
    python bench/time_to_threshold.py --modes areal --seeds "$seed" --threshold 0.70 --max-wall-s 600 \
        --out "$OUT/full"
    python bench/time_to_threshold.py --modes areal --seeds "$seed" --threshold 0.70 --max-wall-s 600 \
        --set lora.rank=8 --set trainer.lr="$LORA_LR" --out "$OUT/lora8"
done
python - "$OUT" "$LORA_LR" "$COMMAND" <<'PY'
import json, statistics, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.common import write_json

out, lora_lr, command = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
arms = {"full": {"lora_rank": 0, "lr": 1e-5}, "lora8": {"lora_rank": 8, "lr": lora_lr}}
runs = []
for arm, knobs in arms.items():
    for seed in (0, 1, 2):
        s = json.loads((out / arm / "runs" / f"areal-decoupled_ppo-s{seed}" / "summary.json").read_text())
        first = next((e["step"] for e in sorted(s["eval_curve"], key=lambda e: e["step"])
                      if e["pass_rate"] >= 0.70), None)
        runs.append({"arm": arm, "seed": seed, **knobs, "time_to_0.70_s": s["time_to_threshold_s"],
                     "step_to_0.70": first, "trainer_idle_frac": s["trainer_idle_frac"],
                     "rollout_idle_frac": s["rollout_idle_frac"], "eval_curve": s["eval_curve"]})
summary = {}
for arm in arms:
    times = [r["time_to_0.70_s"] for r in runs if r["arm"] == arm and r["time_to_0.70_s"] is not None]
    steps = [r["step_to_0.70"] for r in runs if r["arm"] == arm and r["step_to_0.70"] is not None]
    summary[arm] = {"reached": len(times), "median_s": statistics.median(times) if times else None,
                    "mean_s": statistics.mean(times) if times else None,
                    "median_step": statistics.median(steps) if steps else None}
if summary["full"]["median_s"] and summary["lora8"]["median_s"]:
    summary["lora8_vs_full_median"] = summary["lora8"]["median_s"] / summary["full"]["median_s"]
    summary["lora8_vs_full_mean"] = summary["lora8"]["mean_s"] / summary["full"]["mean_s"]
write_json(out / "lora_threshold.json",
           {"command": "bash bench/lora_threshold.sh", "threshold": 0.70, "mode": "areal", "max_wall_s": 600,
            "target_lora8_vs_full_median": 1.25, "summary": summary, "runs": runs}, command=command)
print(json.dumps(summary, indent=1))
print(f"wrote {out / 'lora_threshold.json'}", file=sys.stderr)
PY
