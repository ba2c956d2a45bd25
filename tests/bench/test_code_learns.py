"""bench/code_learns.py: the paired HumanEval comparison, the reward spread per group, and the
report of a finished bench folder written by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench import code_learns


def eval_file(path: Path, passed: list[int], n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = [{"task_id": f"HumanEval/{i}", "pass": i in passed, "reply": "```python\ndef f(x):\n    return x\n```"}
               for i in range(n)]
    path.write_text(json.dumps({"pass_rate": len(passed) / n, "n": n, "seconds": 1.0, "samples": samples}))


def test_the_paired_difference_counts_the_problems_only_one_model_passes(tmp_path):
    eval_file(tmp_path / "a.json", [0, 1, 2, 3], 10)
    eval_file(tmp_path / "b.json", [2, 3, 4, 5, 6], 10)
    a, b = code_learns.read_eval(tmp_path / "a.json"), code_learns.read_eval(tmp_path / "b.json")
    assert a["passed"] == ["HumanEval/0", "HumanEval/1", "HumanEval/2", "HumanEval/3"]
    assert a["se"] == round(math.sqrt(0.4 * 0.6 / 10), 4)
    got = code_learns.paired(a, b)
    assert got == {"gained": 3, "lost": 2, "diff": 0.1, "se": round(math.sqrt(5) / 10, 4)}
    assert code_learns.paired(a, None) is None and code_learns.read_eval(tmp_path / "missing.json") is None


def test_spread_is_the_share_of_groups_whose_rewards_differ():
    rows = [{"group": "g1", "reward": 1.0, "pass": True}, {"group": "g1", "reward": 0.0, "pass": False},
            {"group": "g2", "reward": 0.0, "pass": False}, {"group": "g2", "reward": 0.0, "pass": False},
            {"group": "g3", "reward": 1.0, "pass": True}, {"group": "g3", "reward": 1.0, "pass": True}]
    got = code_learns.spread(rows)
    assert got["groups"] == 3 and got["spread_share"] == round(1 / 3, 4) and got["pass_rate"] == 0.5
    assert got["all_pass_share"] == round(1 / 3, 4) and got["none_pass_share"] == round(1 / 3, 4)
    assert code_learns.spread([]) == {"groups": 0}


def test_report_only_reads_the_finished_files_and_runs_nothing(tmp_path, capsys, monkeypatch):
    reference = [{"task_id": f"HumanEval/{i}", "canonical_solution": "    # one\n    return 1\n" if i < 30 else
                  "    a = 1\n\n    return a\n"} for i in range(164)]
    monkeypatch.setattr("areal_aio.tasks.code_tasks.humaneval_rows", lambda: reference)
    eval_file(tmp_path / "base" / "humaneval.json", [22, 23], 164)
    eval_file(tmp_path / "run" / "humaneval-warm.json", [22, 23, 40], 164)
    eval_file(tmp_path / "run" / "humaneval-rl.json", [22, 23, 40], 164)
    run = tmp_path / "run"
    train = [{"kind": "train", "step": s, "group": f"{s}-{g}", "reward": float(k == 0 and g == 0), "pass": k == 0 and g == 0}
             for s in (1, 2) for g in range(2) for k in range(2)]
    evals = [{"kind": "eval", "step": s, "task_id": f"f{i}", "pass": i < (2 if s == 0 else 3)} for s in (0, 2) for i in range(4)]
    (run / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in train + evals))
    (run / "summary.json").write_text(json.dumps({"steps": 2, "wall_s": 60.0, "ended": "max_wall",
        "eval_curve": [{"step": 2, "wall_s": 50.0, "pass_rate": 0.7}, {"step": 0, "wall_s": 0.0, "pass_rate": 0.6}]}))
    assert code_learns.main(["--out", str(tmp_path), "--report-only"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["humaneval"]["rl"]["passed"] == data["humaneval"]["warm"]["passed"]
    assert data["humaneval_paired"]["warm_vs_base"]["gained"] == 1 and data["humaneval_paired"]["rl_vs_warm"]["se"] == 0
    assert [e["step"] for e in data["run"]["eval_curve"]] == [0, 2]
    assert data["run"]["first_steps"]["spread_share"] == 0.5 and "provenance" in data
    assert data["run"]["held_out_last_vs_first"] == {"gained": 1, "lost": 0, "diff": 0.25, "se": 0.25}
    assert data["commands"]["run"].startswith("python -m areal_aio run ") and "task.name=functions" in data["commands"]["run"]
    assert data["humaneval_shape"] == {"reference_lines_median": 2.0, "one_line_problems": 30,
                                       "base": {"reply_lines_mean": 2, "passed_one_line": 2},
                                       "warm": {"reply_lines_mean": 2, "passed_one_line": 2},
                                       "rl": {"reply_lines_mean": 2, "passed_one_line": 2},
                                       "replies_changed_by_rl": 0}
    out = capsys.readouterr().out
    assert "+0.006 +- 0.006 (+1 -0)" in out and "0: 0.600, 2: 0.700" in out
