"""A judge model as the reward, measured: verdicts per second from a local judge worker, and the
loop's trajectories per second with a judge against the built-in answer reward.

    python bench/judge.py [--model embedded:smollm2-135m-instruct] [--calls 64] [--concurrent 1,8]
        [--steps 6] [--out DIR] [--quick]

1. Verdicts: --calls judge calls (the default rubric, a held-out arithmetic prompt and a reply
   each) to a local judge (control/judging.py: a rollout worker of its own on --model, one
   thread), all asked at once, judge.max_concurrent = each of --concurrent: verdicts/s = calls /
   wall seconds, the worker's start and WARM_UP verdicts before them not counted.
2. The loop: the Orchestrator against an instant fake rollout worker and a fake trainer (no
   policy model: scoring is what differs), the default batch (32 samples, groups of 8) for
   --steps steps in sync mode (each step's samples are generated and scored after the last
   step, so none is scored ahead of the steps counted), task.reward = "answer" against "judge"
   (the same local judge, its default max_concurrent): trajectories/s = the samples of steps
   2..N / the wall seconds between the commits of step 1 and step N (the judge worker's start,
   inside the run, not counted).

--quick: tiny-random as the judge, 8 calls, 3 steps.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from areal_aio.control import judging  # noqa: E402
from areal_aio.control.controller import Orchestrator  # noqa: E402
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer  # noqa: E402
from areal_aio.rewards.scoring import load_rewards  # noqa: E402
from areal_aio.settings import Settings, build_settings  # noqa: E402
from areal_aio.tasks.arithmetic import arithmetic_tasks  # noqa: E402
from bench.common import fmt, parse_list, print_table, run_loop, write_json  # noqa: E402

MODEL = "embedded:smollm2-135m-instruct"
WARM_UP = 8
"""Verdicts asked, untimed, before the timed ones: a fresh worker's first forward passes pay
one-time costs (kernel selection, allocator growth) that a run pays once."""


def settings_for(model: str, reward: str, steps: int, concurrent: int = 8) -> Settings:
    return build_settings({}, ["run.mode=sync", f"task.reward={reward}", f"judge.model={model}", f"judge.max_concurrent={concurrent}",
                               f"run.max_steps={steps}", "run.progress=false", "task.eval_size=1",
                               "task.eval_every=1000", "run.checkpoint_every=0", "controller.reward_procs=0",
                               "model.path=embedded:tiny-random"])


async def verdicts_per_s(model: str, calls: int, concurrent: int, folder: Path) -> dict:
    settings = settings_for(model, "judge", 1, concurrent)
    reward = load_rewards(settings.task, settings.judge)
    tasks = list(arithmetic_tasks(settings.task, 7, calls, "j"))
    async with judging.serving(settings, reward, folder / f"judge-{concurrent}.log") as reader:
        read = asyncio.ensure_future(reader)
        try:
            await asyncio.gather(*(reward.fn(t, f"{t.answer}") for t in tasks[:WARM_UP]))  # first batches: kernels, caches
            t0 = time.perf_counter()
            scores = await asyncio.gather(*(reward.fn(t, f"{t.answer}") for t in tasks))
            wall = time.perf_counter() - t0
        finally:
            read.cancel()
    return {"concurrent": concurrent, "calls": calls, "wall_s": round(wall, 3),
            "verdicts_per_s": round(calls / wall, 2), "parsed": sum(not s.failed for s in scores),
            "passed": sum(s.passed for s in scores)}


async def loop_rate(model: str, reward: str, steps: int, folder: Path) -> dict:
    run = folder / f"loop-{reward}"
    shutil.rmtree(run, ignore_errors=True)
    settings = settings_for(model, reward, steps)
    summary = await Orchestrator(settings, out_dir=run, rollout=FakeRollout(tokens=8, instant=True, record=False),
                                 trainer=FakeTrainer(record=False)).run()
    rows = [orjson.loads(x) for x in (run / "steps.jsonl").read_bytes().splitlines()]
    span = rows[-1]["wall_s"] - rows[0]["wall_s"]
    samples = settings.trainer.batch_size * (len(rows) - 1)
    return {"reward": reward, "steps": summary["steps"], "reward_failures": summary["reward_failures"],
            "trajectories_per_s": round(samples / span, 2) if span > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--concurrent", default="1,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "judge")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.calls, args.steps = "embedded:tiny-random", 8, 3
    args.out.mkdir(parents=True, exist_ok=True)
    calls = [run_loop(verdicts_per_s(args.model, args.calls, c, args.out)) for c in parse_list(args.concurrent, int)]
    loops = [run_loop(loop_rate(args.model, reward, args.steps, args.out)) for reward in ("answer", "judge")]
    print_table(["max_concurrent", "calls", "wall s", "verdicts/s", "parsed"],
                [[str(c["concurrent"]), str(c["calls"]), fmt(c["wall_s"]), fmt(c["verdicts_per_s"]), str(c["parsed"])]
                 for c in calls], title=f"local judge {args.model}")
    print_table(["reward", "steps", "trajectories/s", "reward failures"],
                [[r["reward"], str(r["steps"]), fmt(r["trajectories_per_s"]), str(r["reward_failures"])] for r in loops],
                title="the loop (fake workers)")
    write_json(args.out / "results.json", {"model": args.model, "verdicts": calls, "loop": loops})
    return 0


if __name__ == "__main__":
    sys.exit(main())
