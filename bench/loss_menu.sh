#!/usr/bin/env bash
# The loss and sampling options against the default, areal mode: time and steps to 0.70 and to
# THRESHOLD held-out pass, each (arm, seed) cell its own time_to_threshold.py grid, OUT/ARM/sSEED
# (it resumes: a finished cell is reused; one in a folder of the older layout, OUT/ARM, is run
# again). Arms go one after another, seed by seed, so a drift of the machine's load falls on all.
#
#     bash bench/loss_menu.sh [OUT] [SEEDS] [ARMS]     # default bench/out/loss-menu, seeds "0 1 2", every arm
#     MAX_WALL_S=600 THRESHOLD=0.80 bash bench/loss_menu.sh OUT "0" "default dynamic gspo"
#     EXTRA=--quick bash bench/loss_menu.sh OUT "0"   # a smoke run on tiny-random
#     CORES_PER_CELL=2 bash bench/loss_menu.sh OUT "0 1" "default clamp"   # a many-core CPU
#
# CORES_PER_CELL=N runs every (seed, arm) cell at once instead, each pinned (taskset) to N CPUs of
# its own, a physical core's threads together where the machine has them, so a 16-CPU machine runs
# 8 two-CPU cells side by side: each cell sees its N CPUs as the whole machine (its workers take
# their threads from the affinity), and a drift of the machine's load falls on all cells at once.
# The cells share the memory bandwidth and caches, so their times are slower than a machine of N
# cores alone would give; they compare with each other, not with a sequential grid's. Each cell's
# log is OUT/ARM/sSEED.log, its grid OUT/ARM/sSEED/.
#
# The arms run on the file's defaults, int8 generation on a CPU included (rollout.quantize =
# auto); bench/results/epyc-2core/loss_menu.json ran in float32, the default then:
# EXTRA="--set rollout.quantize=off" repeats it.
#
# Last, bench/loss_menu_report.py gathers the arms into OUT/loss_menu.json and OUT/loss_menu.png:
# per seed the time and first eval step at 0.70 and at THRESHOLD, the final pass rate, the mean
# entropy of the last 5 steps, the skipped samples and the reward and entropy curves; per arm the
# medians over the seeds that reached each (docs/objectives.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in MAX_WALL_S THRESHOLD EXTRA CORES_PER_CELL; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/loss_menu.sh${*:+ ${*@Q}}"
OUT="${1:-bench/out/loss-menu}"
SEEDS="${2:-0 1 2}"
ARMS="${3:-default dynamic sequence drgrpo gspo cispo entropy overlong}"
MAX_WALL_S="${MAX_WALL_S:-1200}"
THRESHOLD="${THRESHOLD:-0.80}"
EXTRA="${EXTRA:-}"
CORES_PER_CELL="${CORES_PER_CELL:-}"

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
        lr2x) echo "--set trainer.lr=2e-5" ;;  # not a menu option: the step size the options compete with
        # the behaviour-policy cap of decoupled PPO (default: mask at 5), for int8 generation's mismatch:
        #     EXTRA="--set rollout.quantize=int8" bash bench/loss_menu.sh bench/out/int8-caps "0 1 2" "default clamp mask2 clamp2"
        clamp) echo "--set trainer.cap_mode=clamp" ;;
        mask2) echo "--set trainer.behav_cap=2" ;;
        clamp2) echo "--set trainer.cap_mode=clamp --set trainer.behav_cap=2" ;;
        *) echo "unknown arm $1" >&2; exit 2 ;;
    esac
}

cell() {  # one (seed, arm) cell: a time_to_threshold.py grid of one run, in a folder of its own
    # shellcheck disable=SC2046
    python bench/time_to_threshold.py --modes areal --seeds "$1" --threshold "$THRESHOLD" \
        --max-wall-s "$MAX_WALL_S" $EXTRA $(sets "$2") --out "$OUT/$2/s$1"
}

core_order() {  # the CPUs this process may use, the threads of one physical core next to each other
    python - <<'EOF'
import os
def core(cpu):
    topo = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        return tuple(int(open(topo + f).read()) for f in ("physical_package_id", "core_id")), cpu
    except OSError:  # no topology: each CPU its own core
        return (cpu,), cpu
print(" ".join(str(cpu) for _, cpu in sorted(map(core, os.sched_getaffinity(0)))))
EOF
}

for arm in $ARMS; do sets "$arm" >/dev/null; done  # an unknown arm stops the script before any run
if [ -z "$CORES_PER_CELL" ]; then
    for seed in $SEEDS; do
        for arm in $ARMS; do cell "$seed" "$arm"; done
    done
else
    read -r -a cpus <<<"$(core_order)"
    read -r -a seeds <<<"$SEEDS"; read -r -a arms <<<"$ARMS"
    need=$((${#seeds[@]} * ${#arms[@]} * CORES_PER_CELL))
    if (( need > ${#cpus[@]} )); then
        echo "${#seeds[@]} seeds x ${#arms[@]} arms x $CORES_PER_CELL CPUs need $need CPUs, this process may use ${#cpus[@]}" >&2
        exit 2
    fi
    i=0; pids=()
    for seed in "${seeds[@]}"; do
        for arm in "${arms[@]}"; do
            mine=$(IFS=,; echo "${cpus[*]:i*CORES_PER_CELL:CORES_PER_CELL}")
            mkdir -p "$OUT/$arm"
            echo "seed $seed, $arm: CPUs $mine" >&2
            (  # pinned before it starts anything: its processes inherit the affinity
                taskset -cp "$mine" "$BASHPID" >/dev/null
                cell "$seed" "$arm" >"$OUT/$arm/s$seed.log" 2>&1 && rc=0 || rc=$?
                echo "seed $seed, $arm: exit $rc" >&2
            ) &
            pids+=($!)
            i=$((i + 1))
        done
    done
    wait "${pids[@]}"
fi
python bench/loss_menu_report.py "$OUT" --threshold "$THRESHOLD" --seeds "$SEEDS" --arms "$ARMS" \
    --max-wall-s "$MAX_WALL_S" --command "$COMMAND"
