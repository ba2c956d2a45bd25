"""agents/calculator.py: the calculator evaluates arithmetic only (parsed, never executed), and its
episode answers a call with a tool turn and stops at an answer or at the reply limit. (The
calculator tasks: tests/tasks/test_calculator.py.)"""

from __future__ import annotations

from fractions import Fraction

import pytest

from areal_aio.agents import calculator
from areal_aio.agents.calculator import (
    MAX_EXPRESSION,
    CalcError,
    calculate,
    evaluate,
    reference_turns,
)
from areal_aio.agents.model import Bounds, Model
from areal_aio.tasks.calculator import CALCULATOR_INSTRUCTION
from areal_aio.tasks.task import Task
from tests.conftest import ScriptedReplies


@pytest.mark.parametrize("expression,value", [
    ("1+2", 3), ("6 * 7", 42), ("(2 + 3) * 4", 20), ("2 + 3 * 4", 14), ("7 / 2", Fraction(7, 2)),
    ("-3 + +5", 2), ("0.1 + 0.2", Fraction(3, 10)), ("((((1))))", 1), (" 10 - 4 - 3 ", 3),
])
def test_arithmetic_is_evaluated_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('/etc/passwd')", "x + 1", "2 ** 64", "9 // 2", "7 % 3",
    "(lambda: 1)()", "[1, 2]", "'a' * 3", "True + 1", "1j * 2", "1 if 1 else 2", "1 < 2", "a.b",
    "", "1 +", "1e999", "1e999 - 1e999", "(" * 300 + "1" + ")" * 300, "1" * (MAX_EXPRESSION + 1),
])
def test_anything_but_arithmetic_is_refused(expression):
    with pytest.raises(CalcError):
        evaluate(expression)


def test_the_tool_answers_values_and_errors_as_text():
    assert calculate("6*7") == "42" and calculate("1/3") == "0.3333333333" and calculate("4/2") == "2"
    assert calculate("1/0") == "error: division by zero"
    assert calculate("1e300*1e300/7") == "error: too large"
    assert calculate("os.getcwd()") == "error: only numbers, + - * / and parentheses"


def test_the_reference_episode_calls_on_the_question_and_answers_the_value():
    task = Task("t", f"Calculate 378 * 937. {CALCULATOR_INSTRUCTION}", "354186")
    assert reference_turns(task) == [("assistant", "<calc>378 * 937</calc>"), ("tool", "354186"),
                                     ("assistant", "<answer>354186</answer>")]
    assert reference_turns(Task("t", f"Calculate 5 - 9. {CALCULATOR_INSTRUCTION}", "-4"))[1] == ("tool", "-4")
    # no reference episode where the calculator's value would score wrong
    assert reference_turns(Task("t", f"Calculate 4 / 1 / 7. {CALCULATOR_INSTRUCTION}", "8")) is None
    assert reference_turns(Task("t", f"What is 2 + 3? {CALCULATOR_INSTRUCTION}", "5")) is None


@pytest.mark.parametrize("texts,turns,tools", [
    (["<answer>5</answer>"], 1, []),
    (["<calc>2+3</calc>", "<answer>5</answer>"], 2, ["5"]),
    (["<calc>2+3</calc>", "<calc>1/0</calc>", "<calc>9</calc>"], 3, ["5", "error: division by zero"]),
    # the reply stops at </calc>: what the model would have written after it never comes
    (["<calc>2+3</calc> so <answer>7</answer>", "<answer>5</answer>"], 2, ["5"]),
])
async def test_the_episode_answers_calls_until_an_answer_or_the_reply_limit(texts, turns, tools):
    script = ScriptedReplies(texts)
    model = Model(Bounds(turns=3, tokens=100, timeout_s=1.0, max_new_tokens=8), script)
    assert await calculator.episode(Task("t", "What is 2 + 3?", "5"), model) is None
    assert model.replies == turns
    assert [a[0]["content"] for a in script.appended if a] == tools
    assert all(a[0]["role"] == "tool" for a in script.appended if a)
    assert script.stops == [["</calc>"]] * turns
