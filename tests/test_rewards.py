import asyncio

import pytest

from areal_aio.rewards import AnswerReward, Score, Scorer, as_score, final_answer, same_answer
from areal_aio.tasks import Task

T = Task("t", "Calculate 3 + 4.", "7")


@pytest.mark.parametrize("text,answer,tagged", [
    ("<answer>7</answer>", "7", True),
    ("3 + 4 = 7. <answer> 7 </answer>", "7", True),
    ("first <answer>5</answer> then <answer>7</answer>", "7", True),
    ("<answer>The answer is 7</answer>", "7", True),
    ("<ANSWER>-3</ANSWER>", "-3", True),
    ("3 + 4 = 7", "7", False),
    ("The sum is 7.", "7", False),
    ("<answer>7", "7", False),                # unclosed tag: falls back to the last number
    ("It is 1,234 apples", "1,234", False),
    ("no numbers here", None, False),
    ("", None, False),
    ("<answer></answer> 7", "", True),        # an empty tag is the (wrong) final answer
])
def test_final_answer(text, answer, tagged):
    assert final_answer(text) == (answer, tagged)


def test_same_answer_numeric_and_text():
    assert same_answer("7", "7") and same_answer("7.0", "7") and same_answer("+7", "7")
    assert same_answer("1,234", "1234") and not same_answer("8", "7")
    assert same_answer(" Paris ", "paris") and not same_answer("Paris", "Rome")


@pytest.mark.parametrize("text,reward,passed,strict", [
    ("<answer>7</answer>", 1.2, True, True),
    ("3 + 4 = 7", 1.0, True, False),
    ("<answer>8</answer>", 0.0, False, False),      # the tag alone earns nothing
    ("<answer>8</answer> wait, 7", 0.0, False, False),  # the tagged answer is final
    ("nothing", 0.0, False, False),
])
def test_reward_pays_format_bonus_only_when_correct(text, reward, passed, strict):
    score = AnswerReward(format_bonus=0.2)(T, text)
    assert score == Score(pytest.approx(reward), passed, strict)


def test_as_score():
    assert as_score(0.5) == Score(0.5, True)
    assert as_score(0) == Score(0.0, False)
    for bad in (None, "1", float("nan"), True):
        with pytest.raises(TypeError):
            as_score(bad)


async def test_scorer_process_pool_and_inline_agree():
    pool = Scorer(AnswerReward(0.2), timeout_s=30, procs=1)
    inline = Scorer(AnswerReward(0.2), timeout_s=30, procs=0)
    try:
        texts = ["<answer>7</answer>", "7", "8"]
        a = [await pool.score(T, t) for t in texts]
        b = [await inline.score(T, t) for t in texts]
        assert a == b and a[0].strict and not a[2].passed
    finally:
        pool.close()


async def test_scorer_failures_score_zero_and_count():
    def raises(task, text):
        raise RuntimeError("broken")

    async def slow(task, text):
        await asyncio.sleep(10)
        return 1.0

    async def wrong_type(task, text):
        return "yes"

    for fn in (raises, slow, wrong_type, lambda t, c: 1 / 0):
        scorer = Scorer(fn, timeout_s=0.05, procs=1)
        score = await scorer.score(T, "7")
        scorer.close()
        assert score.failed and score.reward == 0.0 and scorer.failures == 1, fn


async def test_scorer_accepts_lambdas_async_and_callable_objects():
    class Async:
        async def __call__(self, task, text):
            return Score(2.0, True, True)

    assert (await Scorer(lambda t, c: 0.25, timeout_s=1, procs=1).score(T, "x")).reward == 0.25
    assert (await Scorer(Async(), timeout_s=1, procs=0).score(T, "x")).strict
