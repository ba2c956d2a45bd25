"""Sandbox cost: seconds per program through sandbox/sandbox.py against a bare interpreter start.

    bare:        subprocess.run([python, "-c", PROGRAM])        (a user's interpreter: its venv, site)
    bare -I -S:  subprocess.run([base python, "-I", "-S", ...])  (the start the sandbox itself makes)
    program:     sandbox.run(PROGRAM)                             (one program, every layer)
    function:    sandbox.programs: call tests, one run            (the harness + 3 calls)
    check:       sandbox.programs: assert-style test code, one run (the driver + the serving program)

Every arm runs one program at a time on one core (the process and its children pinned to it),
so the numbers are per core. Arms are interleaved (each repeat in rotated order) so a machine
whose load drifts shifts every arm alike; the table gives each arm's median over the repeats and
its cost relative to `bare` (target: every sandboxed style within 2x). With --as-user (root
only) the same arms run again as that unprivileged uid (the sandbox then uses a user namespace
of its own), in the same sitting.

    python bench/sandbox.py                         # 7 repeats of 20 programs, as this user
    python bench/sandbox.py --as-user 65534         # ... and as nobody
    python bench/sandbox.py --quick                 # 3 repeats of 5
    python bench/sandbox.py --against REV           # ... and that commit's sandbox, side by side

With --against REV the same arms also run on the package as it was at REV (a clone in a temporary
folder; the arms call APIs both have, so REV needs the sandbox as its own subpackage,
areal_aio/sandbox/), one repeat of each tree after the other, rotated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.sandbox import programs, sandbox  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402

PROGRAM = "print(sum(range(1000)))"
"""A program that does next to nothing: what is measured is the cost of running one."""
FUNCTION = "def add(a, b):\n    return a + b\n"
CALL_TESTS = [{"args": [1, 2], "output": 3}, {"args": [10, -4], "output": 6}, {"args": [0, 0], "output": 0}]
CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(10, -4) == 6\n" \
        "    assert candidate(0, 0) == 0\n"
TARGET_RATIO = 2.0
"""Sandbox seconds per program / bare seconds per program."""


def arms() -> dict[str, Callable[[], None]]:
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)  # the sandbox's

    def bare() -> None:
        done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, check=True)
        assert done.stdout == b"499500\n"

    def bare_isolated() -> None:
        done = subprocess.run([base, "-I", "-S", "-c", PROGRAM], capture_output=True, check=True)
        assert done.stdout == b"499500\n"

    def program() -> None:
        out = sandbox.run(PROGRAM)
        assert out.status == "exited" and out.stdout == b"499500\n", out

    def function() -> None:
        assert programs.run_function_tests(FUNCTION, "add", CALL_TESTS) == (True, "")

    def check() -> None:
        assert programs.run_check_tests(FUNCTION, CHECK, "add") == (True, "")

    return {"bare": bare, "bare -I -S": bare_isolated, "program": program, "function": function, "check": check}


def measure(n: int, repeats: int, core: int) -> dict[str, list[float]]:
    """{arm: [seconds per program, one a repeat]}, arms interleaved and rotated."""
    os.sched_setaffinity(0, {core})
    table = arms()
    for fn in table.values():  # warm-up: page cache, the layers' probe, the filter
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in table}
    names = list(table)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(n):
                table[name]()
            seconds[name].append((time.perf_counter() - t0) / n)
    return seconds


def as_user(uid: int, n: int, repeats: int, core: int) -> dict:
    """measure() run by `uid` (tests/sandbox/as_user.py makes the interpreter reachable)."""
    from tests.sandbox.as_user import json_as

    return json_as(f"import json, sys\nsys.path.insert(0, {str(REPO)!r})\nfrom bench import sandbox as b\n"
                   f"from areal_aio.sandbox import sandbox\n"
                   f"s = b.measure({n}, {repeats}, {core})\n"
                   f"print(json.dumps({{'seconds': s, 'layers': sandbox.layers().as_dict()}}))", uid=uid, timeout=3600)


def against(rev: str, n: int, repeats: int, core: int) -> dict[str, dict[str, list[float]]]:
    """{"this tree": seconds, rev: seconds}: measure() in a child process per tree and repeat,
    the trees alternating (rotated each repeat), so drift shifts both alike."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sandbox-ab-") as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(old)], check=True)
        subprocess.run(["git", "-C", str(old), "checkout", "-q", rev], check=True)
        trees = {"this tree": REPO, rev: old}
        out: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for r in range(repeats):
            for name in list(trees)[r % 2:] + list(trees)[:r % 2]:
                code_ = (f"import json, sys\nsys.path[:0] = [{str(trees[name])!r}]\nimport areal_aio\n"
                         f"sys.path.insert(0, {str(REPO)!r})\nfrom bench import sandbox as b\n"
                         f"print(json.dumps(b.measure({n}, 1, {core})))")
                done = subprocess.run([sys.executable, "-c", code_], capture_output=True, check=True, cwd=tmp)
                for arm, s in json.loads(done.stdout.decode().splitlines()[-1]).items():
                    out[name].setdefault(arm, []).extend(s)
    return out


