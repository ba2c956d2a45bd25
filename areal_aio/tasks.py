"""Task sources: where prompts and their verifiable answers come from.

A task source is any iterable (or async iterable) of `Task`. Built in:
  * arithmetic: reasoning-gym's basic_arithmetic, generated offline from a seed
    (two-term single-digit + and - by default), an endless stream for training
    and a fixed held-out set drawn from `task.eval_seed` for evaluation;
  * jsonl: a file of {"prompt": ..., "answer": ...} rows (an optional "id");
  * chain: multi-step arithmetic with a worked solution per task, in the step-tagged
    reply format (areal_aio/chain.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from areal_aio.settings import Settings, TaskSettings

ANSWER_INSTRUCTION = "Give only the final answer inside <answer></answer> tags."
EPOCH = 10_000
"""Arithmetic tasks per reseeded epoch of the endless training stream."""


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt with its reference answer; `id` is unique within a source."""

    id: str
    prompt: str
    answer: str


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


def read_jsonl(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file; a malformed row is an error naming its line."""
    tasks = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
        problem = _row_problem(row)
        if problem:
            raise ValueError(f"{path}:{number}: {problem}; expected an object with a prompt string "
                             f"and an answer (string or number)")
        tasks.append(Task(id=str(row.get("id", number)), prompt=row["prompt"], answer=str(row["answer"])))
    if not tasks:
        raise ValueError(f"{path}: no tasks (the file is empty)")
    return tasks


def _row_problem(row: object) -> str:
    """What is wrong with one JSONL row, or "" (a None or a list would become the text "None")."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        return "no prompt" if "prompt" not in row else f"prompt is {row['prompt']!r}"
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return "no answer" if "answer" not in row else f"answer is {answer!r}"
    return ""


def training_tasks(settings: Settings, start: int = 0) -> Iterator[Task]:
    """The default training stream of `settings` (endless: jsonl files are cycled), from its
    `start`-th task on (a resumed run continues where it stopped)."""
    if settings.task.name == "jsonl":
        rows = read_jsonl(settings.task.path)
        held_out = settings.task.eval_size if len(rows) > settings.task.eval_size else 0
        train = rows[:len(rows) - held_out]
        offset = start % len(train)
        return itertools.cycle(train[offset:] + train[:offset])
    if settings.task.name == "chain":
        from areal_aio.chain import chain_stream

        return chain_stream(settings.task, settings.run.seed, start)
    return arithmetic_stream(settings.task, settings.run.seed, start)


def eval_tasks(settings: Settings) -> list[Task]:
    """The held-out eval set: a different seed for arithmetic and chain; the file's last rows for jsonl
    (held out of training when the file has more rows than task.eval_size)."""
    if settings.task.name == "jsonl":
        rows = read_jsonl(settings.task.path)
        return rows[-settings.task.eval_size:]
    if settings.task.name == "chain":
        from areal_aio.chain import chain_eval

        return chain_eval(settings.task)
    return list(_arithmetic(settings.task, settings.task.eval_seed, settings.task.eval_size, "e"))
