"""Programs against tests, in the sandbox: the harness that runs a program's function on each
input, the driver that runs test code against a program in another process, the values that
cross the sandbox's wall (encoded there, decoded and compared here), and the verdicts read back.

    program --+ harness --sandbox.run--> fd 3: one JSON line a test (values, encoded)
                                          |
    tests (expected values, never sent) --+-- compared here: function_results, run_*_tests

Three kinds of tests:
  * call tests, [{"args": [...], "kwargs": {...}, "output": v}, ...] with an entry point: the
    harness calls the function on each input and writes what it returned, strictly encoded
    (plain types only: an object whose __eq__ says True is not a value, and cannot be sent);
    the parent decodes and compares with `output` (JSON semantics: a tuple is a list; floats to
    1e-6 relative);
  * stdin/stdout tests, [{"stdin": "...", "stdout": "..."}, ...]: the program is run once per
    test; its stdout is compared line by line (trailing blanks ignored);
  * test code, `def check(candidate): assert ...` (HumanEval) or bare asserts calling the entry
    point: one sandbox run, two processes. The driver (`prefix`, the tests: no model code) runs
    check(candidate), where candidate sends its arguments, encoded, to the program's process and
    returns the value that process encodes back (a raised exception comes back as the same
    built-in type). The program's process never holds the tests, the values they compare with,
    or their frames; the driver's verdict is the one read.

The code reward (rewards/code.py) judges completions through here; the code tasks
(tasks/code_tasks.py) make their tests here too, running a data set's reference code on its
own generated inputs (the harness's generate mode).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import textwrap
import threading
from collections.abc import Sequence
from typing import Any

from areal_aio.sandbox import sandbox

MAX_DEPTH = 64
"""Nesting of an encoded value (a deeper one is not a value we judge)."""
MAX_INT_BITS = 14_000
"""Largest int the harness encodes (Python prints at most 4300 digits of one anyway)."""
REL_TOL, ABS_TOL = 1e-6, 1e-9
"""Floats compare to this (codeio's references round; a harness float is exact)."""
HARNESS_MODULES = ("json", "random")
"""What the harness and the driver import: the sandbox's init imports them once before it forks."""
RESULT_LINES_MAX = 10_000
"""Result lines read from one run (the 1 MB cap comes first for any real test)."""
RECORD_DEPTH = 3 * MAX_DEPTH + 8
"""Nesting of one JSON record read back (an encoded value nests 3 levels per level of its own):
a deeper one is not read, so nothing after it can recurse past the interpreter's limit."""


# --------------------------------------------------------- values across the boundary
# encode runs in the sandbox (its source is part of the harness), decode on both sides.


def encode(value: Any, depth: int = 0) -> Any:
    """A plain value as JSON data (tuple, set, dict, bytes, nan tagged as one-key objects);
    TypeError for anything that is not a plain value."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError("int too large")
        return value
    if kind is float:
        return value if value - value == 0.0 else {"$float": repr(value)}
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"$tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"$" + kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"$bytes": value.hex()}
    if kind is complex:
        return {"$complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    module = getattr(kind, "__module__", None)
    if type(module) is str and module.split(".")[0] == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist(), depth + 1)  # numpy scalars and arrays: their plain values
    raise TypeError(f"{kind.__name__} is not a plain value")


def decode(data: Any, depth: int = 0) -> Any:
    """The value `encode` wrote; ValueError for anything else (the data may be forged)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v, depth + 1) for v in data]
    if kind is not dict or len(data) != 1:
        raise ValueError("not an encoded value")
    (tag, inner), = data.items()
    if tag == "$float" and inner in ("nan", "inf", "-inf"):
        return float(inner)
    if tag == "$bytes" and type(inner) is str:
        return bytes.fromhex(inner)
    if type(inner) is not list:
        raise ValueError(f"bad {tag}")
    items = [decode(v, depth + 1) for v in inner] if tag != "$dict" else None
    try:
        if tag == "$tuple":
            return tuple(items)
        if tag == "$set":
            return set(items)
        if tag == "$frozenset":
            return frozenset(items)
        if tag == "$complex" and len(items) == 2 and all(type(v) in (int, float) for v in items):
            return complex(*items)
        if tag == "$dict":
            if not all(type(p) is list and len(p) == 2 for p in inner):
                raise ValueError("bad $dict")
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in inner}
    except TypeError as exc:  # an unhashable key or set member
        raise ValueError(str(exc)) from None
    raise ValueError(f"unknown tag {tag!r}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(line: bytes | str) -> Any:
    """Strict JSON (no NaN or Infinity literals), at most RECORD_DEPTH deep; ValueError else."""
    try:
        data = json.loads(line, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _depth(data) > RECORD_DEPTH:
        raise ValueError("nested too deeply")
    return data


def _depth(data: Any) -> int:
    """Nesting depth of JSON data, without recursion (it may be a thousand levels deep)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if type(item) is list:
            stack.extend((v, depth + 1) for v in item)
        elif type(item) is dict:
            stack.extend((v, depth + 1) for v in item.values())
    return deepest


def as_json(value: Any) -> Any:
    """A decoded value as json.dumps would see it (tuples are lists, dict keys strings); a
    value JSON cannot hold (a set, bytes) is kept as it is, and so equals no JSON value."""
    kind = type(value)
    if kind in (list, tuple):
        return [as_json(v) for v in value]
    if kind is dict:
        keys = [_json_key(k) for k in value]
        if any(k is None for k in keys):
            return value
        return {k: as_json(v) for k, v in zip(keys, value.values(), strict=True)}
    return value


def _json_key(key: Any) -> str | None:
    kind = type(key)
    if kind is str:
        return key
    if kind is bool or key is None:
        return json.dumps(key)
    if kind in (int, float):
        return json.dumps(key)
    return None


def same(actual: Any, expected: Any) -> bool:
    """JSON values equal: bools only to bools, numbers to REL_TOL, containers item by item."""
    a, e = type(actual), type(expected)
    if a is bool or e is bool or actual is None or expected is None:
        return a is e and actual == expected
    if a in (int, float) and e in (int, float):
        if a is int and e is int:
            return actual == expected
        try:
            return math.isclose(actual, expected, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        except OverflowError:  # an int too large for a float (10**400): not close to one
            return False
    if a is str and e is str:
        return actual == expected
    if a is list and e is list:
        return len(actual) == len(expected) and all(same(x, y) for x, y in zip(actual, expected, strict=True))
    if a is dict and e is dict:
        return actual.keys() == expected.keys() and all(same(actual[k], expected[k]) for k in expected)
    return False


# ---------------------------------------------------------------------------- harness

HEADER = '''from __future__ import annotations
import json as _json, os as _os, random as _random, sys as _sys
MAX_DEPTH, MAX_INT_BITS, MAX_LINE = {max_depth}, {max_int_bits}, {max_line}
{encode}
{decode}
_DATA = _json.loads({data!r})


def _send(fd, record):
    line = (_json.dumps(record, allow_nan=False) + "\\n").encode()
    while line:
        line = line[_os.write(fd, line):]


def _emit(record):
    _send(3, record)


def _error(exc):
    return (type(exc).__name__ + ": " + str(exc))[:300]


def _load(source, name, ns):
    exec(compile(source, name, "exec"), ns)


class _Ended(Exception):
    pass


_buffers = {{}}


def _read_line(fd):
    buf = _buffers.setdefault(fd, bytearray())
    while b"\\n" not in buf:
        chunk = _os.read(fd, 1 << 16)
        if not chunk:
            raise _Ended("the other process ended")
        buf += chunk
        if len(buf) > MAX_LINE:
            raise _Ended("a line past the size limit")
    i = buf.index(b"\\n")
    line = bytes(buf[:i])
    del buf[:i + 1]
    return _json.loads(line)
'''

HARNESS = '''

def _main():
    mode = _DATA["mode"]
    ns = {{"__name__": "solution", "__builtins__": __builtins__}}
    try:
        _load(_DATA["program"], "<program>", ns)
    except BaseException as exc:
        _emit({{"setup": _error(exc)}})
        return
    if mode == "generate":
        Random = _random.Random
        for i, seed in enumerate(_DATA["seeds"]):
            try:
                given = encode(ns["generate_inputs"](Random(seed)))
                first = encode(ns["main_solution"](**decode(given)))
                again = encode(ns["main_solution"](**decode(given)))
                _emit({{"i": i, "input": given, "output": first, "again": again}})
            except BaseException as exc:
                _emit({{"i": i, "error": _error(exc)}})
        return
    fn = ns.get(_DATA["entry_point"])
    if not callable(fn):
        _emit({{"setup": "no function " + repr(_DATA["entry_point"])}})
        return
    if mode == "call":
        for i, test in enumerate(_DATA["inputs"]):
            args, kwargs = decode(test)
            try:
                _emit({{"i": i, "value": encode(fn(*args, **kwargs))}})
            except BaseException as exc:
                _emit({{"i": i, "error": _error(exc)}})
        return
    while True:  # serve: the driver's calls, one a line on fd 4, each answered on fd 3
        try:
            args, kwargs = decode(_read_line(4))
        except _Ended:
            return
        stop = False
        try:
            reply = {{"value": encode(fn(*args, **kwargs))}}
        except BaseException as exc:
            reply, stop = {{"error": _error(exc), "type": type(exc).__name__}}, not isinstance(exc, Exception)
        try:
            _sys.stdout.flush()  # before the reply: the run ends when the driver does
        except BaseException:
            pass
        _emit(reply)
        if stop:
            return


_main()
'''

DRIVER = '''
import builtins as _builtins


class _Broken(BaseException):
    "The program's process did not answer a call as a function would: the check fails."


_broken = []


def _raised(reply):
    kind = getattr(_builtins, str(reply.get("type")), None)
    if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, _Ended):
        return kind(str(reply.get("error"))[:300])
    _broken.append("the program raised " + str(reply.get("error"))[:200])
    return _Broken(_broken[-1])


def candidate(*args, **kwargs):
    if _broken:
        raise _Broken(_broken[0])
    try:
        request = encode([list(args), kwargs])
    except (TypeError, ValueError) as exc:
        _emit({{"unusable": "the tests call the function with " + _error(exc)}})
        _os._exit(0)
    try:
        _send(4, request)
        reply = _read_line(5)
    except (_Ended, OSError, ValueError) as exc:
        _broken.append("the program's process: " + _error(exc))
        raise _Broken(_broken[-1]) from None
    if type(reply) is dict and "value" in reply:
        try:
            return decode(reply["value"])
        except (ValueError, RecursionError) as exc:
            _broken.append("not a value: " + _error(exc))
            raise _Broken(_broken[-1]) from None
    if type(reply) is dict and "error" in reply:
        raise _raised(reply)
    if type(reply) is dict and "setup" in reply:
        _broken.append("program: " + str(reply["setup"])[:200])
    else:
        _broken.append("the program's process answered out of turn")
    raise _Broken(_broken[-1])


def _main():
    ns = {{"__name__": "tests", "__builtins__": __builtins__}}
    try:
        _load(_DATA["prefix"], "<prefix>", ns)
        _load(_DATA["tests"], "<tests>", ns)
    except BaseException as exc:
        _emit({{"unusable": "the test code does not run: " + _error(exc)}})
        return
    ns[_DATA["entry_point"]] = candidate  # a check calling it by name means the program's
    _random.seed(0)
    try:
        ns["check"](candidate)
    except BaseException as exc:
        _emit({{"passed": False, "error": _broken[0] if _broken else _error(exc)}})
        return
    _emit({{"passed": not _broken, "error": _broken[0] if _broken else ""}})


_main()
'''


@functools.lru_cache(maxsize=2)
def _codec_source() -> tuple[str, str]:
    """encode's and decode's source, read once (inspect reads and tokenizes the file)."""
    return inspect.getsource(encode), inspect.getsource(decode)


def _source(template: str, data: dict[str, Any]) -> str:
    enc, dec = _codec_source()
    return (HEADER + template).format(max_depth=MAX_DEPTH, max_int_bits=MAX_INT_BITS, max_line=sandbox.MAX_OUTPUT,
                                      encode=enc, decode=dec, data=json.dumps(data))


def harness(data: dict[str, Any]) -> str:
    """The program the sandbox runs: encode/decode (this module's own source), the model's (or
    a reference's) program, then `data`'s mode: call (each input, results to fd 3), generate
    (a codeio reference on its generator's inputs) or serve (the driver's calls)."""
    return _source(HARNESS, data)


def driver(data: dict[str, Any]) -> str:
    """The driver the sandbox runs beside a serving program: `prefix` and the tests, calling the
    program's function across the pipe; its verdict goes to fd 3."""
    return _source(DRIVER, data)


def read_results(outcome: sandbox.Outcome) -> list[dict[str, Any]]:
    """The JSON objects on the results channel, one a line; a line that is not one ends it."""
    out = []
    for line in outcome.results.splitlines()[:RESULT_LINES_MAX]:
        try:
            record = loads(line)
        except (ValueError, RecursionError):  # "[" * 100000: the program's bytes, not a record
            break
        if type(record) is not dict:
            break
        out.append(record)
    return out


# ----------------------------------------------------------------------------- tests


_PARSING = threading.Lock()
"""ast.parse from several threads at once can fail in CPython 3.11 ("AST constructor recursion
depth mismatch": the conversion's depth counter is the interpreter's, not the thread's), and
code items are made and judged in threads: every parse here takes this lock."""


def parse(source: str, mode: str = "exec") -> ast.AST:
    """ast.parse, one thread at a time (_PARSING)."""
    with _PARSING:
        return ast.parse(source, mode=mode)


def check_source(tests: str, entry_point: str | None) -> tuple[str, str]:
    """(the tests as a `check(param)` module, param): a test module with its own check, or bare
    asserts calling entry_point wrapped into one."""
    tree = parse(tests)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check" and node.args.args:
            return tests, node.args.args[0].arg
    if not entry_point:
        raise ValueError("test code without a check(candidate) function needs an entry_point")
    return f"def check({entry_point}):\n{textwrap.indent(tests, '    ')}\n    pass\n", entry_point


# ---------------------------------------------------------------------------- verdicts


def function_results(program: str, entry_point: str, tests: list[dict[str, Any]], *,
                     wall_s: float = sandbox.WALL_S, packages: Sequence[str] = ()) -> tuple[list[bool] | None, str]:
    """(whether each call test passed, why the first did not); (None, why) when the sandbox
    failed to start."""
    inputs = [encode([list(t.get("args", [])), dict(t.get("kwargs", {}))]) for t in tests]
    outcome = sandbox.run(harness({"mode": "call", "program": program, "entry_point": entry_point,
                                   "inputs": inputs}), wall_s=wall_s, packages=packages,
                          preload=HARNESS_MODULES)
    if outcome.infra:
        return None, outcome.error
    failed = [False] * len(tests)
    got: dict[int, dict[str, Any]] = {}
    for record in read_results(outcome):
        if "setup" in record:
            return failed, f"program: {str(record['setup'])[:200]}"
        i = record.get("i")
        if type(i) is not int or i in got or not 0 <= i < len(tests):
            return failed, "results channel: a forged or repeated record"
        got[i] = record
    passed, why = [], ""
    for i, test in enumerate(tests):
        record = got.get(i)
        if record is None:
            problem = f"no result ({outcome.status})"
        elif "value" not in record:
            problem = str(record.get("error"))[:200]
        else:
            try:
                problem = "" if same(as_json(decode(record["value"])), test["output"]) else "wrong output"
            except ValueError as exc:
                problem = f"not a value ({exc})"
        passed.append(not problem)
        why = why or (f"test {i}: {problem}" if problem else "")
    return passed, why


def run_function_tests(program: str, entry_point: str, tests: list[dict[str, Any]], *,
                       wall_s: float = sandbox.WALL_S, packages: Sequence[str] = ()) -> tuple[bool | None, str]:
    """(all passed, why not) for call tests; (None, why) when the sandbox failed to start."""
    passed, why = function_results(program, entry_point, tests, wall_s=wall_s, packages=packages)
    return (None if passed is None else all(passed)), why


def run_stdio_tests(program: str, tests: list[dict[str, Any]], *,
                    wall_s: float = sandbox.WALL_S, packages: Sequence[str] = ()) -> tuple[bool | None, str]:
    """(all passed, why not) for stdin/stdout tests, one run each, stopping at the first failure."""
    for i, test in enumerate(tests):
        outcome = sandbox.run(program, str(test.get("stdin", "")).encode(), wall_s=wall_s, packages=packages)
        if outcome.infra:
            return None, outcome.error
        if outcome.status != "exited":
            return False, f"test {i}: {outcome.status}"
        if _lines(outcome.stdout.decode(errors="replace")) != _lines(str(test["stdout"])):
            return False, f"test {i}: wrong output"
    return True, ""


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_check_tests(program: str, tests: str, entry_point: str, prefix: str = "", *,
                    wall_s: float = sandbox.WALL_S, packages: Sequence[str] = ()) -> tuple[bool | None, str]:
    """(passed, why not) for assert-based test code: the driver runs the tests, calling the
    program's function in the program's own process (one sandbox run)."""
    try:
        module, _param = check_source(tests, entry_point)
    except (SyntaxError, ValueError) as exc:
        return None, f"the test code cannot be used: {exc}"
    outcome = sandbox.run(harness({"mode": "serve", "program": program, "entry_point": entry_point}),
                          driver=driver({"prefix": prefix, "tests": module, "entry_point": entry_point}),
                          wall_s=wall_s, packages=packages, preload=HARNESS_MODULES)
    if outcome.infra:
        return None, outcome.error
    verdict = read_results(outcome)
    if len(verdict) == 1 and "unusable" in verdict[0]:
        return None, str(verdict[0]["unusable"])[:300]
    if len(verdict) != 1 or type(verdict[0].get("passed")) is not bool:
        return False, f"no verdict ({outcome.status})"
    return verdict[0]["passed"], str(verdict[0].get("error", ""))[:300]


def tests_problem(tests: Any, entry_point: Any, packages: Any = None) -> str | None:
    """Why a tests column (with its entry_point and packages) cannot be judged (None when it can)."""
    if packages is not None:
        if not isinstance(packages, list) or not all(isinstance(p, str) for p in packages):
            return "packages: expected a list of package names"
        try:
            sandbox.package_binds(packages)
        except ValueError as exc:
            return f"packages: {exc}"
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        return f"entry_point {entry_point!r} is not a function name"
    if isinstance(tests, str):
        try:
            check_source(tests, entry_point)
        except SyntaxError as exc:
            return f"tests: the test code does not parse ({exc.msg}, line {exc.lineno})"
        except ValueError as exc:
            return f"tests: {exc}"
        return None
    if not isinstance(tests, list) or not tests or not all(isinstance(t, dict) for t in tests):
        return "tests: expected test code or a non-empty list of objects"
    if all("stdout" in t for t in tests):
        return None if all(isinstance(t["stdout"], str) and isinstance(t.get("stdin", ""), str) for t in tests) \
            else "tests: stdin and stdout must be strings"
    if all("output" in t for t in tests):
        if not entry_point:
            return "tests with outputs need an entry_point (the function to call)"
        bad = next((t for t in tests if not isinstance(t.get("args", []), list)
                    or not isinstance(t.get("kwargs", {}), dict)), None)
        return None if bad is None else f"tests: args must be a list and kwargs an object, got {bad}"
    return "tests: each needs an output (with args/kwargs) or a stdout (with stdin)"
