"""The calculator episode written with smolagents (agents/calculator_smolagents.py) against the
endpoint: on the fake workers its tool call and final answer go through and are rewarded, each
call its own trained sequence; the slow test trains it on the real workers (tiny-random)."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_aio.agents import calculator_smolagents
from areal_aio.control.controller import Orchestrator
from tests.agents.test_endpoint import real_settings, trained
from tests.agents.test_episodes import rows


def agent_policy(prompt: str, version: int) -> str:
    """A fake policy for the agent: on the task, a calculator call on its two terms; on the
    tool's observation (smolagents sends it as a user turn), the final answer with its value."""
    if "Observation:" in prompt:
        call = {"name": "final_answer", "arguments": {"answer": prompt.split("Observation:")[1].strip()}}
    else:
        a, b = prompt.split("Calculate ")[1].split(".")[0].split(" + ")
        call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


async def test_the_smolagents_calculator_calls_the_tool_and_is_rewarded(tmp_path):
    summary, samples = await trained(tmp_path, calculator_smolagents.episode, agent_policy)
    assert summary["steps"] == 2 and summary["episode_failures"] == 0 and summary["endpoint_errors"] == {}
    assert samples and all(s.reward == 1.0 for s in samples)  # the tool's value was the final answer
    # smolagents sends each step back in its own words: two calls, two sequences, each one reply
    assert len(samples) == 2 * 8 and all(sum(s.loss_mask) == len(s.loss_mask) for s in samples)


@pytest.mark.slow
async def test_the_smolagents_calculator_trains_on_the_real_workers(tmp_path):
    """tiny-random never writes a tool call: each step's reply fails the agent's parse, and
    after MAX_STEPS its final answer's call ends the run; every call trains as its own sample."""
    orch = Orchestrator(real_settings(**{"task.name": "calculator"}), episode=calculator_smolagents.episode,
                        out_dir=tmp_path / "run")
    summary = await asyncio.wait_for(orch.run(), 300)
    assert summary["steps"] == 2 and summary["episode_failures"] == 0, summary.get("error")
    assert set(summary["endpoint_errors"]) <= {"410"}  # agents whose episodes the run's end cancelled
    assert summary["endpoint_calls"] >= (calculator_smolagents.MAX_STEPS + 1) * 8
    trained_rows = [r for r in rows(tmp_path / "run") if r["dropped"] is None and r["step"] is not None]
    assert len({r["request_id"] for r in trained_rows}) == 8  # the episodes trained
    assert len(trained_rows) == summary["sequences_trained"] > 8  # a row per sequence each trained
    assert all(0 <= r["sequence"] < r["sequences"] for r in trained_rows)
    for r in trained_rows:  # the last sequence of each episode: the final answer's call alone
        if r["sequence"] == r["sequences"] - 1:
            assert [(t["role"], t["trained"]) for t in r["turns"]] == [("assistant", True)]
