"""Where a run's workers live: the clients the controller talks to, one per role.

    rollout.devices = [d0, d1, ...]  ->  one rollout worker per entry
    trainer.devices = [d0, d1, ...]  ->  one trainer rank per entry

A role with one worker is that worker's client: PipeWorker (a local subprocess), or with
ray.address set RayWorker (the same subprocess inside a Ray actor, areal_aio/fleet/ray_workers.py).
Several rollout workers are one RolloutPool (rollout_pool.py), several trainer ranks one
TrainerRanks (trainer_ranks.py), whichever client each worker has. The controller never sees
how many workers a role has, nor where: it holds one WorkerClient per role.
"""

from __future__ import annotations

from pathlib import Path

from areal_aio.fleet.client import PipeWorker, WorkerClient
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.fleet.trainer_ranks import TrainerRanks
from areal_aio.settings import Settings


def worker(role: str, index: int, count: int, settings: Settings, folder: Path) -> WorkerClient:
    """The client of one worker of `role`: worker `index` of `count`; its log goes to the run
    folder (rollout.log, or rollout-1.log ... with several)."""
    threads = settings.rollout.threads if role == "rollout" else settings.trainer.threads
    log = folder / (f"{role}.log" if count == 1 else f"{role}-{index}.log")
    if settings.ray.address:
        from areal_aio.fleet.ray_workers import RayWorker  # ray is an optional extra

        return RayWorker(role, index, settings, log)
    return PipeWorker(role, log, threads)


def rollout_client(settings: Settings, folder: Path) -> WorkerClient:
    """The rollout role's client: one worker's on rollout.device, else a pool of one worker per
    entry of rollout.devices (each told its device in its Init; one entry too)."""
    devices = settings.rollout_devices
    if devices == [settings.rollout.device]:
        return worker("rollout", 0, 1, settings, folder)
    return RolloutPool([worker("rollout", i, len(devices), settings, folder) for i in range(len(devices))],
                       devices)


def trainer_client(settings: Settings, folder: Path) -> WorkerClient:
    """The trainer role's client: one worker, or the ranks of a data-parallel trainer
    (areal_aio.fleet.trainer_ranks) with trainer.devices (one entry too: each rank is told its
    device in its Init)."""
    devices = settings.trainer_devices
    if devices == [settings.trainer.device]:
        return worker("trainer", 0, 1, settings, folder)
    return TrainerRanks([worker("trainer", i, len(devices), settings, folder) for i in range(len(devices))],
                        devices)
