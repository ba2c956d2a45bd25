import asyncio
import os
import subprocess
import sys
import time

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
        await pool.aclose()


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
        await scorer.aclose()
        assert score.failed and score.reward == 0.0 and scorer.failures == 1, fn


async def test_scorer_accepts_lambdas_async_and_callable_objects():
    class Async:
        async def __call__(self, task, text):
            return Score(2.0, True, True)

    assert (await Scorer(lambda t, c: 0.25, timeout_s=1, procs=1).score(T, "x")).reward == 0.25
    assert (await Scorer(Async(), timeout_s=1, procs=0).score(T, "x")).strict


def nan_score(task, text):
    return Score(float("nan"), True)


def dies_on_die(task, text):
    if text == "die":
        import os

        os._exit(1)
    return AnswerReward(0.2)(task, text)


async def test_a_score_with_a_non_finite_reward_is_a_counted_failure():
    async def inf_score(task, text):
        return Score(float("inf"), True)

    for fn, procs in ((nan_score, 0), (nan_score, 1), (inf_score, 0), (lambda t, c: Score(float("-inf"), False), 1)):
        scorer = Scorer(fn, timeout_s=30, procs=procs)
        score = await scorer.score(T, "7")
        await scorer.aclose()
        assert score.failed and score.reward == 0.0 and scorer.failures == 1, fn
    with pytest.raises(TypeError):
        as_score(Score(float("nan"), True))
    assert as_score(Score(1, True)).reward == 1.0 and type(as_score(Score(1, True)).reward) is float


async def test_a_dead_pool_process_is_replaced_not_scored_zero_forever():
    scorer = Scorer(dies_on_die, timeout_s=30, procs=1)
    try:
        assert (await scorer.score(T, "die")).failed
        after = [await scorer.score(T, "<answer>7</answer>") for _ in range(3)]
        assert not any(s.failed for s in after) and all(s.strict for s in after)
        assert scorer.failures == 1
    finally:
        await scorer.aclose()


HUNG = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from areal_aio.rewards import Scorer
from areal_aio.tasks import Task
from test_rewards import hangs

async def main():
    scorer = Scorer({fn}, timeout_s=0.5, procs={procs})
    score = await scorer.score(Task("t", "p", "7"), "7")
    print("failed" if score.failed else "scored", scorer.failures, flush=True)
    await scorer.aclose()

asyncio.run(main())
"""


def hangs(task, text):
    time.sleep(3600)
    return 1.0


@pytest.mark.slow
@pytest.mark.parametrize("fn,procs", [("hangs", 1), ("hangs", 0), ("lambda t, c: hangs(t, c)", 1)])
def test_a_hung_sync_reward_times_out_and_the_process_still_exits(fn, procs):
    """In the pool (killed), in a thread for an unpicklable function (abandoned, a daemon), or
    in a thread for any user function with procs = 0 (never inline on the loop): the call fails
    at its timeout and the process still exits."""
    tests = os.path.dirname(os.path.abspath(__file__))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HUNG.format(tests=tests, fn=fn, procs=procs)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", "1"]
    assert time.perf_counter() - t0 < 30
