"""The code reward: programs are judged on their outputs, in this process, against values that
never entered the sandbox; the tricks that fool a sentinel- or assert-based judge score 0. (The
values across the sandbox's wall alone: tests/sandbox/test_programs.py.)"""

from __future__ import annotations

import pytest

from areal_aio.rewards import code
from areal_aio.rewards.code import extract_program, reward
from areal_aio.rewards.scoring import Score, reward_columns
from areal_aio.sandbox import programs, sandbox
from areal_aio.sandbox.programs import same
from areal_aio.tasks.task import Task

ADD_TESTS = [{"args": [1, 2], "output": 3}, {"args": [10, -4], "output": 6}, {"kwargs": {"a": 0, "b": 0}, "output": 0}]
ADD = Task("add", "Write add(a, b).", "", {"tests": ADD_TESTS, "entry_point": "add", "timeout_s": 2.0})
CHECK = ("def check(candidate):\n"
         "    assert candidate(1, 2) == 3\n"
         "    assert candidate(10, -4) == 6, 'message'\n"
         "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n")
ADD_CHECK = Task("add-check", "Write add(a, b).", "", {"tests": CHECK, "entry_point": "add", "timeout_s": 2.0})


def score(task: Task, completion: str) -> Score:
    return reward(task, completion, **task.extra)


def fenced(body: str) -> str:
    return f"Here it is:\n```python\n{body}\n```\nDone."


# ----------------------------------------------------------------------- the pieces


def test_the_program_is_the_last_python_block_else_the_text():
    assert extract_program("```python\na = 1\n```\ntext\n```python\nb = 2\n```") == ("b = 2\n", True)
    assert extract_program("```\nc = 3\n```") == ("c = 3\n", True)
    assert extract_program("```python\nd = 4\n")[0] == "d = 4\n"  # cut at max_new_tokens
    assert extract_program("def f(): return 1") == ("def f(): return 1", False)


def test_what_a_program_sends_back_never_raises_out_of_the_judge():
    """Values and bytes the model's program controls: a wrong answer, never a crash (which the
    pool would count as a failed reward)."""
    assert not same(10**400, 1.5) and not same(1.5, 10**400) and same(10**400, 10**400)
    flood = sandbox.Outcome(status="exited", results=b"[" * 100_000 + b'\n{"i": 0}\n')
    assert programs.read_results(flood) == []
    assert not code.defines("-" * 300_000 + "1", "f") and not code.defines("(" * 10_000, "f")


def test_the_reward_names_its_columns_for_the_loader():
    columns, required = reward_columns("areal_aio.rewards.code:reward", reward)
    assert columns is None and required == ("tests",)


# --------------------------------------------------------------------- function tests


def test_a_correct_function_passes_and_a_wrong_one_does_not():
    assert score(ADD, fenced("def add(a, b):\n    return a + b")) == Score(1.0, True, True)
    assert score(ADD, "def add(a, b):\n    return a + b") == Score(1.0, True, False)
    assert score(ADD, fenced("def add(a, b):\n    return a - b")) == Score(0.0, False)
    assert score(ADD, fenced("def add(a, b):\n    return 3")) == Score(0.0, False)
    assert score(ADD, fenced("def add(a, b) return")) == Score(0.0, False)
    assert score(ADD, fenced("def plus(a, b):\n    return a + b")) == Score(0.0, False)


def test_a_tuple_is_a_list_and_floats_are_close():
    task = Task("t", "", "", {"tests": [{"args": [2], "output": [0.5, 1]}], "entry_point": "f"})
    assert score(task, "def f(x):\n    return (1 / x, 1.0000000001)").passed


