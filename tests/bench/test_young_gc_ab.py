"""bench/young_gc_ab.sh end to end: both arms measured at the threshold they name, the report written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_aio.app.runner import YOUNG_GC_THRESHOLD
from tests.conftest import ROOT as REPO


@pytest.mark.slow
def test_one_round_measures_both_thresholds(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/young_gc_ab.sh", "1", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "young_gc_ab.json").read_text())
    assert {arm: a["young_gc_threshold"] for arm, a in result["arms"].items()} == \
        {"700": 700, "default": YOUNG_GC_THRESHOLD}
    assert all(len(a["rates"]) == 1 and a["rates"][0] > 0 for a in result["arms"].values())
    assert result["ratio"] == pytest.approx(result["median"]["default"] / result["median"]["700"])
    assert result["provenance"]["command"] == f"bash bench/young_gc_ab.sh '1' '{tmp_path}'"

    bad = subprocess.run(["bash", "bench/young_gc_ab.sh", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "ROUNDS must be a positive integer" in bad.stderr