def summary(seconds: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    floor = statistics.median(seconds["bare"])
    return {name: {"ms": 1000 * statistics.median(s), "min_ms": 1000 * min(s), "max_ms": 1000 * max(s),
                   "vs_bare": statistics.median(s) / floor} for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=None, help="programs per arm and repeat (default 20)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7)")
    ap.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last one allowed)")
    ap.add_argument("--as-user", type=int, default=None, help="also run every arm as this uid (root only)")
    ap.add_argument("--against", default=None, help="also run the arms on this commit's package, side by side")
    ap.add_argument("--quick", action="store_true", help="3 repeats of 5 programs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "sandbox")
    args = ap.parse_args(argv)
    n = args.programs or (5 if args.quick else 20)
    repeats = args.repeats or (3 if args.quick else 7)
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    users = {f"uid {os.geteuid()}": {"seconds": measure(n, repeats, core), "layers": sandbox.layers().as_dict()}}
    if args.as_user is not None:
        users[f"uid {args.as_user}"] = as_user(args.as_user, n, repeats, core)
    if args.against is not None:
        for name, seconds in against(args.against, n, repeats, core).items():
            users[f"uid {os.geteuid()}, {name}"] = {"seconds": seconds, "layers": {}, "side_by_side": True}
    met = True
    results = {}
    for who, got in users.items():
        table = summary(got["seconds"])
        results[who] = {"mode": got["layers"].get("mode"), "seccomp": got["layers"].get("seccomp"), "arms": table,
                        "seconds": got["seconds"]}
        print_table(["arm", "ms/program", "range", "cost vs bare"],
                    [[name, f"{t['ms']:.1f}", f"{t['min_ms']:.1f}-{t['max_ms']:.1f}", f"{t['vs_bare']:.2f}x"]
                     for name, t in table.items()],
                    title=f"{who} (sandbox mode {got['layers'].get('mode')}), one core (cpu {core}), "
                          f"{repeats} interleaved repeats of {n} programs (median)")
        worst = max(table[a]["vs_bare"] for a in ("program", "function", "check"))
        if not got.get("side_by_side"):  # the target is this tree's, as each user runs it
            met = met and worst <= TARGET_RATIO
        print(f"target: every sandboxed style at most {TARGET_RATIO:g}x bare: worst {worst:.2f}x")
    write_json(args.out / "results.json", {
        "program": PROGRAM, "programs": n, "repeats": repeats, "core": core, "target_ratio": TARGET_RATIO,
        "met": met, "users": results})
    print(f"wrote {args.out / 'results.json'}", file=sys.stderr)
    print(json.dumps({"met": met}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
