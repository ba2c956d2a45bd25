"""The suite's own limits (pyproject's [tool.pytest.ini_options]): a hung test fails by name
instead of stalling CI, and every run lists its slowest tests."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import ROOT as ROOT

OPTIONS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def test_the_per_test_limit_is_set_far_above_a_slow_test():
    assert OPTIONS["timeout"] >= 600  # the slowest test passes in a few minutes on 2 cores
    assert "--durations=15" in OPTIONS["addopts"].split()


def test_a_hung_test_fails_by_name_with_the_projects_options(tmp_path):
    (tmp_path / "test_hang.py").write_text("import time\n\n\ndef test_hangs():\n    time.sleep(120)\n\n\n"
                                           "def test_passes():\n    assert True\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "-o", "timeout=2",
                           str(tmp_path / "test_hang.py")], capture_output=True, text=True, timeout=90)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-2000:]
    assert "Timeout" in out and "FAILED" in out and "test_hangs" in out
    assert "1 failed, 1 passed" in out  # the run went on past the hung test
    assert "slowest 15 durations" in out
