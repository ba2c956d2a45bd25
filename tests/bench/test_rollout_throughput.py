"""bench/rollout_throughput.py --quick runs end to end and writes its results and plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT as REPO


@pytest.mark.slow
def test_quick_bench_writes_results_and_plot(tmp_path):
    proc = subprocess.run([sys.executable, "bench/rollout_throughput.py", "--quick", "--no-hf-cb",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "rollout_throughput.png").stat().st_size > 0
    rows = {r["method"]: r for r in results["rows"]}
    assert set(rows) == {"engine", "engine+updates", "engine+updates/keep", "engine/int8", "engine/int8+updates",
                         "engine/int8+updates/keep", "engine/static", "engine/static+updates",
                         "engine/static/wait4", "generate/b8", "generate/b32"}
    # the static path on a CPU: eager steps, no graph captured, the same float32 drift as the engine's
    assert rows["engine/static"]["graphs"] == 0 and rows["engine/static"]["graph_error"] is None
    assert rows["engine/static"]["mismatch_kl"] < rows["engine/int8"]["mismatch_kl"]
    assert rows["engine/static+updates"]["updates"] == rows["engine+updates"]["updates"]
    assert 0 <= 10 * rows["engine"]["mismatch_kl"] < rows["engine/int8"]["mismatch_kl"] < 0.1
    assert rows["engine/int8+updates"]["updates"] > 0
    for row in rows.values():
        assert row["sequences"] == results["sequences"] and row["tok_s"] > 0
        # tiny-random practically never samples EOS: every sequence runs to max_new_tokens
        assert row["tokens"] == results["sequences"] * results["max_new_tokens"]
    assert rows["engine+updates"]["updates"] > 0 and rows["engine+updates"]["rebuilt_rows"] > 0
    assert rows["engine+updates/keep"]["updates"] == rows["engine+updates"]["updates"]
    assert rows["engine+updates/keep"]["rebuilt_rows"] == 0 == rows["engine/int8+updates/keep"]["rebuilt_rows"]
    assert results["weight_load_median_s"] > 0
    assert "engine" in results["speedup_vs_generate_group"]["1"]
    assert "rollout throughput" in proc.stdout


@pytest.mark.slow
def test_a_model_folder_with_random_weights_and_a_chosen_method(tmp_path):
    """--random-weights: a folder's config and tokenizer, weights drawn (what travels to a GPU
    machine the model cannot reach); --only runs the methods named, in the bench's order, and
    refuses a name it does not know; --ops profiles the engine."""
    from areal_aio.workers.models import TINY, load_model

    model, tok = load_model(TINY)
    folder = tmp_path / "config-only"
    model.config.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert not list(folder.glob("*.safetensors"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "bench/rollout_throughput.py", "--model", str(folder), "--random-weights",
                           "--sequences", "8", "--max-new-tokens", "4", "--threads", "1", "--no-hf-cb",
                           "--only", "engine,generate/b8", "--ops", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["random_weights"] and [r["method"] for r in results["rows"]] == ["engine", "generate/b8"]
    for ops in results["ops"].values():  # --ops: the float32 engine and the int8 one, profiled
        assert set(ops["op_share"]) >= {"matmul", "attention"} and sum(ops["op_share"].values()) == pytest.approx(1)
        assert 0 <= ops["padding_free_bound"] <= ops["op_share"]["attention"] and 0 <= ops["padded_kv_columns"] < 1
        # what the sums above cannot show: the profile found both classes of operator
        assert ops["op_share"]["matmul"] > 0 and ops["op_share"]["attention"] > 0
        assert ops["stop_check_us"] > 0 and 0 < ops["stop_check_share"] < 1
    assert set(results["ops"]) == {"engine", "engine/int8"} and "padding-free attention saves at most" in proc.stdout
    bad = subprocess.run([sys.executable, "bench/rollout_throughput.py", "--quick", "--only", "engine,nope",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--only: no method nope" in bad.stderr
