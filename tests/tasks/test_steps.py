"""The step-tagged format: rendering, parsing, prefixes, and why a reply is invalid."""

import pytest

from areal_aio.tasks.steps import parse, render


def test_a_rendered_reply_parses_back_to_its_steps_and_answer():
    text = render(["7 + 5 = 12", "12 - 3 = 9"], "9")
    reply = parse(text)
    assert reply.valid and reply.problem == ""
    assert reply.steps == ("7 + 5 = 12", "12 - 3 = 9") and reply.answer == "9"


def test_prefixes_end_where_the_next_step_starts():
    text = "Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9\n<answer>9</answer>"
    reply = parse(text)
    assert reply.prefix(1) == "Step 1: 7 + 5 = 12\n"
    assert reply.prefix(2) == "Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9\n"
    assert text.startswith(reply.prefix(2))
    with pytest.raises(IndexError):
        reply.prefix(3)


def test_multi_line_steps_and_loose_labels_are_tolerated():
    reply = parse("step 1 : add\n 7 + 5 = 12\n  Step 2: subtract 3\n<answer> 9 </answer>\n")
    assert reply.valid, reply.problem
    assert reply.steps == ("add\n 7 + 5 = 12", "subtract 3") and reply.answer == "9"


@pytest.mark.parametrize("text, problem", [
    ("The answer is 9.", "no steps"),
    ("<answer>9</answer>\nStep 1: 9", "no 'Step 1:' line before the answer"),
    ("So: Step 1: 7 + 5 = 12\n<answer>12</answer>", "no steps"),  # a label starts a line
    ("Well.\nStep 1: 7 + 5 = 12\n<answer>12</answer>", "text before Step 1"),
    ("Step 1: a\nStep 3: b\n<answer>1</answer>", "steps numbered 1, 3, expected 1, 2"),
    ("Step 2: a\n<answer>1</answer>", "steps numbered 2, expected 1"),
    ("Step 1: a\nStep 2:\n<answer>1</answer>", "step 2 is empty"),
    ("Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9", "no <answer> tag"),
    ("Step 1: a\n<answer>1</answer><answer>2</answer>", "2 answer tags"),
    ("Step 1: a\n<answer> </answer>", "the answer tag is empty"),
    ("Step 1: a\n<answer>1</answer>\nStep 2: more", "text after the answer tag"),
])
def test_invalid_replies_say_why(text, problem):
    reply = parse(text)
    assert not reply.valid and reply.problem == problem


def test_an_invalid_reply_still_has_its_steps_for_step_credit():
    reply = parse("Step 1: 7 + 5 = 12\nStep 2: 12 - 3 = 9")
    assert reply.steps == ("7 + 5 = 12", "12 - 3 = 9") and reply.answer is None
    assert reply.prefix(1) == "Step 1: 7 + 5 = 12\n"
