"""bench/decode_step.py --quick: the decode-step timing bench/gpu.sh runs goes end to end on a CPU
(every engine path it times still exists), so a GPU's few minutes are not spent finding that it
broke."""

from __future__ import annotations

import json

import pytest

from areal_aio.workers.rollout.slots import COLUMN_QUANTUM
from bench import decode_step


@pytest.mark.slow
def test_quick_decode_step_times_each_path_and_writes_its_results(tmp_path, capsys) -> None:
    assert decode_step.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["provenance"]["command"].startswith("python bench/decode_step.py")
    assert (res["rows"], res["steps"], res["device"]) == (8, 3, "cpu")
    for key in ("dynamic_ms", "static_eager_ms", "advance_ms"):
        assert res[key] > 0, key
    assert "static_graph_ms" not in res and "kernels" not in res  # a GPU's alone
    assert res["columns"] >= COLUMN_QUANTUM and res["columns"] & (res["columns"] - 1) == 0  # a power of two
    assert "dynamic_ms" in capsys.readouterr().out
