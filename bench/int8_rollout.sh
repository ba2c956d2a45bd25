#!/usr/bin/env bash
# int8 generation against float32, and areal against an honest sync, on the default run: time and
# steps to 0.70 and to THRESHOLD held-out pass, each arm a time_to_threshold.py grid (finished cells
# are reused). Arms go one after another, seed by seed, so a drift of the machine's load falls on all.
#
#     bash bench/int8_rollout.sh [OUT] [SEEDS] [ARMS]   # default bench/out/int8-rollout, "0 1 2", "sync areal int8"
#     MAX_WALL_S=600 THRESHOLD=0.75 bash bench/int8_rollout.sh OUT "0 1 2"
#     EXTRA=--quick bash bench/int8_rollout.sh OUT "0"   # a smoke run on tiny-random
#
# Arms: sync (run.mode = sync: the workers take turns, each with every core), areal (the default
# file), int8 (areal with rollout.quantize = int8), sync-int8 (sync with it). OUT/int8_rollout.json gathers per seed the time
# and first eval step at each level, the final pass rate, the mean mismatch_kl (behaviour vs the
# trainer's float32 log-probs of a version's own tokens), tokens generated per second and both
# workers' idle shares; per arm the medians over the seeds that reached each level (README: int8
# rollout; Time to threshold).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out/int8-rollout}"
SEEDS="${2:-0 1 2}"
ARMS="${3:-sync areal int8}"
MAX_WALL_S="${MAX_WALL_S:-600}"
THRESHOLD="${THRESHOLD:-0.75}"
EXTRA="${EXTRA:-}"

args() {  # the mode and settings of one arm
    case "$1" in
        sync) echo "--modes sync" ;;
        areal) echo "--modes areal" ;;
        int8) echo "--modes areal --set rollout.quantize=int8" ;;
        sync-int8) echo "--modes sync --set rollout.quantize=int8" ;;
        *) echo "unknown arm $1" >&2; exit 2 ;;
    esac
}

for seed in $SEEDS; do
    for arm in $ARMS; do
        # shellcheck disable=SC2046
        python bench/time_to_threshold.py --seeds "$seed" --threshold "$THRESHOLD" --report-at 0.7 \
            --max-wall-s "$MAX_WALL_S" $EXTRA $(args "$arm") --out "$OUT/$arm"
    done
done
python - "$OUT" "$THRESHOLD" "$SEEDS" "$ARMS" "$MAX_WALL_S" <<'PY'
import json, statistics, sys
from pathlib import Path

out, top, seeds, arms = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
levels = sorted({0.70, top})


def first(curve, level):
    """(wall s, step) of the first eval at or above `level`, or (None, None)."""
    hit = next((e for e in sorted(curve, key=lambda e: e["step"]) if e["pass_rate"] >= level), None)
    return (hit["wall_s"], hit["step"]) if hit else (None, None)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


runs, summary = [], {}
for arm in arms:
    for cell in sorted((out / arm / "runs").glob("*-s*")):
        s = json.loads((cell / "summary.json").read_text())
        steps = [json.loads(x) for x in (cell / "steps.jsonl").read_text().splitlines()] \
            if (cell / "steps.jsonl").exists() else []
        kl = [r["mismatch_kl"] for r in steps if r.get("mismatch_kl") is not None]
        row = {"arm": arm, "seed": s["seed"], "steps": s["steps"], "wall_s": s["wall_s"],
               "initial_pass": s["eval_curve"][0]["pass_rate"] if s["eval_curve"] else None,
               "final_pass": s["eval_curve"][-1]["pass_rate"] if s["eval_curve"] else None,
               "mismatch_kl_mean": statistics.mean(kl) if kl else None,
               "gen_tokens_per_s": s["gen_tokens_per_s"], "trainer_idle_frac": s["trainer_idle_frac"],
               "rollout_idle_frac": s["rollout_idle_frac"],
               "eval_curve": [{"step": e["step"], "wall_s": e["wall_s"], "pass_rate": e["pass_rate"]}
                              for e in s["eval_curve"]]}
        for level in levels:
            row[f"time_to_{level:.2f}_s"], row[f"step_to_{level:.2f}"] = first(s["eval_curve"], level)
        runs.append(row)
    mine = [r for r in runs if r["arm"] == arm]
    summary[arm] = {"seeds": len(mine)}
    for key in ("mismatch_kl_mean", "gen_tokens_per_s", "trainer_idle_frac", "rollout_idle_frac", "final_pass"):
        summary[arm][f"median_{key}"] = median([r[key] for r in mine])
    for level in levels:
        times = [r[f"time_to_{level:.2f}_s"] for r in mine if r[f"time_to_{level:.2f}_s"] is not None]
        summary[arm][f"reached_{level:.2f}"] = len(times)
        summary[arm][f"median_s_{level:.2f}"] = median(times)
        summary[arm][f"median_step_{level:.2f}"] = median([r[f"step_to_{level:.2f}"] for r in mine])
for arm, row in summary.items():
    for base in ("sync", "areal", "sync-int8"):
        if arm == base or base not in summary:
            continue
        for level in levels:
            key = f"median_s_{level:.2f}"
            if summary[base].get(key) and row.get(key):
                row[f"speedup_vs_{base}_{level:.2f}"] = summary[base][key] / row[key]
(out / "int8_rollout.json").write_text(json.dumps(
    {"command": f'MAX_WALL_S={sys.argv[5]} THRESHOLD={sys.argv[2]} bash bench/int8_rollout.sh OUT '
                f'"{sys.argv[3]}" "{sys.argv[4]}"', "threshold": top, "max_wall_s": float(sys.argv[5]),
     "seeds": seeds, "summary": summary, "runs": runs}, indent=1))
print(json.dumps(summary, indent=1))
print(f"wrote {out / 'int8_rollout.json'}", file=sys.stderr)
PY
