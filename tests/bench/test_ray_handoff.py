"""bench/ray_handoff.py runs end to end in --quick mode on a private local Ray cluster: three
rollout workers (local, a Ray actor, a Ray actor whose weights are shipped), each loading every
version the trainer's actor publishes; it leaves no Ray connection and none of its /dev/shm folders
(its store's and the shipped actor's beside it; other runs on the machine may have theirs)."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.conftest import need

pytestmark = pytest.mark.slow
ray = need("ray")


def test_ray_handoff_quick(tmp_path, capsys, monkeypatch) -> None:
    from areal_aio.store.weights import SHM_BASE, WeightStore
    from bench import ray_handoff

    made = []

    class Recorded(WeightStore):
        @classmethod
        def create(cls, run_name: str, base=SHM_BASE) -> WeightStore:
            made.append(run_name)
            return super().create(run_name, base)

    monkeypatch.setattr(ray_handoff, "WeightStore", Recorded)
    assert ray_handoff.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "shipped" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["worker"]: r for r in res["rows"]}
    assert set(rows) == set(ray_handoff.WORKERS)
    for r in rows.values():
        assert len(r["handoff_all"]) == res["versions"] == 2 and min(r["handoff_all"]) > 0
        assert r["tokens_per_s"] > 0
    assert res["file_bytes"] > 0
    for r in rows.values():  # medians of each worker's own passes, against the local worker's
        assert r["handoff_s"] == statistics.median(r["handoff_all"])
        assert r["handoff_vs_local"] == pytest.approx(r["handoff_s"] / statistics.median(rows["local"]["handoff_all"]))
    assert (tmp_path / "ray_handoff.png").stat().st_size > 1000
    assert not ray.is_initialized()
    (name,) = made  # the run's store; a shipped actor's folder is named after it: <name>-rollout<i>
    left = [p.name for p in SHM_BASE.glob(f"{name}*") if p.name == name or p.name.startswith(name + "-")]
    assert not left, left
