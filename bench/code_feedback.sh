#!/usr/bin/env bash
# The code-with-feedback episode against one reply: HumanEval's 164 problems, greedy, the model
# shown why its program failed (the first failing test's reason, never the expected values) and
# asked again, up to TURNS replies. The episode's first reply is the one-reply eval's reply (same
# prompt, greedy), so one run gives both: pass after reply 1, after reply 2, ... (docs/episodes.md;
# bench/results/epyc-2core/code_feedback.json).
#
#     bash bench/code_feedback.sh [OUT] [TURNS]   # default bench/out/code-feedback, 3
#     MODEL=embedded:tiny-random MAX_NEW=16 bash bench/code_feedback.sh OUT 2   # a smoke run (~20 s)
#
# HumanEval's pass@1 is over all 164 problems whatever task.eval_size says, so a smoke run is short
# through its model and MAX_NEW, not through fewer problems.
set -euo pipefail
cd "$(dirname "$0")/.."
# the command line as given (and the knobs below as the environment set them), for the results file
COMMAND="$(for v in MODEL MAX_NEW EXTRA; do [ -z "${!v+set}" ] || printf '%s=%s ' "$v" "${!v@Q}"; done)bash bench/code_feedback.sh${*:+ ${*@Q}}"
OUT="${1:-bench/out/code-feedback}"
TURNS="${2:-3}"
MODEL="${MODEL:-embedded:smollm2-135m-instruct}"
EXTRA="${EXTRA:-}"
MAX_NEW="${MAX_NEW:-384}"
# shellcheck disable=SC2086
python -m areal_aio eval "$MODEL" --set task.name=humaneval --set rollout.max_new_tokens="$MAX_NEW" \
    --set controller.reward_timeout_s=15 --set rollout.threads=2 \
    --set task.episode=areal_aio.agents.code_feedback:episode --set task.episode_turns="$TURNS" \
    --set task.episode_tokens=$((TURNS * (MAX_NEW + 128))) --set task.episode_timeout_s=7200 \
    $EXTRA --out "$OUT/eval.json"
python - "$OUT" "$TURNS" "$MODEL" "$MAX_NEW" "$COMMAND" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, ".")
from bench.common import write_json

out, turns, model, max_new, command = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
ev = json.loads((out / "eval.json").read_text())
rows = ev["samples"]
replies = [sum(t["role"] == "assistant" for t in r.get("turns", [])) or 1 for r in rows]
passed = [bool(r["pass"]) for r in rows]
n = len(rows)
by_reply = {k: sum(p and m <= k for p, m in zip(passed, replies)) for k in range(1, turns + 1)}
summary = {
    "command": f"bash bench/code_feedback.sh OUT {turns}", "model": model, "problems": n,
    "max_new_tokens": int(max_new), "turns": turns, "seconds": ev["seconds"],
    "episode_failures": ev.get("episode_failures"),
    "passed_by_reply": by_reply, "pass_rate_by_reply": {k: round(v / n, 4) for k, v in by_reply.items()},
    "replies_mean": round(sum(replies) / n, 3),
    "tokens_per_episode_mean": round(sum(r["tokens"] for r in rows) / n, 1),
    "passed_ids": [r["task_id"] for r, p in zip(rows, passed) if p],
}
write_json(out / "code_feedback.json", summary, command=command)
print(json.dumps(summary, indent=1))
PY
