"""RolloutPool: several fake rollout workers behind one client, alone and under the controller."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from areal_aio import wire
from areal_aio.fleet import placement
from areal_aio.fleet.client import PipeWorker, WorkerFailed
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.fleet.rollout_pool import RolloutPool
from tests.conftest import make_settings, orchestrator, rollouts

SLOW = dict(tokens=1000, token_delay_s=0.01)
"""A request that is still running when the test looks."""


class Recording(FakeRollout):
    """Keeps its Init and every message it was sent."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.init: wire.Init | None = None
        self.sent: list = []

    async def start(self, init: wire.Init) -> wire.Ready:
        self.init = init
        return await super().start(init)

    async def send(self, msg) -> None:
        self.sent.append(msg)
        await super().send(msg)


def generates(prefix: str, n: int) -> list[wire.Generate]:
    return [wire.Generate(f"{prefix}.{i}", "Calculate 1 + 2.", 64, 0.7) for i in range(n)]


async def started(n: int, devices=None, **kw) -> tuple[list[Recording], RolloutPool]:
    fakes = [Recording(**kw) for _ in range(n)]
    pool = RolloutPool(fakes, devices)
    await pool.start(wire.Init("rollout", make_settings().to_dict(), "shm"))
    return fakes, pool


def holding(fakes: list[Recording]) -> list[set[str]]:
    """The request ids each fake holds (started, not answered)."""
    return [set(f._requests) for f in fakes]


async def test_each_worker_gets_its_rank_and_device_and_one_ready_stands_for_all():
    fakes, pool = await started(3, ["cuda:0", "cuda:1", "cpu"])
    try:
        assert [(f.init.rank, f.init.world) for f in fakes] == [(0, 3), (1, 3), (2, 3)]
        assert [f.init.settings["rollout"]["device"] for f in fakes] == ["cuda:0", "cuda:1", "cpu"]
        assert len(pool.readies) == 3 and pool.readies[0].device == "fake"
        assert all(f.init.settings["run"] == fakes[0].init.settings["run"] for f in fakes)
    finally:
        await pool.stop()


async def test_workers_that_disagree_on_their_version_do_not_start():
    class Ahead(FakeRollout):
        async def start(self, init):
            return wire.Ready("rollout", 1, 0.0, "fake", 3)

    pool = RolloutPool([FakeRollout(), Ahead()])
    with pytest.raises(WorkerFailed, match=r"versions \[0, 3\]"):
        await pool.start(wire.Init("rollout", make_settings().to_dict(), "shm"))
    await pool.stop()


async def test_a_group_goes_whole_to_the_least_loaded_worker_and_a_completion_frees_its_slot():
    fakes, pool = await started(3, **SLOW)
    try:
        await pool.send_many(generates("g0", 3))  # all idle: worker 0
        await pool.send_many(generates("g1", 2))  # worker 1
        await pool.send_many(generates("g2", 2))  # worker 2
        await pool.send_many(generates("g3", 1))  # 1 and 2 hold 2 each: worker 1 (lowest index)
        assert holding(fakes) == [{"g0.0", "g0.1", "g0.2"}, {"g1.0", "g1.1", "g3.0"}, {"g2.0", "g2.1"}]
        await pool.send(wire.Abort("g0.0"))
        await pool.send(wire.Abort("g0.1"))
        for _ in range(2):
            assert (await pool.recv()).finish == "abort"
        await pool.send_many(generates("g4", 2))  # worker 0 holds one now
        assert holding(fakes)[0] == {"g0.2", "g4.0", "g4.1"}
    finally:
        await pool.stop()


async def test_single_requests_spread_across_the_workers():
    fakes, pool = await started(2, **SLOW)
    try:
        for msg in generates("eval0", 6):
            await pool.send(msg)
        assert [len(h) for h in holding(fakes)] == [3, 3]
    finally:
        await pool.stop()


