import asyncio
import itertools
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from areal_aio.agents import episodes
from areal_aio.agents.model import Transcript
from areal_aio.rewards.scoring import (
    REWARD_LIMIT,
    AnswerReward,
    Reward,
    Score,
    Scorer,
    as_score,
    check_columns,
    final_answer,
    load_rewards,
    same_answer,
)
from areal_aio.settings import SettingsError, build_settings
from areal_aio.tasks.task import Task
from tests.conftest import ROOT

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


async def test_only_column_less_built_in_rewards_score_inline_and_their_bonus_is_finite():
    assert Scorer(AnswerReward(0.2), timeout_s=30, procs=0).inline
    assert Scorer([Reward("a", AnswerReward(), weight=2.0), Reward("b", AnswerReward())], timeout_s=30, procs=0).inline
    wants_columns = Scorer(Reward("answer", AnswerReward(), columns=None), timeout_s=30, procs=0)
    assert not wants_columns.inline  # scored as any other reward: the same result for every procs
    with pytest.raises(ValueError, match="format_bonus must be a finite number"):
        AnswerReward(float("inf"))


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
sys.path.insert(0, {tests!r})  # the repository: tests.conftest
from areal_aio.rewards.scoring import Scorer
from areal_aio.agents.model import Transcript
from areal_aio.tasks.task import Task
from tests.conftest import hangs

async def main():
    scorer = Scorer({fn}, timeout_s=0.5, procs={procs})
    score = await scorer.score(Task("t", "p", "7"), "7")
    print("failed" if score.failed else "scored", scorer.failures, flush=True)
    await scorer.aclose()

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("fn,procs", [("hangs", 1), ("hangs", 0), ("lambda t, c: hangs(t, c)", 1)])
def test_a_hung_sync_reward_times_out_and_the_process_still_exits(fn, procs):
    """In the pool (killed), in a thread for an unpicklable function (abandoned, a daemon), or
    in a thread for any user function with procs = 0 (never inline on the loop): the call fails
    at its timeout and the process still exits."""
    tests = str(ROOT)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", HUNG.format(tests=tests, fn=fn, procs=procs)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["failed", "1"]
    assert time.perf_counter() - t0 < 30


# ---------------------------------------------------------------- rewards named in settings

USER_REWARDS = '''
import asyncio, os
from areal_aio.rewards.scoring import Score

def exact(task, completion):
    return float(completion.strip() == task.answer)

def by_level(task, completion, level, bonus=0.0):
    return float(level) + bonus

def every_column(task, completion, **columns):
    return float(sum(columns.values()))

async def judged(task, completion):
    await asyncio.sleep(0)
    return Score(0.5, passed=False)

def pid(task, completion):
    return float(os.getpid())

def broken(task, completion):
    raise ValueError("no")

class Judge:
    def score(self, task, completion):
        return 2.0

JUDGE = Judge()
NOT_CALLABLE = 3

def one_arg(completion):
    return 1.0

def trl_style(prompts, completions, **kwargs):
    return [1.0 for _ in completions]

def positional_only(task, completion, level, /):
    return 1.0
'''
MODULES = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of reward functions importable by name here and in the pool's processes."""
    name = f"byo_rewards_{os.getpid()}_{next(MODULES)}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    (tmp_path / f"{name}_raises.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / f"{name}_needs.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def task_settings(reward):
    return build_settings({"task": {"reward": reward}}).task


def test_each_reward_form_loads(user_module):
    m = user_module
    builtin = load_rewards(task_settings("answer"))
    assert builtin == Reward("answer", AnswerReward(0.2))
    exact = load_rewards(task_settings(f"{m}:exact"))
    assert exact.name == "exact" and exact.fn(T, " 7") == 1.0 and exact.columns == () and exact.required == ()
    level = load_rewards(task_settings(f"{m}:by_level"))
    assert level.columns == ("level", "bonus") and level.required == ("level",)
    assert load_rewards(task_settings(f"{m}:every_column")).columns is None
    assert load_rewards(task_settings(f"{m}:JUDGE.score")).fn(T, "x") == 2.0
    several = load_rewards(task_settings(["answer", {"fn": f"{m}:judged", "weight": 2.0},
                                          {"fn": f"{m}:exact", "weight": -0.5, "name": "penalty"}]))
    assert [(r.name, r.weight) for r in several] == [("answer", 1.0), ("judged", 2.0), ("penalty", -0.5)]


