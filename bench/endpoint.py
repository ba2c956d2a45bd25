"""The OpenAI-compatible endpoint's cost (agents/endpoint.py), side by side with model.reply().

    python bench/endpoint.py [--calls 2000] [--steps 4] [--repeats 3] [--out DIR]

Everything runs as `python -m areal_aio run` runs (bench.common.run_loop: uvloop, the run's
garbage-collector settings), against instant fake workers (a reply's Completion at once).

1. Per call: one episode's calls, 4 an episode, each extending the last (a user turn between):
   the time of `await model.reply()` against the time of the same call as an HTTP POST through
   the endpoint (an aiohttp client in the same loop, keep-alive: the server's and the client's
   work, no network). Median and p99 of the difference, the two sets paired by rank (each
   sorted: they are different calls, so there is no per-call difference); target <= 2 ms on
   the CPU. Beside it, the same calls through the openai package's AsyncOpenAI (model.openai()),
   a quarter as many: its per-call cost is the client's own, paid in the loop by an episode
   that uses it.
2. The controller's loop: an Orchestrator, 256 episodes at once (groups of 8, batches of 256)
   of 4 calls each, three ways:

       model.reply         the episode calls model.reply() itself: no HTTP
       http_same_loop      an aiohttp client in the controller's loop (an `async def` agent in the
                           controller's process): the loop does the client's work as well
       http_other_process  an agent process: each episode hands it model.base_url, the agent
                           makes the 4 calls and POSTs the reward, and the episode returns
                           `await model.posted_reward()`: the loop does the server's work only

   Each: trajectories/s (samples_accepted / wall_s), the controller process's CPU time per
   trajectory (what the loop pays; in the third way the agent process's work is not in it, and
   its client, slower than the server, paces the rate), the largest loop stall
   (loop_lag_max_ms) with the loop thread's CPU time during it (`stall_probe`: a stall with
   little CPU in it is the process waiting for a core, not the loop's work) and the endpoint's
   answers (endpoint_calls, endpoint_errors) from the run's summary; the median run of
   --repeats by trajectories/s.

The load average before and after is recorded: on a shared machine the figures move with it.
Writes DIR/endpoint.json (bench.common.write_json) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

import aiohttp  # noqa: E402
import openai  # noqa: E402

from areal_aio import wire  # noqa: E402
from areal_aio.agents.endpoint import Endpoint  # noqa: E402
from areal_aio.agents.model import Bounds, Model  # noqa: E402
from areal_aio.control.controller import Orchestrator  # noqa: E402
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer, prompt_ids  # noqa: E402
from areal_aio.settings import EndpointSettings, build_settings  # noqa: E402
from areal_aio.tasks.arithmetic import arithmetic_prompt  # noqa: E402
from areal_aio.tasks.task import Task  # noqa: E402
from bench.common import print_table, run_loop, write_json  # noqa: E402

CALLS_PER_EPISODE = 4
EPISODES = 256
"""Episodes at once in the loop bench: a batch of 256 samples, groups of 8."""
TARGET_MS = 2.0
OPENAI_SHARE = 4
"""The openai client's calls are a quarter of --calls: each costs several times an aiohttp call."""
AGENT_STOP_S = 30.0
"""How long the agent process gets to finish its episodes and exit before it is killed."""
STALL_PROBE_S = 0.05
"""The stall probe's sleep: the controller's own loop-lag probe period (controller.MONITOR_PERIOD_S)."""
TASK = Task("t0", "What is 2 + 3?", "5")


async def instant(ask) -> wire.Completion:
    """A reply at once: what the fake worker's instant mode answers, without a pipe."""
    msg = ask.generate("r", TASK, 1.0, 1.0)
    return wire.Completion("r", prompt_ids(msg), [1, 2, 3, 4], [-1.0] * 4, [0] * 4, "It is 5.", "stop", 0, 0.0)


def user(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}?"}


async def chat(session: aiohttp.ClientSession, base_url: str, model_name: str,
               timings: list[float] | None = None) -> None:
    """One episode's calls as an agent makes them: each sends the history so far, the last reply
    as returned, and a new user turn (each call's seconds appended to `timings`)."""
    messages = []
    for k in range(CALLS_PER_EPISODE):
        messages.append(user(k))
        t0 = time.perf_counter()
        async with session.post(f"{base_url}/chat/completions",
                                json={"model": model_name, "messages": messages}) as r:
            body = await r.json()
        if timings is not None:
            timings.append(time.perf_counter() - t0)
        messages.append(body["choices"][0]["message"])


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    ms = lambda q: round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"median": ms(0.5), "p99": ms(0.99)}


