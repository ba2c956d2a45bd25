"""bench/arms.py: the runs of an arm read from its cells' grid folders, old layout and new."""

from __future__ import annotations

from bench.arms import runs
from tests.bench.conftest import write_run


def test_an_arm_s_runs_come_from_every_seed_s_grid_folder_and_the_older_shared_one(tmp_path):
    write_run(tmp_path, "clamp", 1, [(0, 0.0, 0.5), (5, 90.0, 0.75)], [{"entropy": 0.5}])
    write_run(tmp_path, "clamp", 0, [(0, 0.0, 0.5), (5, 60.0, 0.71)], [{"entropy": 0.5}], grid="")  # OUT/ARM/runs
    write_run(tmp_path, "clamp", 2, [(0, 0.0, 0.5)], [])
    (tmp_path / "clamp" / "s2" / "runs" / "areal-decoupled_ppo-s2" / "summary.json").unlink()  # still running
    write_run(tmp_path, "mask2", 0, [(0, 0.0, 0.5)], [])
    write_run(tmp_path, "clamp", 1, [(0, 0.0, 0.5)], [], grid="")  # seed 1 in the older layout too
    rows = [row for _, _, row in runs(tmp_path, "clamp", [0.7, 0.75])]
    assert [r["seed"] for r in rows] == [0, 1]  # once each, seed 1 from its own grid folder
    assert (rows[0]["time_to_0.70_s"], rows[0]["step_to_0.75"]) == (60.0, None)
    assert (rows[1]["time_to_0.75_s"], rows[1]["step_to_0.75"]) == (90.0, 5)
