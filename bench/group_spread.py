"""Which training groups carried a gradient, early and late in finished or running runs.

    python bench/group_spread.py RUN [RUN ...] [--first 10] [--last 30] [--out FILE]

A GRPO group teaches only when its rewards differ: a group whose replies all pass, or all fail
with the same reward, has a zero advantage in every reply. Per run folder, from its samples.jsonl
(the trained samples; runs from before steps.jsonl logged `spread_frac` too) and steps.jsonl:
over its first --first steps and its last --last steps, the groups trained, the shares with
reward spread, all passing (solved) and none passing (unsolved), the mean per-token entropy,
and how many unsolved groups of three or more replies gave one wrong answer in all but at most
one of them (collapsed); the unsolved problems of the last steps with their most common answer
and how many replies gave it; the run's rollout and trainer idle shares (summary.json). Writes
--out (default RUN/group_spread.json for one run, else bench/out/group_spread.json) with its
provenance.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.app.report import read_jsonl  # noqa: E402
from areal_aio.control.stats import group_fields  # noqa: E402
from areal_aio.rewards.scoring import final_answer  # noqa: E402
from bench.common import (  # noqa: E402
    command_line,
    fmt,
    print_table,
    read_summary,
    shown_path,
    trained,
    write_json,
)

COLLAPSED_SPARE = 1
"""An unsolved group is collapsed when all its replies but at most this many give one answer
(groups of more than COLLAPSED_SPARE + 1 replies; a reply without an answer gives none)."""
SHOWN_UNSOLVED = 8
"""Unsolved problems of the last steps listed per run (the most often unsolved first)."""


def by_group(rows: list[dict]) -> list[list[dict]]:
    """Trained samples.jsonl rows gathered by their group, in the order the groups first appear."""
    groups: dict[Any, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["group"]].append(r)
    return list(groups.values())


def answer(row: dict) -> str | None:
    """The reply's final answer as the built-in reward reads it (None: it gave none)."""
    return final_answer(row["reply"] or "")[0]


def top_answer(group: list[dict]) -> tuple[str | None, int]:
    """The answer most replies of `group` gave, and how many gave it (answerless replies aside)."""
    answers = Counter(a for r in group if (a := answer(r)) is not None)
    return answers.most_common(1)[0] if answers else (None, 0)


def window(rows: list[dict], steps: list[dict], lo: int, hi: int) -> tuple[dict[str, Any], list[list[dict]]]:
    """The groups trained at steps lo..hi: group_fields, collapsed unsolved groups, mean entropy;
    and the unsolved groups themselves."""
    rows = [r for r in rows if lo <= r["step"] <= hi]
    unsolved = [g for g in by_group(rows) if not any(r["pass"] for r in g)]
    collapsed = sum(len(g) > COLLAPSED_SPARE + 1 and top_answer(g)[1] >= len(g) - COLLAPSED_SPARE
                    for g in unsolved)
    entropy = [s["entropy"] for s in steps if lo <= s["step"] <= hi and s.get("entropy") is not None]
    return {"steps": [lo, hi], **group_fields((r["group"], r["reward"], r["pass"]) for r in rows),
            "unsolved_collapsed": collapsed,
            "entropy_mean": sum(entropy) / len(entropy) if entropy else None}, unsolved


def misses(unsolved: list[list[dict]]) -> list[dict[str, Any]]:
    """The problems of the `unsolved` groups, the most often unsolved first: each with its most
    common wrong answer, the groups it was unsolved in, and the replies that gave that answer."""
    tally: dict[tuple, dict[str, int]] = defaultdict(lambda: {"groups": 0, "replies_with_it": 0, "replies": 0})
    for g in unsolved:
        wrong, n = top_answer(g)
        t = tally[(g[0]["prompt"], g[0]["answer"], wrong)]
        t["groups"], t["replies_with_it"], t["replies"] = t["groups"] + 1, t["replies_with_it"] + n, t["replies"] + len(g)
    ranked = sorted(tally.items(), key=lambda kv: -kv[1]["groups"])[:SHOWN_UNSOLVED]
    return [{"prompt": p, "answer": a, "most_common_reply_answer": w, **t} for (p, a, w), t in ranked]


def run_record(folder: Path, first: int, last: int) -> dict[str, Any]:
    """What one run's folder says (module docstring); a run still going is read as far as written."""
    rows = trained(read_jsonl(folder / "samples.jsonl")[0])
    steps = read_jsonl(folder / "steps.jsonl")[0]
    summary = read_summary(folder) or {}
    end = max((r["step"] for r in rows), default=0)
    early, _ = window(rows, steps, 1, min(first, end))
    late, unsolved = window(rows, steps, max(end - last + 1, 1), end)
    return {"run": shown_path(folder), "steps": end,
            "rollout_idle_frac": summary.get("rollout_idle_frac"), "trainer_idle_frac": summary.get("trainer_idle_frac"),
            "first": early, "last": late, "unsolved_last": misses(unsolved)}


def print_records(records: list[dict]) -> None:
    """The table: per run, its first and its last window."""
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
