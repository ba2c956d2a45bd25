"""How long the README's test command takes: its two tiers, timed as CI runs them.

    python bench/test_tiers.py [--tiers fast,slow] [--out DIR]

fast   `python -m pytest -q -n 2 -m "not slow"` (the tests without real workers, on both cores)
slow   `python -m pytest -q -m slow` (real workers on a tiny model, one test at a time)

Per tier: its wall seconds, pytest's counts (passed, failed, skipped) and the slowest tests
pytest printed (pyproject's `--durations`), and the tests that failed. Nothing else may run on the machine meanwhile.
Writes DIR/results.json (default bench/out/test-tiers) and prints a table.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bench.common import command_line, parse_list, print_table, write_json  # noqa: E402

TIERS = {"fast": ["-n", "2", "-m", "not slow"], "slow": ["-m", "slow"]}
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")
FAILED = re.compile(r"^FAILED (\S+)", re.MULTILINE)
SLOWEST = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)", re.MULTILINE)


def run_tier(name: str) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TIERS[name]]
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in COUNTS.findall(tail)}
    slowest = [{"s": float(s), "phase": phase, "test": test} for s, phase, test in SLOWEST.findall(done.stdout)]
    return {"tier": name, "command": "python -m pytest -q " + " ".join(
                f'"{a}"' if " " in a else a for a in TIERS[name]),
            "exit_code": done.returncode, "wall_s": round(wall, 1), "counts": counts,
            "failed": FAILED.findall(done.stdout), "slowest": slowest[:15]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", default="fast,slow")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "test-tiers"))
    args = ap.parse_args(argv)
    tiers = parse_list(args.tiers)
    if unknown := [t for t in tiers if t not in TIERS]:
        ap.error(f"--tiers: unknown {unknown}; choose from {sorted(TIERS)}")
    rows = []
    for name in tiers:
        rows.append(run_tier(name))
        print(f"{name}: {rows[-1]['wall_s']:.0f} s, {rows[-1]['counts']}, exit {rows[-1]['exit_code']}", flush=True)
    print_table(["tier", "wall s", "passed", "failed", "exit"],
                [[r["tier"], f"{r['wall_s']:.0f}", str(r["counts"].get("passed", 0)),
                  str(r["counts"].get("failed", 0)), str(r["exit_code"])] for r in rows])
    write_json(Path(args.out) / "results.json", {"tiers": rows}, command=command_line(__file__, argv))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
