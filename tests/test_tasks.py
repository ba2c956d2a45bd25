import itertools

import pytest

from areal_aio.settings import build_settings
from areal_aio.tasks import ANSWER_INSTRUCTION, eval_tasks, read_jsonl, training_tasks


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
    s = build_settings({"task": {"terms": 3, "digits": 2, "operators": ["*"]}})
    task = next(training_tasks(s))
    assert task.prompt.count("*") == 2


def test_jsonl_source_holds_out_eval_rows(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(f'{{"prompt": "q{i}", "answer": "{i}"}}' for i in range(10)) + "\n")
    s = build_settings({"task": {"name": "jsonl", "path": str(path), "eval_size": 3}})
    ev = eval_tasks(s)
    assert [t.prompt for t in ev] == ["q7", "q8", "q9"]
    train = list(itertools.islice(training_tasks(s), 14))
    assert [t.prompt for t in train[:8]] == [f"q{i}" for i in range(7)] + ["q0"]


def test_jsonl_bad_rows_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_jsonl(path)


def test_streams_resume_at_any_position(tmp_path):
    """A resumed run continues its task stream where it stopped: start=n is the stream minus n."""
    from areal_aio.tasks import EPOCH, arithmetic_stream, training_tasks

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
