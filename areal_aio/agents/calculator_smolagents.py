"""The calculator episode (agents/calculator.py) written with an agent framework: smolagents'
ToolCallingAgent, its OpenAIModel pointed at the episode's own endpoint URL
(agents/endpoint.py), as an agent built with the framework for any OpenAI-compatible server
would be. task.episode = "areal_aio.agents.calculator_smolagents:episode" trains it.

smolagents is the lightest framework that takes a base URL: one 160 KB wheel next to what
areal_aio installs (openai-agents brings mcp and cryptography, langchain-openai brings
langchain-core, langsmith and tiktoken: several MB each). Two things follow from how it works:

* It is synchronous: each episode's agent runs in a thread of its own, and its calls come back
  to the endpoint in the controller's loop. (A thread shares the interpreter with the loop: for
  many episodes at once, an agent in another process costs the loop less; docs/agents.md.)
* It sends each step back in its own words (the call as an assistant turn "Calling tools: [...]",
  the tool's value as a user turn "Observation: ..."), not the reply as returned: every call
  starts a new sequence, trained as its own sample with the episode's reward.

The reward is the episode's own: 1 when the agent's final answer is the task's answer, else 0
(task.reward would score the last reply, here a final_answer tool call).

Needs pip install smolagents (the `smolagents` extra).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from smolagents import OpenAIModel, ToolCallingAgent, tool
from smolagents.monitoring import LogLevel

from areal_aio.agents.calculator import calculate
from areal_aio.agents.model import Model
from areal_aio.tasks.task import Task, same_answer

MAX_STEPS = 3
"""Tool-calling steps of one agent run; with the final answer's call after the last one, 4 calls:
task.episode_turns' default (a call past it is refused with 400 and the episode scores 0)."""


@tool
def calculator(expression: str) -> str:
    """The exact value of an arithmetic expression: numbers, + - * / and parentheses.

    Args:
        expression: the expression to evaluate, such as "(2 + 3) * 4".
    """
    return calculate(expression)


async def episode(task: Task, model: Model) -> float:
    """Run the agent on the task's text in a thread of its own (the loop's default executor has
    a few threads, and an episode waiting for one would spend its task.episode_timeout_s there);
    1.0 when its final answer is the task's answer."""
    if model.base_url is None:
        raise RuntimeError("no endpoint serves this episode (endpoint.enabled = false)")
    llm = OpenAIModel(model.model_name, api_base=model.base_url, api_key=model.api_key or "unused")
    agent = ToolCallingAgent(tools=[calculator], model=llm, max_steps=MAX_STEPS, verbosity_level=LogLevel.OFF)
    thread = ThreadPoolExecutor(1, thread_name_prefix="smolagents")
    try:
        answer = await asyncio.get_running_loop().run_in_executor(thread, agent.run, task.text)
    finally:
        thread.shutdown(wait=False)  # a cancelled episode's agent ends at its next call (410)
        llm.client.close()
    return 1.0 if same_answer(str(answer), task.answer) else 0.0

