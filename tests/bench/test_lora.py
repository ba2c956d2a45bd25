"""bench/lora.py runs end to end in --quick mode: a trainer process per variant, the hand-off both
ways, decode, the checkpoint; its table, JSON and plot, each ratio against the times it came from."""

from __future__ import annotations

import json
import statistics

import pytest

pytestmark = pytest.mark.slow


def test_lora_bench_quick(tmp_path, capsys) -> None:
    from bench import lora

    assert lora.main(["--quick", "--ranks", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "merge s (a)" in out and "unmerged / merged" in out and "targets lora-4" in out
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"full", "lora-4"} and rows["full"]["rank"] == 0 and rows["lora-4"]["rank"] == 4
    full, low = rows["full"], rows["lora-4"]
    assert low["trainable"] < full["trainable"] / 50
    for r in rows.values():
        assert r["step_s"] == pytest.approx(statistics.median(r["step_runs"]))
        assert r["speedup"] == pytest.approx(full["step_s"] / r["step_s"])
        assert r["handoff_frac"] == pytest.approx(r["handoff_bytes"] / full["handoff_bytes"])
        assert r["checkpoint_frac"] == pytest.approx(r["checkpoint_bytes"] / full["checkpoint_bytes"])
        assert r["peak_rss"] >= r["rss_loaded"] > 0  # each trainer's own process
    assert low["handoff_bytes"] < full["handoff_bytes"] / 20 and low["checkpoint_bytes"] < full["checkpoint_bytes"] / 10
    assert full["handoff_s"] == pytest.approx(full["publish_s"] + full["load_s"])
    assert low["handoff_merged_s"] == pytest.approx(low["publish_s"] + low["merged_s"])
    assert low["handoff_unmerged_s"] == pytest.approx(low["publish_s"] + low["unmerged_s"])
    (d,) = res["decode"]
    assert d["unmerged_vs_merged"] == pytest.approx(d["unmerged_tok_s"] / d["merged_tok_s"])
    assert d["merged_tok_s"] == pytest.approx(statistics.median(d["runs"]["merged"]))
    assert res["met"]["lora-4"]["handoff"] == (low["handoff_frac"] <= res["targets"]["handoff_frac"])
    assert (tmp_path / "lora.png").stat().st_size > 1000
    assert not list(tmp_path.glob("bench-lora-*"))  # the checkpoints' scratch folder is gone
