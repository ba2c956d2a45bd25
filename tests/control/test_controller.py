"""Controller logic against in-process fake workers (milliseconds per run)."""

from __future__ import annotations

import asyncio
import os
import time

import orjson
import pytest

from areal_aio import wire
from areal_aio.control.controller import Orchestrator
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet.busy import Busy
from areal_aio.fleet.client import WorkerFailed
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.settings import build_settings
from tests.conftest import WORKERS, Jitter, make_settings, orchestrator, rollouts, tasks


class JitteryRollout(Jitter, FakeRollout):
    """Each request sleeps a random time per token: groups finish out of order."""


def merged_log(fakes: list[FakeRollout]) -> list[tuple]:
    """Every fake's log in time order."""
    return sorted((entry for f in fakes for entry in f.log), key=lambda entry: entry[0])


def trained_staleness(trainer: FakeTrainer) -> list[int]:
    return [b.version - min(s.versions) for b in trainer.batches for s in b.samples]


async def test_run_completes_and_counts_add_up(tmp_path):
    trainer = FakeTrainer()
    orch = orchestrator(tmp_path, make_settings("areal"), trainer=trainer)
    summary = await orch.run()
    assert summary["steps"] == 6 and summary["final_version"] == 6
    assert summary["samples_admitted"] == (summary["samples_accepted"] + summary["samples_dropped_stale"]
                                           + summary["samples_dropped_interrupt"] + summary["samples_unused"])
    assert summary["samples_accepted"] == 6 * 4
    groups = [s.group for b in trainer.batches for s in b.samples]
    assert len(groups) == 24 and all(groups.count(g) == 2 for g in set(groups))  # each group once, whole
    folder = tmp_path / "run"
    for name in ("settings.toml", "summary.json", "steps.jsonl", "samples.jsonl", "events.jsonl"):
        assert (folder / name).exists(), name
    steps = [orjson.loads(line) for line in (folder / "steps.jsonl").read_bytes().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 7))
    events = [orjson.loads(line)["event"] for line in (folder / "events.jsonl").read_bytes().splitlines()]
    assert events.count("version_commit") == 6 and "weights_loaded" in events
    required = ("mode max_staleness cold_start_s wall_s steps final_version samples_generated "
                "samples_accepted samples_dropped_stale samples_dropped_interrupt interrupts "
                "max_staleness_trained staleness_hist eval_curve time_to_threshold_s "
                "reward_per_1k_tokens gen_tokens_per_s train_tokens_per_s rollout_idle_frac "
                "trainer_idle_frac loop_lag_max_ms").split()
    assert not [k for k in required if k not in summary]


async def test_loop_lag_is_the_loops_not_the_monitors_own_flush(tmp_path, monkeypatch):
    """The monitor awaits its rows' flush every progress period; that wait is not loop lag."""
    from areal_aio.control import controller
    from areal_aio.control.runlog import RunLog

    flush = RunLog.flush

    async def slow_flush(self):
        await asyncio.sleep(0.5)  # a write that takes a while; the loop is free meanwhile
        await flush(self)

    monkeypatch.setattr(controller, "PROGRESS_PERIOD_S", 0.0)
    monkeypatch.setattr(RunLog, "flush", slow_flush)
    settings = make_settings("sync", **{"run.max_steps": 2})
    summary = await orchestrator(tmp_path, settings, trainer=FakeTrainer(step_delay_s=0.4)).run()
    assert summary["wall_s"] > 0.7 and summary["loop_lag_max_ms"] < 300  # it counted 500+


async def test_loop_lag_counts_the_monitors_own_redraw(tmp_path, monkeypatch):
    """The progress redraw after the flush runs on the loop: while it draws, nothing else runs,
    and the lag probe says so (the flush's wait alone is left out)."""
    from areal_aio.control import controller
    from areal_aio.control.progress import Progress

    drawn = []

    def slow_refresh(self):
        if not drawn:
            drawn.append(True)
            time.sleep(0.4)  # a redraw that holds the loop

    monkeypatch.setattr(controller, "PROGRESS_PERIOD_S", 0.0)
    monkeypatch.setattr(Progress, "refresh", slow_refresh)
    settings = make_settings("sync", **{"run.max_steps": 2})
    summary = await orchestrator(tmp_path, settings, trainer=FakeTrainer(step_delay_s=0.4)).run()
    assert drawn and summary["loop_lag_max_ms"] >= 350


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_no_trained_sample_older_than_eta_under_adversarial_timing(tmp_path, eta, seed, workers):
    trainer = FakeTrainer(step_delay_s=0.003)
    settings = make_settings("areal", **{"controller.max_staleness": eta, "run.max_steps": 10})
    _, rollout = rollouts(workers, lambda i: JitteryRollout(seed + 100 * i))
    summary = await orchestrator(tmp_path, settings, rollout=rollout, trainer=trainer).run()
    assert summary["steps"] == 10
    ages = trained_staleness(trainer)
    assert max(ages) <= eta and summary["max_staleness_trained"] == max(ages)
    assert sum(summary["staleness_hist"].values()) == summary["samples_accepted"]


