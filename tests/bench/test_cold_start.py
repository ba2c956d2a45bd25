"""bench/cold_start.py: each cell's figures read off a run folder written by hand, and the report
of finished cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import cold_start


def write_cell(out: Path, name: str, curve: list[tuple[int, float, float, float]], sft_s: float | None) -> None:
    folder = out / "runs" / name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"steps": curve[-1][0], "wall_s": curve[-1][1], "error": None,
        "eval_curve": [{"step": s, "wall_s": w, "pass_rate": p, "strict_rate": t} for s, w, p, t in curve]}))
    if sft_s is not None:
        (folder / "sft").mkdir()
        (folder / "sft" / "sft.json").write_text(json.dumps({"wall_s": sft_s, "train_s": sft_s - 30.0,
                                                             "loss_first": 1.1, "loss_last": 0.05}))


def test_a_cells_times_count_the_cold_start_and_its_rates_are_read_off_the_curve(tmp_path):
    write_cell(tmp_path, "cold-s0", [(10, 200.0, 0.81, 0.81), (0, 0.0, 0.56, 0.56), (20, 400.0, 0.91, 0.9)], 150.0)
    rec = cold_start.cell_record(tmp_path / "runs" / "cold-s0", [0.8, 0.9, 0.95])
    assert rec["sft_s"] == 150.0 and rec["sft_train_s"] == 120.0 and rec["sft_loss"] == [1.1, 0.05]
    assert rec["reached"]["0.8"] == {"wall_s": 200.0, "step": 10, "recipe_s": 350.0}
    assert rec["reached"]["0.9"]["recipe_s"] == 550.0 and rec["reached"]["0.95"] is None
    assert rec["first_eval"] == {"pass_rate": 0.56, "strict_rate": 0.56}
    assert rec["last_eval"]["step"] == 20 and rec["best_pass"] == 0.91
    write_cell(tmp_path, "plain-s0", [(0, 0.0, 0.55, 0.0), (10, 300.0, 0.8, 0.0)], None)
    plain = cold_start.cell_record(tmp_path / "runs" / "plain-s0", [0.8])
    assert plain["sft_s"] == 0.0 and plain["sft_loss"] is None and plain["reached"]["0.8"]["recipe_s"] == 300.0


def test_report_only_gathers_the_finished_cells_and_runs_nothing(tmp_path, capsys):
    write_cell(tmp_path, "cold-s0", [(0, 0.0, 0.56, 0.56), (20, 400.0, 0.91, 0.9)], 150.0)
    assert cold_start.main(["--out", str(tmp_path), "--seeds", "0,1", "--report-only", "--report-at", "0.85"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [c["cell"] for c in data["cells"]] == ["cold-s0"] and data["thresholds"] == [0.85, 0.9]
    assert data["cells"][0]["command"].startswith("python -m areal_aio run ")
    assert "sft.before_run=on" in data["cells"][0]["command"] and "provenance" in data
    assert "550 (20)" in capsys.readouterr().out


def test_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        cold_start.main(["--arms", "cold,warm", "--report-only"])
    assert "unknown ['warm']" in capsys.readouterr().err


def test_tool_use_counts_calls_valid_calls_and_replies():
    from bench.tool_use import window

    call = [{"role": "assistant", "text": "<calc>41 * 265</calc>"}, {"role": "tool", "text": "10865"},
            {"role": "assistant", "text": "<answer>10865</answer>"}]
    bad = [{"role": "assistant", "text": "<calc>x</calc>"}, {"role": "tool", "text": "error: not arithmetic"},
           {"role": "assistant", "text": "<calc>2*3</calc>"}, {"role": "tool", "text": "6"},
           {"role": "assistant", "text": "6"}]
    rows = [{"pass": True, "tokens": 30, "turns": call}, {"pass": False, "tokens": 50, "turns": bad},
            {"pass": False, "tokens": 10}, {"pass": True, "tokens": 10, "turns": []}]
    got = window(rows)
    assert got["episodes"] == 4 and got["pass_rate"] == 0.5 and got["tool_call_rate"] == 0.5
    assert got["calls"] == 3 and got["valid_call_share"] == round(2 / 3, 4)
    assert got["replies_per_episode"] == 1.75 and got["tokens_per_episode"] == 25.0
    assert window([]) == {"episodes": 0} and window(rows[2:])["valid_call_share"] is None
