"""bench/loss_menu.sh refuses, before any run, what it cannot do: an unknown arm, and more
(seed, arm) cells x CORES_PER_CELL than the CPUs this process may use."""

import os
import subprocess
from pathlib import Path

from tests.conftest import ROOT


def menu(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "bench" / "loss_menu.sh"), str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=60)


def test_more_cells_than_cpus_is_refused_before_any_run(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    done = menu(tmp_path, "0 1", "default clamp", CORES_PER_CELL=str(cpus))
    assert done.returncode == 2
    assert f"2 seeds x 2 arms x {cpus} CPUs need {4 * cpus} CPUs, this process may use {cpus}" in done.stderr
    assert not (tmp_path / "out").exists()


def test_an_unknown_arm_is_refused_before_any_run(tmp_path):
    done = menu(tmp_path, "0", "default nonsense", CORES_PER_CELL="1")
    assert done.returncode == 2 and "unknown arm nonsense" in done.stderr
    assert not (tmp_path / "out").exists()
