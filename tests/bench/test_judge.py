"""bench/judge.py runs end to end in --quick mode (a tiny-random judge in a real worker)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_judge_quick(tmp_path, capsys) -> None:
    from bench import judge

    assert judge.main(["--quick", "--concurrent", "1,4", "--out", str(tmp_path)]) == 0
    assert "verdicts/s" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    assert [v["concurrent"] for v in res["verdicts"]] == [1, 4]
    assert all(v["calls"] == 8 and v["verdicts_per_s"] > 0 for v in res["verdicts"])
    loops = {r["reward"]: r for r in res["loop"]}
    assert loops["answer"]["steps"] == loops["judge"]["steps"] == 3
    assert loops["answer"]["reward_failures"] == 0 and loops["judge"]["trajectories_per_s"] > 0
    # tiny-random's verdicts do not parse: every judged reply is a counted failure
    assert loops["judge"]["reward_failures"] > 0
