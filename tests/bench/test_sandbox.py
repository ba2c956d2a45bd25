"""bench/sandbox.py runs every arm and writes its results with their provenance."""

from __future__ import annotations

import json

from bench import sandbox as bench


def test_one_repeat_of_one_program_per_arm_writes_its_results(tmp_path):
    assert bench.main(["--programs", "1", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (who, got), = data["users"].items()
    assert got["mode"] == "root" and set(got["arms"]) == {"bare", "bare -I -S", "program", "function", "check"}
    assert all(len(s) == 1 and s[0] > 0 for s in got["seconds"].values())
    assert data["provenance"]["commit"] and data["provenance"]["command"]
