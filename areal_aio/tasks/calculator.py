"""task.name = calculator: the arithmetic task's problems, with an instruction that offers the
calculator tool (`<calc>expression</calc>`). The episode that answers those calls, and the tool
itself, are the agents' (agents/calculator.py): a run with task.name = calculator plays it unless
task.episode names another (agents/episodes.py). The held-out set is the same episode on
held-out problems, with the same instruction.
"""

from __future__ import annotations

from collections.abc import Iterator

from areal_aio.settings import TaskSettings
from areal_aio.tasks.arithmetic import arithmetic_stream, arithmetic_tasks
from areal_aio.tasks.task import Task

CALCULATOR_INSTRUCTION = ("You may use a calculator: write <calc>expression</calc> (numbers, + - * / "
                          "and parentheses) and its value comes back. Give only the final answer "
                          "inside <answer></answer> tags.")


def calculator_stream(task: TaskSettings, seed: int, start: int = 0) -> Iterator[Task]:
    """The training stream: the arithmetic task's problems, offering the tool."""
    return arithmetic_stream(task, seed, start, CALCULATOR_INSTRUCTION)


def calculator_eval(task: TaskSettings) -> list[Task]:
    """The held-out set: the arithmetic task's held-out problems, offering the tool."""
    return list(arithmetic_tasks(task, task.eval_seed, task.eval_size, "e", instruction=CALCULATOR_INSTRUCTION))
