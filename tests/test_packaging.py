"""The wheel: everything under the areal_aio namespace, no generic top-level `workers` package
that could clash with a user's own (pyproject maps the workers/ folder to areal_aio.workers). Built
offline from a copy of the source (no build isolation)."""

from __future__ import annotations

import os
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
    for name in ("areal_aio", "workers"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    # every module ships, workers/ inside the areal_aio namespace
    expected = {str(p.relative_to(src)) for p in (src / "areal_aio").rglob("*.py")}
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
    # unpacked on the path, the wheel's own files answer (not this checkout's, which the editable
    # install maps): the workers' entry points included
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import importlib.util, areal_aio.workers.models as m; "
            "print(m.__file__); print(importlib.util.find_spec('areal_aio.workers.rollout.__main__').origin)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(site / "areal_aio/workers/models.py"),
                                   str(site / "areal_aio/workers/rollout/__main__.py")], done.stdout