@pytest.mark.parametrize("body", [
    "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b",  # exits before the tests
    "import os\ndef add(a, b):\n    os._exit(0)",  # exits during them
    "def add(a, b):\n    print('ALL TESTS PASSED')\n    raise SystemExit(0)",  # a sentinel
    "class Eq:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
    "def add(a, b):\n    return Eq()",  # the always-equal object
    "class Eq(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Eq(0)",
    "import os\nfor i in range(3):\n    print('{\"i\": %d, \"value\": %d}' % (i, [3, 6, 0][i]))\n"
    "def add(a, b):\n    return None",  # the right values, on stdout: not the results channel
    "import os\nfor i in range(3):\n    os.write(3, b'{\"i\": %d, \"value\": 3}\\n' % i)\n"
    "def add(a, b):\n    return a + b",  # forged records first: repeated indices fail the run
    "import os\nos.write(3, b'{\"passed\": true}\\n')\nos._exit(0)",  # a forged verdict
    "import json\nopen('results.json', 'w').write(json.dumps({'passed': True}))\n"
    "open('/tmp/results.json', 'w').write('{}')\ndef add(a, b):\n    return None",  # a results file
    "import os\nos.close(3)\ndef add(a, b):\n    return a + b",  # no channel: no results
    "while True:\n    pass",
], ids=["exit-before", "os-exit", "sentinel", "always-equal", "int-subclass-eq", "fake-stdout-frames",
        "fake-fd3-frames", "fake-verdict", "results-file", "closes-channel", "loop"])
def test_tricks_score_zero(body):
    assert score(ADD, fenced(body)) == Score(0.0, False)


def test_stdio_tests_compare_lines():
    task = Task("io", "", "", {"tests": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "1 1", "stdout": "2"}],
                               "timeout_s": 2.0})
    assert score(task, fenced("a, b = map(int, input().split())\nprint(a + b)  ")).passed
    assert not score(task, fenced("print(5)")).passed
    assert not score(task, fenced("import time\ntime.sleep(60)")).passed


# ------------------------------------------------------------- assert-based test code


def test_check_code_passes_a_correct_function_and_fails_a_wrong_one():
    assert score(ADD_CHECK, fenced("def add(a, b):\n    return a + b")).passed
    assert not score(ADD_CHECK, fenced("def add(a, b):\n    return a * b")).passed
    assert not score(ADD_CHECK, fenced("def add(a, b):\n    raise ValueError")).passed


SECRET = 918_273_645_501
TABLE = ("CASES = [((1, 2), 3), ((10, -4), 6), ((SECRET, 1), SECRET + 1)]\n"
         "def check(candidate):\n    for args, want in CASES:\n        assert candidate(*args) == want\n"
         ).replace("SECRET", str(SECRET))
"""A table-driven check: the values compared with sit in the test's frames and globals."""
SNOOP = ("import gc, sys\n"
         "def add(a, b):\n"
         "    seen = []\n"
         "    f = sys._getframe(1)\n"
         "    while f is not None:\n"
         "        seen += [v for v in list(f.f_locals.values()) + list(f.f_globals.values())]\n"
         "        f = f.f_back\n"
         "    seen += [o for o in gc.get_objects() if isinstance(o, (list, dict, tuple))]\n"
         "    hit = ''.join(reversed('DIGITS')) in repr(seen)\n"
         "    print('found' if hit else 'not found')\n"
         "    return a + b\n").replace("DIGITS", str(SECRET + 1)[::-1])
"""A program that looks for an expected value it is never sent (SECRET + 1) in every frame above
it and every object (its source holds the digits reversed, so only a copy it is handed matches)."""


def test_the_programs_process_never_holds_what_the_tests_compare_with():
    task = Task("table", "", "", {"tests": TABLE, "entry_point": "add"})
    assert score(task, fenced("def add(a, b):\n    return a + b")).passed
    outcome = sandbox.run(programs.harness({"mode": "serve", "program": SNOOP, "entry_point": "add"}),
                          driver=programs.driver({"prefix": "", "tests": TABLE, "entry_point": "add"}))
    assert outcome.stdout == b"not found\n" * 3, outcome
    assert programs.read_results(outcome) == [{"passed": True, "error": ""}]


