"""A run that cannot learn from what it gets: rewards outside the sane range (rewards/scoring.py
REWARD_LIMIT) are counted failures before the trainer sees them, and steps the trainer skipped
(a loss or gradient norm that was not finite) are counted, several in a row stopping the run
with one line (control/stats.py SKIPPED_IN_A_ROW_MAX). Fake workers: milliseconds per run."""

from __future__ import annotations

import orjson
import pytest

from areal_aio.control.stats import SKIPPED_IN_A_ROW_MAX, TrainingDiverged, cause
from areal_aio.fleet.fakes import FakeTrainer
from tests.conftest import make_settings, orchestrator


def steps(folder) -> list[dict]:
    return [orjson.loads(line) for line in (folder / "steps.jsonl").read_bytes().splitlines()]


def summary_of(folder) -> dict:
    return orjson.loads((folder / "summary.json").read_bytes())


async def test_a_huge_reward_is_a_counted_failure_and_never_reaches_the_trainer(tmp_path):
    trainer = FakeTrainer()
    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 2}), trainer=trainer,
                                 reward=lambda task, text: 1e308).run()
    trained = [s.reward for b in trainer.batches for s in b.samples]
    assert summary["ended"] == "completed" and summary["reward_failures"] >= len(trained) == 8
    assert trained == [0.0] * 8 and all(r["reward_mean"] == 0.0 for r in steps(tmp_path / "run"))


async def test_an_episode_returning_a_huge_reward_is_a_counted_failure(tmp_path):
    async def episode(task, model):
        await model.reply()
        return 1e308

    trainer = FakeTrainer()
    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 1}), trainer=trainer,
                                 episode=episode).run()
    assert summary["reward_failures"] >= 4 and summary["episode_failures"] >= 4
    assert [s.reward for s in trainer.batches[0].samples] == [0.0] * 4


async def test_skipped_steps_are_counted_and_a_run_of_them_stops_the_run_as_failed(tmp_path):
    first = 2
    skipped = set(range(first, first + SKIPPED_IN_A_ROW_MAX))
    orch = orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 10}),
                        trainer=FakeTrainer(skip_steps=skipped))
    with pytest.raises(TrainingDiverged) as info:
        await orch.run()
    last = first + SKIPPED_IN_A_ROW_MAX - 1
    assert cause(info.value) == (f"TrainingDiverged: steps {first}-{last} took no update: their loss or "
                                 f"gradient norm was not finite (steps.jsonl: skipped); model/ keeps the last "
                                 f"finite weights")
    folder = tmp_path / "run"
    summary = summary_of(folder)
    assert summary["ended"].startswith("failed: TrainingDiverged: steps 2-4")
    assert summary["steps"] == last and summary["steps_skipped"] == SKIPPED_IN_A_ROW_MAX
    rows = steps(folder)
    assert [r["skipped"] for r in rows] == [0] + [1] * SKIPPED_IN_A_ROW_MAX
    assert rows[-1]["loss"] is None and rows[-1]["grad_norm"] is None  # NaN, as JSON writes it
    assert orjson.loads((folder / "model" / "config.json").read_bytes())["version"] == last  # kept
    assert not orch.store.root.exists()


async def test_skipped_steps_apart_do_not_stop_the_run(tmp_path):
    skipped = {2, 4, 6}
    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 6}),
                                 trainer=FakeTrainer(skip_steps=skipped)).run()
    assert summary["ended"] == "completed" and summary["steps"] == 6 and summary["steps_skipped"] == 3
    assert [r["step"] for r in steps(tmp_path / "run") if r["skipped"]] == [2, 4, 6]


def half_huge(task, text) -> float:
    """1e308 for every other reply (by length), 0 for the rest: a group with both."""
    return 1e308 if len(text) % 2 else 0.0


@pytest.mark.slow
async def test_a_huge_reward_leaves_the_real_trainer_finite(tmp_path):
    """Issue 36's run: drgrpo (advantages not divided by a std), a reward of 1e308 for some
    replies. It is counted as a failure, each step trains, and model/ is finite."""
    from safetensors.torch import load_file

    from areal_aio.control.controller import Orchestrator
    from areal_aio.settings import load_settings
    from tests.conftest import ROOT
    from tests.test_e2e import TINY

    settings = load_settings(ROOT / "settings.toml", TINY + ["run.mode=sync", "run.max_steps=2",
                                                              "trainer.advantage=drgrpo", "task.eval_every=100"])
    summary = await Orchestrator(settings, out_dir=tmp_path / "run", reward=half_huge).run()
    assert summary["ended"] == "completed" and summary["reward_failures"] > 0 and summary["steps_skipped"] == 0
    rows = steps(tmp_path / "run")
    assert all(r["loss"] is not None and r["grad_norm"] is not None and r["skipped"] == 0 for r in rows)
    weights = load_file(tmp_path / "run" / "model" / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())
