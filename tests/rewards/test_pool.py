"""The reward pool: hung calls are killed and replaced, dead processes are healed, a pool
that keeps breaking stops the run, and no pool process outlives its owner."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_aio.rewards.pool import MAX_BREAKS, RewardCallFailed, RewardPool, RewardPoolBroken
from areal_aio.rewards.scoring import Scorer
from areal_aio.tasks.task import Task
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # real pool processes, a second or two each
T = Task("t", "Calculate 3 + 4.", "7")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def answer_len(task: Task, text: str) -> float:
    if text == "hang":
        time.sleep(3600)
    if text == "die":
        os._exit(3)
    if text == "raise":
        raise ValueError("bad input")
    return float(len(text))


async def test_calls_run_in_pool_processes_and_return_values():
    async with RewardPool(answer_len, procs=2, timeout_s=30) as pool:
        assert await asyncio.gather(*(pool.call(T, "x" * n) for n in range(6))) == [float(n) for n in range(6)]
        assert len(pool.pids) == 2 and os.getpid() not in pool.pids
        with pytest.raises(RewardCallFailed, match="ValueError: bad input"):
            await pool.call(T, "raise")
        assert await pool.call(T, "abc") == 3.0  # a raising call leaves its process usable
        assert len(pool.pids) == 2


async def test_a_hung_call_is_killed_at_its_timeout_and_its_process_replaced():
    async with RewardPool(answer_len, procs=1, timeout_s=2) as pool:  # room for a busy machine
        await pool.call(T, "warm")
        (first,) = pool.pids
        t0 = time.perf_counter()
        with pytest.raises(RewardCallFailed, match="timed out"):
            await pool.call(T, "hang")
        assert time.perf_counter() - t0 < 10
        assert not alive(first)
        assert await pool.call(T, "ok") == 2.0
        assert pool.pids and pool.pids != [first]
        assert not pool.breaks  # a timeout is the reward's failure, not the pool's


async def test_a_dead_process_is_replaced_and_counted_as_a_break():
    async with RewardPool(answer_len, procs=1, timeout_s=30) as pool:
        with pytest.raises(RewardCallFailed, match="died"):
            await pool.call(T, "die")
        assert await pool.call(T, "ok") == 2.0
        (pid,) = pool.pids
        os.kill(pid, signal.SIGKILL)  # killed while idle: found dead at its next call
        async def reaped() -> None:  # the pool knows once asyncio has its exit code
            while pid in pool.pids:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(reaped(), 30)
        assert await pool.call(T, "ok") == 2.0  # a new process answers
        assert len(pool.breaks) == 2


async def test_a_pool_that_keeps_breaking_raises_instead_of_scoring_zeros():
    async with RewardPool(answer_len, procs=1, timeout_s=30) as pool:
        for _ in range(MAX_BREAKS - 1):
            with pytest.raises(RewardCallFailed):
                await pool.call(T, "die")
        with pytest.raises(RewardPoolBroken, match=f"broke {MAX_BREAKS} times"):
            await pool.call(T, "die")
        with pytest.raises(RewardPoolBroken):
            await pool.call(T, "ok")


async def test_scorer_lets_a_broken_pool_stop_the_run_but_counts_single_deaths():
    scorer = Scorer(answer_len, timeout_s=30, procs=1)
    try:
        score = await scorer.score(T, "die")
        assert score.failed and score.reward == 0.0 and scorer.failures == 1
        with pytest.raises(RewardPoolBroken):
            for _ in range(MAX_BREAKS):
                await scorer.score(T, "die")
    finally:
        await scorer.aclose()


async def test_a_function_the_pool_cannot_load_stops_at_once():
    fn = answer_len
    pool = RewardPool(fn, procs=1, timeout_s=30)
    pool._fn = pool._fn.replace(b"answer_len", b"answer_lex")  # importable here, not there
    with pytest.raises(RewardPoolBroken, match="cannot be loaded"):
        await pool.call(T, "x")
    await pool.aclose()


async def test_cancelling_a_call_kills_its_process():
    async with RewardPool(answer_len, procs=1, timeout_s=30) as pool:
        await pool.call(T, "warm")
        (pid,) = pool.pids
        call = asyncio.create_task(pool.call(T, "hang"))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not alive(pid)
        assert await pool.call(T, "ok") == 2.0


async def test_close_kills_a_process_in_a_hung_call():
    pool = RewardPool(answer_len, procs=1, timeout_s=3600)
    await pool.call(T, "warm")
    (pid,) = pool.pids
    call = asyncio.create_task(pool.call(T, "hang"))
    await asyncio.sleep(0.2)
    await pool.aclose()
    with pytest.raises(RewardCallFailed, match="closed"):
        await asyncio.wait_for(call, 10)
    assert not alive(pid) and not pool.breaks


OWNER = textwrap.dedent("""
    import asyncio, os, sys, time
    sys.path.insert(0, {tests!r})  # the repository: tests.conftest
    from areal_aio.rewards.pool import RewardPool
    from areal_aio.tasks.task import Task
    from tests.conftest import pid_of_worker

    async def main():
        pool = RewardPool(pid_of_worker, procs=2, timeout_s=30)
        await asyncio.gather(*(pool.call(Task("t", "p", "a"), "x") for _ in range(4)))
        print(*pool.pids, flush=True)
        time.sleep(3600)

    asyncio.run(main())
""")


def test_pool_processes_die_with_their_owner_and_start_no_resource_tracker():
    """SIGKILL of the process that owns the pool takes every pool process with it."""
    tests = str(ROOT)
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(tests=tests)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        children = _children(owner.pid)
        assert set(children) == set(pids), "nothing but the pool processes (no resource tracker)"
        owner.kill()
        owner.wait()
        deadline = time.time() + 5
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.02)
        assert not any(alive(p) for p in pids)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found
