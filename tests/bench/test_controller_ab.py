"""bench/controller_ab.sh end to end, in a clone of the repository (it adds and removes git
worktrees): every arm measured, the report written, no worktree left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from areal_aio.app.runner import YOUNG_GC_THRESHOLD
from tests.conftest import ROOT as REPO

OLD = "fa782e377c99508e7f8e70398cb77d71a115ac7c"
"""A commit from before the bench recorded its GC threshold and the package raised it."""


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_smoke_run_measures_every_arm_and_leaves_no_worktree(tmp_path):
    clone = tmp_path / "clone"
    git("clone", "-q", str(REPO), str(clone), cwd=tmp_path)
    shutil.copy(REPO / "bench" / "controller_ab.sh", clone / "bench" / "controller_ab.sh")  # the script as it is here
    before = git("worktree", "list", cwd=clone)
    env = dict(os.environ, EXTRA="--quick", PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/controller_ab.sh", OLD, "1", str(tmp_path / "out")], cwd=clone,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "controller_ab.json").read_text())
    assert set(result["rates"]) == {"old", "old-fakes", "new"}
    assert all(len(r) == 1 and r[0] > 0 for r in result["rates"].values())
    assert result["rev"] == git("rev-parse", OLD, cwd=clone).strip()
    # each arm ran the tree it names: OLD's bench records no threshold, today's does, and only
    # today's package raises it (so old-fakes ran today's bench on OLD's package)
    assert result["young_gc_threshold"] == {"old": None, "old-fakes": 700, "new": YOUNG_GC_THRESHOLD}
    assert result["total_ratio"] == pytest.approx(result["median"]["new"] / result["median"]["old"])
    assert (tmp_path / "out" / "controller_ab.png").stat().st_size > 1000
    assert git("worktree", "list", cwd=clone) == before

    bad = subprocess.run(["bash", "bench/controller_ab.sh", "HEAD", "0"], cwd=clone, capture_output=True,
                         text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "ROUNDS must be a positive integer" in bad.stderr
