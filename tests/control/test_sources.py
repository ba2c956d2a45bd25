"""control/sources.py: the tasks a run trains and evaluates on, as settings name them: generated
streams, a file's rows (cycled, the last held out), code tasks from the sandbox."""

import itertools

import orjson
import pytest

from areal_aio.control.sources import eval_tasks, read_tasks, training_tasks
from areal_aio.settings import build_settings
from areal_aio.tasks.arithmetic import ANSWER_INSTRUCTION
from areal_aio.tasks.files import read_dataset, read_parquet


def test_arithmetic_stream_is_two_term_single_digit_and_seeded():
    s = build_settings({})
    first = list(itertools.islice(training_tasks(s), 50))
    again = list(itertools.islice(training_tasks(s), 50))
    assert first == again
    for task in first:
        assert ANSWER_INSTRUCTION in task.prompt
        expr = task.prompt.split("Calculate ")[1].split(".")[0]
        a, op, b = expr.split()
        assert 0 <= int(a) <= 10 and 0 <= int(b) <= 10 and op in "+-"  # reasoning-gym's 1 digit is 0..10
        assert int(task.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    other = list(itertools.islice(training_tasks(build_settings({"run": {"seed": 1}})), 50))
    assert other != first


def test_eval_set_is_fixed_and_from_another_seed():
    s = build_settings({"task": {"eval_size": 20}})
    ev = eval_tasks(s)
    assert len(ev) == 20 and ev == eval_tasks(s)
    train = list(itertools.islice(training_tasks(s), 20))
    assert [t.prompt for t in ev] != [t.prompt for t in train]
    assert {t.id for t in ev}.isdisjoint(t.id for t in train)


def test_difficulty_settings():
    s = build_settings({"task": {"terms": 3, "digits": 2, "operators": ["-"]}})
    task = next(training_tasks(s))
    assert task.prompt.count("-") == 2


def test_arithmetic_answers_are_the_expressions_values():
    s = build_settings({"task": {"terms": 4, "digits": 2}})
    for task in itertools.islice(training_tasks(s), 200):
        expression = task.prompt.removeprefix("Calculate ").split(".")[0]
        assert int(task.answer) == eval(expression), task  # only digits, + and - here


def test_jsonl_source_holds_out_eval_rows(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(f'{{"prompt": "q{i}", "answer": "{i}"}}' for i in range(10)) + "\n")
    s = build_settings({"task": {"name": "jsonl", "path": str(path), "eval_size": 3}})
    ev = eval_tasks(s)
    assert [t.prompt for t in ev] == ["q7", "q8", "q9"]
    train = list(itertools.islice(training_tasks(s), 14))
    assert [t.prompt for t in train[:8]] == [f"q{i}" for i in range(7)] + ["q0"]


def test_streams_resume_at_any_position(tmp_path):
    """A resumed run continues its task stream where it stopped: start=n is the stream minus n."""
    from areal_aio.tasks.arithmetic import EPOCH, arithmetic_stream

    settings = build_settings({}, ["run.seed=3"])
    whole = list(itertools.islice(training_tasks(settings), 40))
    assert list(itertools.islice(training_tasks(settings, start=17), 23)) == whole[17:]
    later = list(itertools.islice(arithmetic_stream(settings.task, 3, start=EPOCH - 2), 4))
    assert [t.id for t in later] == [f"t0-{EPOCH - 2}", f"t0-{EPOCH - 1}", "t1-0", "t1-1"]
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(f'{{"prompt": "p{i}", "answer": "{i}"}}\n' for i in range(5)))
    js = build_settings({}, ["task.name=jsonl", f"task.path={str(rows)!r}", "task.eval_size=1"])
    cycled = list(itertools.islice(training_tasks(js), 12))
    assert list(itertools.islice(training_tasks(js, start=6), 6)) == cycled[6:]


CHAT = [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_a_file_rows_tests_are_checked_as_the_judge_reads_them(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text('{"prompt": "Write f.", "tests": [{"args": [1], "output": 2}], "entry_point": "f"}\n'
                    '{"prompt": "Write g.", "tests": [{"args": [1]}], "entry_point": "g"}\n')
    s = build_settings({"task": {"name": "jsonl", "path": str(path)}})
    with pytest.raises(ValueError, match=r"code.jsonl:2: tests: each needs an output"):
        read_tasks(s.task)


def test_parquet_file_is_a_task_source(tmp_path):
    import pyarrow  # the data extra; dev installs it
    import pyarrow.parquet as pq

    rows = [{"messages": CHAT, "answer": str(i), "difficulty": i} for i in range(6)]
    pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "tasks.parquet")
    s = build_settings({"task": {"name": "parquet", "path": str(tmp_path / "tasks.parquet"), "eval_size": 2}})
    tasks = read_tasks(s.task)
    assert [t.answer for t in tasks] == [str(i) for i in range(6)]
    assert tasks[3].messages == CHAT and tasks[3].extra == {"difficulty": 3} and tasks[3].id == "4"
    assert [t.answer for t in eval_tasks(s)] == ["4", "5"]
    assert [t.answer for t in itertools.islice(training_tasks(s), 5)] == ["0", "1", "2", "3", "0"]
    pq.write_table(pyarrow.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]),
                   tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet: row 2: prompt is None"):
        read_parquet(tmp_path / "bad.parquet")
    (tmp_path / "not.parquet").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"not.parquet: not a Parquet file"):
        read_parquet(tmp_path / "not.parquet")
    pq.write_table(pyarrow.Table.from_pylist([{"prompt": "a", "answer": "1", "blob": b"\x00"}]),
                   tmp_path / "blob.parquet")
    with pytest.raises(ValueError, match=r"blob.parquet: row 1: a column holds a value that is not JSON"):
        read_parquet(tmp_path / "blob.parquet")


