#!/usr/bin/env bash
# The rollout-side arms on the default run (int8 generation against float32, the KV kept over a
# weight update against rebuilt, areal against an honest sync): time and steps to 0.70 and to
# THRESHOLD held-out pass, each arm a time_to_threshold.py grid (finished cells are reused). Arms go
# one after another, seed by seed, so a drift of the machine's load falls on all.
#
#     bash bench/rollout_arms.sh [OUT] [SEEDS] [ARMS]   # default bench/out/rollout-arms, "0 1 2", "sync areal int8"
#     MAX_WALL_S=600 THRESHOLD=0.75 bash bench/rollout_arms.sh OUT "0 1 2"
#     EXTRA=--quick bash bench/rollout_arms.sh OUT "0"   # a smoke run on tiny-random
#
# Arms: sync (run.mode = sync: the workers take turns, each with every core), areal (the default
# file), int8 (areal with rollout.quantize = int8), sync-int8 (sync with it), keep (areal with
# rollout.kv_on_update = keep: no KV rebuild after a load), int8-keep (both); any arm with -etaN
# appended runs at staleness bound N (areal's default is 4), as int8-keep-eta1.
# OUT/rollout_arms.json gathers per seed the time and first eval step at each level, the final pass
# rate, the mean mismatch_kl (behaviour vs the trainer's float32 log-probs of a version's own
# tokens), the mean over steps of a batch's mean staleness, tokens generated per second and both
# workers' idle shares; per arm the medians over the seeds that reached each level (README: int8
# rollout; Time to threshold).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench/out/rollout-arms}"
SEEDS="${2:-0 1 2}"
ARMS="${3:-sync areal int8}"
MAX_WALL_S="${MAX_WALL_S:-600}"
THRESHOLD="${THRESHOLD:-0.75}"
EXTRA="${EXTRA:-}"

args() {  # the mode and settings of one arm; a suffix -etaN also sets controller.max_staleness = N
    if [[ "$1" =~ ^(.+)-eta([0-9]+)$ ]]; then
        echo "$(args "${BASH_REMATCH[1]}") --set controller.max_staleness=${BASH_REMATCH[2]}"
        return
    fi
    case "$1" in
        sync) echo "--modes sync" ;;
        areal) echo "--modes areal" ;;
        int8) echo "--modes areal --set rollout.quantize=int8" ;;
        sync-int8) echo "--modes sync --set rollout.quantize=int8" ;;
        keep) echo "--modes areal --set rollout.kv_on_update=keep" ;;
        int8-keep) echo "--modes areal --set rollout.quantize=int8 --set rollout.kv_on_update=keep" ;;
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

from bench.arms import arm_summary, median, runs as arm_runs

out, top, seeds, arms = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
levels = sorted({0.70, top})

runs, summary = [], {}
for arm in arms:
    mine = []
    for s, steps, row in arm_runs(out, arm, levels):
        kl = [r["mismatch_kl"] for r in steps if r.get("mismatch_kl") is not None]
        stale = [r["staleness_mean"] for r in steps if r.get("staleness_mean") is not None]
        row.update(mismatch_kl_mean=statistics.mean(kl) if kl else None,
                   staleness_mean=statistics.mean(stale) if stale else None,
                   gen_tokens_per_s=s["gen_tokens_per_s"])
        mine.append(row)
    runs += mine
    summary[arm] = arm_summary(mine, levels)
    for key in ("mismatch_kl_mean", "staleness_mean", "gen_tokens_per_s", "trainer_idle_frac", "rollout_idle_frac", "final_pass"):
        summary[arm][f"median_{key}"] = median([r[key] for r in mine])
for arm, row in summary.items():
    for base in ("sync", "areal", "sync-int8", "int8"):
        if arm == base or base not in summary:
            continue
        for level in levels:
            key = f"median_s_{level:.2f}"
            if summary[base].get(key) and row.get(key):
                row[f"speedup_vs_{base}_{level:.2f}"] = summary[base][key] / row[key]
(out / "rollout_arms.json").write_text(json.dumps(
    {"command": f'MAX_WALL_S={sys.argv[5]} THRESHOLD={sys.argv[2]} bash bench/rollout_arms.sh OUT '
                f'"{sys.argv[3]}" "{sys.argv[4]}"', "threshold": top, "max_wall_s": float(sys.argv[5]),
     "seeds": seeds, "summary": summary, "runs": runs}, indent=1))
print(json.dumps(summary, indent=1))
print(f"wrote {out / 'rollout_arms.json'}", file=sys.stderr)
PY
