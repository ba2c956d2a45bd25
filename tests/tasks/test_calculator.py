"""tasks/calculator.py: calculator tasks are the arithmetic task's problems, their held-out set
too, each offering the tool. (The tool and the episode: tests/agents/test_calculator.py.)"""

from __future__ import annotations

from areal_aio.control.sources import eval_tasks, training_tasks
from areal_aio.settings import build_settings


def test_calculator_tasks_and_their_held_out_set_offer_the_tool():
    settings = build_settings({}, ["task.name=calculator", "task.eval_size=3"])
    first = next(iter(training_tasks(settings)))
    assert "<calc>expression</calc>" in first.prompt and first.answer
    plain = next(iter(training_tasks(build_settings({}, []))))
    assert plain.id == first.id and plain.answer == first.answer  # the same problems
    held_out = eval_tasks(settings)
    plain_held_out = eval_tasks(build_settings({}, ["task.eval_size=3"]))
    assert all("<calc>expression</calc>" in t.prompt for t in held_out)  # the eval runs the episode
    assert [(t.id, t.answer) for t in held_out] == [(t.id, t.answer) for t in plain_held_out]