def test_datasets_folder_is_a_task_source(tmp_path):
    import datasets  # the data extra; dev installs it

    rows = {"prompt": [f"q{i}" for i in range(5)], "answer": [i for i in range(5)], "level": list(range(5))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    tasks = read_dataset(tmp_path / "plain")
    assert [(t.prompt, t.answer, t.extra) for t in tasks[:2]] == [("q0", "0", {"level": 0}), ("q1", "1", {"level": 1})]
    chat = datasets.Dataset.from_list([{"messages": CHAT, "answer": "5"}])
    datasets.DatasetDict({"train": chat, "test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dd"))
    s = build_settings({"task": {"name": "datasets", "path": str(tmp_path / "dd")}})
    (task,) = read_tasks(s.task)  # the train split
    assert task.messages == CHAT and task.text == "What is 2 + 3?"
    datasets.DatasetDict({"a": chat, "b": chat}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"splits a, b and no train split"):
        read_dataset(tmp_path / "two")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: not a folder written by datasets' save_to_disk"):
        read_dataset(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        read_dataset(tmp_path / "missing")


# ---------------------------------------------------------------- code tasks


def code_settings(name: str = "code", **task):
    return build_settings({"task": {"name": name, "eval_size": 3, **task}})


async def test_code_tasks_come_as_an_async_stream_and_sft_gets_a_plain_one():
    from areal_aio.tasks.code_tasks import code_stream

    s = code_settings()
    stream = training_tasks(s, start=1)
    first = await anext(stream)
    await stream.aclose()
    assert first == next(iter(training_tasks(s, start=1, in_loop=False))) == next(code_stream(None, 0, 1))
    assert first.extra["entry_point"] == "main_solution" and len(first.extra["tests"]) >= 3


def test_code_evaluates_on_held_out_problems_and_humaneval_on_humaneval(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path))
    held = eval_tasks(code_settings())
    assert [t.id for t in held] == ["e0", "e1", "e2"]
    assert all(t.extra["problem"] % 10 == 0 for t in held)
    human = eval_tasks(code_settings("humaneval"))
    assert [t.id for t in human] == [f"HumanEval/{i}" for i in range(164)]


def test_answer_means_the_code_reward_for_a_code_task():
    from areal_aio.rewards.code import reward
    from areal_aio.rewards.scoring import AnswerReward, load_rewards

    assert load_rewards(code_settings().task).fn is reward
    assert load_rewards(code_settings("humaneval").task).fn is reward
    assert isinstance(load_rewards(build_settings({}).task).fn, AnswerReward)


async def test_a_run_on_code_tasks_is_judged_in_the_sandbox(tmp_path, monkeypatch):
    """The controller's own sources (no tasks given): code items from the async stream, the
    held-out problems, the code reward; a fake policy that writes each problem's reference
    solution from version 2 on, and a wrong function before."""
    from areal_aio.control.controller import Orchestrator
    from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
    from areal_aio.tasks.code_tasks import code_eval, code_stream
    from tests.conftest import make_settings

    monkeypatch.setenv("AREAL_AIO_CACHE", str(tmp_path / "cache"))
    settings = make_settings("sync", **{"task.name": "code", "task.eval_size": 2, "run.max_steps": 3,
                                        "task.eval_every": 3})
    known = {t.prompt: t.answer for t in code_eval(settings.task)}
    items = code_stream(None, settings.run.seed, 0)

    def policy(prompt: str, version: int) -> str:
        while prompt not in known:
            item = next(items)
            known[item.prompt] = item.answer
        body = known[prompt] if version >= 2 else "def main_solution(*args, **kwargs):\n    return None\n"
        return f"Here it is.\n```python\n{body}\n```"

    summary = await Orchestrator(settings, out_dir=tmp_path / "run", rollout=FakeRollout(policy=policy),
                                 trainer=FakeTrainer()).run()
    assert summary["error"] is None and summary["steps"] == 3 and summary["reward_failures"] == 0
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    trained = [r for r in rows if r["kind"] == "train" and r["dropped"] is None]
    assert {r["reward"] for r in trained if r["newest_version"] < 2} == {0.0}
    assert {r["reward"] for r in trained if r["oldest_version"] >= 2} == {1.0}
    assert [(e["step"], e["pass_rate"]) for e in summary["eval_curve"]] == [(0, 0.0), (3, 1.0)]
