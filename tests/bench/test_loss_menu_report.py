"""bench/loss_menu_report.py: the loss-menu grid's runs gathered into medians, curves and a figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import loss_menu_report
from tests.bench.conftest import write_run


def write_menu_run(out: Path, arm: str, seed: int, curve: list[tuple[int, float, float]],
                   entropy: list[float], skipped: int = 0) -> None:
    write_run(out, arm, seed, curve, [{"reward_mean": 0.1 * i, "entropy": e, "tokens": 40, "seqs": 4,
                                       "grad_norm": 2.0, "mismatch_kl": 0.002 * (i % 2) if i else None,
                                       "capped_frac": 0.01} for i, e in enumerate(entropy)],
              samples_skipped_uniform=skipped)


def test_the_report_gives_each_arm_its_medians_against_the_default_and_draws_them(tmp_path, monkeypatch):
    entropy = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    write_menu_run(tmp_path, "default", 0, [(0, 0.0, 0.5), (5, 100.0, 0.72), (10, 200.0, 0.81)], entropy)
    write_menu_run(tmp_path, "default", 1, [(0, 0.0, 0.5), (5, 120.0, 0.6), (10, 300.0, 0.7)], entropy)
    write_menu_run(tmp_path, "dynamic", 0, [(0, 0.0, 0.5), (5, 50.0, 0.85)], entropy[:5], skipped=40)
    write_menu_run(tmp_path, "dynamic", 1, [(0, 0.0, 0.5), (5, 70.0, 0.71)], entropy[:5], skipped=24)
    monkeypatch.setattr(sys, "argv", ["loss_menu_report.py", str(tmp_path), "--threshold", "0.8", "--seeds", "0 1",
                                      "--arms", "default dynamic", "--max-wall-s", "300"])
    loss_menu_report.main()

    data = json.loads((tmp_path / "loss_menu.json").read_text())
    default, dynamic = data["summary"]["default"], data["summary"]["dynamic"]
    assert default["reached_0.70"] == 2 and default["median_s_0.70"] == pytest.approx(200.0)  # 100 and 300
    assert default["reached_0.80"] == 1 and default["median_s_0.80"] == pytest.approx(200.0)
    assert dynamic["median_s_0.70"] == pytest.approx(60.0)
    assert dynamic["vs_default_0.70"] == pytest.approx(0.3)
    assert dynamic["vs_default_0.80"] == pytest.approx(50.0 / 200.0)  # only seed 0 reached 0.80
    runs = {(r["arm"], r["seed"]): r for r in data["runs"]}
    assert runs["default", 1]["time_to_0.80_s"] is None and runs["default", 1]["step_to_0.70"] == 10
    assert runs["default", 0]["last_entropy"] == pytest.approx(sum(entropy[-5:]) / 5)
    assert runs["dynamic", 1]["skipped_uniform"] == 24
    assert runs["dynamic", 0]["mean_mismatch_kl"] == pytest.approx(0.001)  # steps 1-4: 0.002, 0, 0.002, 0
    assert runs["dynamic", 0]["mean_capped_frac"] == pytest.approx(0.01) and runs["dynamic", 0]["mean_mismatch_k1"] is None
    assert [p["entropy"] for p in runs["dynamic", 0]["step_curve"]] == entropy[:5]
    assert all(p["reply_tokens"] == 10.0 and p["grad_norm"] == 2.0 and p["overlong"] is None
               for p in runs["dynamic", 0]["step_curve"])
    assert data["command"] == 'MAX_WALL_S=300 THRESHOLD=0.8 bash bench/loss_menu.sh OUT "0 1" "default dynamic"'
    assert data["provenance"]["command"].startswith("python loss_menu_report.py ")
    assert (tmp_path / "loss_menu.png").stat().st_size > 10_000


def test_per_step_means_cover_only_the_steps_every_seed_made():
    runs = [{"step_curve": [{"step": 1, "entropy": 1.0}, {"step": 2, "entropy": 0.5}]},
            {"step_curve": [{"step": 1, "entropy": 0.0}]}]
    assert loss_menu_report.per_step_mean(runs, "entropy") == ([1], [0.5])
    assert loss_menu_report.running_mean([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