def test_the_program_cannot_reach_the_drivers_memory_or_its_verdict():
    """The driver is another process (another uid, not dumpable): no /proc/<pid>/mem, fd, environ,
    no ptrace, no process_vm_readv; killing it or writing fd 3 gives no verdict, never a pass."""
    probe = ("import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             "def add(a, b):\n"
             "    for pid in [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
             "        for what in ('mem', 'environ', 'fd/3', 'maps'):\n"
             "            try:\n"
             "                open(f'/proc/{pid}/{what}', 'rb').read(1)\n"
             "                print('READ', pid, what)\n"
             "            except OSError:\n"
             "                pass\n"
             "        if libc.ptrace(16, int(pid), 0, 0) == 0:\n"
             "            print('ATTACHED', pid)\n"
             "    try:\n"
             "        os.write(3, b'{\"passed\": true}\\n')\n"
             "    except OSError:\n"
             "        pass\n"
             "    return 0\n")
    outcome = sandbox.run(programs.harness({"mode": "serve", "program": probe, "entry_point": "add"}),
                          driver=programs.driver({"prefix": "", "tests": TABLE, "entry_point": "add"}))
    assert b"READ" not in outcome.stdout and b"ATTACHED" not in outcome.stdout, outcome.stdout
    assert programs.read_results(outcome)[0]["passed"] is False
    killer = "import os, signal\ndef add(a, b):\n    os.kill(-1, signal.SIGKILL)\n    return 0\n"
    assert not score(Task("t", "", "", {"tests": TABLE, "entry_point": "add"}), fenced(killer)).passed


def test_an_exception_comes_back_as_its_built_in_type():
    tests = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n        pass\n"
             "    else:\n        assert False, 'no error'\n    assert candidate(4) == 2\n")
    task = Task("sqrt", "", "", {"tests": tests, "entry_point": "root"})
    assert score(task, fenced("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n"
                               "    return int(x ** 0.5)")).passed
    assert not score(task, fenced("def root(x):\n    if x < 0:\n        raise KeyError(x)\n    return 2")).passed
    swallow = ("def check(candidate):\n    try:\n        candidate(1)\n    except BaseException:\n        pass\n")
    task = Task("swallow", "", "", {"tests": swallow, "entry_point": "f"})
    assert not score(task, fenced("import os\ndef f(x):\n    os._exit(0)")).passed  # a broken pipe is no pass


def test_deeply_nested_output_scores_zero_and_never_raises():
    deep = "def add(a, b):\n    v = []\n    for _ in range(5000):\n        v = [v]\n    return v\n"
    assert score(ADD, fenced(deep)) == Score(0.0, False)
    assert score(ADD_CHECK, fenced(deep)) == Score(0.0, False)
    raw = ("import os\nline = b'{\"i\": 0, \"value\": ' + b'[' * 990 + b']' * 990 + b'}\\n'\n"
           "os.write(3, line)\ndef add(a, b):\n    return a + b\n")
    assert score(ADD, fenced(raw)) == Score(0.0, False)
    nested = b'{"i": 0, "error": ' + b"[" * 990 + b"]" * 990 + b"}\n"
    assert programs.read_results(sandbox.Outcome(status="exited", results=nested)) == []


def test_a_program_sees_only_the_packages_its_task_names():
    numpy_add = fenced("import numpy\ndef add(a, b):\n    return int(numpy.add(a, b))")
    assert not score(ADD, numpy_add).passed
    with_numpy = Task("add", "", "", {**ADD.extra, "packages": ["numpy"]})
    assert score(with_numpy, numpy_add).passed
    gym = fenced("import reasoning_gym\ndef add(a, b):\n    return a + b")
    assert not score(with_numpy, gym).passed
    assert programs.tests_problem(ADD_TESTS, "add", ["reasoning_gym"]) == \
        "packages: package 'reasoning_gym' cannot be given to a program"
    assert "not installed" in programs.tests_problem(ADD_TESTS, "add", ["no_such_package_here"])
    assert programs.tests_problem(ADD_TESTS, "add", ["numpy"]) is None


