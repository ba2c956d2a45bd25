"""bench/endpoint.py on a small batch: every way of playing the episodes trains them, the HTTP
ones answer every call without an error, the agent in another process included."""

from __future__ import annotations

from bench import endpoint


async def test_the_three_ways_train_every_episode_without_an_error():
    runs = await endpoint.loop_arms(steps=1, repeats=1, episodes=16)
    assert list(runs) == ["model.reply", "http_same_loop", "http_other_process"]
    for name, run in runs.items():
        assert run["error"] is None and run["samples"] == 16 and run["episode_failures"] == 0, name
        assert run["endpoint_errors"] == {}, name
    assert runs["model.reply"]["endpoint_calls"] == 0
    assert runs["http_same_loop"]["endpoint_calls"] == runs["http_other_process"]["endpoint_calls"] >= 16 * 4


async def test_per_call_reports_the_overhead_over_model_reply():
    result = await endpoint.per_call(40)
    assert result["calls"] == 36 and set(result["overhead_ms"]) == {"median", "p99"}
    assert result["openai_client_ms"]["calls"] == 8  # a quarter of the episodes: 2 of 4 calls
