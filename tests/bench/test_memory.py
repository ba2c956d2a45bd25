"""bench/memory.py: a configuration in a process of its own measures its load and its step apart,
the full-logits head costs what the chunked one saves, a configuration that would not fit is
skipped with its estimate, and the targets are read off the rows."""

from __future__ import annotations

import json

import pytest

from bench import memory

GIB = 2**30


@pytest.mark.slow
def test_memory_bench_quick(tmp_path, capsys) -> None:
    assert memory.main(["--quick", "--variants", "lora", "--no-rollout", "--threads", "1",
                        "--out", str(tmp_path)]) == 0
    assert "peak GiB" in capsys.readouterr().out
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {r["head"]: r for r in res["rows"]}
    assert set(rows) == {"chunked", "full"} and res["provenance"]["command"].startswith("python bench/memory.py")
    for r in rows.values():
        assert r["load_peak"] + 65536 >= r["loaded"] > 0 and r["peak"] > 0 and r["loss_finite"]  # peak and RSS read a moment apart
        assert r["trained_tokens"] == memory.ROWS * (512 // memory.ROWS - memory.PROMPT_TOKENS)
    # [rows x L, V] fp32 logits of 512 tokens at 49,152: 100 MB, kept with their log-softmax
    assert rows["full"]["peak"] > rows["chunked"]["peak"] + 100 * 2**20


def test_a_configuration_that_would_not_fit_is_skipped_with_its_estimate(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(memory, "mem_available_gib", lambda: 4.0)
    cfg = {"device": "cpu", "threads": 1, "checkpointing": False, "gen": [1, 1, 1], "shape": "qwen2.5-1.5b",
           "vocab": None, "variant": "full", "tokens": 512, "head": "chunked"}
    row = memory.run_one(cfg, tmp_path)
    assert row["estimate_gib"] > 1.5e9 * memory.STATE_BYTES["full"] / GIB  # weights, grads, AdamW
    assert row["skipped"].startswith(f"needs ~{row['estimate_gib']:.1f} GiB, 4.0 GiB available")
    assert not list(tmp_path.iterdir())  # nothing started, no model folder written


def test_targets_are_read_off_the_rows() -> None:
    def row(shape, variant, head, peak, loaded=1.0, vocab=None, tokens=2048):
        return {"shape": shape, "variant": variant, "head": head, "peak": peak * GIB, "loaded": loaded * GIB,
                "vocab": vocab, "tokens": tokens}

    rows = [row("qwen2.5-1.5b", "lora", "chunked", 9.0), row("qwen2.5-1.5b", "lora-int8", "chunked", 4.0),
            row("qwen2.5-1.5b", "lora", "full", 20.0),  # the unchunked head is not the product's
            row("qwen2.5-0.5b", "lora", "chunked", 3.0), row("qwen2.5-0.5b", "lora", "full", 6.0),
            row("qwen2.5-0.5b", "lora", "chunked", 2.9, vocab=49_152), row("qwen2.5-0.5b", "lora", "full", 3.5, vocab=49_152)]
    met = memory.targets(rows)
    assert met["lora_1.5b_peak_gib"] == 9.0 and met["lora_1.5b_within_16_gib"]
    assert met["vocab_sweep_step_gib"] == {"chunked head, vocab 151936": 2.0, "chunked head, vocab 49152": 1.9,
                                           "full head, vocab 151936": 5.0, "full head, vocab 49152": 2.5}