@pytest.mark.parametrize("workers", WORKERS)
async def test_rate_control_holds_at_every_admission(tmp_path, workers):
    eta, B = 1, 4
    settings = make_settings("one_step", **{"run.max_steps": 8})
    violations = []

    class Checking(JitteryRollout):
        async def send(self, msg):
            if type(msg).__name__ == "Generate" and not msg.request_id.startswith("eval"):
                if (orch.admission.live - 1) // B > orch.version + eta:
                    violations.append((orch.admission.live, orch.version))
            await super().send(msg)

    fakes, rollout = rollouts(workers, lambda i: Checking(3 + 100 * i))
    orch = orchestrator(tmp_path, settings, rollout=rollout, trainer=FakeTrainer(step_delay_s=0.002))
    await orch.run()
    assert not violations and all(f.log for f in fakes)


@pytest.mark.parametrize("workers", WORKERS)
async def test_sync_mode_never_overlaps_generation_and_training(tmp_path, workers):
    fakes, rollout = rollouts(workers, lambda i: FakeRollout(tokens=3, token_delay_s=0.002))
    trainer = FakeTrainer(step_delay_s=0.01)
    await orchestrator(tmp_path, make_settings("sync", **{"task.eval_every": 100}),
                       rollout=rollout, trainer=trainer).run()
    log = merged_log(fakes)
    starts = {rid: t for t, what, rid in log if what == "generate" and not rid.startswith("eval")}
    ends = {rid: t for t, what, rid in log if what == "done" and rid in starts}
    train = {}
    for t, what, step in trainer.log:
        train.setdefault(step, [0.0, 0.0])[what == "end"] = t
    assert len(train) == 6 and ends
    for rid, t_end in ends.items():
        for t0, t1 in train.values():
            assert t_end <= t0 or starts[rid] >= t1, f"{rid} generated while step trained"
    assert all(min(s.versions) == b.version for b in trainer.batches for s in b.samples)


async def test_areal_mode_overlaps(tmp_path):
    rollout = FakeRollout(tokens=3, token_delay_s=0.002)
    trainer = FakeTrainer(step_delay_s=0.02)
    await orchestrator(tmp_path, make_settings("areal"), rollout=rollout, trainer=trainer).run()
    starts = {rid: t for t, what, rid in rollout.log if what == "generate" and not rid.startswith("eval")}
    ends = {rid: t for t, what, rid in rollout.log if what == "done" and rid in starts}
    spans = {}
    for t, what, step in trainer.log:
        spans.setdefault(step, [0.0, 0.0])[what == "end"] = t
    assert any(starts[rid] < t1 and end > t0 for rid, end in ends.items() for t0, t1 in spans.values())


@pytest.mark.parametrize("workers", WORKERS)
async def test_stale_groups_are_dropped_counted_and_release_admission(tmp_path, workers):
    # Group 1 is slow: later groups fill the batches, and it comes back (its oldest token from
    # version 0, interrupted on the way) only once the policy is at version 2: more than eta = 1
    # behind. Tied to the clock, not to timing, so a loaded machine cannot reorder it.
    class SlowGroup(FakeRollout):
        async def next_token(self, request_id, i, delay):
            if request_id.startswith("g1.") and i:
                while self.version < 2:
                    await asyncio.sleep(0.001)
            await super().next_token(request_id, i, delay)

    _, rollout = rollouts(workers, lambda i: SlowGroup(tokens=20))
    trainer = FakeTrainer(step_delay_s=0.03)
    settings = make_settings("areal", **{"controller.max_staleness": 1, "run.max_steps": 8})
    summary = await orchestrator(tmp_path, settings, rollout=rollout, trainer=trainer).run()
    assert summary["steps"] == 8, "drops must give admission back, or the run stalls"
    assert max(trained_staleness(trainer)) <= 1
    assert summary["samples_dropped_stale"] == 2
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    assert sum(r.get("dropped") == "stale" for r in rows) == summary["samples_dropped_stale"]


