"""Run folders and checkpoints: refusing, locking, validating, resuming (fake workers: milliseconds)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import orjson
import pytest

from areal_aio.app import cli
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.store import checkpoint
from areal_aio.store.checkpoint import CheckpointError
from tests.conftest import make_settings, tasks


def orch(folder, settings, **kw):
    return Orchestrator(settings, tasks=tasks(), eval_set=list(tasks(4, start=100)), out_dir=folder,
                        rollout=FakeRollout(), trainer=kw.pop("trainer", FakeTrainer()), **kw)


def resumed(folder, settings, **kw):
    return Orchestrator(settings, tasks=tasks(), eval_set=list(tasks(4, start=100)), resume=folder,
                        rollout=FakeRollout(), trainer=kw.pop("trainer", FakeTrainer()), **kw)


def rows(folder, name):
    return [orjson.loads(x) for x in (folder / f"{name}.jsonl").read_bytes().splitlines()]


async def test_checkpoints_are_kept_newest_first_and_the_model_is_exported_at_the_end(tmp_path):
    trainer = FakeTrainer()
    summary = await orch(tmp_path / "r", make_settings("sync", **{"run.checkpoint_every": 2,
                                                                "run.keep_checkpoints": 2}),
                         trainer=trainer).run()
    assert summary["steps"] == 6
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    ckpt = checkpoint.latest(tmp_path / "r")
    assert (ckpt.step, ckpt.version) == (6, 6) and ckpt.state["trained"] == 24
    assert orjson.loads((tmp_path / "r" / "model" / "config.json").read_bytes())["version"] == 6
    assert [s.kind for s in trainer.saves] == ["checkpoint", "checkpoint", "model", "checkpoint"]


async def test_resume_continues_steps_rows_curve_and_tasks_without_duplicates(tmp_path):
    folder = tmp_path / "r"
    first = FakeTrainer()
    await orch(folder, make_settings("sync", **{"run.checkpoint_every": 2, "run.max_steps": 4,
                                                "run.keep_checkpoints": 2}), trainer=first).run()
    # the run's stop checkpoint is step 4; pretend it died after step 2's: drop the newer one
    shutil.rmtree(folder / "checkpoints" / "step-000004")
    await orch(tmp_path / "whole", make_settings("sync", **{"run.max_steps": 8}), trainer=(whole := FakeTrainer())).run()
    again = FakeTrainer()
    summary = await resumed(folder, make_settings("sync", **{"run.checkpoint_every": 2, "run.max_steps": 8}),
                            trainer=again).run()
    assert summary["steps"] == summary["final_version"] == 8 and again.batches[0].version == 2
    assert [r["step"] for r in rows(folder, "steps")] == list(range(1, 9))
    trained = [(r["step"], r["request_id"], r["prompt"]) for r in rows(folder, "samples") if r["kind"] == "train"]
    assert trained == [(r["step"], r["request_id"], r["prompt"])
                       for r in rows(tmp_path / "whole", "samples") if r["kind"] == "train"]
    assert [s.prompt_ids for b in again.batches for s in b.samples] == \
        [s.prompt_ids for b in whole.batches[2:] for s in b.samples]
    assert [r["step"] for r in summary["eval_curve"]] == [0, 2, 4, 6, 8]
    assert summary["resumes"] == [{"step": 2, "version": 2, "checkpoint": "step-000002",
                                   "lost_in_flight": summary["lost_in_flight"],
                                   "wall_s": summary["resumes"][0]["wall_s"]}]
    assert "resumed" in [r.get("event") for r in rows(folder, "events")]
    [share] = summary["rollout_workers_detail"]  # counted afresh: this process's steps 3 to 8
    assert 0 < share["gen_tokens"] < summary["gen_tokens"] and 0 <= share["idle_frac"] <= 1


async def test_resume_redispatches_groups_admitted_but_not_trained(tmp_path):
    """areal mode admits ahead of training: a checkpoint holds groups in flight; a resume sends
    the same group ids and tasks again first and counts the lost samples."""
    folder = tmp_path / "r"
    settings = make_settings("areal", **{"run.checkpoint_every": 3, "run.max_steps": 3})
    await orch(folder, settings).run()
    state = checkpoint.latest(folder).state
    assert state["open_groups"], "areal mode should have groups admitted ahead at the stop"
    rollout = FakeRollout()
    summary = await Orchestrator(make_settings("areal", **{"run.checkpoint_every": 3, "run.max_steps": 5}),
                                 tasks=tasks(), eval_set=list(tasks(4, start=100)), resume=folder,
                                 rollout=rollout, trainer=FakeTrainer()).run()
    first = [rid for _, what, rid in rollout.log if what == "generate" and rid.startswith("g")]
    expected = [f"g{g['group']}.{i}" for g in state["open_groups"] for i in range(2)]
    assert first[:len(expected)] == expected
    assert summary["lost_in_flight"] == len(expected) and summary["steps"] == 5


async def test_a_folder_holding_a_run_is_refused_and_left_untouched(tmp_path):
    folder = tmp_path / "r"
    await orch(folder, make_settings("sync", **{"run.max_steps": 1})).run()
    before = (folder / "steps.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match="already holds a run"):
        await orch(folder, make_settings("sync")).run()
    assert (folder / "steps.jsonl").read_bytes() == before


async def test_two_runs_on_one_folder_at_once_the_second_refuses(tmp_path):
    folder = tmp_path / "r"
    first = asyncio.create_task(orch(folder, make_settings("sync", **{"run.max_steps": 1000})).run())
    while not (folder / "settings.toml").exists():
        await asyncio.sleep(0.01)
    with pytest.raises(CheckpointError, match="in use by another run"):
        checkpoint.claim(folder, resume=True)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    checkpoint.claim(folder, resume=True).close()  # free again once the run ended


async def test_changing_what_is_trained_on_resume_is_refused_naming_the_key(tmp_path):
    folder = tmp_path / "r"
    await orch(folder, make_settings("sync", **{"run.max_steps": 2, "run.checkpoint_every": 2})).run()
    with pytest.raises(CheckpointError, match=r"trainer.lr is 0.5"):
        resumed(folder, make_settings("sync", **{"run.max_steps": 4, "trainer.lr": 0.5}))
    ckpt = checkpoint.latest(folder)
    with pytest.raises(CheckpointError, match=r"--set rollout.temperature: cannot change on resume"):
        checkpoint.resume_settings(ckpt, ["run.max_steps=9", "rollout.temperature=0.3"])
    assert checkpoint.resume_settings(ckpt, ["run.max_steps=9"]).run.max_steps == 9


def one_line_error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


async def test_missing_partial_and_incompatible_checkpoints_are_one_line_errors(tmp_path, capsys):
    assert "no such run folder" in one_line_error(capsys, ["run", "--resume", str(tmp_path / "none")])
    folder = tmp_path / "r"
    await orch(folder, make_settings("sync", **{"run.max_steps": 2, "run.checkpoint_every": 0})).run()
    assert "no checkpoint" in one_line_error(capsys, ["run", "--resume", str(folder)])
    await orch(tmp_path / "c", make_settings("sync", **{"run.max_steps": 2, "run.checkpoint_every": 2})).run()
    shutil.copytree(tmp_path / "c", tmp_path / "ok")
    step = tmp_path / "c" / "checkpoints" / "step-000002"
    manifest = orjson.loads((step / "manifest.json").read_bytes())
    (step / "controller.json").write_bytes(b"{}")  # a truncated file
    assert "partial checkpoint (controller.json" in one_line_error(capsys, ["run", "--resume", str(tmp_path / "c")])
    (step / "manifest.json").unlink()
    assert "partial checkpoint (no manifest.json)" in one_line_error(capsys, ["run", "--resume", str(tmp_path / "c")])
    (step / "manifest.json").write_bytes(orjson.dumps({**manifest, "format": 99}))
    assert "checkpoint format 99" in one_line_error(capsys, ["run", "--resume", str(tmp_path / "c")])
    err = one_line_error(capsys, ["run", "--resume", str(tmp_path / "ok"), "--set", "trainer.lr=1.0"])
    assert "--set trainer.lr: cannot change on resume" in err


def test_a_resumed_run_without_its_own_checkpoint_refuses_a_settings_file(tmp_path, capsys):
    assert "--resume takes its settings" in one_line_error(
        capsys, ["run", "settings.toml", "--resume", str(tmp_path)])


async def test_keep_best_exports_the_version_with_the_best_eval(tmp_path):
    """The fake policy answers correctly from version 2 on: the eval at step 2 is the best (later
    ones only tie), so best/ holds version 2 while model/ holds the last."""
    trainer = FakeTrainer()
    folder = tmp_path / "r"
    summary = await orch(folder, make_settings("sync", **{"run.keep_best": True}), trainer=trainer).run()
    assert summary["best_eval"]["version"] == 2 and summary["best_eval"]["pass_rate"] == 1.0
    info = orjson.loads((folder / "best" / "areal_aio.json").read_bytes())
    assert info["version"] == 2 and info["eval"]["pass_rate"] == 1.0
    best_save = next(s for s in trainer.saves if s.path.endswith(".best.tmp"))
    assert best_save.weights.endswith("v2.safetensors") or best_save.weights == ""
    assert orjson.loads((folder / "model" / "areal_aio.json").read_bytes())["version"] == 6


def test_a_sync_run_resumed_on_other_devices_shares_the_cores_again(monkeypatch) -> None:
    """The checkpoint's thread counts were preset for its own workers."""
    from areal_aio import settings as settings_module

    monkeypatch.setattr(settings_module, "cpu_cores", lambda: 8)
    saved = settings_module.load_settings(None, ["run.mode=sync"])
    assert (saved.rollout.threads, saved.trainer.threads) == (8, 8)
    ckpt = checkpoint.Checkpoint(Path("ckpt"), 1, 1, {"settings": saved.to_dict()})
    s = checkpoint.resume_settings(ckpt, ["rollout.devices=4"])
    assert (s.rollout.threads, s.trainer.threads) == (2, 8)
    assert checkpoint.resume_settings(ckpt, ["rollout.devices=4", "rollout.threads=3"]).rollout.threads == 3
    assert checkpoint.resume_settings(ckpt, ["run.max_steps=9"]).rollout.threads == 8  # devices unchanged
    areal = settings_module.load_settings(None, ["rollout.threads=1"])
    ckpt = checkpoint.Checkpoint(Path("ckpt"), 1, 1, {"settings": areal.to_dict()})
    assert checkpoint.resume_settings(ckpt, ["rollout.devices=2"]).rollout.threads == 1  # no preset there


