"""The chain task: arithmetic of several terms, each with its worked solution, one step per operation.

    item (seed, i) -> "Calculate 4 - 1 + 7." + STEP_INSTRUCTION, answer "10",
                      steps ("4 - 1 = 3", "3 + 7 = 10")
                      solution (what cold-start SFT learns, areal_aio.tasks.steps.render):
                          Step 1: 4 - 1 = 3
                          Step 2: 3 + 7 = 10
                          <answer>10</answer>

A step is one binary operation, taken in the usual order: the leftmost * or / first, then
+ and - from the left, so `task.terms` terms take terms - 1 steps. Terms have `task.digits`
digits (one digit: 0-9), operators are drawn from `task.operators`. A division is always
exact: its divisor is drawn from the divisors of the product it divides (a product with
no divisor in range, which needs two or more digits, takes a * there instead). Item i of
a stream depends only on (seed, i), so a stream resumes at any position and the held-out
set (task.eval_seed) is the same in every run.

We generate the items ourselves rather than through reasoning-gym: its basic_arithmetic
computes * and / from left to right, ignoring precedence, and writes a divisor other than
the one it divided by, and a worked solution needs the exact order of operations.
"""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Iterator
from dataclasses import dataclass

from areal_aio.settings import TaskSettings
from areal_aio.tasks.steps import STEP_INSTRUCTION, render
from areal_aio.tasks.task import Task

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
FIRST = ("*", "/")
"""Operators taken before + and - (the leftmost first)."""


@dataclass(frozen=True, slots=True)
class ChainItem:
    """One expression with its answer and its solution steps ("a op b = c", in order)."""

    expression: str  # "4 - 1 + 7"
    answer: str
    steps: tuple[str, ...]

    @property
    def question(self) -> str:
        return f"Calculate {self.expression}."

    @property
    def solution(self) -> str:
        """The step-tagged reference reply."""
        return render(self.steps, self.answer)

    def task(self, task_id: str) -> Task:
        return Task(id=task_id, prompt=f"{self.question} {STEP_INSTRUCTION}", answer=self.answer)


def solve(numbers: list[int], ops: list[str]) -> tuple[int, tuple[str, ...]]:
    """(value, steps) of numbers[0] ops[0] numbers[1] ...; every / must divide exactly."""
    numbers, ops, steps = list(numbers), list(ops), []
    while ops:
        k = next((j for j, op in enumerate(ops) if op in FIRST), 0)
        a, b, op = numbers[k], numbers[k + 1], ops[k]
        if op == "/" and (b == 0 or a % b):
            raise ValueError(f"{a} / {b} is not an exact division")
        value = OPS[op](a, b)
        steps.append(f"{a} {op} {b} = {value}")
        numbers[k:k + 2] = [value]
        del ops[k]
    return numbers[0], tuple(steps)


def item(seed: int, index: int, terms: int, digits: int, operators: list[str]) -> ChainItem:
    """Item `index` of the stream `seed` (a function of the two alone)."""
    rng = random.Random(f"chain:{seed}:{index}")
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
    numbers, ops = [rng.randint(lo, hi)], []
    product = numbers[0]  # value of the run of * and / that ends at the last number
    for _ in range(terms - 1):
        op, n = rng.choice(operators), rng.randint(lo, hi)
        if op == "/":
            divisors = [d for d in range(max(lo, 1), hi + 1) if product % d == 0]
            if divisors:
                n = rng.choice(divisors)
            else:
                op = "*"
        if op in FIRST:
            product = OPS[op](product, n)
        else:
            product = n
        numbers.append(n)
        ops.append(op)
    value, steps = solve(numbers, ops)
    expression = " ".join([str(numbers[0]), *(f"{op} {n}" for op, n in zip(ops, numbers[1:], strict=True))])
    return ChainItem(expression, str(value), steps)


def chain_items(task: TaskSettings, seed: int, start: int = 0) -> Iterator[ChainItem]:
    """The endless item stream of `seed`, from item `start` on."""
    for index in itertools.count(start):
        yield item(seed, index, task.terms, task.digits, task.operators)


def chain_stream(task: TaskSettings, seed: int, start: int = 0) -> Iterator[Task]:
    """Endless training tasks (ids t<i>); `start` skips to task `start` directly."""
    for index, it in enumerate(chain_items(task, seed, start), start=start):
        yield it.task(f"t{index}")


def chain_eval(task: TaskSettings) -> list[Task]:
    """The held-out set: the first task.eval_size items of the stream task.eval_seed (ids e<i>)."""
    items = itertools.islice(chain_items(task, task.eval_seed), task.eval_size)
    return [it.task(f"e{index}") for index, it in enumerate(items)]
