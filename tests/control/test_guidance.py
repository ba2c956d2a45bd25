"""Guided groups' guides (areal_aio/control/guidance.py): what each writes, and which settings
may not have one."""

from __future__ import annotations

import pytest

from areal_aio.control import guidance
from areal_aio.settings import SettingsError
from areal_aio.tasks.task import Task
from tests.conftest import make_settings

TASK = Task(id="t", prompt="Calculate 5 - 9. Give only the final answer inside <answer></answer> tags.", answer="-4")


def test_the_tag_guide_tags_the_first_correct_untagged_reply():
    assert guidance.tag_guide(TASK, ["-3", "5 - 9 = -4 ", "It is -4"], [False, True, True]) == [
        "5 - 9 = -4\n<answer>-4</answer>"]


def test_the_tag_guide_cuts_a_correct_reply_that_wrote_on_after_its_tag():
    assert guidance.tag_guide(TASK, ["-4\n<answer>-4</answer>\n<output>x</output>", "-4"], [True, True]) == [
        "-4\n<answer>-4</answer>"]


@pytest.mark.parametrize(("replies", "passed"), [(["<answer>-4</answer>", "-4"], [True, True]),
                                                 (["<answer>-4</answer> \n", "-3"], [True, False]),
                                                 (["-3", "5"], [False, False]), ([], [])])
def test_the_tag_guide_writes_nothing_when_a_correct_reply_is_tagged_or_none_is_correct(replies, passed):
    assert guidance.tag_guide(TASK, replies, passed) == []


def test_the_reference_guide_answers_only_a_group_that_failed():
    guide = guidance.load_guide(make_settings(**{"task.guide": "reference"}))
    assert guide(TASK, ["-3", "1"], [False, False]) == ["5 - 9 = -4\n<answer>-4</answer>"]
    assert guide(TASK, ["-4", "1"], [True, False]) == []
    both = guidance.load_guide(make_settings(**{"task.guide": "both"}))
    assert both(TASK, ["-4", "1"], [True, False]) == ["-4\n<answer>-4</answer>"]
    assert both(TASK, ["-3"], [False]) == ["5 - 9 = -4\n<answer>-4</answer>"]


def test_off_is_no_guide_and_a_function_is_imported():
    assert guidance.load_guide(make_settings()) is None
    assert guidance.load_guide(make_settings(**{"task.guide": "areal_aio.control.guidance:tag_guide"})) is guidance.tag_guide


@pytest.mark.parametrize(("sets", "message"), [
    ({"task.guide": "tag", "task.episode": "areal_aio.agents.calculator:episode"}, "plays episodes"),
    ({"task.guide": "tag", "task.name": "calculator"}, "plays episodes"),
    ({"task.guide": "tag", "process.mode": "outcome"}, "process.mode"),
    ({"task.guide": "reference", "task.name": "chain", "task.terms": 3}, "has none"),
    ({"task.guide": "areal_aio.control.guidance:nothing_here"}, "has no 'nothing_here'"),
])
def test_a_guide_the_run_cannot_use_is_one_line_naming_task_guide(sets, message):
    with pytest.raises(SettingsError, match=f"task.guide: .*{message}"):
        guidance.load_guide(make_settings(**sets))


def test_a_guide_value_that_is_neither_built_in_nor_a_function_is_refused():
    with pytest.raises(SettingsError, match="task.guide: expected one of off, tag"):
        make_settings(**{"task.guide": "tags"})


def test_what_a_guide_returns_is_checked():
    assert guidance.texts(lambda task, replies, passed: ["a", " "], TASK, [], []) == ["a"]
    with pytest.raises(TypeError, match="task.guide: the guide returned str"):
        guidance.texts(lambda task, replies, passed: "a", TASK, [], [])

