"""areal_aio/fleet/trainer_ranks.py: a data-parallel trainer behind one client, first over in-process
fake ranks (what goes where, which rank failed), then as real gloo ranks in a sync run."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import orjson
import pytest

from areal_aio import wire
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.client import KILL_TIMEOUT_S, SHUTDOWN_TIMEOUT_S, WorkerFailed
from areal_aio.fleet.fakes import FakeTrainer
from areal_aio.fleet.trainer_ranks import TrainerRanks
from areal_aio.settings import load_settings
from tests.conftest import ROOT as ROOT
from tests.conftest import alive, make_settings, orchestrator


def ranks(*fakes: FakeTrainer) -> TrainerRanks:
    return TrainerRanks(list(fakes), ["cpu"] * len(fakes))


async def test_every_rank_trains_every_step_and_only_rank_0_saves(tmp_path):
    fakes = [FakeTrainer(step_delay_s=0.002 * (2 - i)) for i in range(3)]  # rank 0 answers last
    orch = orchestrator(tmp_path, make_settings("sync", **{"run.checkpoint_every": 2}), trainer=ranks(*fakes))
    summary = await orch.run()
    assert summary["error"] is None and summary["steps"] == summary["final_version"] == 6
    assert [[b.step for b in f.batches] for f in fakes] == [list(range(1, 7))] * 3
    assert fakes[0].saves and not fakes[1].saves and not fakes[2].saves
    assert all(f.returncode == 0 for f in fakes)


async def test_start_gives_each_rank_its_place_and_device(tmp_path):
    seen = []

    class Seeing(FakeTrainer):
        async def start(self, init: wire.Init) -> wire.Ready:
            seen.append(init)
            return await super().start(init)

    client = TrainerRanks([Seeing(), Seeing()], ["cuda:0", "cuda:1"])
    ready = await client.start(wire.Init("trainer", make_settings().to_dict(), str(tmp_path)))
    await client.stop()
    assert [(i.rank, i.world, i.settings["trainer"]["device"]) for i in seen] == [(0, 2, "cuda:0"), (1, 2, "cuda:1")]
    assert seen[0].dist_addr == seen[1].dist_addr and seen[0].dist_addr.startswith("tcp://127.0.0.1:")
    assert ready.device == "fake,fake" and ready.version == 0


async def test_an_error_on_rank_1_reaches_the_controller_named(tmp_path):
    orch = orchestrator(tmp_path, make_settings(), trainer=ranks(FakeTrainer(), FakeTrainer(fail_at_step=2)))
    with pytest.raises(WorkerFailed, match="trainer worker failed: rank 1: RuntimeError: fake trainer failure"):
        await orch.run()
    assert not orch.store.root.exists()


async def test_a_rank_killed_while_rank_0_waits_ends_the_step_at_once(tmp_path):
    slow, doomed = FakeTrainer(step_delay_s=60.0), FakeTrainer()
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000}), trainer=ranks(slow, doomed))

    async def kill_in_first_step() -> None:
        while not slow.batches:
            await asyncio.sleep(0.005)
        doomed.kill()

    killer = asyncio.create_task(kill_in_first_step())
    with pytest.raises(WorkerFailed, match="rank 1: exited with code -9") as info:
        await asyncio.wait_for(orch.run(), 10)
    await killer
    assert info.value.role == "trainer" and slow.returncode is not None


async def test_ranks_that_disagree_on_the_step_are_a_failure(tmp_path):
    class Ahead(FakeTrainer):
        async def _train(self, msg: wire.Train) -> None:
            await super()._train(wire.Train(msg.step + 1, msg.version, msg.samples))

    orch = orchestrator(tmp_path, make_settings(), trainer=ranks(FakeTrainer(), Ahead()))
    with pytest.raises(WorkerFailed, match="rank 1 trained step 2 to version 1, rank 0 step 1"):
        await orch.run()


# ---- real ranks ---------------------------------------------------------------------------------

TINY = ["model.path=embedded:tiny-random", "rollout.max_new_tokens=12", "rollout.group_size=4",
        "trainer.batch_size=8", "task.eval_size=8", "task.eval_every=2", "run.progress=false",
        "trainer.bf16=off", "controller.reward_procs=0", "run.mode=sync", "trainer.devices=2"]


@pytest.mark.slow
async def test_a_sync_run_on_two_gloo_ranks_trains_and_leaves_nothing(tmp_path):
    settings = load_settings(ROOT / "settings.toml", TINY + ["run.max_steps=3"])
    orch = Orchestrator(settings, out_dir=tmp_path / "run")
    summary = await orch.run()
    assert summary["error"] is None and summary["steps"] == summary["final_version"] == 3
    assert isinstance(orch.trainer, TrainerRanks) and len(orch.trainer.pids) == 2
    steps = [orjson.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_bytes().splitlines()]
    assert [r["tokens"] > 0 and r["loss"] == r["loss"] for r in steps] == [True] * 3
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
    assert {p.name for p in (tmp_path / "run").glob("trainer-*.log")} == {"trainer-0.log", "trainer-1.log"}
    assert not any(alive(p) for p in (*orch.rollout.pids, *orch.trainer.pids))
    assert not orch.store.root.exists()


@pytest.mark.slow
async def test_killing_rank_1_mid_run_stops_the_run_naming_it(tmp_path):
    settings = load_settings(ROOT / "settings.toml", TINY + ["run.max_steps=1000"])
    orch = Orchestrator(settings, out_dir=tmp_path / "run")
    run = asyncio.create_task(orch.run())
    while orch.step < 1:
        await asyncio.sleep(0.1)
        assert not run.done()
    os.kill(orch.trainer.pids[1], signal.SIGKILL)
    t0 = time.perf_counter()
    # the pipe's end may reach the controller before the exit status does (client.PipeWorker)
    with pytest.raises(WorkerFailed, match="trainer worker failed: rank 1: (exited with code -9|closed its pipe|pipe closed while sending)"):
        await asyncio.wait_for(run, 30)
    assert time.perf_counter() - t0 < SHUTDOWN_TIMEOUT_S + KILL_TIMEOUT_S + 10  # not the 60 s a step waits
    assert not any(alive(p) for p in (*orch.rollout.pids, *orch.trainer.pids))
    assert not orch.store.root.exists()
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert "rank 1" in summary["error"]


@pytest.mark.slow
async def test_a_checkpoint_of_one_rank_resumes_on_two(tmp_path):
    """Every rank loads the checkpoint's trainer part (optimizer state included; rank 0's
    weights are broadcast), and the run goes on from its version."""
    from areal_aio.store import checkpoint

    folder = tmp_path / "run"
    one = load_settings(ROOT / "settings.toml", TINY + ["trainer.devices=1", "run.max_steps=2",
                                                        "run.checkpoint_every=2"])
    assert (await Orchestrator(one, out_dir=folder).run())["steps"] == 2
    settings = checkpoint.resume_settings(checkpoint.latest(folder), ["trainer.devices=2", "run.max_steps=4"])
    orch = Orchestrator(settings, resume=folder)
    summary = await orch.run()
    assert summary["error"] is None and summary["steps"] == summary["final_version"] == 4
    assert summary["resumes"][0]["step"] == 2 and isinstance(orch.trainer, TrainerRanks)
    steps = [orjson.loads(x) for x in (folder / "steps.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in steps)
    assert {p.name for p in folder.glob("trainer-*.log")} == {"trainer-0.log", "trainer-1.log"}
    assert not any(alive(p) for p in (*orch.rollout.pids, *orch.trainer.pids))
