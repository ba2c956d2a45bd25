"""Workers as Ray actors (areal_aio/fleet/ray_workers.py) on a private local Ray cluster, tiny-random."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import orjson
import pytest

from tests.conftest import need

ray = need("ray")

from areal_aio.control.controller import Orchestrator  # noqa: E402
from areal_aio.fleet.client import WorkerFailed  # noqa: E402
from areal_aio.settings import build_settings  # noqa: E402
from areal_aio.store.weights import SHM_BASE  # noqa: E402
from areal_aio.tasks.task import Task  # noqa: E402

pytestmark = pytest.mark.slow
TASKS = [Task(f"t{i}", f"Write something about topic number {i}.", "") for i in range(100)]
HELD_OUT = [Task(f"e{i}", f"Write something about topic number {i}.", "") for i in range(100, 104)]
EXACT = ["model.path=embedded:tiny-random", "run.mode=sync", "rollout.max_new_tokens=12",
         "rollout.group_size=4", "trainer.batch_size=8", "task.eval_every=100", "run.progress=false",
         "trainer.bf16=false", "controller.reward_procs=0", "rollout.max_batch=1",
         "rollout.temperature=1.0", "trainer.lr=3e-2", "run.checkpoint_every=0", "run.max_steps=3"]
"""A sync run whose samples are the same bit for bit wherever its workers run (max_batch = 1: every
row decodes alone, see tests/test_e2e.py EXACT), trained on a dense reward."""
ON_RAY = ["ray.address=local", "ray.ship_weights=always"]
"""Every rollout actor gets its weights through Ray's object store, on one machine too."""


def vowel_share(task: Task, completion: str) -> float:
    letters = [c for c in completion.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def run(sets: list[str], folder: Path) -> Orchestrator:
    return Orchestrator(build_settings({}, EXACT + sets), tasks=itertools.cycle(TASKS), eval_set=HELD_OUT,
                        reward=vowel_share, out_dir=folder)


def trained(folder: Path) -> list[tuple]:
    rows = [orjson.loads(x) for x in (folder / "samples.jsonl").read_bytes().splitlines()]
    return [(r["step"], r["request_id"], r["reply"], r["reward"], r["oldest_version"], r["newest_version"])
            for r in rows if r["kind"] == "train"]


def tagged(token: str) -> list[int]:
    """Live processes (not zombies) whose environment holds `token`: Ray's own, its actors and
    the worker processes all inherit the test's environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture
def leaves_nothing(monkeypatch):
    """After the test: no Ray connection, no process it started (Ray's, actors, workers), no new
    file in /dev/shm."""
    token = f"ray-test-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("AREAL_AIO_TEST_TAG", token)
    before = set(os.listdir("/dev/shm")) | {SHM_BASE.name}
    yield token
    assert not ray.is_initialized()
    deadline = time.monotonic() + 15
    while (left := tagged(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left if Path(f"/proc/{p}").exists()]
    assert set(os.listdir("/dev/shm")) <= before
    assert not [p for p in SHM_BASE.iterdir() if token in p.name] if SHM_BASE.is_dir() else True


async def test_a_run_of_ray_actors_trains_exactly_like_the_local_run(tmp_path, leaves_nothing):
    name = f"{leaves_nothing}-run"
    local = run([], tmp_path / "local")
    assert (await local.run())["steps"] == 3
    orch = run(ON_RAY + [f"run.name={name}"], tmp_path / "ray")
    shipped: set[str] = set()  # what the rollout actor's own store folder held during the run

    async def watch() -> None:
        while True:
            for folder in SHM_BASE.glob(f"{name}-*-rollout0-*"):
                shipped.update(p.name for p in folder.glob("v*.safetensors"))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    t0 = time.perf_counter()
    try:
        summary = await orch.run()
    finally:
        watcher.cancel()
    print(f"ray run: {time.perf_counter() - t0:.1f}s, cold start {summary['cold_start_s']}s")
    assert summary["steps"] == summary["final_version"] == 3 and summary["error"] is None
    assert orch.rollout.workers[0].shipped and shipped >= {"v2.safetensors"}  # v3 may come and go between looks
    rows = trained(tmp_path / "ray")
    assert rows == trained(tmp_path / "local") and len(rows) == 3 * 8
    assert len({r[3] for r in rows}) > 1  # a dense reward: the updates moved the weights
    assert (tmp_path / "ray" / "model" / "model.safetensors").read_bytes() == \
        (tmp_path / "local" / "model" / "model.safetensors").read_bytes()
    assert "[rollout 0] v3: load" in (tmp_path / "ray" / "rollout.log").read_text()  # its stderr, relayed


async def test_a_killed_actor_stops_the_run_with_its_name(tmp_path, leaves_nothing):
    orch = run(ON_RAY + [f"run.name={leaves_nothing}-killed", "run.max_steps=1000"], tmp_path / "run")
    task = asyncio.create_task(orch.run())
    while orch.step < 1:
        await asyncio.sleep(0.1)
        assert not task.done()
    ray.kill(orch.rollout.workers[0].actor)
    t0 = time.perf_counter()
    with pytest.raises(WorkerFailed, match="rollout worker failed: its Ray actor died"):
        await asyncio.wait_for(task, 60)
    assert time.perf_counter() - t0 < 30
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert "its Ray actor died" in summary["error"]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()  # the trainer kept the run


def test_workers_naming_one_gpu_share_it() -> None:
    from areal_aio.fleet.ray_workers import gpu_share
    from areal_aio.settings import build_settings

    one_gpu = build_settings({}, ["rollout.device=cuda", "trainer.device=cuda:0"])
    assert gpu_share("cuda", one_gpu) == 0.5  # the usual layout fits one GPU
    several = build_settings({}, ['rollout.devices=["cuda:0", "cuda:0", "cuda:1"]', 'trainer.devices=["cuda:1"]'])
    assert gpu_share("cuda:0", several) == 0.5 and gpu_share("cuda:1", several) == 0.5
    assert gpu_share("cuda:1", build_settings({}, ['trainer.devices=["cuda:0", "cuda:1"]'])) == 1.0
