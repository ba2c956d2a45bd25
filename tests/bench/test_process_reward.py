"""bench/process_reward.py: its aggregation on hand-made runs, and --quick end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import process_reward
from tests.conftest import ROOT as REPO


def point(step: int, wall: float, tokens: int, passed: float, strict: float = 0.0) -> dict:
    return {"step": step, "version": step, "wall_s": wall, "pass_rate": passed, "strict_rate": strict,
            "gen_tokens": tokens, "continuation_tokens": 0, "tokens": tokens}


def run(arm: str, seed: int, points: list[dict], **summary) -> dict:
    return {"arm": arm, "seed": seed, "cell": f"{arm}-s{seed}", "status": "ran", "points": points,
            "summary": {"error": None, "steps": points[-1]["step"], "wall_s": 100.0, "gen_tokens": 1000,
                        "continuation_tokens": 0, "cost_multiple": 1.0, "continuation_s": 0.0,
                        "process_gated": 0, "samples_generated": 64, **summary}}


def test_eval_points_carry_the_tokens_generated_by_their_version():
    summary = {"eval_curve": [{"step": 2, "version": 2, "wall_s": 20.0, "pass_rate": 0.5, "strict_rate": 0.25},
                              {"step": 0, "version": 0, "wall_s": 0.0, "pass_rate": 0.25, "strict_rate": 0.0}]}
    steps = [{"version": 1, "gen_tokens": 100, "continuation_tokens": 300},
             {"version": 2, "gen_tokens": 210, "continuation_tokens": 590}]
    points = process_reward.eval_points(summary, steps)
    assert [(p["step"], p["tokens"], p["gen_tokens"]) for p in points] == [(0, 0, 0), (2, 800, 210)]
    assert process_reward.rate_at_tokens(points, 799) == 0.25 and process_reward.rate_at_tokens(points, 800) == 0.5
    assert process_reward.eval_points(summary, [])[1]["tokens"] is None  # rows not written: unknown


def test_aggregate_compares_arms_at_the_end_and_at_equal_tokens():
    runs = [run("outcome", 0, [point(0, 0, 0, 0.5), point(10, 90, 1000, 0.75, 0.5)]),
            run("outcome", 1, [point(0, 0, 0, 0.5), point(10, 95, 1200, 0.625, 0.25)]),
            run("process", 0, [point(0, 0, 0, 0.5), point(2, 40, 400, 0.5625), point(4, 85, 900, 0.875, 0.75)],
                cost_multiple=4.0, continuation_tokens=3000, continuation_s=60.0, process_gated=16),
            run("process", 1, [point(0, 0, 0, 0.5), point(4, 80, 950, 0.8125, 0.5)], cost_multiple=3.0)]
    failed = run("mixed", 0, [point(0, 0, 0, 0.5)], error="WorkerFailed: boom")
    agg = process_reward.aggregate([*runs, failed])
    assert agg["token_budget"] == 900 and list(agg["arms"]) == ["outcome", "process"]
    assert agg["failed"] == [{"cell": "mixed-s0", "error": "WorkerFailed: boom"}]
    out, proc = agg["arms"]["outcome"], agg["arms"]["process"]
    assert out["final_pass"] == {"0": 0.75, "1": 0.625} and out["final_pass_mean"] == 0.6875
    assert out["pass_at_tokens"] == {"0": 0.5, "1": 0.5}  # neither had evaluated a version past 900 tokens
    assert proc["pass_at_tokens"] == {"0": 0.875, "1": 0.5} and proc["final_strict_mean"] == 0.625
    assert proc["cost_multiple_mean"] == 3.5 and out["cost_multiple_mean"] == 1.0
    assert proc["continuation_s_frac_mean"] == 0.3 and proc["gated_frac_mean"] == 0.125
    assert proc["best_pass_mean"] == (0.875 + 0.8125) / 2 and proc["steps_mean"] == 4
    assert [c.name for c in process_reward.cells(["outcome", "process"], [0, 1])] == \
        ["outcome-s0", "process-s0", "outcome-s1", "process-s1"]
    json.dumps(agg)


@pytest.mark.slow
def test_process_reward_quick_end_to_end_with_a_model_that_writes_steps(tmp_path, step_model):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "bench/process_reward.py", "--quick", "--model", str(step_model),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert list(res["arms"]) == ["outcome", "process", "mixed"] and res["failed"] == []
    for arm, g in res["arms"].items():
        assert g["steps_mean"] == 2 and g["final_pass_mean"] is not None and g["pass_at_tokens_mean"] is not None
        assert (g["cost_multiple_mean"] == 1.0) if arm == "outcome" else (g["cost_multiple_mean"] > 1.0)
    for r in res["runs"]:
        assert [p["step"] for p in r["points"]] == [0, 1, 2] and r["points"][-1]["tokens"] > 0
        assert (r["continuation_tokens"] > 0) is (r["arm"] != "outcome")
    assert (out / "process_reward.png").stat().st_size > 1000
    assert "cost x" in proc.stdout
