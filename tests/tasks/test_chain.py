import itertools
import operator
import re
from fractions import Fraction

import pytest

from areal_aio.control.sources import eval_tasks, training_tasks
from areal_aio.settings import build_settings
from areal_aio.tasks.chain import chain_eval, chain_items, chain_stream, item, solve
from areal_aio.tasks.steps import STEP_INSTRUCTION, parse

STEP = re.compile(r"(-?\d+) ([-+*/]) (\d+) = (-?\d+)")
EXACT = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def value_of(expression: str) -> Fraction:
    """The expression's value with the usual precedence, computed by Python on exact fractions."""
    tokens = expression.split()
    code = " ".join(f"Fraction({t})" if t.isdigit() else t for t in tokens)
    return eval(code, {"Fraction": Fraction})  # noqa: S307 - digits and + - * / only


@pytest.mark.parametrize("terms,digits,operators", [
    (3, 1, ["+", "-"]), (5, 1, ["+", "-"]), (4, 1, ["+", "-", "*", "/"]), (6, 2, ["*", "/", "-"]),
    (2, 1, ["/"]), (3, 3, ["+", "*"]),
])
def test_solutions_are_valid_step_replies_with_the_right_answer(terms, digits, operators):
    task = build_settings({"task": {"name": "chain", "terms": terms, "digits": digits,
                                    "operators": operators}}).task
    for it in itertools.islice(chain_items(task, seed=5), 300):
        numbers = [int(t) for t in it.expression.split()[::2]]
        assert len(numbers) == terms
        low = 0 if digits == 1 else 10 ** (digits - 1)
        assert all(low <= n < 10 ** digits for n in numbers)
        assert Fraction(int(it.answer)) == value_of(it.expression)  # exact divisions only
        reply = parse(it.solution)
        assert reply.valid, (it.solution, reply.problem)
        assert reply.answer == it.answer and len(reply.steps) == terms - 1
        for step in reply.steps:  # each step is one true binary operation
            a, op, b, result = STEP.fullmatch(step).groups()
            assert EXACT[op](Fraction(a), Fraction(b)) == int(result)


def test_steps_take_products_first_then_left_to_right():
    assert solve([2, 3, 4, 1], ["+", "*", "-"]) == (13, ("3 * 4 = 12", "2 + 12 = 14", "14 - 1 = 13"))
    assert solve([8, 2, 3], ["/", "*"]) == (12, ("8 / 2 = 4", "4 * 3 = 12"))
    assert solve([4, 1, 7], ["-", "-"]) == (-4, ("4 - 1 = 3", "3 - 7 = -4"))
    with pytest.raises(ValueError, match="exact"):
        solve([7, 2], ["/"])


def test_items_are_a_function_of_seed_and_index():
    task = build_settings({"task": {"name": "chain", "terms": 4}}).task
    first = list(itertools.islice(chain_stream(task, 3), 40))
    assert first == list(itertools.islice(chain_stream(task, 3), 40))
    assert first != list(itertools.islice(chain_stream(task, 4), 40))
    assert list(itertools.islice(chain_stream(task, 3, start=25), 15)) == first[25:]
    assert [t.id for t in first[:3]] == ["t0", "t1", "t2"]
    assert item(3, 7, 4, 1, ["+", "-"]).task("t7") == first[7]
    assert len({t.prompt for t in first}) > 30  # not one question over and over


def test_task_settings_select_the_chain_stream_and_held_out_set():
    s = build_settings({"task": {"name": "chain", "terms": 3, "eval_size": 16}})
    train = list(itertools.islice(training_tasks(s), 8))
    held_out = eval_tasks(s)
    assert len(held_out) == 16 and held_out == chain_eval(s.task)
    assert all(t.prompt.startswith("Calculate ") and t.prompt.endswith(STEP_INSTRUCTION) for t in train + held_out)
    assert [t.id for t in held_out[:2]] == ["e0", "e1"]
    assert [t.prompt for t in held_out] != [t.prompt for t in train[:16]]
    assert held_out == chain_eval(build_settings({"task": {"name": "chain", "terms": 3, "eval_size": 16},
                                                  "run": {"seed": 9}}).task)  # seed-independent
