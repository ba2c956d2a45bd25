"""The task sources a run trains and evaluates on, chosen by `task.name`.

A task source is any iterable (or async iterable) of `Task` (tasks/task.py). Built in:
  * arithmetic: reasoning-gym's basic_arithmetic, generated offline (tasks/arithmetic.py);
  * calculator: the same problems, trained as episodes with a calculator tool
    (tasks/calculator.py; the episode: agents/calculator.py); its held-out eval is the same
    episode on held-out problems, with the same instruction (greedy: control/evaluation.py
    run_episodes);
  * chain: multi-step arithmetic with a worked solution per task, in the step-tagged reply
    format (tasks/chain.py, tasks/steps.py);
  * code: write a Python function, judged by running tests in the sandbox (tasks/code_tasks.py):
    training items from reasoning-gym's CodeI/O problems, each made by a sandbox run (in
    threads, off the event loop: `code_stream_async`); the eval set from its held-out problems
    (code) or HumanEval (humaneval: trained on CodeI/O, scored on HumanEval);
  * functions: small common functions to write (sum the even numbers of a list, count vowels,
    gcd, fizzbuzz), made in process with their tests, no sandbox run
    (tasks/function_tasks.py), judged as code is; the eval set from each family's held-out
    variants;
  * rows from a file (`task.path`): jsonl, parquet, datasets (tasks/files.py; `read_tasks`
    here checks a code row's tests as the judge reads them), cycled for training, the last
    `task.eval_size` held out.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

from areal_aio.settings import CODE_TASKS, Settings, TaskSettings
from areal_aio.tasks import files
from areal_aio.tasks.arithmetic import arithmetic_stream, arithmetic_tasks
from areal_aio.tasks.calculator import calculator_eval, calculator_stream
from areal_aio.tasks.chain import chain_eval, chain_stream
from areal_aio.tasks.task import Task


def read_tasks(task: TaskSettings) -> list[Task] | None:
    """All rows of a file source (`task.path`); None for a generated source. A row with tests
    is checked as the code judge reads it (a bad one is named by its line, as any bad row is)."""
    from areal_aio.tasks.code_tasks import tests_columns_problem

    return files.read_tasks(task, check_tests=tests_columns_problem)


def training_tasks(settings: Settings, start: int = 0, rows: list[Task] | None = None, *,
                   in_loop: bool = True) -> Iterator[Task] | AsyncIterator[Task]:
    """The default training stream of `settings` (endless: file rows are cycled), from its
    `start`-th task on (a resumed run continues where it stopped). `rows`: the file's rows when
    the caller has read them already (read_tasks). `in_loop`: the caller is an event loop, so
    tasks that take a subprocess to make (code) come as an async stream made in threads;
    False: always a plain iterator (`sft`)."""
    rows = rows if rows is not None else read_tasks(settings.task)
    if rows is not None:
        held_out = settings.task.eval_size if len(rows) > settings.task.eval_size else 0
        train = rows[:len(rows) - held_out]
        offset = start % len(train)
        return itertools.cycle(train[offset:] + train[:offset])
    if settings.task.name == "chain":
        return chain_stream(settings.task, settings.run.seed, start)
    if settings.task.name == "calculator":
        return calculator_stream(settings.task, settings.run.seed, start)
    if settings.task.name == "functions":
        from areal_aio.tasks.function_tasks import function_stream

        return function_stream(settings.task, settings.run.seed, start)
    if settings.task.name in CODE_TASKS:
        from areal_aio.tasks.code_tasks import code_stream, code_stream_async

        return (code_stream_async if in_loop else code_stream)(settings.task, settings.run.seed, start)
    return arithmetic_stream(settings.task, settings.run.seed, start)


def eval_tasks(settings: Settings, rows: list[Task] | None = None) -> list[Task]:
    """The held-out eval set: a different seed for arithmetic and chain; a file's last rows (held
    out of training when the file has more rows than task.eval_size)."""
    rows = rows if rows is not None else read_tasks(settings.task)
    if rows is not None:
        return rows[-settings.task.eval_size:]
    if settings.task.name == "chain":
        return chain_eval(settings.task)
    if settings.task.name == "humaneval":
        from areal_aio.tasks.code_tasks import humaneval_tasks

        return humaneval_tasks()  # pass@1 over HumanEval is over its 164, whatever task.eval_size
    if settings.task.name == "code":
        from areal_aio.tasks.code_tasks import code_eval

        return code_eval(settings.task)
    if settings.task.name == "functions":
        from areal_aio.tasks.function_tasks import function_eval

        return function_eval(settings.task)
    if settings.task.name == "calculator":
        return calculator_eval(settings.task)
    return list(arithmetic_tasks(settings.task, settings.task.eval_seed, settings.task.eval_size, "e"))