async def test_a_worker_is_busy_while_it_holds_a_request_and_recv_says_which_worker_sent():
    fakes, pool = await started(2, **SLOW)
    try:
        await pool.send_many(generates("g0", 2))  # worker 0
        assert [b.active for b in pool.busy] == [2, 0] and pool.busy[1].seconds() == 0.0
        await pool.send_many(generates("g1", 1))  # worker 1
        await pool.send(wire.Abort("g1.0"))
        assert (await asyncio.wait_for(pool.recv(), 10)).request_id == "g1.0" and pool.source == 1
        await pool.send(wire.Abort("g0.1"))
        assert (await asyncio.wait_for(pool.recv(), 10)).request_id == "g0.1" and pool.source == 0
        assert [b.active for b in pool.busy] == [1, 0] and pool.busy[1].total > 0.0
    finally:
        await pool.stop()


async def test_an_abort_reaches_only_the_worker_holding_it_and_an_unknown_one_none():
    fakes, pool = await started(2, **SLOW)
    try:
        await pool.send_many(generates("g0", 2))
        await pool.send_many(generates("g1", 2))
        await pool.send_many([wire.Abort("g1.1"), wire.Abort("nobody")])
        done = await asyncio.wait_for(pool.recv(), 10)
        assert done.request_id == "g1.1" and done.finish == "abort"
        aborts = [[m.request_id for m in f.sent if isinstance(m, wire.Abort)] for f in fakes]
        assert aborts == [[], ["g1.1"]]
    finally:
        await pool.stop()


async def test_update_weights_reaches_every_worker_and_each_reports_its_load():
    fakes, pool = await started(3, **SLOW)
    try:
        await pool.send_many(generates("g0", 1))
        await pool.send(wire.UpdateWeights(1, "v1.safetensors"))
        loaded = [await asyncio.wait_for(pool.recv(), 10) for _ in range(3)]
        assert sorted((m.version, m.worker, m.rebuilt) for m in loaded) == [(1, 0, 1), (1, 1, 0), (1, 2, 0)]
        assert all(f.version == 1 for f in fakes)
    finally:
        await pool.stop()


async def test_a_dead_worker_is_named_and_stop_ends_them_all_and_every_reader():
    fakes, pool = await started(3, **SLOW)
    await pool.send_many(generates("g0", 2))
    fakes[2].kill()
    msg = await asyncio.wait_for(pool.recv(), 10)
    assert msg is None
    failure = pool.failure(msg)
    assert failure.role == "rollout 2" and "rollout 2 worker failed: exited with code -9" in str(failure)
    with pytest.raises(WorkerFailed, match="rollout 2 worker failed: exited with code -9"):
        await pool.send(wire.UpdateWeights(1, "v1.safetensors"))
    readers = list(pool._readers)
    await pool.stop()
    assert [f.returncode for f in fakes] == [0, 0, -9] and not fakes[0]._running
    assert all(task.done() for task in readers) and not pool._readers


async def test_a_broken_pipe_in_one_reader_reaches_the_caller():
    class Garbled(FakeRollout):
        async def recv(self):
            raise wire.WireError("malformed frame")

    pool = RolloutPool([FakeRollout(), Garbled()])
    await pool.start(wire.Init("rollout", make_settings().to_dict(), "shm"))
    with pytest.raises(wire.WireError, match="malformed"):
        await asyncio.wait_for(pool.recv(), 10)
    await pool.stop()


def test_placement_pools_several_rollout_devices_and_keeps_one_worker_plain(tmp_path):
    one = placement.rollout_client(make_settings(), tmp_path)
    assert isinstance(one, PipeWorker) and one.log_path == tmp_path / "rollout.log"
    pool = placement.rollout_client(make_settings(**{"rollout.devices": 2}), tmp_path)
    assert isinstance(pool, RolloutPool) and pool.devices == ["cpu", "cpu"]
    assert [w.log_path.name for w in pool.workers] == ["rollout-0.log", "rollout-1.log"]
    moved = placement.rollout_client(make_settings(**{"rollout.devices": ["cuda:1"]}), tmp_path)
    assert isinstance(moved, RolloutPool) and moved.devices == ["cuda:1"]  # its Init says cuda:1


# ---------------------------------------------------------------------- under the controller


def events(folder) -> list[dict]:
    return [orjson.loads(x) for x in (folder / "events.jsonl").read_bytes().splitlines()]


