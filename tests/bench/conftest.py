"""What the bench-report tests share: a time_to_threshold.py run folder written by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_run(out: Path, arm: str, seed: int, curve: list[tuple[int, float, float]], steps: list[dict[str, Any]],
              cell: str = "areal-decoupled_ppo", grid: str | None = None, **summary: Any) -> None:
    """OUT/ARM/sSEED/runs/CELL-sSEED as time_to_threshold.py leaves it (`grid`: the folder under
    OUT/ARM, default sSEED; "" for the older layout OUT/ARM/runs): summary.json (its eval curve of
    (step, wall s, pass rate), idle shares, and `summary`'s keys) and steps.jsonl (`steps`, one row
    each, numbered from 1 every 10 s)."""
    folder = out / arm / (f"s{seed}" if grid is None else grid) / "runs" / f"{cell}-s{seed}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(
        {"seed": seed, "steps": len(steps), "wall_s": curve[-1][1], "trainer_idle_frac": 0.4,
         "rollout_idle_frac": 0.05, "eval_curve": [{"step": s, "wall_s": w, "pass_rate": p} for s, w, p in curve],
         **summary}))
    (folder / "steps.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "wall_s": 10.0 * (i + 1), **row}) + "\n" for i, row in enumerate(steps)))
