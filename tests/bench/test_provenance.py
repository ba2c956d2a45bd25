"""bench/common.py's provenance: every results file says where it came from (command, commit,
date, machine, versions), the writer records each field, and every file kept under bench/results
has the block (recovered after the fact for files older than the writer)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path

import pytest

from bench import common
from tests.conftest import ROOT as REPO

RESULTS = REPO / "bench" / "results"
HASH = re.compile(r"[0-9a-f]{40}")
MACHINE_KEYS = {"cpu", "cpu_flags", "cpu_flag_count", "cores", "cores_usable", "ram_gib", "gpu", "gpu_count",
                "gpu_driver"}
REWRITTEN_ELSEWHERE = {"sandbox.json"}
"""Files whose bench is being rewritten to write through the writer; their block comes with their rerun."""


def utc(date: str) -> datetime:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", date), date
    return datetime.strptime(date, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_the_writer_records_every_field(tmp_path, monkeypatch):
    for name in common.RESULT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    command = f"bash bench/x.sh {REPO / 'bench' / 'out' / 'x'} 2"
    common.write_json(tmp_path / "r" / "results.json", {"rate": 1.5, 2: "an int key"}, command=command)

    data = json.loads((tmp_path / "r" / "results.json").read_text())
    assert data["rate"] == 1.5 and data["2"] == "an int key"
    p = data["provenance"]
    assert set(p) == {"command", "commit", "dirty", "date", "machine", "env", "versions"}
    assert p["command"] == "bash bench/x.sh bench/out/x 2"  # inside the repository: relative
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert p["commit"] == head and HASH.fullmatch(p["commit"]) and isinstance(p["dirty"], bool)
    assert abs(utc(p["date"]) - datetime.now(UTC)) < timedelta(minutes=5)
    m = p["machine"]
    assert set(m) == MACHINE_KEYS
    assert m["cores"] == os.cpu_count() and 1 <= m["cores_usable"] <= m["cores"] and m["ram_gib"] > 0
    if sys.platform == "linux":
        assert m["cpu"] and m["cpu_flag_count"] >= len(m["cpu_flags"])
        assert all(common.CPU_FLAGS.fullmatch(f) for f in m["cpu_flags"])
    assert (m["gpu"] is None) == (m["gpu_count"] == 0)
    assert p["env"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert p["versions"] == {"python": platform.python_version(), "torch": metadata.version("torch"),
                             "transformers": metadata.version("transformers")}


def test_the_command_defaults_to_this_process(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(REPO / "bench" / "train_step.py"), "--out", "bench/out/a b"])
    assert common.provenance()["command"] == "python bench/train_step.py --out 'bench/out/a b'"
    assert common.command_line(REPO / "bench" / "lora.py", ["--quick"]) == "python bench/lora.py --quick"


def test_packages_not_installed_are_none(monkeypatch):
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    for name in ("torch", "transformers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(metadata, "version", missing)
    assert common.provenance("x")["versions"] == {"python": platform.python_version(), "torch": None,
                                                  "transformers": None}


def test_provenance_imports_neither_torch_nor_transformers():
    code = ("import sys; from bench.common import provenance; provenance('x'); "
            "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("*.json")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_results_file_says_where_it_came_from(path: Path):
    data = json.loads(path.read_text())
    if path.name in REWRITTEN_ELSEWHERE and "provenance" not in data:
        pytest.skip("rerun through the writer by its bench's rewrite")
    p = data.get("provenance")
    assert isinstance(p, dict), "no provenance block"
    assert "command" in p and (p["command"] is None or isinstance(p["command"], str) and p["command"])
    assert isinstance(p["commit"], str) and HASH.fullmatch(p["commit"])
    utc(p["date"])
    assert isinstance(p["machine"], dict) and p["machine"]
    assert {"dirty", "env", "versions"} <= set(p)
    if p.get("recovered"):  # an older file: what could still be known, null for the rest
        assert p["machine"]["name"] == path.parent.name
        assert HASH.fullmatch(p["last_commit"]) and utc(p["last_date"]) >= utc(p["date"])
    else:
        assert MACHINE_KEYS <= set(p["machine"])
