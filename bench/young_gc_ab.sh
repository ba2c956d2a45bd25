#!/usr/bin/env bash
# The controller's rate (bench/controller_overhead.py) with a run's young-generation GC threshold
# (areal_aio/app/runner.py, YOUNG_GC_THRESHOLD) beside CPython's 700, in one sitting: ROUNDS
# rounds, the two arms alternating, each the bench's median of 5 timed runs.
#
#     bash bench/young_gc_ab.sh [ROUNDS] [OUT]   # ROUNDS default 3, OUT bench/out/young-gc-ab
#
# Writes OUT/young_gc_ab.json (each arm's per-round medians, their median, the ratio). Run it alone
# on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="bash bench/young_gc_ab.sh${*:+ ${*@Q}}"
ROUNDS="${1:-3}"
OUT="${2:-bench/out/young-gc-ab}"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got $ROUNDS" >&2; exit 2; }
PY="${PYTHON:-python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for round in $(seq "$ROUNDS"); do
  for arm in 700 default; do
    flag=(); [ "$arm" = default ] || flag=(--young-gc "$arm")
    "$PY" bench/controller_overhead.py --repeats 5 "${flag[@]}" --out "$WORK/$arm-$round" > "$WORK/log" 2>&1 \
      || { echo "arm $arm failed:" >&2; tail -20 "$WORK/log" >&2; exit 1; }
  done
done
"$PY" - "$WORK" "$OUT" "$ROUNDS" "$COMMAND" <<'PY'
import json, statistics, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.common import write_json

work, out, rounds, command = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
arms = {}
for arm in ("700", "default"):
    results = [json.loads((work / f"{arm}-{r}" / "results.json").read_text()) for r in range(1, rounds + 1)]
    arms[arm] = {"young_gc_threshold": results[0]["young_gc_threshold"],
                 "rates": [round(r["trajectories_per_s_median"]) for r in results]}
median = {arm: statistics.median(a["rates"]) for arm, a in arms.items()}
ratios = [d / o for d, o in zip(arms["default"]["rates"], arms["700"]["rates"])]
result = {"command": f"bash bench/young_gc_ab.sh {rounds}", "arms": arms, "median": median,
          "ratio": median["default"] / median["700"], "per_round_ratios": [round(x, 3) for x in ratios]}
write_json(out / "young_gc_ab.json", result, command=command)
for arm, a in arms.items():
    print(f"young gc {a['young_gc_threshold']}: {' '.join(map(str, a['rates']))} -> median {median[arm]:,.0f}")
print(f"default / 700: {result['ratio']:.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}x); "
      f"wrote {out / 'young_gc_ab.json'}")
PY
