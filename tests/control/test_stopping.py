"""How a run stops (fake workers: milliseconds): the summary's `ended`, a stop that a second
cancel cannot cut short (and leaves no temp folder), an eval in flight finished at the stop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import orjson
import pytest

from areal_aio import wire
from areal_aio.control import keeping
from areal_aio.control.stats import finished_by_itself
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.store import checkpoint
from tests.conftest import make_settings, orchestrator, tasks


async def run_until(orch, condition, limit_s: float = 10.0) -> asyncio.Task:
    """Start `orch.run()` and return its task once `condition()` holds (the run still going)."""
    task = asyncio.create_task(orch.run())
    for _ in range(int(limit_s / 0.002)):
        if condition():
            return task
        assert not task.done(), task.result()
        await asyncio.sleep(0.002)
    raise AssertionError("the condition never held")


def summary_of(folder: Path) -> dict:
    return orjson.loads((folder / "summary.json").read_bytes())


# ---------------------------------------------------------------- ended


async def test_a_cancelled_run_ended_interrupted_not_failed(tmp_path):
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000}), trainer=FakeTrainer(step_delay_s=0.005))
    task = await run_until(orch, lambda: orch.step >= 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    summary = summary_of(tmp_path / "run")
    assert summary["ended"] == "interrupted" and summary["error"] is None and summary["steps"] >= 2
    assert not finished_by_itself(summary) and finished_by_itself({"ended": "threshold", "error": None})
    assert not finished_by_itself({"error": ""})  # a summary from before `ended`: a cancel set error
    events = [orjson.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()]
    assert [e["ended"] for e in events if e["event"] == "run_end"] == ["interrupted"]


@pytest.mark.parametrize("how,ended", [
    ({"run.max_steps": 3}, "completed"),
    ({"run.max_steps": 100, "tasks": 6}, "exhausted"),
    ({"run.threshold": 0.9, "run.max_steps": 50, "task.eval_every": 1}, "threshold"),
    ({"run.max_steps": 100_000, "run.max_wall_s": 0.3}, "max_wall"),
])
async def test_a_run_that_stops_by_itself_says_why(tmp_path, how, ended):
    how = dict(how)
    source = tasks(how.pop("tasks")) if "tasks" in how else tasks()
    summary = await orchestrator(tmp_path, make_settings(**how), tasks=source,
                                 trainer=FakeTrainer(step_delay_s=0.002)).run()
    assert summary["ended"] == ended and summary["error"] is None


async def test_stop_ends_stopped_and_a_failure_names_its_cause(tmp_path):
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 10_000}), trainer=FakeTrainer(step_delay_s=0.005))
    task = await run_until(orch, lambda: orch.step >= 1)
    orch.stop()
    assert (await asyncio.wait_for(task, 10))["ended"] == "stopped"

    from areal_aio.fleet.client import WorkerFailed

    failing = orchestrator(tmp_path / "f", make_settings(), trainer=FakeTrainer(fail_at_step=2))
    with pytest.raises(WorkerFailed):
        await failing.run()
    assert summary_of(tmp_path / "f" / "run")["ended"] == \
        "failed: trainer worker failed: RuntimeError: fake trainer failure"


# ---------------------------------------------------------------- a stop runs to its end


class SlowSaves(FakeTrainer):
    """Each Save takes `save_s`: the stop is slow enough to be cancelled again meanwhile."""

    def __init__(self, save_s: float, **kw) -> None:
        super().__init__(**kw)
        self.save_s = save_s
        self.saving = asyncio.Event()

    async def send(self, msg) -> None:
        if isinstance(msg, wire.Save):
            self.saving.set()
            Path(msg.path).mkdir(parents=True, exist_ok=True)  # the writer has begun
            await asyncio.sleep(self.save_s)
        await super().send(msg)


async def test_cancelling_again_while_the_stop_writes_does_not_cut_it_short(tmp_path):
    trainer = SlowSaves(0.2, step_delay_s=0.005)
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000, "run.checkpoint_every": 2}),
                        trainer=trainer)
    task = await run_until(orch, lambda: orch.step >= 3)
    trainer.saving.clear()
    task.cancel()
    await asyncio.wait_for(trainer.saving.wait(), 10)  # the stop is writing model/
    for _ in range(5):  # a second Ctrl-C, a third, ...
        task.cancel()
        await asyncio.sleep(0.05)
    with pytest.raises(asyncio.CancelledError):
        await task
    folder = tmp_path / "run"
    # the stop ran to its end before run() returned: nothing left, nothing half-written
    assert not orch.store.root.exists() and trainer.returncode == 0
    assert not [p.name for p in folder.rglob("*") if p.name.endswith(".tmp")]
    assert json.loads((folder / "model" / "config.json").read_text())["version"] == orch.version
    assert checkpoint.latest(folder).version == orch.version  # the stop's own checkpoint, whole
    assert summary_of(folder)["ended"] == "interrupted"


class StuckModelSave(FakeTrainer):
    """Starts writing model/ and never finishes (a hung disk): the stop's write times out."""

    async def send(self, msg) -> None:
        if isinstance(msg, wire.Save) and msg.kind == "model":
            (Path(msg.path) / "half.safetensors").parent.mkdir(parents=True, exist_ok=True)
            (Path(msg.path) / "half.safetensors").write_bytes(b"x")
            return  # no Saved ever comes
        await super().send(msg)