@pytest.mark.parametrize("body", [
    "class Eq:\n    def __eq__(self, other):\n        return True\n    def __sub__(self, other):\n        return self\n"
    "    def __abs__(self):\n        return 0\n    def __lt__(self, other):\n        return True\n"
    "def add(a, b):\n    return Eq()",  # passes the original asserts
    "import sys\ndef add(a, b):\n    consts = sys._getframe(1).f_code.co_consts\n"
    "    return next((c for c in consts if isinstance(c, int) and c not in (a, b)), 0)",  # reads the test
    "import os\nos.write(3, b'{\"passed\": true}\\n')\ndef add(a, b):\n    return 0",  # a forged verdict
    "import os\nos.write(3, b'{\"value\": 3}\\n' * 3)\ndef add(a, b):\n    return 0",  # answers ahead of the calls
    "import sys\nprint('ALL TESTS PASSED')\nsys.exit(0)\ndef add(a, b):\n    return a + b",
], ids=["always-equal", "reads-caller", "forged-verdict", "answers-ahead", "exit-before"])
def test_tricks_against_check_code_score_zero(body):
    assert score(ADD_CHECK, fenced(body)) == Score(0.0, False)


def test_bare_asserts_calling_the_entry_point_work_too():
    task = Task("mbpp", "", "", {"tests": "assert add(1, 2) == 3\nassert add(2, 2) == 4", "entry_point": "add"})
    assert score(task, fenced("def add(a, b):\n    return a + b")).passed
    assert not score(task, fenced("def add(a, b):\n    return 3")).passed


def test_random_inputs_in_a_check_are_the_tests_own():
    tests = ("import random\ndef check(candidate):\n    for _ in range(20):\n"
             "        x = random.randint(0, 100)\n        assert candidate(x) == x * 2\n")
    task = Task("rand", "", "", {"tests": tests, "entry_point": "double"})
    assert score(task, fenced("import random\ndef double(x):\n    random.random()\n    return 2 * x")).passed
    assert not score(task, fenced("def double(x):\n    return x + 2")).passed


# ------------------------------------------------------------------------ infrastructure


def test_a_sandbox_that_cannot_start_is_a_counted_failure_never_a_pass(monkeypatch):
    monkeypatch.setattr(sandbox, "_layers", sandbox.Layers("root", "/nonexistent/unshare", ("pid",), seccomp=True))
    for task in (ADD, ADD_CHECK):
        assert score(task, fenced("def add(a, b):\n    return a + b")) == Score(0.0, False, failed=True)


def test_where_nothing_isolates_programs_the_reward_refuses_and_counts_it(monkeypatch):
    monkeypatch.setattr(sandbox, "_layers", sandbox.Layers(None, open=("nothing isolates programs here",)))
    for task in (ADD, ADD_CHECK):
        assert score(task, fenced("def add(a, b):\n    return a + b")) == Score(0.0, False, failed=True)


def test_malformed_tests_are_an_error_not_a_score():
    with pytest.raises(ValueError):
        reward(ADD, "x", tests=[{"nothing": 1}])
    with pytest.raises(ValueError):
        reward(ADD, "x", tests=ADD_TESTS)  # no entry_point


@pytest.mark.slow
async def test_the_reward_runs_in_the_reward_pool(tmp_path):
    from areal_aio.rewards.scoring import Scorer, load_rewards
    from areal_aio.settings import build_settings

    settings = build_settings({"task": {"reward": "areal_aio.rewards.code:reward"}})
    scorer = Scorer(load_rewards(settings.task), timeout_s=30, procs=1, log_path=tmp_path / "reward.log")
    try:
        assert scorer.pool is not None
        good = await scorer.score(ADD, fenced("def add(a, b):\n    return a + b"))
        bad = await scorer.score(ADD, fenced("while True:\n    pass"))
    finally:
        await scorer.aclose()
    assert good.passed and good.reward == 1.0 and not bad.passed and not bad.failed