@pytest.mark.parametrize("spec,needle", [
    ("no_such_module_xyz:fn", "task.reward: cannot import 'no_such_module_xyz' (no module named "
                              "'no_such_module_xyz'); install it or run from the folder that holds it"),
    ("{m}:exactt", "task.reward: '{m}:exactt': '{m}' has no 'exactt'; did you mean 'exact'?"),
    ("{m}_raises:fn", "task.reward: importing '{m}_raises' failed: RuntimeError: boom"),
    ("{m}_needs:fn", "task.reward: importing '{m}_needs' failed: ModuleNotFoundError: No module named "
                     "'not_installed_dependency'"),
    ("{m}:Judge", "task.reward: '{m}:Judge' is a class; name a function (or a callable instance)"),
    ("{m}:NOT_CALLABLE", "task.reward: '{m}:NOT_CALLABLE' is a int, not a function"),
    ("{m}:one_arg", "task.reward: '{m}:one_arg' takes (completion), but a reward is called as "
                    "fn(task, completion, **columns)"),
    ("{m}:trl_style", "(a TRL reward takes lists and returns a list: score one completion and return a float)"),
    ("{m}:positional_only", "its positional-only 'level' cannot be given"),
])
def test_a_reward_that_cannot_be_used_is_one_clear_line(user_module, spec, needle):
    with pytest.raises(SettingsError) as info:
        load_rewards(task_settings([spec.format(m=user_module)]))
    assert needle.format(m=user_module) in str(info.value)


async def test_weighted_rewards_are_summed_and_each_is_kept(user_module):
    """answer inline-able but pooled here, by_level in the pool with its column, judged async on
    the loop, pid in the pool (another process): each scored under the contract, then summed."""
    m = user_module
    rewards = load_rewards(task_settings(["answer", {"fn": f"{m}:by_level", "weight": 0.5},
                                          {"fn": f"{m}:judged", "weight": 2.0}, {"fn": f"{m}:pid", "weight": 0}]))
    task = Task("t", "Calculate 3 + 4.", "7", {"level": 3, "source": "x"})
    scorer = Scorer(rewards, timeout_s=30, procs=1)
    try:
        score = await scorer.score(task, "<answer>7</answer>")
    finally:
        await scorer.aclose()
    assert score.reward == pytest.approx(1.2 + 0.5 * 3 + 2.0 * 0.5)
    assert score.passed and score.strict and not score.failed  # the first reward decides pass and strict
    assert score.components["answer"] == pytest.approx(1.2) and score.components["by_level"] == 3.0
    assert score.components["judged"] == 0.5 and score.components["pid"] not in (0.0, float(os.getpid()))


async def test_a_failing_reward_of_a_set_scores_zero_the_others_count(user_module):
    m = user_module
    rewards = load_rewards(task_settings([f"{m}:exact", f"{m}:broken", f"{m}:by_level"]))
    for procs in (0, 1):
        scorer = Scorer(rewards, timeout_s=30, procs=procs)
        try:
            missing = await scorer.score(T, "7")  # T has no level column: by_level fails too
            score = await scorer.score(Task("t", "p", "7", {"level": 2}), "7")
        finally:
            await scorer.aclose()
        assert missing.components == {"exact": 1.0, "broken": 0.0, "by_level": 0.0} and missing.failed
        assert score.reward == 3.0 and score.components["broken"] == 0.0 and score.failed
        assert scorer.failures == 3 and missing.passed and score.passed  # exact's: the first decides


async def test_columns_reach_a_reward_as_keywords_in_every_place_it_runs(user_module):
    m = user_module
    task = Task("t", "p", "7", {"level": 2, "bonus": 0.25, "other": 100})
    for spec, expected in ((f"{m}:by_level", 2.25), (f"{m}:every_column", 102.25)):
        for procs in (0, 1):
            scorer = Scorer(load_rewards(task_settings(spec)), timeout_s=30, procs=procs)
            try:
                score = await scorer.score(task, "x")
            finally:
                await scorer.aclose()
            assert score.reward == expected and not score.failed and score.components is None, (spec, procs)


