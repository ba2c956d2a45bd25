"""Which training groups carried a gradient, early and late in finished or running runs.

    python bench/group_spread.py RUN [RUN ...] [--first 10] [--last 30] [--out FILE]

A GRPO group teaches only when its rewards differ: a group whose replies all pass, or all fail
with the same reward, has a zero advantage in every reply. Per run folder, from its samples.jsonl
(the trained samples; runs from before steps.jsonl logged `spread_frac` too) and steps.jsonl:
over its first --first steps and its last --last steps, the groups trained, the shares with
reward spread, all passing (solved) and none passing (unsolved), the mean per-token entropy,
how many unsolved groups gave one wrong answer in every reply but at most one (collapsed), and
the unsolved problems of the last steps with their most common answer. Writes --out (default
RUN/group_spread.json for one run, else bench/out/group_spread.json) with its provenance.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.control.stats import group_fields  # noqa: E402
from areal_aio.rewards.scoring import final_answer  # noqa: E402
from bench.common import command_line, fmt, print_table, shown_path, write_json  # noqa: E402

COLLAPSED_SPARE = 1
"""An unsolved group is collapsed when all its replies but at most this many give one answer."""
SHOWN_UNSOLVED = 8
"""Unsolved problems of the last steps listed per run (the most often unsolved first)."""


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A JSONL file's rows as far as they parse (a running run may end in a half-written line)."""
    rows = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return rows


def window(samples: list[dict], steps: list[dict], lo: int, hi: int) -> dict[str, Any]:
    """The groups trained at steps lo..hi: group_fields, collapsed unsolved groups, mean entropy."""
    rows = [r for r in samples if lo <= r["step"] <= hi]
    groups: dict[Any, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    unsolved = [g for g in groups.values() if not any(r["pass"] for r in g)]
    collapsed = sum(Counter(answer(r) for r in g).most_common(1)[0][1] >= len(g) - COLLAPSED_SPARE
                    for g in unsolved)
    entropy = [s["entropy"] for s in steps if lo <= s["step"] <= hi and s.get("entropy") is not None]
    return {"steps": [lo, hi], **group_fields((r["group"], r["reward"], r["pass"]) for r in rows),
            "unsolved_collapsed": collapsed,
            "entropy_mean": sum(entropy) / len(entropy) if entropy else None}


def answer(row: dict) -> str | None:
    return final_answer(row["reply"] or "")[0]


def run_record(folder: Path, first: int, last: int) -> dict[str, Any]:
    """What one run's folder says (module docstring)."""
    samples = [r for r in read_rows(folder / "samples.jsonl")
               if r.get("kind") == "train" and r.get("step") is not None and r.get("reward") is not None]
    steps = read_rows(folder / "steps.jsonl")
    end = max((r["step"] for r in samples), default=0)
    late = [r for r in samples if r["step"] > end - last]
    by_group: dict[Any, list[dict]] = defaultdict(list)
    for r in late:
        by_group[r["group"]].append(r)
    misses: Counter = Counter()
    for g in by_group.values():
        if not any(r["pass"] for r in g):
            wrong = Counter(answer(r) for r in g).most_common(1)[0][0]
            misses[(g[0]["prompt"], g[0]["answer"], wrong)] += 1
    return {"run": shown_path(folder), "steps": end,
            "first": window(samples, steps, 1, min(first, end)),
            "last": window(samples, steps, max(end - last + 1, 1), end),
            "unsolved_last": [{"prompt": p, "answer": a, "most_common_reply_answer": w, "groups": n}
                              for (p, a, w), n in misses.most_common(SHOWN_UNSOLVED)]}


def print_records(records: list[dict]) -> None:
    rows = []
    for rec in records:
        for name in ("first", "last"):
            w = rec[name]
            rows.append([rec["run"], f"{name} {w['steps'][0]}-{w['steps'][1]}", str(w["groups"]),
                         fmt(w["spread_frac"]), fmt(w["solved_frac"]), fmt(w["unsolved_frac"]),
                         str(w["unsolved_collapsed"]), fmt(w["entropy_mean"])])
    print_table(["run", "steps", "groups", "spread", "solved", "unsolved", "collapsed", "entropy"], rows,
                title="training groups with reward spread (the only ones with a GRPO gradient)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders")
    ap.add_argument("--first", type=int, default=10, help="the first this many steps")
    ap.add_argument("--last", type=int, default=30, help="the last this many steps")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if missing := [str(r) for r in args.runs if not (r / "samples.jsonl").exists()]:
        ap.error(f"no samples.jsonl in {', '.join(missing)}: not a run folder")
    records = [run_record(folder, args.first, args.last) for folder in args.runs]
    print_records(records)
    out = args.out or (args.runs[0] / "group_spread.json" if len(args.runs) == 1
                       else REPO / "bench" / "out" / "group_spread.json")
    write_json(out, {"first": args.first, "last": args.last, "runs": records}, command=command_line(__file__, argv))
    print(f"\nwritten: {shown_path(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
