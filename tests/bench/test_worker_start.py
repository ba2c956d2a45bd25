"""bench/worker_start.py: both modes measured side by side, each worker's start and each run's
first step timed, the forked workers started from the zygote and the fresh ones without it."""

from __future__ import annotations

import json

import pytest

from bench import worker_start


@pytest.mark.slow
def test_worker_start_bench_quick(tmp_path, capsys) -> None:
    assert worker_start.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "run to first step s" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    rows = res["spawn"]["rows"]
    assert {(r["mode"], r["role"]) for r in rows} == {(m, r) for m in worker_start.MODES for r in ("rollout", "trainer")}
    assert all(r["ready_s"] >= r["load_s"] > 0 and r["started"] == r["mode"] for r in rows)
    assert res["spawn"]["zygote_import_s"] > 0
    assert {r["mode"] for r in res["runs"]} == set(worker_start.MODES)
    assert all(r["first_step_s"] and r["first_step_s"] > 0 for r in res["runs"])
    for mode in worker_start.MODES:
        assert res["medians"][mode]["run_first_step_s"] is not None
    assert res["provenance"]["command"].startswith("python bench/worker_start.py")
