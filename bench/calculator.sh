#!/usr/bin/env bash
# The calculator task (multi-turn, a <calc> tool) against the single-turn default, areal mode,
# seed 0, the same wall time each. The two runs go at once, so each sees the same machine
# load: on 2 cores, each run gets about one core (its rollout and trainer share it).
#
#     bash bench/calculator.sh [OUT] [WALL_S]   # default bench/out/calculator, 1800 s (30 min)
#     EXTRA=--quick bash bench/calculator.sh OUT 60   # a smoke run on tiny-random
#
# Last, OUT/calculator.json compares the arms from their samples.jsonl (sampled at T=0.7, the
# calculator's with its tool): pass rate, tool-call rate, replies and tokens per episode over
# the first and the last 5 trained steps, and the same for the first and the last held-out eval
# (greedy; a calculator run's eval runs its episodes, tool turns included); from summary.json
# the steps, the episode failures and the eval curve (docs/episodes.md;
# bench/results/epyc-2core/calculator.json).
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in EXTRA; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/calculator.sh${*:+ ${*@Q}}"
OUT="${1:-bench/out/calculator}"
WALL="${2:-1800}"
EXTRA="${EXTRA:-}"
python bench/time_to_threshold.py --modes areal --seeds 0 --threshold 1.0 --max-wall-s "$WALL" $EXTRA \
    --out "$OUT/single" &
single=$!
python bench/time_to_threshold.py --modes areal --seeds 0 --threshold 1.0 --max-wall-s "$WALL" $EXTRA \
    --set task.name=calculator --out "$OUT/calculator" &
calculator=$!
trap 'kill -TERM $single $calculator 2>/dev/null || true' INT TERM
wait $single
wait $calculator
python - "$OUT" "$WALL" "$COMMAND" <<'PY'
import json, statistics, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.common import write_json

out, wall, command = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
EDGE = 5  # steps at each end of a run


def rate(rows, test):
    return round(sum(map(test, rows)) / len(rows), 4) if rows else None


def window(rows):
    return {"samples": len(rows), "pass_rate": rate(rows, lambda r: bool(r["pass"])),
            "tool_call_rate": rate(rows, lambda r: any(t["role"] == "tool" for t in r.get("turns", []))),
            "replies_per_episode": round(statistics.mean(
                sum(t["role"] == "assistant" for t in r["turns"]) if "turns" in r else 1 for r in rows), 3)
            if rows else None,
            "tokens_per_episode": round(statistics.mean(r["tokens"] for r in rows), 1) if rows else None}


arms = {}
for arm in ("single", "calculator"):
    run = out / arm / "runs" / "areal-decoupled_ppo-s0"
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("kind") == "train" and r.get("dropped") is None and r.get("step")]
    steps = sorted({r["step"] for r in trained})
    curve = sorted(summary["eval_curve"], key=lambda e: e["step"])
    arms[arm] = {"steps": summary["steps"], "wall_s": summary["wall_s"],
                 "episode_failures": summary.get("episode_failures", 0),
                 "trainer_idle_frac": summary["trainer_idle_frac"],
                 "rollout_idle_frac": summary["rollout_idle_frac"],
                 "first_steps": window([r for r in trained if r["step"] in steps[:EDGE]]),
                 "last_steps": window([r for r in trained if r["step"] in steps[-EDGE:]]),
                 "heldout_first": curve[0]["pass_rate"] if curve else None,
                 "heldout_last": curve[-1]["pass_rate"] if curve else None,
                 "heldout_best": max((e["pass_rate"] for e in curve), default=None),
                 "first_eval": window([r for r in rows if r.get("kind") == "eval"
                                                and curve and r["step"] == curve[0]["step"]]),
                 "last_eval": window([r for r in rows if r.get("kind") == "eval"
                                               and curve and r["step"] == curve[-1]["step"]]),
                 "eval_curve": [{"step": e["step"], "pass_rate": e["pass_rate"]} for e in curve]}
write_json(out / "calculator.json",
           {"command": "bash bench/calculator.sh", "mode": "areal", "seed": 0, "wall_s_each": wall,
            "concurrent": True, "edge_steps": EDGE, "arms": arms}, command=command)
print(json.dumps({a: {k: v for k, v in r.items() if k != "eval_curve"} for a, r in arms.items()}, indent=1))
print(f"wrote {out / 'calculator.json'}", file=sys.stderr)
PY
