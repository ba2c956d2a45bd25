"""A local judge (task.reward = "judge" without judge.url): judge.model served for the run by a
rollout worker of its own, whose engine batches the judge's calls together (continuous batching,
as a run's rollouts are), beside the run's own workers.

    Judge(task, reply) --complete(messages)--> Generate (greedy, judge.max_tokens)
        --> the judge worker --> Completion --reader--> that call's future --> the verdict text

`serving` binds every Judge among the run's rewards to record its unparsed verdicts in
events.jsonl (judge_unparsed), starts the worker of a local one, binds it there, and yields the reader, which the run starts
among its tasks: the judge worker dying fails the run as any worker's death does. On leaving,
the worker is stopped and calls still waiting are cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from areal_aio import wire
from areal_aio.control.awaited import Awaited
from areal_aio.fleet.client import PipeWorker, WorkerClient
from areal_aio.rewards.judge import Judge
from areal_aio.rewards.scoring import Reward
from areal_aio.settings import Settings


def all_judges(rewards: Any) -> list[Judge]:
    """The Judges among a run's rewards (a Reward, a list of them, or a bare function)."""
    parts = rewards if isinstance(rewards, list) else [rewards]
    fns = [r.fn if isinstance(r, Reward) else r for r in parts]
    return [fn for fn in fns if isinstance(fn, Judge)]


def judge_settings(settings: Settings) -> Settings:
    """The judge worker's settings: the run's, with judge.model as the model, judge.threads,
    one worker, replies of at most judge.max_tokens, and no LoRA (the judge is never trained)."""
    return dataclasses.replace(
        settings,
        model=dataclasses.replace(settings.model, path=settings.judge.model),
        rollout=dataclasses.replace(settings.rollout, threads=settings.judge.threads, devices=[],
                                    max_new_tokens=settings.judge.max_tokens),
        lora=dataclasses.replace(settings.lora, rank=0))


class JudgeWorker:
    """One judge worker's calls: `complete` sends a Generate and awaits its Completion, which
    `read` hands to it."""

    def __init__(self, worker: WorkerClient) -> None:
        self.worker = worker
        self._calls = Awaited()
        self._ids = itertools.count()

    async def complete(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        rid = f"judge-{next(self._ids)}"
        future = self._calls.expect(rid)
        try:
            await self.worker.send(wire.Generate(rid, messages[-1]["content"], max_tokens, 0.0, 1.0, 0, messages))
            return (await future).text
        finally:
            if self._calls.forget(rid):
                with contextlib.suppress(Exception):
                    await self.worker.send(wire.Abort(rid))  # given up (a timeout): free its slot

    async def read(self) -> None:
        """Hand each Completion to its call until the worker ends; its death raises (WorkerFailed)."""
        while True:
            msg = await self.worker.recv()
            if not isinstance(msg, wire.Completion):
                raise self.worker.failure(msg)
            self._calls.deliver(msg)

    def cancel(self) -> None:
        self._calls.cancel()


@contextlib.asynccontextmanager
async def serving(settings: Settings, rewards: Any, log: Path, events: Any = None,
                  worker: WorkerClient | None = None) -> AsyncIterator[Coroutine | None]:
    """Every judge among `rewards` records its unparsed verdicts in `events` (judge_unparsed);
    a local one gets a worker of its own for the block. Yields that worker's reader (None when
    no judge is local)."""
    judges = all_judges(rewards)
    record = (lambda row: events.info("judge_unparsed", **row)) if events is not None else None
    for judge in judges:
        judge.record = record
    local = [judge for judge in judges if judge.local]
    if not local:
        yield None
        return
    cfg = judge_settings(settings)
    client = worker or PipeWorker("rollout", log, settings.judge.threads)
    served = JudgeWorker(client)
    try:
        await client.prepare(cfg.model.path)
        await client.start(wire.Init("rollout", cfg.to_dict(), ""))
        for judge in local:
            judge.bind(served.complete, record)
        yield served.read()
    finally:
        served.cancel()
        await client.stop()