async def test_async_reward_timeout_and_async_task_source(tmp_path):
    async def reward(task, text):
        if task.id == "t1":
            await asyncio.sleep(5)
        return 0.5

    async def source():
        for t in tasks(40):
            await asyncio.sleep(0)
            yield t

    settings = make_settings(**{"controller.reward_timeout_s": 0.05, "run.max_steps": 3})
    summary = await orchestrator(tmp_path, settings, reward=reward, tasks=source()).run()
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    trained = [r for r in rows if r.get("kind") == "train"]
    assert summary["steps"] == 3 and summary["reward_failures"] == settings.rollout.group_size  # t1's alone
    assert trained and all(r["reward"] == 0.5 and not r.get("reward_failed") for r in trained)  # the others in time


async def test_finite_source_ends_the_run(tmp_path):
    summary = await orchestrator(tmp_path, make_settings(**{"run.max_steps": 100}), tasks=tasks(10)).run()
    assert summary["steps"] == 5 and summary["samples_unused"] == 0


async def test_worker_error_stops_run_with_traceback_and_cleans_up(tmp_path):
    orch = orchestrator(tmp_path, make_settings(), trainer=FakeTrainer(fail_at_step=2))
    with pytest.raises(WorkerFailed, match="fake trainer failure") as info:
        await orch.run()
    assert "Traceback" in str(info.value)
    assert not orch.store.root.exists()
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    # steps counts committed updates: step 2 failed, so one was committed
    assert "fake trainer failure" in summary["error"] and summary["steps"] == summary["final_version"] == 1
    assert not (tmp_path / "run" / "model").exists()  # a failed trainer exports nothing


async def test_rollout_error_stops_run(tmp_path):
    orch = orchestrator(tmp_path, make_settings(), rollout=FakeRollout(fail_on="g3.1"))
    with pytest.raises(WorkerFailed, match="rollout worker failed: boom"):
        await orch.run()
    assert not orch.store.root.exists()


@pytest.mark.parametrize("role", ["rollout", "trainer"])
async def test_a_killed_worker_ends_the_run_like_a_dead_subprocess(tmp_path, role):
    workers = {"rollout": FakeRollout(token_delay_s=0.002), "trainer": FakeTrainer(step_delay_s=0.01)}
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000}), **workers)

    async def kill_at_step_two() -> None:
        while orch.step < 2:
            await asyncio.sleep(0.005)
        workers[role].kill()

    killer = asyncio.create_task(kill_at_step_two())
    with pytest.raises(WorkerFailed, match=f"{role} worker failed: exited with code -9") as info:
        await asyncio.wait_for(orch.run(), 10)
    await killer
    assert info.value.role == role and not orch.store.root.exists()
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert "exited with code -9" in summary["error"] and summary["steps"] >= 2
    with pytest.raises(WorkerFailed, match="exited with code -9"):
        await workers[role].send(wire.Shutdown())


async def test_cancel_stops_workers_and_removes_store(tmp_path):
    rollout = FakeRollout(tokens=4, token_delay_s=0.01)
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000}), rollout=rollout)
    run = asyncio.create_task(orch.run())
    await asyncio.sleep(0.3)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert not orch.store.root.exists() and not rollout._running
    assert (tmp_path / "run" / "summary.json").exists()


async def test_external_stop_ends_after_current_step(tmp_path):
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 10_000}),
                        trainer=FakeTrainer(step_delay_s=0.005))
    run = asyncio.create_task(orch.run())
    for _ in range(2000):  # the first step, however slow the machine (10 s at most)
        if orch.step >= 1 or run.done():
            break
        await asyncio.sleep(0.005)
    at = orch.step
    orch.stop()
    summary = await asyncio.wait_for(run, 10)
    assert at >= 1 and summary["steps"] in (at, at + 1)  # the step in flight at most, then no other
    assert summary["eval_curve"][-1]["step"] == summary["steps"]


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("mode", ["sync", "one_step"])
async def test_admission_never_runs_ahead_of_the_clock(tmp_path, mode, workers):
    """At version i at most (i + eta + 1) * B rollouts have ever started: sync drops nothing."""
    eta = 0 if mode == "sync" else 1
    settings = make_settings(mode, **{"run.max_steps": 8, "task.eval_every": 100})
    fakes, rollout = rollouts(workers, lambda i: JitteryRollout(7 + 100 * i))
    summary = await orchestrator(tmp_path, settings, rollout=rollout,
                                 trainer=FakeTrainer(step_delay_s=0.002)).run()
    started = sum(1 for _, what, rid in merged_log(fakes) if what == "generate" and not rid.startswith("eval"))
    assert started <= (8 + eta + 1) * 4
    if mode == "sync":
        assert summary["samples_dropped_stale"] == 0 and started == 8 * 4


