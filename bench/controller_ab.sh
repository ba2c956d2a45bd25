#!/usr/bin/env bash
# The controller's rate (bench/controller_overhead.py) of an earlier commit beside this tree's, in
# one sitting: ROUNDS rounds, each running every arm once (5 timed runs each, the bench's median),
# so a drift of the machine's load falls on all arms.
#
#     bash bench/controller_ab.sh REV [ROUNDS]   # ROUNDS default 3
#     EXTRA=--quick bash bench/controller_ab.sh HEAD 1   # a smoke run (20 steps, 2 timed runs per arm)
#
# Arms: `old` (REV as it was, its own bench and fakes), `old-fakes` (REV's controller with this
# tree's bench and fake workers: what the controller itself changed, apart from the fakes) and
# `new` (this tree). Prints each arm's per-round medians and their median. Run it alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
REV="${1:?usage: bash bench/controller_ab.sh REV [ROUNDS]}"
ROUNDS="${2:-3}"
EXTRA="${EXTRA:---repeats 5}"
PY="${PYTHON:-python}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the arms change directory
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"; git worktree prune' EXIT
for arm in old old-fakes; do
  git worktree add -q --detach "$WORK/$arm" "$REV"
done
cp areal_aio/fleet/fakes.py "$WORK/old-fakes/areal_aio/fleet/fakes.py"
cp bench/controller_overhead.py "$WORK/old-fakes/bench/controller_overhead.py"

declare -A RATES
for round in $(seq "$ROUNDS"); do
  for arm in old old-fakes new; do
    dir="$WORK/$arm"; [ "$arm" = new ] && dir="$PWD"
    if ! (cd "$dir" && PYTHONPATH="$dir" "$PY" bench/controller_overhead.py $EXTRA --out "$WORK/out-$arm" \
          > "$WORK/$arm.log" 2>&1); then
      tail -20 "$WORK/$arm.log"; exit 1
    fi
    rate=$(sed -n 's/^median \([0-9,]*\) trajectories.*/\1/p' "$WORK/$arm.log" | tr -d ,)
    echo "round $round  $arm  $rate trajectories/s"
    RATES[$arm]="${RATES[$arm]:-} $rate"
  done
done
for arm in old old-fakes new; do
  echo "$arm: ${RATES[$arm]} -> median $(printf '%s\n' ${RATES[$arm]} | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
done
