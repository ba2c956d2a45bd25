"""The OpenAI-compatible endpoint's cost (control/endpoint.py), side by side with model.reply().

    python bench/endpoint.py [--calls 2000] [--steps 4] [--out DIR]

1. Per call: one episode's calls answered by an instant fake request (the reply's Completion
   returned at once), 4 calls an episode, each extending the last (a user turn between): the
   time of `await model.reply()` against the time of the same call as an HTTP POST through the
   endpoint (an aiohttp client in the same loop, keep-alive: the server's and the client's
   work, no network). Median and p99 of the difference; target <= 2 ms on the CPU.
2. The controller's loop: an Orchestrator against instant fake workers, 256 episodes at once
   (groups of 8, batches of 256) of 4 calls each, through HTTP against through model.reply():
   trajectories/s (samples_accepted / wall_s) and the largest loop stall (loop_lag_max_ms).

Writes DIR/endpoint.json (bench.common.write_json) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

import aiohttp  # noqa: E402

from areal_aio import wire  # noqa: E402
from areal_aio.control.controller import Orchestrator  # noqa: E402
from areal_aio.control.endpoint import Endpoint  # noqa: E402
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer, prompt_ids  # noqa: E402
from areal_aio.settings import EndpointSettings, build_settings  # noqa: E402
from areal_aio.tasks.arithmetic import arithmetic_prompt  # noqa: E402
from areal_aio.tasks.episode import Bounds, Model  # noqa: E402
from areal_aio.tasks.task import Task  # noqa: E402
from bench.common import print_table, write_json  # noqa: E402

CALLS_PER_EPISODE = 4
TARGET_MS = 2.0
TASK = Task("t0", "What is 2 + 3?", "5")


async def instant(ask) -> wire.Completion:
    """A reply at once: what the fake worker's instant mode answers, without a pipe."""
    msg = ask.generate("r", TASK, 1.0, 1.0)
    return wire.Completion("r", prompt_ids(msg), [1, 2, 3, 4], [-1.0] * 4, [0] * 4, "It is 5.", "stop", 0, 0.0)


def user(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}?"}


async def per_call(calls: int) -> dict:
    """Median and p99 of (HTTP call - model.reply()) in ms, over `calls` calls of each."""
    bounds = Bounds(CALLS_PER_EPISODE, 10_000, 60.0, 64)
    direct = []
    for _ in range(calls // CALLS_PER_EPISODE):
        model = Model(bounds, instant)
        for k in range(CALLS_PER_EPISODE):
            if k:
                model.add_turn("user", f"Question {k}?")
            t0 = time.perf_counter()
            await model.reply()
            direct.append(time.perf_counter() - t0)
    ep = Endpoint(EndpointSettings())
    await ep.start()
    http = []
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(calls // CALLS_PER_EPISODE):
                model = Model(bounds, instant)
                with ep.episode(model):
                    url, messages = f"{model.base_url}/chat/completions", []
                    for k in range(CALLS_PER_EPISODE):
                        messages.append(user(k))
                        t0 = time.perf_counter()
                        async with session.post(url, json={"model": "policy", "messages": messages}) as r:
                            body = await r.json()
                        http.append(time.perf_counter() - t0)
                        messages.append(body["choices"][0]["message"])
    finally:
        await ep.stop()
    warm = len(direct) // 10  # the first calls pay imports and connection set-up
    direct, http = sorted(direct[warm:]), sorted(http[warm:])
    over = sorted(h - d for h, d in zip(http, direct, strict=True))
    ms = lambda xs, q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"calls": len(over), "direct_ms": {"median": ms(direct, 0.5), "p99": ms(direct, 0.99)},
            "http_ms": {"median": ms(http, 0.5), "p99": ms(http, 0.99)},
            "overhead_ms": {"median": ms(over, 0.5), "p99": ms(over, 0.99)}, "target_ms": TARGET_MS}


async def through_reply(task, model) -> float:
    for k in range(CALLS_PER_EPISODE):
        if k:
            model.add_turn("user", f"Question {k}?")
        await model.reply()
    return 1.0


SESSION: dict[int, aiohttp.ClientSession] = {}  # one client session per loop: what an agent pool keeps


async def through_http(task, model) -> float:
    loop = id(asyncio.get_running_loop())
    session = SESSION.get(loop) or SESSION.setdefault(loop, aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0)))
    messages = []
    for k in range(CALLS_PER_EPISODE):
        messages.append(user(k))
        async with session.post(f"{model.base_url}/chat/completions",
                                json={"model": model.model_name, "messages": messages}) as r:
            body = await r.json()
        messages.append(body["choices"][0]["message"])
    return 1.0


async def loop_run(episode, steps: int) -> dict:
    settings = build_settings({}, [
        "model.path=embedded:tiny-random", "run.progress=false", f"run.max_steps={steps}", "run.mode=sync",
        "rollout.group_size=8", "trainer.batch_size=256", "task.eval_size=1", "task.eval_every=1000",
        "controller.reward_procs=0", "run.checkpoint_every=0", "run.log_completions_every=0",
        f"task.episode_turns={CALLS_PER_EPISODE}"])
    tasks = [Task(f"t{i}", arithmetic_prompt(f"Calculate {i % 10} + 3."), str(i % 10 + 3)) for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        orch = Orchestrator(settings, tasks=itertools.cycle(tasks), eval_set=tasks[:1], out_dir=Path(tmp) / "run",
                            rollout=FakeRollout(tokens=4, instant=True, record=False),
                            trainer=FakeTrainer(record=False), episode=episode)
        summary = await orch.run()
    for session in SESSION.values():
        await session.close()
    SESSION.clear()
    return {"trajectories_per_s": round(summary["samples_accepted"] / summary["wall_s"], 1),
            "loop_lag_max_ms": summary["loop_lag_max_ms"], "samples": summary["samples_accepted"],
            "episode_failures": summary["episode_failures"], "wall_s": summary["wall_s"]}


async def main(args: argparse.Namespace) -> dict:
    calls = await per_call(args.calls)
    await loop_run(through_reply, 1)  # warm-up
    runs = {name: await loop_run(fn, args.steps) for name, fn in (("model.reply", through_reply),
                                                                   ("http", through_http))}
    return {"per_call": calls, "loop_256_episodes": runs, "calls_per_episode": CALLS_PER_EPISODE}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "epyc-2core")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    c = result["per_call"]
    print_table(["per call (ms)", "median", "p99"],
                [[k, c[k]["median"], c[k]["p99"]] for k in ("direct_ms", "http_ms", "overhead_ms")])
    print_table(["256 episodes x 4 calls", "trajectories/s", "loop lag max (ms)", "failures"],
                [[k, v["trajectories_per_s"], v["loop_lag_max_ms"], v["episode_failures"]]
                 for k, v in result["loop_256_episodes"].items()])
    write_json(args.out / "endpoint.json", result)
    print(f"wrote {args.out / 'endpoint.json'}")
