"""tasks/code_feedback.py: a failing program gets the failure's reason as a user turn and another
try; the verdict is the last program's, judged in the sandbox."""

from __future__ import annotations

import pytest

from areal_aio import wire
from areal_aio.control.episodes import Bounds, Model
from areal_aio.tasks.code_feedback import episode
from areal_aio.tasks.task import Task

ADD_TESTS = [{"args": [1, 2], "output": 3}, {"args": [10, -4], "output": 6}]
ADD = Task("add", "Write add(a, b).", "", {"tests": ADD_TESTS, "entry_point": "add", "timeout_s": 4.0})
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"


class Scripted:
    """Answers each Generate with the next scripted text; records the turns sent."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.appended: list = []

    async def __call__(self, sent, append, limit, room):
        self.appended.append(append)
        return wire.Completion("r", [9] if sent is None else sent + [5], [1, 2], [-0.5, -0.5], [0, 0],
                               self.texts.pop(0), "stop", 0, 0.0)


@pytest.mark.parametrize("texts,turns,passed", [
    ([RIGHT], 1, True),
    ([WRONG, RIGHT], 2, True),
    ([WRONG, WRONG, WRONG], 3, False),
])
async def test_failures_are_fed_back_until_a_pass_or_the_reply_limit(texts, turns, passed):
    script = Scripted(texts)
    model = Model(Bounds(turns=3, tokens=1000, timeout_s=30.0, max_new_tokens=64), script)
    score = await episode(ADD, model)
    assert (score.passed, score.reward, score.failed) == (passed, float(passed), False)
    assert score.strict == passed  # fenced programs
    assert model.replies == turns
    feedback = [a[0] for a in script.appended if a]
    assert len(feedback) == turns - 1
    for turn in feedback:
        assert turn["role"] == "user" and "test 0: wrong output" in turn["content"]
        assert "3" not in turn["content"] and "6" not in turn["content"]  # no expected values