def test_lora_keys_are_not_resumable_and_a_checkpoint_older_than_them_trained_without_lora() -> None:
    from areal_aio import settings as settings_module

    s = settings_module.load_settings(None, [])
    old = s.to_dict()
    del old["lora"]  # a checkpoint written before the [lora] section existed
    ckpt = checkpoint.Checkpoint(Path("ckpt"), 1, 1, {"settings": old})
    checkpoint.check_compatible(ckpt, s)
    assert checkpoint.resume_settings(ckpt, ["run.max_steps=9"]).lora.rank == 0
    with pytest.raises(CheckpointError, match="lora.rank is 8, the checkpoint was trained with 0"):
        checkpoint.check_compatible(ckpt, settings_module.load_settings(None, ["lora.rank=8"]))
    with pytest.raises(CheckpointError, match="--set lora.rank: cannot change on resume"):
        checkpoint.resume_settings(ckpt, ["lora.rank=8"])
    # a key newer than its section's checkpoint (task.episode came after [task]): its default
    del old["task"]["episode"]
    checkpoint.check_compatible(ckpt, s)
    with pytest.raises(CheckpointError, match="task.episode is 'json:dumps', the checkpoint was trained with ''"):
        checkpoint.check_compatible(ckpt, settings_module.load_settings(None, ["task.episode=json:dumps"]))
