"""A user's task file (`task.path`): rows cycled for training, the last `task.eval_size` held out.

  jsonl     one JSON object a line (a bad row is named as file:line)
  parquet   a Parquet file (pyarrow)
  datasets  a folder written by datasets' `save_to_disk` (its train split)

Every format has the same columns: `prompt` (a string) or `messages` (a chat: system, user and
assistant turns, the last one a user turn; a `prompt` holding such a list is one too), `answer`
(a string or a number), an optional `id`; any other column travels with the Task (`Task.extra`)
to the reward, which takes those its signature names. A row with `tests` is a code task (its
answer optional); whether the judge can read its tests is the judge's rule, which the caller
hands in as `check_tests` (control/sources.py read_tasks does), since tasks/ sit below rewards/."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from areal_aio.settings import TaskSettings
from areal_aio.tasks.task import Task

ROLES = ("system", "user", "assistant")


TestsCheck = Callable[[dict[str, Any]], str]
"""What is wrong with a code row's tests for the judge, or "" (tasks/code_tasks.py
tests_columns_problem)."""

COLUMNS = ("id", "prompt", "messages", "answer")
"""The columns a task row is made of; any other column is the row's `extra`."""


EXPECTED = ("expected an object with a prompt string (or a messages list) and an answer "
            "(string or number), or tests for a code task")


def jsonl_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row) of each non-blank line; a line that is not JSON is a
    ValueError naming it."""
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None


def read_jsonl(path: str | Path, check_tests: TestsCheck | None = None) -> list[Task]:
    """Tasks from a JSONL file; a malformed row is an error naming its line."""
    tasks = [task_from_row(row, number, f"{path}:{number}", check_tests) for number, row in jsonl_rows(path)]
    if not tasks:
        raise ValueError(f"{path}: no tasks (the file is empty)")
    return tasks


def read_parquet(path: str | Path, check_tests: TestsCheck | None = None) -> list[Task]:
    """Tasks from a Parquet file (or a folder of them); a bad row is named by its number."""
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
    return _from_rows(rows, path, check_tests)


def read_dataset(path: str | Path, check_tests: TestsCheck | None = None) -> list[Task]:
    """Tasks from a folder written by `Dataset.save_to_disk` (of a DatasetDict: its train split,
    or its only split). Read from the folder alone: nothing is downloaded."""
    import datasets

    if not Path(path).exists():
        raise FileNotFoundError(path)
    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: not a folder written by datasets' save_to_disk ({exc})") from None
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        if "train" not in data and len(splits) != 1:
            raise ValueError(f"{path}: a DatasetDict with splits {', '.join(splits)} and no train split; "
                             f"save the split to train on")
        data = data["train" if "train" in data else splits[0]]
    return _from_rows(data.to_list(), path, check_tests)


READERS = {"jsonl": read_jsonl, "parquet": read_parquet, "datasets": read_dataset}


def read_tasks(task: TaskSettings, check_tests: TestsCheck | None = None) -> list[Task] | None:
    """All rows of a file source (`task.path`); None for a generated source (arithmetic).
    `check_tests`: the judge's check of a row with tests (None: taken as they are)."""
    reader = READERS.get(task.name)
    return reader(task.path, check_tests) if reader is not None else None


def _from_rows(rows: list[Any], path: str | Path, check_tests: TestsCheck | None) -> list[Task]:
    tasks = [task_from_row(row, number, f"{path}: row {number}", check_tests)
             for number, row in enumerate(rows, start=1)]
    if not tasks:
        raise ValueError(f"{path}: no tasks (no rows)")
    return tasks


def task_from_row(row: Any, number: int, where: str, check_tests: TestsCheck | None = None) -> Task:
    """One row as a Task (`number` is its id when it has none); ValueError naming `where`."""
    problem = _row_problem(row, check_tests)
    if problem:
        raise ValueError(f"{where}: {problem}; {EXPECTED}")
    prompt = row["messages"] if "messages" in row else row["prompt"]
    if isinstance(prompt, list):
        prompt = [{"role": turn["role"], "content": turn["content"]} for turn in prompt]
    extra = {key: value for key, value in row.items() if key not in COLUMNS}
    try:
        orjson.dumps(extra)  # a checkpoint keeps the tasks in flight as JSON
    except TypeError as exc:
        raise ValueError(f"{where}: a column holds a value that is not JSON data ({exc})") from None
    return Task(id=str(row["id"]) if row.get("id") is not None else str(number), prompt=prompt,
                answer=str(row.get("answer", "")), extra=extra)


def _row_problem(row: object, check_tests: TestsCheck | None) -> str:
    """What is wrong with one row, or "" (a None or a list would become the text "None")."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if "messages" in row and "prompt" in row:
        return "both prompt and messages; give one"
    key = "messages" if "messages" in row else "prompt"
    prompt = row.get(key)
    if isinstance(prompt, list):
        if problem := _chat_problem(key, prompt):
            return problem
    elif key == "messages" or not isinstance(prompt, str) or not prompt.strip():
        return "no prompt" if key not in row else f"{key} is {prompt!r}"
    if "tests" in row:  # a code task: judged by its tests (rewards/code.py), an answer optional
        if check_tests is not None and (problem := check_tests(row)):
            return problem
        if "answer" not in row:
            return ""
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "no answer" if "answer" not in row else f"answer is {answer!r}"
    return ""


def _chat_problem(key: str, turns: list) -> str:
    """What is wrong with a chat prompt, or "": turns of {role, content}, the last a user's."""
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            return (f"{key}[{i}] is {turn!r}; a turn is {{\"role\": system | user | assistant, "
                    f"\"content\": text}}")
    if not turns or turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        return f"{key} must end with a user turn that has content"
    return ""
