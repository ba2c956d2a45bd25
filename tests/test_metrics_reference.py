"""The metrics reference (docs/hooks/metrics_reference.py) against the rows a run writes: runs on
the fake workers (a weighted reward set, process rewards, episodes, a resume) and an `eval` write
their run folders, and every field of every row must have a description; every described field
must be written by one of them unless its description says when it is ("Only ..."). The
trainer's stats, which the fake trainer leaves out, come from one update of the real trainer,
in-process on embedded:tiny-random."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from areal_aio import wire
from areal_aio.app import trackers
from areal_aio.control import evaluation, stats
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.rewards.scoring import AnswerReward, Reward
from tests.conftest import ROOT, load_hook, make_settings, orchestrator, tasks, trainer_settings

HOOK = ROOT / "docs" / "hooks" / "metrics_reference.py"


def reference_module():
    return load_hook(HOOK)


hook = reference_module()


def short(task, completion: str) -> float:
    """A second reward of a weighted set: shorter replies score higher."""
    return -len(completion) / 100


async def tool_turn(task, model) -> None:
    """An episode of two replies around a tool turn; task.reward scores the last."""
    await model.reply()
    model.add_turn("tool", "7")
    await model.reply()


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def read_folder(folder: Path, into: dict[str, set[str]]) -> None:
    """Every key of `folder`'s rows into `into`, by the reference's table of each kind of row."""
    for row in lines(folder / "steps.jsonl"):
        into["steps"] |= row.keys()
    for row in lines(folder / "samples.jsonl"):
        into["samples" if row["kind"] == "train" else "eval-samples"] |= row.keys()
        if row.get("process") is not None:
            into["process-record"] |= row["process"].keys()
    for row in lines(folder / "events.jsonl"):
        if row["event"] == "eval":
            into["evals"] |= row.keys() - {"event", "t"}
    read_summary(orjson.loads((folder / "summary.json").read_bytes()), into)


def read_summary(summary: dict, into: dict[str, set[str]]) -> None:
    into["summary"] |= summary.keys()
    for row in summary["eval_curve"]:
        into["evals"] |= row.keys()
    for row in summary["rollout_workers_detail"]:
        into["workers"] |= row.keys()
    for row in summary["resumes"]:
        into["resumes"] |= row.keys()
    if summary["best_eval"] is not None:
        into["best-eval"] |= summary["best_eval"].keys()


async def runs(tmp: Path) -> dict[str, set[str]]:
    """The keys written by a few runs that between them write every field a fake run can."""
    written: dict[str, set[str]] = defaultdict(set)
    weighted = [Reward("answer", AnswerReward()), Reward("short", short, weight=0.5)]
    first = make_settings("areal", **{"run.max_steps": 4, "run.checkpoint_every": 2, "task.overlong_buffer": 2})
    read_summary(await orchestrator(tmp / "weighted", first, reward=weighted).run(), written)
    resumed = make_settings("areal", **{"run.max_steps": 6, "run.checkpoint_every": 2, "task.overlong_buffer": 2})
    await Orchestrator(resumed, tasks=tasks(), eval_set=list(tasks(4, start=100)), resume=tmp / "weighted" / "run",
                       rollout=FakeRollout(), trainer=FakeTrainer(), reward=weighted).run()
    await orchestrator(tmp / "process", make_settings("sync", **{"run.max_steps": 2, "process.mode": "process"})).run()
    await orchestrator(tmp / "episodes", make_settings("sync", **{"run.max_steps": 2}), episode=tool_turn).run()
    for name in ("weighted", "process", "episodes"):
        read_folder(tmp / name / "run", written)
    result = await evaluation.evaluate_model(make_settings("sync"), tmp / "eval" / "eval.json")
    written["eval-json"] |= result.keys()
    for row in result["samples"]:
        written["eval-samples"] |= row.keys()
    return written


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, set[str]]:
    mp = pytest.MonkeyPatch()
    mp.setattr(evaluation, "eval_rollout", lambda settings, log: FakeRollout())  # eval.json without a model
    try:
        return asyncio.run(runs(tmp_path_factory.mktemp("runs")))
    finally:
        mp.undo()


@pytest.mark.parametrize("anchor", [t.anchor for t in hook.TABLES])
def test_every_field_a_run_writes_has_a_description(written, anchor):
    assert written[anchor], f"no {anchor} row was written: the runs above no longer cover it"
    assert hook.unlisted(anchor, written[anchor]) == []


@pytest.mark.parametrize("anchor", [t.anchor for t in hook.TABLES])
def test_every_field_described_is_written_or_says_when(written, anchor):
    """The trainer's stats are the real trainer's (below): the fake trainer sends only a few."""
    never = [key for s in hook.table(anchor).sources if s.writer != "trainer" for key, doc in s.fields.items()
             if not hook.conditional(doc) and not any(hook.listed([key], k) for k in written[anchor])]
    assert never == []


def test_the_trainer_writes_exactly_its_described_stats(tmp_path, one_thread):
    from areal_aio.workers.models import TINY, load_model
    from areal_aio.workers.trainer.worker import SFT_STATS, TRAIN_STATS, Trainer

    model, tok = load_model(TINY, seed=0)
    trainer = Trainer(trainer_settings("trainer.kl_coef=0.1").to_dict(), tmp_path, model=model, tokenizer=tok)
    samples = [wire.TrainSample([1, 2, 3], [4 + i, 5, 6], [-1.0] * 3, [0] * 3, float(i % 2), i // 2)
               for i in range(8)]
    rl = trainer.train(wire.Train(step=1, version=0, samples=samples)).stats
    sft = trainer.train(wire.Train(step=2, version=1, samples=samples, objective="sft")).stats
    assert sorted(rl.keys() - TRAIN_STATS.keys()) == [] and sorted(sft.keys() - TRAIN_STATS.keys()) == []
    assert sorted(k for k, doc in TRAIN_STATS.items() if k not in rl and not hook.conditional(doc)) == []
    assert set(SFT_STATS) <= TRAIN_STATS.keys()
    assert set(FakeTrainer()._stats(1, 0)) <= TRAIN_STATS.keys()


def test_a_field_left_out_of_its_dict_fails_the_check(written, monkeypatch):
    monkeypatch.delitem(stats.STEP_FIELDS, "spread_frac")
    assert hook.unlisted("steps", written["steps"]) == ["spread_frac"]


def test_a_field_without_a_description_stops_the_reference(monkeypatch):
    monkeypatch.setitem(stats.STEP_FIELDS, "new_field", " ")
    assert hook.undocumented() == ["steps: new_field"]
    with pytest.raises(hook.MissingDescription, match="steps: new_field"):
        hook.reference()


def test_a_tracker_name_for_a_field_no_table_lists_stops_the_reference(monkeypatch):
    monkeypatch.setitem(trackers.STEP_METRICS, "no_such_field", "train/no_such_field")
    assert hook.undocumented() == ["steps: no_such_field (trackers)"]
    with pytest.raises(hook.MissingDescription, match="no_such_field"):
        hook.reference()


def test_a_pattern_covers_its_fields_only():
    assert hook.listed(["reward/<name>"], "reward/format") and hook.listed(["step"], "step")
    assert not hook.listed(["reward/<name>"], "reward/") and not hook.listed(["reward/<name>"], "rewards")


def test_the_page_holds_the_marker_and_the_reference_every_field():
    assert hook.MARKER in (ROOT / "docs" / "metrics.md").read_text()
    page = hook.reference()
    for t in hook.TABLES:
        for key in t.fields:
            assert f"| `{key}` |" in page, f"{t.anchor}: {key}"
    for _, names in hook.TRACKED:
        assert all(f"| `{name}` |" in page for name in names.values())