@pytest.mark.parametrize("workers", WORKERS)
async def test_unbounded_staleness_is_capped_by_max_in_flight(tmp_path, workers):
    settings = make_settings("areal", **{"controller.max_staleness": -1, "run.max_steps": 5})
    outstanding = []

    class Counting(JitteryRollout):
        async def send(self, msg):
            if type(msg).__name__ == "Generate" and not msg.request_id.startswith("eval"):
                outstanding.append(orch.admission.outstanding)
            await super().send(msg)

    _, rollout = rollouts(workers, lambda i: Counting(1 + 100 * i))
    orch = orchestrator(tmp_path, settings, rollout=rollout, trainer=FakeTrainer(step_delay_s=0.01))
    summary = await orch.run()
    assert summary["steps"] == 5 and summary["max_staleness"] is None
    assert max(outstanding) <= settings.max_in_flight == 8 * 4


async def test_the_final_eval_runs_after_training_rollouts_end(tmp_path):
    """max_steps a multiple of eval_every: the last eval still starts only once every training
    rollout has been aborted or finished, so it measures the final weights alone."""

    class Watching(FakeRollout):
        seen: list[set[str]] = []

        async def send(self, msg):
            if isinstance(msg, wire.Generate) and msg.request_id.startswith("eval4."):
                self.seen.append({r for r in self._running if not r.startswith("eval")})
            await super().send(msg)

    rollout = Watching(tokens=5, token_delay_s=0.002)
    s = make_settings("areal", **{"run.max_steps": 4})
    summary = await orchestrator(tmp_path, s, rollout=rollout).run()
    assert summary["steps"] == 4 and [r["step"] for r in summary["eval_curve"]] == [0, 2, 4]
    assert rollout.seen and all(not running for running in rollout.seen)
    first_eval = next(i for i, e in enumerate(rollout.log) if e[1] == "generate" and e[2].startswith("eval4."))
    assert not [e for e in rollout.log[first_eval:] if e[1] == "generate" and not e[2].startswith("eval")]


async def test_a_trained_reply_after_its_step_was_cancelled_is_not_a_fault(tmp_path):
    """Cancelling a run cancels the step waiting for Trained before the trainer reader; a reply
    arriving in between belongs to the stopping run, while a reply nobody asked for is a fault."""

    class Replies(FakeTrainer):
        def __init__(self, *msgs):
            super().__init__()
            for msg in msgs:
                self._out.put_nowait(msg)

    loop = asyncio.get_running_loop()
    reply = wire.Trained(step=0, version=1, path="v1.safetensors", stats={})
    committed = []
    link = TrainerLink(Replies(reply), Busy(), lambda step, trained: committed.append((step, trained)))
    link._trained, link.outstanding = loop.create_future(), 1  # a Train was sent
    link._trained.cancel()
    reader = asyncio.create_task(link.read())
    await asyncio.sleep(0.01)
    assert not reader.done() and link.trainer._out.empty()  # read, kept, waiting for the next
    reader.cancel()
    link._step = "step 1"  # the stop commits the late reply of the step in flight
    await link.settle()
    assert committed == [("step 1", reply)] and link.outstanding == 0

    link = TrainerLink(Replies(reply), Busy(), lambda step, trained: None)
    link._trained = loop.create_future()
    link._trained.set_result(reply)  # that step already has its reply
    with pytest.raises(WorkerFailed, match="unexpected Trained"):
        await asyncio.wait_for(link.read(), 10)


