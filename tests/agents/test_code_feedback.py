"""agents/code_feedback.py: a failing program gets the failure's reason as a user turn and another
try; the verdict is the last program's, judged in the sandbox."""

from __future__ import annotations

import pytest

from areal_aio.agents.code_feedback import episode
from areal_aio.agents.model import Bounds, Model
from areal_aio.tasks.task import Task
from tests.conftest import ScriptedReplies

ADD_TESTS = [{"args": [1, 2], "output": 3}, {"args": [10, -4], "output": 6}]
ADD = Task("add", "Write add(a, b).", "", {"tests": ADD_TESTS, "entry_point": "add", "timeout_s": 4.0})
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"




@pytest.mark.parametrize("texts,turns,passed", [
    ([RIGHT], 1, True),
    ([WRONG, RIGHT], 2, True),
    ([WRONG, WRONG, WRONG], 3, False),
])
async def test_failures_are_fed_back_until_a_pass_or_the_reply_limit(texts, turns, passed):
    script = ScriptedReplies(texts)
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
