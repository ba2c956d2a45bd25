"""The calculator episode and its tool: what task.name = calculator plays.

The problems are the arithmetic task's, with an instruction that offers the tool
(tasks/calculator.py). The episode (it talks to a Model, agents/model.py): the model replies;
while a reply calls the calculator (`<calc>expression</calc>`, no <answer> yet) and replies are left, the
episode adds the value as a "tool" turn and asks for the next reply. It returns None:
task.reward (the answer reward) scores the last reply.

The expression is the model's text: it is parsed with `ast` and only numbers, + - * / and
parentheses are evaluated, by this module's own walk of the tree (exact fractions); nothing
the model writes is ever given to eval or exec.

A cold start (`sft.data = generated`, app/sft.py) teaches the episode `reference_turns` writes:
the question's expression as a call, then, after the tool turn with its value, that value as
the tagged answer.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from areal_aio.agents.model import Model
from areal_aio.tasks.arithmetic import expression_of
from areal_aio.tasks.calculator import CALCULATOR_INSTRUCTION
from areal_aio.tasks.task import Task, same_answer

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
CALL_END = "</calc>"
"""A reply stops here (its tool call is complete): the value comes back before it goes on."""
MAX_EXPRESSION = 200
"""Characters of an expression the calculator takes: bounds the parse and the numbers' size."""
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


class CalcError(ValueError):
    """An expression the calculator does not take (what the tool turn says instead of a value)."""


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`: numbers, + - * /, unary + and -, parentheses. CalcError
    for anything else (names, calls, powers, ...), for division by zero and for overlong input."""
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION:
        raise CalcError(f"longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    try:
        return _value(tree.body)
    except CalcError:
        raise
    except (ValueError, OverflowError):  # a literal such as 1e999: inf has no exact value
        raise CalcError("not a finite number") from None
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except RecursionError:
        raise CalcError("nested too deeply") from None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))  # the literal as written: 0.1 is 1/10
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise CalcError("only numbers, + - * / and parentheses")


def calculate(expression: str) -> str:
    """The tool's answer: the value (an integer when it is one, else up to 10 significant
    digits), or "error: why"."""
    try:
        value = evaluate(expression)
    except CalcError as exc:
        return f"error: {exc}"
    if value.denominator == 1:
        return str(value.numerator)
    try:
        return f"{float(value):.10g}"
    except OverflowError:  # 1e300 * 1e300 / 7: exact, but past a float
        return "error: too large"


def reference_turns(task: Task) -> list[tuple[str, str]] | None:
    """The episode a cold start teaches, as (role, text) turns after the prompt: the call on
    the question's expression (arithmetic.expression_of), the tool turn as the
    episode adds it, and its value as the answer:

        [("assistant", "<calc>41 * 265</calc>"), ("tool", "10865"), ("assistant", "<answer>10865</answer>")]

    None where the calculator's value is not the task's answer (a question that is not one
    expression, or a reference that disagrees): the reward would score that answer wrong."""
    expression = expression_of(task, CALCULATOR_INSTRUCTION)
    value = calculate(expression)
    if not same_answer(value, task.answer):
        return None
    return [("assistant", f"<calc>{expression}{CALL_END}"), ("tool", value),
            ("assistant", f"<answer>{value}</answer>")]


async def episode(task: Task, model: Model) -> None:
    """Reply; while the reply calls the calculator and gives no answer yet, answer the call as a
    tool turn and reply again (at most task.episode_turns replies). task.reward scores the last."""
    text = await model.reply(stop=[CALL_END])
    while (call := CALL.search(text)) and "<answer>" not in text and model.replies_left:
        model.add_turn("tool", calculate(call.group(1)))
        text = await model.reply(stop=[CALL_END])
    return None