async def test_a_step_cancelled_as_its_reply_is_handed_over_is_committed_at_the_stop(tmp_path):
    """The reader hands the step its Trained, and the stop's cancel reaches the step before it
    resumes: the reply is taken and the trainer holds the new version, so the stop commits it
    (else model/ would be asked for a version the trainer no longer has)."""
    committed = []

    class CancelOnReply(FakeTrainer):
        async def send(self, msg):
            await super().send(msg)
            if isinstance(msg, wire.Train):  # runs before the step's own wake-up: the cancel lands first
                link._trained.add_done_callback(lambda _: step.cancel())

    link = TrainerLink(CancelOnReply(), Busy(), lambda s, trained: committed.append((s, trained.version)))
    await link.trainer.start(wire.Init("trainer", {}, str(tmp_path)))
    reader = asyncio.create_task(link.read())
    step = asyncio.create_task(link.train(wire.Train(step=0, version=0), "step 1"))
    with pytest.raises(asyncio.CancelledError):
        await step
    reader.cancel()
    assert committed == [] and link.outstanding == 0  # taken by the reader, committed by nobody
    await link.settle()
    assert committed == [("step 1", 1)]


class RecordingRollout(FakeRollout):
    """Keeps every Generate it was sent."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.generates: list[wire.Generate] = []

    async def send(self, msg) -> None:
        if isinstance(msg, wire.Generate):
            self.generates.append(msg)
        await super().send(msg)


async def test_chat_rows_with_columns_and_a_weighted_reward_from_settings(tmp_path, monkeypatch):
    """No script: task rows and rewards named in settings. Chats reach the rollout worker whole,
    a column reaches the reward (in the pool's process), each reward is logged apart and summed."""
    name = f"ctl_rewards_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("def brevity(task, completion, limit):\n"
                                         "    return float(len(completion) <= limit)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    system = {"role": "system", "content": "Reply with the number only."}
    rows = [{"messages": [system, {"role": "user", "content": f"What is {i % 5} + {i % 3}?"}],
             "answer": i % 5 + i % 3, "limit": 7 + i % 2} for i in range(12)]  # "It is 4." fits 8
    (tmp_path / "chat.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    settings = build_settings({"task": {"name": "jsonl", "path": str(tmp_path / "chat.jsonl"),
                                        "reward": ["answer", {"fn": f"{name}:brevity", "weight": 0.5}]}},
                              ["run.progress=false", "run.max_steps=4", "controller.reward_procs=1", "rollout.group_size=2",
                                 "trainer.batch_size=4", "task.eval_size=4", "task.eval_every=2",
                                 "model.path=embedded:tiny-random"])
    rollout = RecordingRollout()
    summary = await Orchestrator(settings, out_dir=tmp_path / "run", rollout=rollout, trainer=FakeTrainer()).run()
    assert summary["steps"] == 4 and summary["reward_failures"] == 0
    chats = [g for g in rollout.generates if g.messages is not None]
    assert len(chats) == len(rollout.generates) and all(g.messages[0] == system for g in chats)
    assert all(g.prompt == g.messages[-1]["content"] for g in chats)
    steps = [orjson.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_bytes().splitlines()]
    for row in steps:
        assert row["reward_mean"] == pytest.approx(row["reward/answer"] + 0.5 * row["reward/brevity"])
    assert any(0 < row["reward/brevity"] < 1 for row in steps)  # the limit column decides, row by row
    samples = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    trained = [r for r in samples if r["kind"] == "train" and r["step"]]
    assert trained and all(set(r["rewards"]) == {"answer", "brevity"} for r in trained)
    assert all(r["reward"] == pytest.approx(r["rewards"]["answer"] + 0.5 * r["rewards"]["brevity"]) for r in trained)
    assert trained[0]["prompt"][0] == system
    assert all("reward/brevity" in row for row in summary["eval_curve"])


class TeacherTrainer(FakeTrainer):
    """Answers each Train as a trainer with a teacher does: each sequence's reverse KL in a list."""

    async def _train(self, msg: wire.Train) -> None:
        self._kls = [round(0.01 * (i + 1), 4) for i in range(len(msg.samples))]
        await super()._train(msg)

    def _stats(self, step: int, tokens: int) -> dict:
        return {**super()._stats(step, tokens), "teacher_kl": 0.5, "teacher_kl_seq": self._kls}


async def test_each_trained_sequences_teacher_kl_goes_to_its_samples_row_not_to_the_steps(tmp_path):
    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 2}),
                                 trainer=TeacherTrainer()).run()
    assert summary["steps"] == 2
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    trained = [r for r in rows if r["kind"] == "train" and r["step"] is not None]
    assert [r["teacher_kl"] for r in trained] == [0.01, 0.02, 0.03, 0.04] * 2
    steps = [orjson.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_bytes().splitlines()]
    assert all(r["teacher_kl"] == 0.5 and "teacher_kl_seq" not in r for r in steps)
