"""The calculator episode (agents/calculator.py) written against the OpenAI API: the `openai`
package's tool calling through the episode's own endpoint URL (agents/endpoint.py), as an
agent written for any OpenAI-compatible server would be. task.episode =
"areal_aio.agents.calculator_openai:episode" trains it; what it trains is the same kind of
sequence as the Model-API episode's: replies in the loss, tool turns in the context only.

Needs pip install openai (the `openai` extra)."""

from __future__ import annotations

import json
from typing import Any

from areal_aio.agents.calculator import calculate
from areal_aio.agents.model import Model
from areal_aio.tasks.task import Task

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "The exact value of an arithmetic expression: numbers, + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
INSTRUCTION = "Use the calculator tool when it helps. Give only the final answer inside <answer></answer> tags."


def run_tool(arguments: str) -> str:
    """The calculator's answer to a call's arguments (JSON text the model wrote)."""
    try:
        expression = json.loads(arguments).get("expression", "")
    except (ValueError, AttributeError):
        return "error: the arguments are not {\"expression\": \"...\"}"
    return calculate(expression if isinstance(expression, str) else "")


async def episode(task: Task, model: Model) -> None:
    """Ask; while the reply calls the calculator and replies are left, answer each call as a tool
    message and ask again. task.reward scores the last reply."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": INSTRUCTION},
                                      {"role": "user", "content": task.text}]
    async with model.openai() as client:
        while True:
            response = await client.chat.completions.create(model=model.model_name, messages=messages,
                                                            tools=TOOLS)
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls or not model.replies_left:
                return None
            for call in reply.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call.function.arguments)})
