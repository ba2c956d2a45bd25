#!/usr/bin/env bash
# The controller's rate (bench/controller_overhead.py) of an earlier commit beside this tree's, in
# one sitting: ROUNDS rounds, each running every arm once (5 timed runs each, the bench's median),
# so a drift of the machine's load falls on all arms.
#
#     bash bench/controller_ab.sh REV [ROUNDS] [OUT]   # ROUNDS default 3, OUT bench/out/controller-ab
#     EXTRA=--quick bash bench/controller_ab.sh HEAD 1 OUT   # a smoke run (20 steps, 2 timed runs per arm)
#
# Arms:
#   old        REV as it was: its own bench and fake workers
#   old-fakes  REV's package with this tree's bench and fake workers (areal_aio/fleet/fakes.py):
#              old-fakes against old is what the fakes changed, new against old-fakes what the
#              rest of the package changed (the controller, and the process setup of
#              areal_aio/app/runner.py). REV's bench/common.py must offer what today's bench imports.
#   new        this tree
# Writes OUT/controller_ab.json (each arm's per-round medians, their median, the ratios, the young-GC
# threshold each arm's runs collected at: which bench and package it ran) and
# OUT/controller_ab.png. Run it alone on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in EXTRA; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/controller_ab.sh${*:+ ${*@Q}}"
REV="${1:?usage: bash bench/controller_ab.sh REV [ROUNDS] [OUT]}"
ROUNDS="${2:-3}"
OUT="${3:-bench/out/controller-ab}"
EXTRA="${EXTRA:---repeats 5}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got $ROUNDS" >&2; exit 2; }
PY="${PYTHON:-python}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac  # the arms change directory
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"; git worktree prune' EXIT
for arm in old old-fakes; do
  git worktree add -q --detach "$WORK/$arm" "$REV"
done
cp areal_aio/fleet/fakes.py "$WORK/old-fakes/areal_aio/fleet/fakes.py"
cp bench/controller_overhead.py "$WORK/old-fakes/bench/controller_overhead.py"

: > "$WORK/rates"
for round in $(seq "$ROUNDS"); do
  for arm in old old-fakes new; do
    dir="$WORK/$arm"; [ "$arm" = new ] && dir="$PWD"
    # shellcheck disable=SC2086
    if ! (cd "$dir" && PYTHONPATH="$dir" "$PY" bench/controller_overhead.py $EXTRA --out "$WORK/out-$arm" \
          > "$WORK/$arm.log" 2>&1); then
      echo "arm $arm failed:" >&2; tail -20 "$WORK/$arm.log" >&2; exit 1
    fi
    # the arm's median and the young-GC threshold its runs collected at ("-": a bench too old to say)
    read -r rate gc < <("$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(round(r["trajectories_per_s_median"]), r.get("young_gc_threshold", "-"))' "$WORK/out-$arm/results.json") \
      || { echo "arm $arm wrote no results.json:" >&2; tail -20 "$WORK/$arm.log" >&2; exit 1; }
    echo "round $round  $arm  $rate trajectories/s"
    echo "$arm $rate $gc" >> "$WORK/rates"
  done
done
"$PY" - "$WORK/rates" "$OUT" "$REV" "$(git rev-parse "$REV")" "$ROUNDS" "$EXTRA" "$COMMAND" <<'PY'
import statistics, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.common import pyplot, save_figure, write_json

rates_file, out, rev, sha, rounds, extra, command = sys.argv[1:]
arms = {"old": [], "old-fakes": [], "new": []}
gc = {}
for line in Path(rates_file).read_text().splitlines():
    arm, rate, threshold = line.split()
    arms[arm].append(int(rate))
    gc[arm] = None if threshold == "-" else int(threshold)
median = {arm: statistics.median(r) for arm, r in arms.items()}
result = {"command": f"bash bench/controller_ab.sh {rev} {rounds}", "rev": sha, "extra": extra,
          "rates": arms, "median": median, "young_gc_threshold": gc,
          "fakes_ratio": median["old-fakes"] / median["old"],  # what the fake workers changed
          "package_ratio": median["new"] / median["old-fakes"],  # what the rest changed
          "total_ratio": median["new"] / median["old"]}
out = Path(out)
write_json(out / "controller_ab.json", result, command=command)
plt = pyplot()
fig, ax = plt.subplots(figsize=(6, 3.6))
for i, (arm, r) in enumerate(arms.items()):
    ax.scatter([i] * len(r), r, color="tab:blue", alpha=0.6)
    ax.hlines(median[arm], i - 0.25, i + 0.25, color="black")
ax.axhline(50_000, color="tab:red", ls="--", label="target 50,000")
ax.set_xticks(range(len(arms)), list(arms))
ax.set_ylabel("trajectories / s (each round's median)")
ax.set_title(f"controller alone: {rev} beside this tree")
ax.legend()
save_figure(fig, out / "controller_ab.png")
for arm, r in arms.items():
    print(f"{arm}: {' '.join(map(str, r))} -> median {median[arm]:,.0f}")
print(f"new / old {result['total_ratio']:.2f}x (the fakes {result['fakes_ratio']:.2f}x, "
      f"the rest {result['package_ratio']:.2f}x); wrote {out / 'controller_ab.json'}")
PY
