"""Sandbox throughput: programs per second through rewards/sandbox.py vs a bare `python -c`.

    bare:      subprocess.run([python, "-c", PROGRAM])              (the floor: one interpreter start)
    no ns:     sandbox.run(PROGRAM), uid + rlimits only             (session, uid, limits, pipes)
    sandbox:   sandbox.run(PROGRAM) with every layer this machine has (+ pid/net/mount/ipc/uts ns, mounts)

Every arm runs one program at a time on one core (the process and its children pinned to it),
so the numbers are per core. Arms are interleaved (bare, no ns, sandbox, then the next repeat
in rotated order) so a machine whose load drifts shifts every arm alike; the table gives each
arm's median over the repeats and the sandbox's cost relative to bare (target: at most 2x).

    python bench/sandbox.py                    # 7 repeats of 40 programs
    python bench/sandbox.py --quick            # 3 repeats of 10
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.rewards import sandbox  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402

PROGRAM = "print(sum(range(1000)))"
"""A program that does next to nothing: what is measured is the cost of running one."""
TARGET_RATIO = 2.0
"""Sandbox seconds per program / bare seconds per program."""


def bare(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, check=True)
        assert done.stdout == b"499500\n"
    return time.perf_counter() - t0


def through(layers: sandbox.Layers, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        out = sandbox._run(PROGRAM, b"", sandbox.WALL_S, sandbox.Limits(), layers)
        assert out.status == "exited" and out.stdout == b"499500\n", out
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=None, help="programs per arm and repeat (default 40)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7)")
    ap.add_argument("--core", type=int, default=None, help="the core to pin to (default: the last one allowed)")
    ap.add_argument("--quick", action="store_true", help="3 repeats of 10 programs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "sandbox")
    args = ap.parse_args(argv)
    n = args.programs or (10 if args.quick else 40)
    repeats = args.repeats or (3 if args.quick else 7)
    core = args.core if args.core is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    full = sandbox.layers()
    arms = {"bare": lambda: bare(n), "sandbox": lambda: through(full, n)}
    if full.namespaces:
        no_ns = dataclasses.replace(full, unshare=None, namespaces=(), hidden=())
        arms = {"bare": arms["bare"], "no ns": lambda: through(no_ns, n), "sandbox": arms["sandbox"]}
    for fn in arms.values():  # warm-up: page cache, the layers' probe
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds[name].append(arms[name]())
    rate = {name: n / statistics.median(s) for name, s in seconds.items()}
    ratio = rate["bare"] / rate["sandbox"]
    rows = [[name, f"{rate[name]:.1f}", f"{1000 / rate[name]:.1f}",
             f"{min(n / s for s in seconds[name]):.1f}-{max(n / s for s in seconds[name]):.1f}",
             f"{rate['bare'] / rate[name]:.2f}x"] for name in arms]
    print_table(["arm", "programs/s", "ms/program", "range", "cost vs bare"], rows,
                title=f"sandbox throughput, one core (cpu {core}), {repeats} interleaved repeats of {n} programs "
                      f"(median)\nlayers: namespaces {'+'.join(full.namespaces) or 'none'}, "
                      f"uid {'on' if full.uid else 'off'}, rlimits on")
    ok = ratio <= TARGET_RATIO
    print(f"target: sandbox at most {TARGET_RATIO:g}x bare: {ratio:.2f}x, {'met' if ok else 'MISSED'}")
    layers = full.as_dict()  # the folders bound back are this machine's paths: their count only
    layers["kept"] = f"{len(full.kept)} folder(s) of the Python interpreter, bound back read-only"
    write_json(args.out / "results.json", {
        "program": PROGRAM, "programs": n, "repeats": repeats, "core": core, "layers": layers,
        "programs_per_s": rate, "seconds": seconds, "ratio": ratio, "target_ratio": TARGET_RATIO, "met": ok})
    print(f"wrote {args.out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
