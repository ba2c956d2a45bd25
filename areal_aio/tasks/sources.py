"""The task sources a run trains and evaluates on, chosen by `task.name`.

A task source is any iterable (or async iterable) of `Task` (tasks/task.py). Built in:
  * arithmetic: reasoning-gym's basic_arithmetic, generated offline (tasks/arithmetic.py);
  * chain: multi-step arithmetic with a worked solution per task, in the step-tagged reply
    format (tasks/chain.py, tasks/steps.py);
  * rows from a file (`task.path`): jsonl, parquet, datasets (tasks/files.py), cycled for
    training, the last `task.eval_size` held out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from areal_aio.settings import Settings
from areal_aio.tasks.arithmetic import arithmetic_stream, arithmetic_tasks
from areal_aio.tasks.chain import chain_eval, chain_stream
from areal_aio.tasks.files import read_tasks
from areal_aio.tasks.task import Task


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
        return chain_stream(settings.task, settings.run.seed, start)
    return arithmetic_stream(settings.task, settings.run.seed, start)


def eval_tasks(settings: Settings, rows: list[Task] | None = None) -> list[Task]:
    """The held-out eval set: a different seed for arithmetic and chain; a file's last rows (held
    out of training when the file has more rows than task.eval_size)."""
    rows = rows if rows is not None else read_tasks(settings.task)
    if rows is not None:
        return rows[-settings.task.eval_size:]
    if settings.task.name == "chain":
        return chain_eval(settings.task)
    return list(arithmetic_tasks(settings.task, settings.task.eval_seed, settings.task.eval_size, "e"))
