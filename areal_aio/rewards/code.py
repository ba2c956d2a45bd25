"""The code reward: run the program a completion holds in the sandbox, judge its outputs here.

    completion --extract_program--> program --+ harness --sandbox.run--> fd 3: one JSON line a test
                                                                          |  (values, encoded)
    task.extra["tests"] (expected values, never sent) ---- compare here <-+

`task.reward = "areal_aio.rewards.code:reward"`; the task's columns say what to run:
  * tests = [{"args": [...], "kwargs": {...}, "output": v}, ...], entry_point = "f": the harness
    calls f on each input and writes what it returned, strictly encoded; the parent decodes and
    compares with `output` (JSON semantics: a tuple is a list; floats to 1e-6 relative);
  * tests = [{"stdin": "...", "stdout": "..."}, ...]: the program is run once per test; its
    stdout is compared line by line (trailing blanks ignored);
  * tests = "<test code>" with `def check(candidate): assert ...` (HumanEval), or bare asserts
    calling entry_point: one sandbox run, two processes; the driver's verdict is the one read.
How each kind is run, and what crosses the sandbox's wall, is sandbox/programs.py's; here is
what a completion is judged as.

`packages` (a column): packages besides the standard library the program may import (bound
read-only into the sandbox; none by default); codeio items name what their reference imports.
Reward 1 when every test passes, else 0 (`passed` the same; `strict`: passed and fenced).
The program comes from the last ```python block of the completion, else the whole text; an
unclosed block (a reply cut at max_new_tokens) counts from its opening fence. `prefix` (a
column) is code placed before it: HumanEval's prompt (imports, helpers, the stub).
The sandbox failing to start is not the program's fault: Score(failed=True), counted apart.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any

from areal_aio.rewards.scoring import Score
from areal_aio.sandbox import sandbox
from areal_aio.sandbox.programs import parse, run_check_tests, run_function_tests, run_stdio_tests
from areal_aio.tasks.task import Task

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_program(completion: str) -> tuple[str, bool]:
    """(the program, whether it came from a fenced block): the last ```python block (or the
    last untagged one), else the whole text."""
    blocks = FENCE.findall(completion)
    if not blocks:
        return completion, False
    python = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    plain = [body for tag, body in blocks if not tag]
    chosen = python or plain or [blocks[-1][1]]
    return chosen[-1], True


def defines(program: str, name: str) -> bool:
    """Whether the program has a `def name(` (at any depth; a program that does not parse: no)."""
    try:
        tree = parse(program)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the model's text: anything
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in ast.walk(tree))


def assemble(prefix: str, code: str, entry_point: str | None) -> str:
    """prefix + the model's code: a new definition after the stub, or the stub's body continued."""
    if not prefix:
        return code
    if entry_point and not defines(code, entry_point):
        return prefix + code  # a completion of the stub's body (a base model's continuation)
    return prefix.rstrip() + "\n\n" + code


def judge(completion: str, tests: Any, entry_point: str | None = None, prefix: str = "", *,
          wall_s: float = sandbox.WALL_S, packages: Sequence[str] = ()) -> tuple[bool | None, bool, str]:
    """(passed or None for a sandbox failure, fenced, why not) of one completion."""
    code, fenced = extract_program(completion)
    program = assemble(prefix or "", code, entry_point)
    kw = {"wall_s": wall_s, "packages": tuple(packages or ())}
    if isinstance(tests, str):
        if not entry_point:
            raise ValueError("test code needs an entry_point column")
        passed, why = run_check_tests(program, tests, entry_point, prefix or "", **kw)
    elif isinstance(tests, list) and tests and all(isinstance(t, dict) and "stdout" in t for t in tests):
        passed, why = run_stdio_tests(program, tests, **kw)
    elif isinstance(tests, list) and tests and all(isinstance(t, dict) and "output" in t for t in tests):
        if not entry_point:
            raise ValueError("function tests need an entry_point column")
        passed, why = run_function_tests(program, entry_point, tests, **kw)
    else:
        raise ValueError("tests: expected test code (a string), a list of {args, kwargs, output} "
                         "or a list of {stdin, stdout}")
    return passed, fenced, why


def reward(task: Task, completion: str, tests: Any, entry_point: str | None = None, prefix: str = "",
           timeout_s: float | None = None, packages: Sequence[str] | None = None, **_: Any) -> Score:
    """1 when the program passes every test, else 0; a sandbox that failed to start (or refuses:
    no isolation here) is a counted failure (failed=True), never a pass. Columns: tests,
    entry_point, prefix, timeout_s, packages."""
    passed, fenced, _why = judge(completion, tests, entry_point, prefix, wall_s=timeout_s or sandbox.WALL_S,
                                 packages=packages or ())
    if passed is None:
        return Score(reward=0.0, passed=False, failed=True)
    return Score(reward=float(passed), passed=passed, strict=passed and fenced)
