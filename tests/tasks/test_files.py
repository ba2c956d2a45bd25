"""tasks/files.py: a task file's rows as Tasks, each bad row named by its line; a row with tests
is checked by the check the caller hands in (the judge's, from control/sources.py)."""

import orjson
import pytest

from areal_aio.tasks.files import read_jsonl

CHAT = [{"role": "system", "content": "Answer tersely."}, {"role": "user", "content": "What is 2 + 3?"}]


def test_jsonl_bad_rows_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_jsonl(path)


def rows_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return str(path)


def test_chat_rows_and_extra_columns(tmp_path):
    """{messages, answer} and {prompt: [turns], answer} are chats; other columns travel in extra."""
    path = rows_file(tmp_path, [
        {"messages": CHAT, "answer": 5, "difficulty": 2, "tags": ["add"]},
        {"prompt": CHAT[1:], "answer": "5", "id": "b"},
        {"prompt": "Say 5.", "answer": "5", "solution": {"steps": [5]}},
    ])
    chat, listed, plain = read_jsonl(path)
    assert chat.prompt == CHAT and chat.messages == CHAT and chat.text == "What is 2 + 3?"
    assert chat.answer == "5" and chat.extra == {"difficulty": 2, "tags": ["add"]} and chat.id == "1"
    assert listed.messages == CHAT[1:] and listed.id == "b" and listed.extra == {}
    assert plain.messages is None and plain.text == "Say 5." and plain.extra == {"solution": {"steps": [5]}}


@pytest.mark.parametrize("row,needle", [
    ({"messages": CHAT + [{"role": "assistant", "content": "5"}], "answer": 5}, "must end with a user turn"),
    ({"messages": [{"role": "robot", "content": "hi"}], "answer": 5}, "messages[0] is {'role': 'robot'"),
    ({"messages": [{"role": "user"}], "answer": 5}, "messages[0] is {'role': 'user'}"),
    ({"messages": [], "answer": 5}, "must end with a user turn"),
    ({"messages": "What is 2 + 3?", "answer": 5}, "messages is 'What is 2 + 3?'"),
    ({"messages": CHAT}, "no answer"),
    ({"messages": CHAT, "prompt": "x", "answer": 5}, "both prompt and messages"),
    ({"answer": 5}, "no prompt"),
])
def test_bad_chat_rows_name_the_line(tmp_path, row, needle):
    path = rows_file(tmp_path, [{"prompt": "fine", "answer": 1}, row])
    with pytest.raises(ValueError, match=r"rows.jsonl:2: ") as info:
        read_jsonl(path)
    assert needle in str(info.value)


def test_a_row_with_tests_needs_no_answer_and_gets_the_callers_check(tmp_path):
    path = rows_file(tmp_path, [{"prompt": "Write f.", "tests": [1], "entry_point": "f"},
                                {"prompt": "Write g.", "tests": "bad", "entry_point": "g", "answer": "x"}])
    first, second = read_jsonl(path)  # no check: the tests are taken as they are
    assert first.answer == "" and first.extra == {"tests": [1], "entry_point": "f"} and second.answer == "x"
    seen = []

    def check(row):
        seen.append(row["entry_point"])
        return "tests: not for this judge" if row["tests"] == "bad" else ""

    with pytest.raises(ValueError, match=r"rows.jsonl:2: tests: not for this judge"):
        read_jsonl(path, check)
    assert seen == ["f", "g"]
