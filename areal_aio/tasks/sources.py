"""Task sources: where prompts and their verifiable answers come from.

A task source is any iterable (or async iterable) of `Task`. Built in:
  * arithmetic: reasoning-gym's basic_arithmetic, generated offline from a seed
    (two-term single-digit + and - by default), an endless stream for training
    and a fixed held-out set drawn from `task.eval_seed` for evaluation;
  * chain: multi-step arithmetic with a worked solution per task, in the step-tagged
    reply format (areal_aio/tasks/chain.py);
  * rows from a file (`task.path`), cycled for training, the last `task.eval_size` held out:
      jsonl     one JSON object a line (a bad row is named as file:line)
      parquet   a Parquet file (pyarrow)
      datasets  a folder written by datasets' `save_to_disk` (its train split)
    Every format has the same columns: `prompt` (a string) or `messages` (a chat: system, user
    and assistant turns, the last one a user turn; a `prompt` holding such a list is one too),
    `answer` (a string or a number), an optional `id`; any other column travels with the Task
    (`Task.extra`) to the reward, which takes those its signature names.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from areal_aio.settings import Settings, TaskSettings

ANSWER_INSTRUCTION = "Give only the final answer inside <answer></answer> tags."
EPOCH = 10_000
"""Arithmetic tasks per reseeded epoch of the endless training stream."""


ROLES = ("system", "user", "assistant")
COLUMNS = ("id", "prompt", "messages", "answer")
"""The columns a task row is made of; any other column is the row's `extra`."""


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt with its reference answer; `id` is unique within a source.

    `prompt` is the user message, or a chat: a list of {"role", "content"} turns ending with a
    user turn (the rollout worker applies the model's chat template to the whole list).
    `extra` holds a file row's other columns (JSON values), handed to the reward as keywords."""

    id: str
    prompt: str | list[dict[str, str]]
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The turns of a chat task; None for a plain prompt."""
        return self.prompt if isinstance(self.prompt, list) else None

    @property
    def text(self) -> str:
        """The prompt as one text: itself, or a chat's last user turn (what tables show)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[-1]["content"]


def arithmetic_prompt(question: str) -> str:
    return f"{question} {ANSWER_INSTRUCTION}"


def _arithmetic(task: TaskSettings, seed: int, size: int, prefix: str, start: int = 0) -> Iterator[Task]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic", min_terms=task.terms, max_terms=task.terms, min_digits=task.digits,
        max_digits=task.digits, operators=tuple(task.operators), allow_parentheses=False,
        allow_negation=False, seed=seed, size=size)
    for index in range(start, size):
        item = dataset[index]
        yield Task(id=f"{prefix}{index}", prompt=arithmetic_prompt(item["question"]),
                   answer=str(item["answer"]))


def arithmetic_stream(task: TaskSettings, seed: int, start: int = 0) -> Iterator[Task]:
    """Endless training tasks: epoch e is drawn with seed (seed, e), so a run never repeats a
    stream. Task i is item i % EPOCH of epoch i // EPOCH: `start` skips to it directly."""
    first = start // EPOCH
    for epoch in itertools.count(first):
        yield from _arithmetic(task, seed * 1_000_003 + epoch, EPOCH, f"t{epoch}-",
                               start % EPOCH if epoch == first else 0)


EXPECTED = ("expected an object with a prompt string (or a messages list) and an answer "
            "(string or number)")


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


def read_jsonl(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file; a malformed row is an error naming its line."""
    tasks = [task_from_row(row, number, f"{path}:{number}") for number, row in jsonl_rows(path)]
    if not tasks:
        raise ValueError(f"{path}: no tasks (the file is empty)")
    return tasks


def read_parquet(path: str | Path) -> list[Task]:
    """Tasks from a Parquet file (or a folder of them); a bad row is named by its number."""
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
    return _from_rows(rows, path)


def read_dataset(path: str | Path) -> list[Task]:
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
    return _from_rows(data.to_list(), path)


READERS = {"jsonl": read_jsonl, "parquet": read_parquet, "datasets": read_dataset}


def read_tasks(task: TaskSettings) -> list[Task] | None:
    """All rows of a file source (`task.path`); None for a generated source (arithmetic)."""
    reader = READERS.get(task.name)
    return reader(task.path) if reader is not None else None


def _from_rows(rows: list[Any], path: str | Path) -> list[Task]:
    tasks = [task_from_row(row, number, f"{path}: row {number}") for number, row in enumerate(rows, start=1)]
    if not tasks:
        raise ValueError(f"{path}: no tasks (no rows)")
    return tasks


def task_from_row(row: Any, number: int, where: str) -> Task:
    """One row as a Task (`number` is its id when it has none); ValueError naming `where`."""
    problem = _row_problem(row)
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
                answer=str(row["answer"]), extra=extra)


def _row_problem(row: object) -> str:
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


def training_tasks(settings: Settings, start: int = 0, rows: list[Task] | None = None) -> Iterator[Task]:
    """The default training stream of `settings` (endless: file rows are cycled), from its
    `start`-th task on (a resumed run continues where it stopped). `rows`: the file's rows when
    the caller has read them already (read_tasks)."""
    rows = rows if rows is not None else read_tasks(settings.task)
    if rows is not None:
        held_out = settings.task.eval_size if len(rows) > settings.task.eval_size else 0
        train = rows[:len(rows) - held_out]
        offset = start % len(train)
        return itertools.cycle(train[offset:] + train[:offset])
    if settings.task.name == "chain":
        from areal_aio.tasks.chain import chain_stream

        return chain_stream(settings.task, settings.run.seed, start)
    return arithmetic_stream(settings.task, settings.run.seed, start)


def eval_tasks(settings: Settings, rows: list[Task] | None = None) -> list[Task]:
    """The held-out eval set: a different seed for arithmetic and chain; a file's last rows (held
    out of training when the file has more rows than task.eval_size)."""
    rows = rows if rows is not None else read_tasks(settings.task)
    if rows is not None:
        return rows[-settings.task.eval_size:]
    if settings.task.name == "chain":
        from areal_aio.tasks.chain import chain_eval

        return chain_eval(settings.task)
    return list(_arithmetic(settings.task, settings.task.eval_seed, settings.task.eval_size, "e"))


async def task_stream(tasks: Iterable[Task] | AsyncIterable[Task], skip: int = 0) -> AsyncIterator[Task]:
    """Any iterable or async iterable of tasks as one async stream, its first `skip` left out
    (a resumed run's source: the tasks the run had already taken)."""
    if isinstance(tasks, AsyncIterable):
        async for task in tasks:
            if skip:
                skip -= 1
                continue
            yield task
    else:
        for task in itertools.islice(tasks, skip, None):
            yield task
