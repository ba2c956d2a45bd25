#!/usr/bin/env bash
# The rollout-side arms on the default run (int8 generation against float32, the KV kept over a
# weight update against rebuilt, areal against an honest sync): time and steps to 0.70 and to
# THRESHOLD held-out pass, each (arm, seed) cell its own time_to_threshold.py grid, OUT/ARM/sSEED
# (a finished cell is reused; one in a folder of the older layout, OUT/ARM, is run again). Arms go
# one after another, seed by seed, so a drift of the machine's load falls on all.
#
#     bash bench/rollout_arms.sh [OUT] [SEEDS] [ARMS]   # default bench/out/rollout-arms, "0 1 2", "sync areal int8"
#     MAX_WALL_S=600 THRESHOLD=0.75 bash bench/rollout_arms.sh OUT "0 1 2"
#     EXTRA=--quick bash bench/rollout_arms.sh OUT "0"   # a smoke run on tiny-random
#
# Arms: default (the file as it is), sync (run.mode = sync: the workers take turns, each with every
# core; float32 generation), areal (areal mode, float32 generation), int8 (areal with
# rollout.quantize = int8), sync-int8 (sync with it), keep (areal, float32, with
# rollout.kv_on_update = keep: no KV rebuild after a load), int8-keep (int8 and keep); any arm with
# -etaN appended runs at staleness bound N, as int8-eta1. Every arm names its rollout.quantize, so
# an arm means the same whatever the file's default.
# Last, bench/rollout_arms_report.py gathers the arms into OUT/rollout_arms.json and a figure: per
# seed the time and first eval step at each level, the final pass rate, the mean mismatch_kl, the
# mean staleness, tokens generated per second and both workers' idle shares; per arm the medians
# over the seeds that reached each level (docs/rollout.md; docs/benchmarks/time-to-threshold.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in MAX_WALL_S THRESHOLD EXTRA; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/rollout_arms.sh${*:+ ${*@Q}}"
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
        default) echo "--modes areal" ;;
        sync) echo "--modes sync --set rollout.quantize=off" ;;
        areal) echo "--modes areal --set rollout.quantize=off" ;;
        int8) echo "--modes areal --set rollout.quantize=int8" ;;
        sync-int8) echo "--modes sync --set rollout.quantize=int8" ;;
        keep) echo "--modes areal --set rollout.quantize=off --set rollout.kv_on_update=keep" ;;
        int8-keep) echo "--modes areal --set rollout.quantize=int8 --set rollout.kv_on_update=keep" ;;
        *) echo "unknown arm $1" >&2; exit 2 ;;
    esac
}

for seed in $SEEDS; do
    for arm in $ARMS; do
        # shellcheck disable=SC2046
        python bench/time_to_threshold.py --seeds "$seed" --threshold "$THRESHOLD" --report-at 0.7 \
            --max-wall-s "$MAX_WALL_S" $EXTRA $(args "$arm") --out "$OUT/$arm/s$seed"
    done
done
python bench/rollout_arms_report.py "$OUT" --threshold "$THRESHOLD" --seeds "$SEEDS" --arms "$ARMS" \
    --max-wall-s "$MAX_WALL_S" --command "$COMMAND"
