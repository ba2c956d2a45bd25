"""Function tasks: items of (seed, index), the held-out variants, references that pass in the sandbox."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import random

import pytest

from areal_aio.control.sources import eval_tasks, training_tasks
from areal_aio.rewards.code import reward
from areal_aio.sandbox import sandbox
from areal_aio.settings import CODE_TASKS, build_settings
from areal_aio.tasks import function_tasks as ft


def fenced(source: str) -> str:
    return f"Here it is.\n```python\n{source}```"


def params(task) -> list[str]:
    """The argument names of the reference's def line."""
    return task.answer.split(f"def {task.extra['entry_point']}(", 1)[1].split("):", 1)[0].split(", ")


def passes(task) -> bool:
    """The reward's own call: the reply's program run in the sandbox on the task's tests."""
    return reward(task, fenced(task.answer), **task.extra).passed


def test_items_are_a_function_of_seed_and_index():
    a = list(itertools.islice(ft.function_stream(None, 0, 3), 20))
    assert [t.id for t in a] == [f"t{i}" for i in range(3, 23)]
    assert a == list(itertools.islice(ft.function_stream(None, 0, 3), 20))
    assert a[0] == ft.function_item(0, 3) != ft.function_item(1, 3)
    assert len({ft.function_item(0, i).prompt for i in range(2000)}) > 1900  # thousands of problems


def test_every_family_has_training_and_held_out_variants():
    assert len(ft.FAMILIES) >= 20
    for family in ft.FAMILIES:
        keys = [v.key for v in ft.variants(family)]
        assert len(set(keys)) == len(keys) and all(k.startswith(f"{family}/") for k in keys)
        assert ft.split(family, False) and ft.split(family, True)


def test_held_out_prompts_are_never_in_the_training_stream():
    held = {v.key for family in ft.FAMILIES for v in ft.split(family, True)}
    evals = ft.function_eval(None, seed=10_000, size=200)
    assert [t.id for t in evals[:2]] == ["e0", "e1"] and all(t.extra["variant"] in held for t in evals)
    assert len({t.extra["variant"].split("/")[0] for t in evals}) == len(ft.FAMILIES)
    train = list(itertools.islice(ft.function_stream(None, 0), 3000))
    assert not {t.extra["variant"] for t in train} & held
    assert not {t.prompt for t in train} & {t.prompt for t in evals}


def test_tests_are_json_and_no_constant_function_passes():
    for task in (ft.function_item(seed, i) for seed in (0, 1) for i in range(1500)):
        tests = task.extra["tests"]
        assert len(tests) >= ft.TESTS_PER_TASK and json.loads(json.dumps(task.extra)) == task.extra
        assert len({json.dumps(t["output"]) for t in tests}) > 1, task.id


def test_the_prompt_names_the_function_and_shows_one_example_only():
    for task in (ft.function_item(0, i) for i in range(500)):
        name, tests = task.extra["entry_point"], task.extra["tests"]
        assert f"`{name}({', '.join(params(task))})`" in task.prompt and "```python" in task.prompt
        example = f"{ft.call_text(name, tests[0]['args'])} returns {tests[0]['output']!r}."
        assert example in task.prompt and task.prompt.count("For example") == 1
        for test in tests[1:]:
            if test["args"] != tests[0]["args"]:
                assert ft.call_text(name, test["args"]) not in task.prompt


@pytest.mark.parametrize("key,expected", [
    ("sum_if/even", lambda xs: sum(x for x in xs if x % 2 == 0)),
    ("fizzbuzz/3_5_fizzbuzz", lambda n: "FizzBuzz" if n % 15 == 0 else "Fizz" if n % 3 == 0
     else "Buzz" if n % 5 == 0 else str(n)),
    ("number_is/prime", lambda n: n in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73,
                                        79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149, 151, 157,
                                        163, 167, 173, 179, 181, 191, 193, 197, 199)),
    ("count_chars/vowels", lambda s: len([ch for ch in s if ch in "aeiou"])),
])
def test_expected_outputs_are_what_the_prompt_asks_for(key, expected):
    variant = next(v for v in ft.variants(key.split("/")[0]) if v.key == key)
    for seed in range(20):
        tests = ft.variant_task(variant, random.Random(seed), "x").extra["tests"]
        assert all(t["output"] == expected(*t["args"]) for t in tests)


def test_every_familys_reference_passes_and_a_wrong_one_fails():
    rng = random.Random(0)
    for family in ft.FAMILIES:
        variant, other = rng.sample(ft.variants(family), 2)
        task = ft.variant_task(variant, rng, family)
        assert passes(task), (family, task.answer)
        if any(other.value(*t["args"]) != t["output"] for t in task.extra["tests"]):
            wrong = ft.reference(other, task.extra["entry_point"], params(task))
            assert not reward(task, fenced(wrong), **task.extra).passed, family
    task = ft.function_item(0, 0)
    assert not reward(task, fenced(f"def {task.extra['entry_point']}(*args):\n    return None\n"), **task.extra).passed


@pytest.mark.slow
def test_every_variants_reference_passes_its_tests_in_the_sandbox():
    """Each variant of every family once, under its own seed's names and inputs (a sandbox run each)."""
    tasks = [ft.variant_task(v, random.Random(f"{v.key}"), v.key) for family in ft.FAMILIES for v in ft.variants(family)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=sandbox.CONCURRENCY) as pool:
        failed = [t.id for t, ok in zip(tasks, pool.map(passes, tasks), strict=True) if not ok]
    assert failed == []


def test_the_run_sources_serve_functions():
    settings = build_settings({"task": {"name": "functions", "eval_size": 3}})
    assert "functions" in CODE_TASKS
    first = next(iter(training_tasks(settings, start=2)))
    assert first == next(iter(training_tasks(settings, start=2, in_loop=False))) == ft.function_item(0, 2)
    assert eval_tasks(settings) == ft.function_eval(settings.task)
    assert [t.id for t in eval_tasks(settings)] == ["e0", "e1", "e2"]


def test_answer_means_the_code_reward_and_sft_pairs_are_the_references():
    from areal_aio.app.sft import generated_pairs
    from areal_aio.rewards.scoring import load_rewards

    settings = build_settings({"task": {"name": "functions"}})
    assert load_rewards(settings.task).fn is reward
    pair = next(generated_pairs(settings))
    task = ft.function_item(settings.run.seed, 0)
    assert pair.prompt == task.prompt and pair.completion == f"```python\n{task.answer.strip()}\n```"
