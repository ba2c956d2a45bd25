"""The trainer benchmarks run end to end in --quick mode and write their table, JSON and plot."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

pytestmark = pytest.mark.slow


TRAIN_REPLY_TOKENS = 16
"""--completion-tokens of the train_step run: the uniform batch's replies (64 by default). A CPU
without native bf16 emulates the bf16 variants' matmuls, so their update time grows with the reply
tokens (an update of the uniform batch: ~7x shorter at 16); the rows, mixes and padding checked
are the same."""
OVERLAP_REPLY_TOKENS = 4
"""--completion-tokens of the overlap run: its checks are on ratios of the times it measures,
whatever the reply length (16 by default: every phase of the run several times longer)."""


@pytest.fixture
def keep_threads():
    """The benchmarks set torch's thread count; give the rest of the session its own back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_train_step_quick(tmp_path, capsys, keep_threads) -> None:
    from bench import train_step

    assert train_step.main(["--quick", "--completion-tokens", str(TRAIN_REPLY_TOKENS), "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "fp32" in table and "bf16-shared" in table and "mixed" in table
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["threads"], r["lengths"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {(t, m, v) for t in (1, 2) for m in train_step.LENGTH_MIXES
                         for v in train_step.VARIANTS}
    assert all(r["seconds"] > 0 and r["tokens_per_s"] > 0 for r in res["rows"])
    uniform, mixed = res["mixes"]["uniform"], res["mixes"]["mixed"]
    assert uniform["completion_tokens"] == train_step.QUICK_SEQS * TRAIN_REPLY_TOKENS
    assert mixed["reply_lengths"] == list(train_step.MIXED_REPLY_TOKENS[0])  # one group of 8
    # padded rows compute the gaps of the mixed replies; a packed group computes each token once
    assert rows[1, "mixed", "bf16"]["computed_per_token"] > 3
    assert rows[1, "mixed", "bf16-shared"]["computed_per_token"] < 1.4
    assert (tmp_path / "train_step.png").stat().st_size > 1000


def test_train_step_length_mixes() -> None:
    from bench import train_step

    assert train_step.reply_lengths("uniform", 3, 16) == [16, 16, 16]
    mixed = train_step.reply_lengths("mixed", 32)
    rows = train_step.MIXED_REPLY_TOKENS
    assert mixed[:24] == [n for row in rows for n in row] and mixed[24:] == list(rows[0])
    batch = train_step.make_batch(100, mixed)
    assert [len(s.completion_ids) for s in batch] == mixed
    assert [s.group for s in batch] == [i // train_step.GROUP for i in range(32)]
    assert len({tuple(s.prompt_ids) for s in batch[:8]}) == 1  # a group shares its prompt
    with pytest.raises(ValueError, match="length mix"):
        train_step.reply_lengths("long", 8)


def test_weight_sync_quick(tmp_path, capsys, keep_threads) -> None:
    from bench import weight_sync

    assert weight_sync.main(["--quick", "--out", str(tmp_path)]) == 0
    assert "ratio" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    assert [c["dtype"] for c in res["cases"]] == ["float32", "bfloat16"]
    f32, bf16 = res["cases"]
    assert 0.49 < bf16["bytes"] / f32["bytes"] < 0.55  # half the bytes a weight (and one header each)
    for case in res["cases"]:  # the figures are the medians of the samples kept, and their sums
        for key in ("publish_s", "load_s", "raw_write_s", "raw_read_s"):
            assert case[key] == pytest.approx(statistics.median(case["samples"][key])) and case[key] > 0
        assert case["store_s"] == pytest.approx(case["publish_s"] + case["load_s"])
        assert case["ratio"] == pytest.approx(case["store_s"] / (case["raw_write_s"] + case["raw_read_s"]))
    assert (tmp_path / "weight_sync.png").stat().st_size > 1000


def test_overlap_quick(tmp_path, capsys, keep_threads) -> None:
    from bench import overlap

    assert overlap.main(["--quick", "--rollout-quantize", "int8", "--turn-threads", "2",
                         "--completion-tokens", str(OVERLAP_REPLY_TOKENS), "--out", str(tmp_path)]) == 0
    assert "slowdown" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    trainer, rollout = res["rows"]
    assert trainer["alone_s"] > 0 and trainer["both_s"] > 0 and rollout["alone_s"] > 0
    # the ratios are what the table's times give (each worker's time alone, then side by side)
    t, g = trainer["alone_s"], rollout["alone_s"]
    assert res["ideal_ratio"] == pytest.approx((t + g) / max(t, g))
    assert res["gen_both"]["batches"] >= 1 and rollout["both_s"] > 0
    assert res["achievable_ratio"] == pytest.approx((t + g) / max(trainer["both_s"], rollout["both_s"]))
    assert trainer["slowdown"] == pytest.approx(trainer["both_s"] / t)
    assert res["gen_alone"]["batches"] >= 1 and res["gen_alone"]["tokens"] > 0
    # turns with every core (sync's preset): each worker alone with 2 threads, against the overlap
    assert res["rollout_quantize"] == "int8" and res["turn_threads"] == 2
    g_all = res["gen_all_cores"]["seconds"] / res["gen_all_cores"]["batches"]
    t_all = sorted(res["train_all_cores_s"])[len(res["train_all_cores_s"]) // 2]
    assert res["vs_honest_sync_ratio"] == pytest.approx((t_all + g_all) / max(trainer["both_s"], rollout["both_s"]))
    assert (tmp_path / "overlap.png").stat().st_size > 1000


def test_int8_layers_quick(tmp_path, capsys, keep_threads) -> None:
    from bench import int8_layers

    assert int8_layers.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["shape"] for r in res["matmul"]] == [list(s) for s in int8_layers.SHAPES]
    assert all(r["fp32_us"] > 0 and r["int8_us"] > 0 for r in res["matmul"])
    assert [r["variant"] for r in res["drift"]] == ["no rotation", "rotation", "weights alone"]
    kl = {r["variant"]: r["kl_per_position"] for r in res["drift"]}
    assert all(0 < v < 1 for v in kl.values())  # int8 moves the outputs, a little
    assert kl["weights alone"] < kl["no rotation"]  # int8 activations add their own error
    assert res["refresh_s"] > 0
    assert "drift from float32" in capsys.readouterr().out
    assert res["provenance"]["command"] == f"python bench/int8_layers.py --quick --out {tmp_path}"
