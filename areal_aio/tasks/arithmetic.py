"""The default task: reasoning-gym's basic_arithmetic, generated offline from a seed (two-term
single-digit + and - by default), an endless stream for training and a fixed held-out set drawn
from `task.eval_seed` for evaluation."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from areal_aio.settings import TaskSettings
from areal_aio.tasks.task import Task

ANSWER_INSTRUCTION = "Give only the final answer inside <answer></answer> tags."


EPOCH = 10_000
"""Arithmetic tasks per reseeded epoch of the endless training stream."""


def arithmetic_prompt(question: str, instruction: str = ANSWER_INSTRUCTION) -> str:
    return f"{question} {instruction}"


def worked_reply(task: Task) -> str:
    """The reference reply a cold start teaches: the sum written out, then the tagged answer
    ("5 - 9 = -4\n<answer>-4</answer>"). The model already writes the sum out by itself (its
    greedy replies are "5 - 9 = -4"), so only the tag is new: tuned on the tagged answer alone,
    SmolLM2-135M-Instruct answered 0.30 of the held-out sums against 0.55 before
    (docs/benchmarks/cold-start.md, "The default task: tagged answers from the start")."""
    expression = expression_of(task, ANSWER_INSTRUCTION)
    return f"{expression} = {task.answer}\n<answer>{task.answer}</answer>"


def expression_of(task: Task, instruction: str) -> str:
    """The sum an arithmetic prompt asks for ("Calculate 5 - 9. <instruction>" -> "5 - 9")."""
    return task.text.removesuffix(f" {instruction}").removeprefix("Calculate ").rstrip(".")


def arithmetic_tasks(task: TaskSettings, seed: int, size: int, prefix: str, start: int = 0,
                     instruction: str = ANSWER_INSTRUCTION) -> Iterator[Task]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic", min_terms=task.terms, max_terms=task.terms, min_digits=task.digits,
        max_digits=task.digits, operators=tuple(task.operators), allow_parentheses=False,
        allow_negation=False, seed=seed, size=size)
    for index in range(start, size):
        item = dataset[index]
        yield Task(id=f"{prefix}{index}", prompt=arithmetic_prompt(item["question"], instruction),
                   answer=str(item["answer"]))


def arithmetic_stream(task: TaskSettings, seed: int, start: int = 0,
                      instruction: str = ANSWER_INSTRUCTION) -> Iterator[Task]:
    """Endless training tasks: epoch e is drawn with seed (seed, e), so a run never repeats a
    stream. Task i is item i % EPOCH of epoch i // EPOCH: `start` skips to it directly."""
    first = start // EPOCH
    for epoch in itertools.count(first):
        yield from arithmetic_tasks(task, seed * 1_000_003 + epoch, EPOCH, f"t{epoch}-",
                               start % EPOCH if epoch == first else 0, instruction)