async def per_call(calls: int) -> dict:
    """Median and p99 of (HTTP call - model.reply()) in ms, over `calls` calls of each, paired by rank."""
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
    http: list[float] = []
    sdk: list[float] = []
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(calls // CALLS_PER_EPISODE):
                model = Model(bounds, instant)
                with ep.episode(model):
                    await chat(session, model.base_url, model.model_name, http)
        async with openai.AsyncOpenAI(base_url=ep.root, api_key="unused", max_retries=0) as client:
            for _ in range(calls // CALLS_PER_EPISODE // OPENAI_SHARE):
                model = Model(bounds, instant)
                with ep.episode(model):
                    await chat_openai(client.with_options(base_url=model.base_url), model.model_name, sdk)
    finally:
        await ep.stop()
    warm = len(direct) // 10  # the first calls pay imports and connection set-up
    direct, http, sdk = sorted(direct[warm:]), sorted(http[warm:]), sorted(sdk[len(sdk) // 10:])
    over = [h - d for h, d in zip(http, direct, strict=True)]
    return {"calls": len(over), "direct_ms": percentiles(direct), "http_ms": percentiles(http),
            "overhead_ms": percentiles(over), "target_ms": TARGET_MS,
            "openai_client_ms": {**percentiles(sdk), "calls": len(sdk)}}


async def chat_openai(client: openai.AsyncOpenAI, model_name: str, timings: list[float]) -> None:
    """`chat` through the openai package's client (what model.openai() gives an episode)."""
    messages = []
    for k in range(CALLS_PER_EPISODE):
        messages.append(user(k))
        t0 = time.perf_counter()
        response = await client.chat.completions.create(model=model_name, messages=messages)
        timings.append(time.perf_counter() - t0)
        messages.append(response.choices[0].message.model_dump(exclude_none=True))


# ---------------------------------------------------------------------- an agent in another process


def agent_main(conn) -> None:
    """The agent process: tells `conn` it is ready, then plays every base URL it receives (lists
    of them; None ends it) as `chat` and a posted reward of 1, all at once, in its own loop."""
    asyncio.run(_agents(conn))


async def _agents(conn) -> None:
    loop = asyncio.get_running_loop()
    playing: set[asyncio.Task] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        conn.send("ready")
        while (urls := await loop.run_in_executor(None, conn.recv)) is not None:
            for url in urls:
                task = asyncio.create_task(_agent(session, url))
                playing.add(task)
                task.add_done_callback(playing.discard)
        await asyncio.gather(*playing, return_exceptions=True)


async def _agent(session: aiohttp.ClientSession, base_url: str) -> None:
    try:
        await chat(session, base_url, "policy")
    finally:  # the episode waits for it, whatever the calls did
        await session.post(f"{base_url.removesuffix('/v1')}/reward", json={"reward": 1.0})


@contextlib.asynccontextmanager
async def agent_process():
    """A started, ready agent process; yields the function that hands it an episode's base URL.
    The URLs handed over in one loop iteration go in one pipe write at its end: a write per
    episode would put a syscall (and the agent's wake-up) per episode on the loop being timed."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=agent_main, args=(child,), daemon=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, process.start)  # spawn writes to the child: off the loop
    pending: list[str] = []

    def send() -> None:
        conn.send(pending[:])
        pending.clear()

    def hand_over(url: str) -> None:
        if not pending:
            loop.call_soon(send)
        pending.append(url)

    try:
        await loop.run_in_executor(None, conn.recv)
        yield hand_over
    finally:
        conn.send(None)
        await loop.run_in_executor(None, process.join, AGENT_STOP_S)
        if process.is_alive():
            process.kill()


# ---------------------------------------------------------------------- the controller's loop


async def through_reply(task, model) -> float:
    for k in range(CALLS_PER_EPISODE):
        if k:
            model.add_turn("user", f"Question {k}?")
        await model.reply()
    return 1.0


async def stall_probe(worst: dict[str, float]) -> None:
    """The largest lateness of a STALL_PROBE_S sleep (what the run's loop_lag_max_ms measures)
    and the loop thread's CPU seconds over that interval: near the interval's wall time, the
    loop was busy with its own work; far below it, the process was waiting for a core (on a
    shared machine) or the loop was idle."""
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.sleep(STALL_PROBE_S)
        wall = time.perf_counter() - t0
        if wall - STALL_PROBE_S > worst["late"]:
            worst.update(late=wall - STALL_PROBE_S, wall=wall, cpu=time.thread_time() - c0)


async def loop_run(episode, steps: int, episodes: int = EPISODES) -> dict:
    """One run of `steps` steps, `episodes` episodes a batch, on instant fake workers."""
    settings = build_settings({}, [
        "model.path=embedded:tiny-random", "run.progress=false", f"run.max_steps={steps}", "run.mode=sync",
        "rollout.group_size=8", f"trainer.batch_size={episodes}", "task.eval_size=1", "task.eval_every=1000",
        "controller.reward_procs=0", "run.checkpoint_every=0", "run.log_completions_every=0",
        f"task.episode_turns={CALLS_PER_EPISODE}"])
    tasks = [Task(f"t{i}", arithmetic_prompt(f"Calculate {i % 10} + 3."), str(i % 10 + 3)) for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        orch = Orchestrator(settings, tasks=itertools.cycle(tasks), eval_set=tasks[:1], out_dir=Path(tmp) / "run",
                            rollout=FakeRollout(tokens=4, instant=True, record=False),
                            trainer=FakeTrainer(record=False), episode=episode)
        worst = {"late": 0.0, "wall": 0.0, "cpu": 0.0}
        probe = asyncio.create_task(stall_probe(worst))
        cpu = time.process_time()
        summary = await orch.run()
        cpu = time.process_time() - cpu
        probe.cancel()
    return {"trajectories_per_s": round(summary["samples_accepted"] / summary["wall_s"], 1),
            "cpu_ms_per_trajectory": round(1000 * cpu / summary["samples_accepted"], 3),
            "loop_lag_max_ms": summary["loop_lag_max_ms"],
            "largest_stall": {"late_ms": round(1000 * worst["late"], 1), "interval_ms": round(1000 * worst["wall"], 1),
                              "loop_cpu_ms": round(1000 * worst["cpu"], 1)},
            "samples": summary["samples_accepted"],
            "episode_failures": summary["episode_failures"], "endpoint_calls": summary["endpoint_calls"],
            "endpoint_errors": summary["endpoint_errors"], "wall_s": summary["wall_s"], "error": summary["error"]}


async def median_run(episode, steps: int, repeats: int, episodes: int) -> dict:
    """The run of median trajectories/s among `repeats`, with every run's rate."""
    runs = sorted([await loop_run(episode, steps, episodes) for _ in range(repeats)],
                  key=lambda r: r["trajectories_per_s"])
    return {**runs[len(runs) // 2], "runs_trajectories_per_s": [r["trajectories_per_s"] for r in runs]}


async def loop_arms(steps: int, repeats: int = 1, episodes: int = EPISODES) -> dict[str, dict]:
    """The three ways (module docstring), each its median run."""
    runs = {"model.reply": await median_run(through_reply, steps, repeats, episodes)}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def through_http(task, model) -> float:
            await chat(session, model.base_url, model.model_name)
            return 1.0

        runs["http_same_loop"] = await median_run(through_http, steps, repeats, episodes)
    async with agent_process() as hand_over:

        async def through_agent(task, model) -> float:
            hand_over(model.base_url)
            return await model.posted_reward()

        runs["http_other_process"] = await median_run(through_agent, steps, repeats, episodes)
    return runs


async def main(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    calls = await per_call(args.calls)
    await loop_run(through_reply, 1)  # warm-up
    runs = await loop_arms(args.steps, args.repeats)
    return {"per_call": calls, "loop_256_episodes": runs, "calls_per_episode": CALLS_PER_EPISODE,
            "repeats": args.repeats, "loop": "uvloop, the run's GC settings (bench.common.run_loop)",
            "load_avg_1_5_15": {"before": [round(x, 2) for x in load_before],
                                "after": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "epyc-2core")
    args = parser.parse_args()
    result = run_loop(main(args))
    write_json(args.out / "endpoint.json", result)
    c = result["per_call"]
    print_table(["per call (ms)", "median", "p99"],
                [[k, c[k]["median"], c[k]["p99"]] for k in ("direct_ms", "http_ms", "overhead_ms", "openai_client_ms")])
    print_table(["256 episodes x 4 calls", "trajectories/s", "cpu ms/trajectory", "loop lag max (ms)",
                 "loop cpu in it (ms)", "failures", "endpoint errors"],
                [[k, v["trajectories_per_s"], v["cpu_ms_per_trajectory"], v["loop_lag_max_ms"],
                  f"{v['largest_stall']['loop_cpu_ms']} of {v['largest_stall']['interval_ms']}", v["episode_failures"],
                  str(v["endpoint_errors"] or "none")]
                 for k, v in result["loop_256_episodes"].items()])
    print(f"wrote {args.out / 'endpoint.json'}")
