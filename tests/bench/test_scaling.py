"""The scale-out benchmark runs end to end in --quick mode: real pools of rollout workers and real
trainer ranks, its table, JSON and plot."""

from __future__ import annotations

import json
import statistics

import pytest

pytestmark = pytest.mark.slow
MAX_NEW = 16
"""--max-new of the quick run (48 by default): the checks relate each configuration's figures to
its own runs and to one worker's, at any reply length; the one-worker passes decode 3x fewer tokens."""


def test_scaling_quick(tmp_path, capsys) -> None:
    from bench import scaling

    assert scaling.main(["--quick", "--rollout", "1,2", "--ranks", "1,2", "--cores", "2",
                         "--max-new", str(MAX_NEW), "--out", str(tmp_path)]) == 0
    assert "speedup" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["role"], r["workers"]): r for r in res["rows"]}
    assert set(rows) == {("rollout", 1), ("rollout", 2), ("trainer", 1), ("trainer", 2)}
    # the cores are shared out: 2 threads for one worker, 1 each for two
    assert [rows["rollout", n]["threads_each"] for n in (1, 2)] == [2, 1]
    for (role, _), r in rows.items():  # each configuration against one worker of its role, medians
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / rows[role, 1]["tokens_per_s"])
        assert r["tokens_per_s"] == pytest.approx(statistics.median(run["tokens_per_s"] for run in r["runs"]))
    for r in res["rows"]:
        run = r["runs"][0]
        assert run["tokens"] > 0 and run["tokens_per_s"] == pytest.approx(run["tokens"] / run["seconds"])
    # every rollout configuration generated the same requests; a trainer step trains the whole batch
    assert rows["trainer", 1]["runs"][0]["tokens"] == rows["trainer", 2]["runs"][0]["tokens"]
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_settings_of_a_configuration() -> None:
    from bench import scaling

    s = scaling.settings_for("embedded:tiny-random", "rollout", 4, 1, "cpu", 16, [])
    assert s.rollout_devices == ["cpu"] * 4 and s.rollout.threads == 1
    s = scaling.settings_for("embedded:tiny-random", "trainer", 2, 1, "cuda", 16, ["trainer.lr=0.001"])
    assert s.trainer_devices == ["cuda:0", "cuda:1"] and s.trainer.lr == 0.001
