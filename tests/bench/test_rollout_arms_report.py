"""bench/rollout_arms_report.py: the rollout-arms grid's runs gathered into medians, speedups and a figure."""

from __future__ import annotations

import json
import sys

import pytest

from bench import rollout_arms_report
from tests.bench.conftest import write_run


def steps(kl: float | None, stale: float, n: int = 4) -> list[dict]:
    return [{"mismatch_kl": kl, "staleness_mean": stale + i} for i in range(n)]


def test_the_report_gives_each_arm_its_medians_and_speedups_and_draws_them(tmp_path, monkeypatch):
    write_run(tmp_path, "sync", 0, [(0, 0.0, 0.5), (5, 100.0, 0.72), (10, 200.0, 0.76)], steps(0.002, 0.0),
              cell="sync-ppo", gen_tokens_per_s=70.0)
    write_run(tmp_path, "sync", 1, [(0, 0.0, 0.5), (5, 140.0, 0.7), (10, 300.0, 0.6)], steps(0.004, 0.0),
              cell="sync-ppo", gen_tokens_per_s=90.0)
    write_run(tmp_path, "int8-keep-eta1", 0, [(0, 0.0, 0.5), (5, 60.0, 0.8)], steps(None, 1.0),
              gen_tokens_per_s=150.0)
    write_run(tmp_path, "int8-keep-eta1", 1, [(0, 0.0, 0.5), (5, 40.0, 0.71), (10, 90.0, 0.75)],
              steps(0.006, 0.5), gen_tokens_per_s=160.0)
    monkeypatch.setattr(sys, "argv", ["rollout_arms_report.py", str(tmp_path), "--threshold", "0.75", "--seeds", "0 1",
                                      "--arms", "sync int8-keep-eta1", "--max-wall-s", "300",
                                      "--command", "bash bench/rollout_arms.sh OUT"])
    rollout_arms_report.main()

    data = json.loads((tmp_path / "rollout_arms.json").read_text())
    assert data["provenance"]["command"] == "bash bench/rollout_arms.sh OUT"
    sync, fast = data["summary"]["sync"], data["summary"]["int8-keep-eta1"]
    assert sync["reached_0.70"] == 2 and sync["median_s_0.70"] == pytest.approx(120.0)  # 100 and 140
    assert sync["reached_0.75"] == 1 and sync["median_s_0.75"] == pytest.approx(200.0)
    assert fast["median_s_0.70"] == pytest.approx(50.0) and fast["median_s_0.75"] == pytest.approx(75.0)
    assert fast["speedup_vs_sync_0.70"] == pytest.approx(120.0 / 50.0)
    assert fast["speedup_vs_sync_0.75"] == pytest.approx(200.0 / 75.0)
    assert "speedup_vs_sync_0.70" not in sync and not any(k.startswith("speedup_vs_areal") for k in fast)
    assert sync["median_mismatch_kl_mean"] == pytest.approx(0.003)
    assert fast["median_mismatch_kl_mean"] == pytest.approx(0.006)  # a run with no kl rows counts as none
    assert fast["median_staleness_mean"] == pytest.approx((2.5 + 2.0) / 2)  # 1, 2, 3, 4 and 0.5 ... 3.5
    assert fast["median_gen_tokens_per_s"] == pytest.approx(155.0)
    runs = {(r["arm"], r["seed"]): r for r in data["runs"]}
    assert runs["sync", 1]["time_to_0.75_s"] is None and runs["sync", 1]["final_pass"] == 0.6
    assert runs["int8-keep-eta1", 0]["step_to_0.70"] == 5 and runs["int8-keep-eta1", 0]["mismatch_kl_mean"] is None
    assert data["command"] == 'MAX_WALL_S=300 THRESHOLD=0.75 bash bench/rollout_arms.sh OUT "0 1" "sync int8-keep-eta1"'
    assert (tmp_path / "rollout_arms.png").stat().st_size > 10_000