async def test_a_run_on_two_workers_uses_both_loads_every_version_on_each_and_logs_them(tmp_path):
    fakes, pool = rollouts(2, lambda i: Recording(tokens=3, token_delay_s=0.002))
    summary = await orchestrator(tmp_path, make_settings("sync"), rollout=pool).run()
    assert summary["steps"] == 6 and summary["rollout_workers"] == 2 and summary["rollout_devices"] == ["fake"] * 2
    for f in fakes:
        served = {m.request_id for m in f.sent if isinstance(m, wire.Generate)}
        assert any(r.startswith("g") for r in served) and any(r.startswith("eval") for r in served)
        assert f.returncode == 0
    rows = events(tmp_path / "run")
    ready = [(e["role"], e["worker"]) for e in rows if e["event"] == "worker_ready"]
    assert sorted(ready) == [("rollout", 0), ("rollout", 1), ("trainer", 0)]
    loads = {(e["version"], e["worker"]) for e in rows if e["event"] == "weights_loaded"}
    assert loads == {(v, w) for v in range(1, 7) for w in (0, 1)}


async def test_the_summary_gives_each_worker_its_requests_tokens_and_idle_fraction(tmp_path):
    fakes, pool = rollouts(2, lambda i: Recording(tokens=3 + 2 * i, token_delay_s=0.002))
    summary = await orchestrator(tmp_path, make_settings(), rollout=pool).run()
    detail = summary["rollout_workers_detail"]
    assert [(d["worker"], d["device"]) for d in detail] == [(0, "fake"), (1, "fake")]
    assert sum(d["gen_tokens"] for d in detail) == summary["gen_tokens"]
    for d, f, tokens in zip(detail, fakes, (3, 5), strict=True):  # each reply has its worker's length
        sent = sum(isinstance(m, wire.Generate) for m in f.sent)
        assert d["gen_tokens"] > 0 and d["gen_tokens"] % tokens == 0
        assert d["gen_tokens"] // tokens < d["requests"] <= sent  # evals count as requests, not tokens
        assert summary["rollout_idle_frac"] <= d["idle_frac"] <= 1  # the role is busy when either is


async def test_one_worker_is_one_entry_of_the_detail(tmp_path):
    summary = await orchestrator(tmp_path, make_settings(), rollout=Recording(tokens=3)).run()
    [d] = summary["rollout_workers_detail"]
    assert d["gen_tokens"] == summary["gen_tokens"] and d["requests"] > summary["samples_generated"]
    # the worker's busy spans (the pool's, send to its reader) lie inside the role's (send to the
    # controller's recv): a run of a few milliseconds may differ by a scheduling hiccup, no more
    assert summary["rollout_idle_frac"] <= d["idle_frac"] <= 1


async def test_evals_spread_across_the_workers(tmp_path):
    fakes, pool = rollouts(2, lambda i: Recording())
    await orchestrator(tmp_path, make_settings(**{"run.max_steps": 2}), rollout=pool).run()
    evals = [[m.request_id for m in f.sent if isinstance(m, wire.Generate) and m.request_id.startswith("eval0.")]
             for f in fakes]
    assert sorted(len(e) for e in evals) == [2, 2]  # the baseline's four prompts, two each


@pytest.mark.parametrize("how", ["killed", "error"])
async def test_one_dead_worker_ends_the_run_naming_it_and_stops_the_others(tmp_path, how):
    fakes, pool = rollouts(3, lambda i: Recording(token_delay_s=0.002, fail_on="g5.0" if how == "error" else None))
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000}), rollout=pool,
                        trainer=FakeTrainer(step_delay_s=0.01))

    async def kill_at_step_two() -> None:
        while orch.step < 2:
            await asyncio.sleep(0.005)
        fakes[1].kill()

    killer = asyncio.create_task(kill_at_step_two()) if how == "killed" else None
    cause = "exited with code -9" if how == "killed" else "boom"
    with pytest.raises(WorkerFailed, match=rf"rollout \d worker failed: {cause}") as info:
        await asyncio.wait_for(orch.run(), 10)
    if killer is not None:
        await killer
    dead = 1 if how == "killed" else next(i for i, f in enumerate(fakes)
                                          if any(getattr(m, "request_id", "") == "g5.0" for m in f.sent))
    assert info.value.role == f"rollout {dead}"
    assert all(f.returncode is not None for f in fakes) and not pool._readers
    assert not orch.store.root.exists()
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert f"rollout {dead} worker failed: {cause}" in summary["error"]