async def test_a_stop_whose_write_times_out_leaves_no_temp_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(keeping, "STOP_SAVE_TIMEOUT_S", 0.3)
    orch = orchestrator(tmp_path, make_settings(**{"run.max_steps": 1000, "run.checkpoint_every": 2}),
                        trainer=StuckModelSave(step_delay_s=0.005))
    task = await run_until(orch, lambda: orch.step >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    folder = tmp_path / "run"
    assert not (folder / ".model.tmp").exists() and not (folder / "model").exists()  # whole or none
    assert checkpoint.latest(folder).step >= 2  # the last whole checkpoint stays
    assert not orch.store.root.exists() and "could not write model/" in capsys.readouterr().err


# ---------------------------------------------------------------- an eval in flight at a stop


class SlowEval(FakeRollout):
    """The eval of step 2 is slow (a tenth of a second per token); everything else is instant."""

    def token_delay(self, request_id):
        return 0.1 if request_id.startswith("eval2.") else 0.0


async def test_an_eval_in_flight_at_a_stop_is_finished_and_kept_through_resume(tmp_path):
    settings = make_settings(**{"run.max_steps": 1000, "run.checkpoint_every": 2, "task.eval_every": 2})
    orch = orchestrator(tmp_path, settings, rollout=SlowEval(), trainer=FakeTrainer(step_delay_s=0.005))
    task = await run_until(orch, lambda: orch.step >= 3)
    assert 2 not in [row["step"] for row in orch.eval_curve]  # still in flight
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    folder = tmp_path / "run"
    assert 2 in [row["step"] for row in summary_of(folder)["eval_curve"]]
    samples = [orjson.loads(x) for x in (folder / "samples.jsonl").read_bytes().splitlines()]
    assert len([r for r in samples if r["kind"] == "eval" and r["step"] == 2]) == 4
    assert 2 in [row["step"] for row in checkpoint.latest(folder).state["eval_curve"]]

    last = checkpoint.latest(folder).step
    again = orchestrator(tmp_path, make_settings(**{"run.max_steps": last + 2, "run.checkpoint_every": 2,
                                                    "task.eval_every": 2}),
                         resume=folder, trainer=FakeTrainer())
    summary = await again.run()
    steps = [row["step"] for row in summary["eval_curve"]]
    assert summary["ended"] == "completed" and steps.count(2) == 1 and steps[:2] == [0, 2]