def test_a_required_column_missing_from_the_rows_is_named(user_module):
    rewards = load_rewards(task_settings([f"{user_module}:exact", f"{user_module}:by_level"]))
    check_columns(rewards, [Task("1", "p", "1", {"level": 1}), Task("2", "p", "2", {"level": 2, "bonus": 1})])
    with pytest.raises(SettingsError, match=r"'by_level' requires a 'level' argument, and task '2' has no "
                                            r"such column \(its extra columns: bonus\)"):
        check_columns(rewards, [Task("1", "p", "1", {"level": 1}), Task("2", "p", "2", {"bonus": 1})])
    with pytest.raises(SettingsError, match="generated tasks have no columns"):
        check_columns(rewards, None)
    check_columns(load_rewards(task_settings(f"{user_module}:every_column")), None)  # **kwargs needs none


def test_overlong_penalty_is_daps_soft_punishment_by_hand():
    from areal_aio.rewards.scoring import Score, component_means, overlong_penalty, shaped

    # max 64 tokens, a buffer of 16: nothing up to 48, then -1/16 a token, -1 at 64
    assert [overlong_penalty(n, 64, 16, 1.0) for n in (10, 48, 49, 56, 64)] == [0.0, 0.0, -1 / 16, -0.5, -1.0]
    assert overlong_penalty(60, 64, 16, 0.4) == pytest.approx(-0.3)
    assert overlong_penalty(64, 64, 0, 1.0) == 0.0  # off
    base = Score(1.2, True, True)
    assert shaped(base, -0.5) == Score(0.7, True, True, components={"overlong": -0.5})
    assert shaped(base, 0.0) == Score(1.2, True, True, components={"overlong": 0.0})
    assert component_means([shaped(base, -0.5), shaped(base, 0.0), None]) == {"reward/overlong": -0.25}
    assert shaped(Score(0.0, False, failed=True), -0.5).reward == 0.0  # a failure stays a counted 0
    with pytest.raises(SettingsError, match="task.overlong_buffer"):
        build_settings({}, ["task.overlong_buffer=65", "rollout.max_new_tokens=64"])


def huge(task, text):
    return 1e308


async def test_a_reward_outside_the_sane_range_is_a_counted_failure_like_nan():
    async def huge_score(task, text):
        return Score(1e308, True)

    for fn, procs in ((huge, 0), (huge, 1), (huge_score, 0), (lambda t, c: -2 * REWARD_LIMIT, 0)):
        scorer = Scorer(fn, timeout_s=30, procs=procs)
        score = await scorer.score(T, "7")
        await scorer.aclose()
        assert score.failed and score.reward == 0.0 and scorer.failures == 1, fn
    for bad in (1e308, -1e308, REWARD_LIMIT * 1.5, Score(1e308, True)):
        with pytest.raises(TypeError, match="within"):
            as_score(bad)
    assert as_score(REWARD_LIMIT).reward == REWARD_LIMIT and as_score(-REWARD_LIMIT).reward == -REWARD_LIMIT
    with pytest.raises(ValueError, match="within"):
        AnswerReward(1e307)


async def test_weights_that_take_a_sum_out_of_the_sane_range_make_a_counted_failure():
    scorer = Scorer([Reward("a", lambda t, c: REWARD_LIMIT, weight=1e300), Reward("b", lambda t, c: 1.0)],
                    timeout_s=30, procs=0)
    score = await scorer.score(T, "7")
    assert score.failed and score.reward == 0.0 and scorer.failures == 1
    one = Scorer(Reward("a", lambda t, c: REWARD_LIMIT, weight=10.0), timeout_s=30, procs=0)
    assert (await one.score(T, "7")).failed and one.failures == 1


async def test_an_episode_returning_a_huge_reward_scores_zero_as_a_failure():
    async def episode(task, model):
        return 1e308

    async def sane(task, model):
        return 1.0

    # what play reads of a Model: a transcript whose last reply is in (no NoReply), nothing to abandon
    model = SimpleNamespace(transcript=Transcript(last=episodes.no_reply("g0.0.r0")), abandon=lambda: None)
    assert await episodes.play(sane, T, model, timeout_s=5) == (Score(1.0, True), None)  # the fake is enough
    score, failure = await episodes.play(episode, T, model, timeout_s=5)
    assert score.failed and score.reward == 0.0 and failure is not None
    assert isinstance(failure, TypeError) and "within" in str(failure), failure  # the range, not another error


def test_only_answer_check_tells_the_built_in_check_from_a_users_function():
    from areal_aio.rewards.scoring import only_answer_check

    builtin = Reward("answer", AnswerReward(0.2), 1.0)
    assert only_answer_check(builtin) and only_answer_check([builtin, builtin])
    assert not only_answer_check([builtin, Reward("mine", lambda t, c: 1.0, 1.0)])
