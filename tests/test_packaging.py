"""The wheel: everything under the areal_aio namespace, no generic top-level `workers` package
that could clash with a user's own. Built offline from a copy of the source (no build isolation)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT as ROOT


def test_wheel_ships_workers_inside_the_areal_aio_namespace(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("areal_aio", "workers"):  # areal_aio/workers is a link to ../workers: kept as one
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=skip)
    # every module ships, workers/ inside the areal_aio namespace (the link is not followed here)
    expected = {str(p.relative_to(src)) for p in (src / "areal_aio").rglob("*.py")
                if not p.is_relative_to(src / "areal_aio" / "workers")}
    expected |= {"areal_aio/" + str(p.relative_to(src)) for p in (src / "workers").rglob("*.py")}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("areal_aio-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"areal_aio"}, top
    shipped = {n for n in names if n.endswith(".py")}
    assert expected == shipped, sorted(expected ^ shipped)
    assert {"areal_aio/workers/rollout/__main__.py", "areal_aio/workers/trainer/__main__.py"} <= shipped
