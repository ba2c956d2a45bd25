"""Code tasks: HumanEval from its wheel, codeio items made in the sandbox, a user's JSONL."""

from __future__ import annotations

import itertools
import json

import pytest

from areal_aio.rewards.code import judge, reward
from areal_aio.tasks import code_tasks
from areal_aio.tasks.code_tasks import (
    code_item,
    code_stream,
    code_stream_async,
    humaneval_rows,
    humaneval_tasks,
)


def canonical(row: dict) -> str:
    return f"```python\n{row['prompt']}{row['canonical_solution']}\n```"


def test_humaneval_is_read_from_its_wheel():
    rows = humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0"
    first = humaneval_tasks(2)
    assert [t.id for t in first] == ["HumanEval/0", "HumanEval/1"]
    assert set(first[0].extra) == {"tests", "entry_point", "prefix"}
    assert first[0].extra["prefix"] in first[0].prompt or first[0].extra["prefix"].strip() in first[0].prompt


@pytest.mark.parametrize("index", [0, 32, 33, 38, 50])  # plain; property check; calls itself by name; random
def test_humaneval_canonical_solutions_pass_and_stubs_fail(index):
    row, task = humaneval_rows()[index], humaneval_tasks()[index]
    assert reward(task, canonical(row), **task.extra).passed
    assert reward(task, row["canonical_solution"], **task.extra).passed  # a continuation of the stub
    assert not reward(task, f"```python\n{row['prompt']}    return None\n```", **task.extra).passed


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes():
    failed = [t.id for row, t in zip(humaneval_rows(), humaneval_tasks(), strict=True)
              if not judge(canonical(row), **t.extra)[0]]
    assert failed == []


def test_code_items_are_a_function_of_seed_and_index():
    a = list(itertools.islice(code_stream(None, 0, 3), 2))
    b = list(itertools.islice(code_stream(None, 0, 3), 2))
    assert [t.id for t in a] == ["t3", "t4"] and a == b
    assert code_item(1, 3) != a[0]
    task = a[0]
    assert task.extra["entry_point"] == "main_solution" and len(task.extra["tests"]) >= code_tasks.MIN_TESTS
    assert "main_solution(" in task.text and "```python" in task.text
    json.dumps(task.extra)  # JSON all the way: it travels in sample rows and pipes


def test_a_reference_solution_passes_its_items_tests_and_a_wrong_one_fails():
    task = code_item(0, 0)
    assert reward(task, f"```python\n{task.answer}\n```", **task.extra).passed
    assert not reward(task, "```python\ndef main_solution(**kw):\n    return None\n```", **task.extra).passed


def test_held_out_problems_are_never_trained_on():
    train, held = set(code_tasks.split(False)), set(code_tasks.split(True))
    assert not train & held and len(train) + len(held) == len(code_tasks.codeio_problems())
    assert code_item(0, 0, held_out=True).extra["problem"] in held
    assert all(code_item(0, i).extra["problem"] in train for i in range(3))


async def test_the_async_stream_gives_the_same_items():
    got = []
    async for task in code_stream_async(None, 0, 2, prefetch=3):
        got.append(task)
        if len(got) == 3:
            break
    assert got == list(itertools.islice(code_stream(None, 0, 2), 3))


def test_the_held_out_set_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path))
    first = code_tasks.code_eval(None, seed=5, size=2)
    assert [t.id for t in first] == ["e0", "e1"]
    assert list((tmp_path / "code").glob("codeio-eval-5-2-*.json"))
    assert code_tasks.code_eval(None, seed=5, size=2) == first


def test_a_users_jsonl_of_code_tasks(tmp_path):
    rows = [
        {"prompt": "add", "tests": [{"args": [1, 2], "output": 3}], "entry_point": "add"},
        {"prompt": "echo", "tests": [{"stdin": "x", "stdout": "x"}], "id": "io"},
        {"prompt": "check", "tests": "def check(candidate):\n    assert candidate(2) == 4", "entry_point": "sq"},
    ]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    read = code_tasks.read_code_jsonl(path)
    assert [t.id for t in read] == ["r0", "io", "r2"]
    assert reward(read[0], "def add(a, b):\n    return a + b", **read[0].extra).passed
    assert reward(read[1], "print(input())", **read[1].extra).passed
    assert reward(read[2], "def sq(x):\n    return x * x", **read[2].extra).passed


@pytest.mark.parametrize("row,message", [
    ({"prompt": "p"}, "prompt string and tests"),
    ({"prompt": "p", "tests": [{"args": [1], "output": 2}]}, "need an entry_point"),
    ({"prompt": "p", "tests": "assert f(1) ==", "entry_point": "f"}, "does not parse"),
    ({"prompt": "p", "tests": [{"foo": 1}]}, "each needs an output"),
    ({"prompt": "p", "tests": [{"output": 1, "args": 3}], "entry_point": "f"}, "args must be a list"),
    ({"prompt": "p", "tests": "assert True", "entry_point": "no such"}, "not a function name"),
])
def test_a_bad_row_is_named_by_its_line(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "tests": [{"stdin": "", "stdout": ""}]}) + "\n" + json.dumps(row))
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{message}"):
        code_tasks.read_code_jsonl(path)


@pytest.mark.slow
def test_the_run_command_trains_on_code_tasks_end_to_end(tmp_path):
    """`python -m areal_aio run` with task.name = code: pre-flight, the real workers on
    tiny-random, items and rewards made in the sandbox (tiny-random writes no program: rewards
    0, none failed), a clean end."""
    import subprocess
    import sys

    import orjson

    from tests.conftest import ROOT

    sets = ["model.path=embedded:tiny-random", "task.name=code", "rollout.max_new_tokens=8",
            "rollout.group_size=2", "trainer.batch_size=4", "task.eval_size=2", "task.eval_every=2",
            "run.max_steps=2", "run.progress=false", "trainer.bf16=false", "controller.reward_procs=1"]
    done = subprocess.run([sys.executable, "-m", "areal_aio", "run", str(ROOT / "settings.toml"),
                           *[arg for kv in sets for arg in ("--set", kv)], "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert summary["ended"] == "completed" and summary["steps"] == 2 and summary["reward_failures"] == 0
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    assert {r["task_id"][0] for r in rows if r["kind"] == "train"} == {"t"}
    assert {r["task_id"] for r in rows if r["kind"] == "eval"} == {"e0", "e1"}
