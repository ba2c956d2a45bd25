"""The Keeper (areal_aio/control/keeping.py) on its own: it is given what it reads (a folder,
settings, the trainer link, the controller's clock as two callables), never the controller."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import orjson

from areal_aio import wire
from areal_aio.control import keeping
from areal_aio.control.runlog import RunLog
from areal_aio.control.stats import Counts
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet.busy import Busy
from areal_aio.fleet.fakes import FakeTrainer
from areal_aio.store import checkpoint
from areal_aio.store.weights import WeightStore
from tests.conftest import ROOT, make_settings, tasks


def test_keeping_does_not_import_the_controller():
    tree = ast.parse((ROOT / "areal_aio" / "control" / "keeping.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "areal_aio.control.controller" not in imported  # not even for type checking


async def test_a_keeper_writes_model_and_a_checkpoint_from_what_it_is_given(tmp_path):
    """No Orchestrator: a folder, settings, a trainer link, and the clock as two callables."""
    trainer = FakeTrainer()
    store = WeightStore.create(f"keeper-test-{id(trainer)}", base=tmp_path / "shm")
    await trainer.start(wire.Init("trainer", make_settings().to_dict(), str(store.root)))
    link = TrainerLink(trainer, Busy(), lambda step, trained: None)
    at = keeping.Position(step=0, version=0)
    keeper = keeping.Keeper(tmp_path / "run", make_settings(**{"run.checkpoint_every": 1}), link, None,
                            position=lambda: at,
                            controller_state=lambda: {"step": at.step, "version": at.version})
    lock = keeper.claim()
    keeper.attach(RunLog(tmp_path / "run", "", append=False), store)
    trainer.version = 1  # the trainer holds version 1, committed at step 1
    at = keeping.Position(step=1, version=1)
    keeper.evaluated({"step": 1, "version": 1, "pass_rate": 0.5})
    await keeper.keep_and_stop_trainer(None, workers_up=True)
    lock.close()
    store.close()
    info = orjson.loads((tmp_path / "run" / "model" / "areal_aio.json").read_bytes())
    assert info["version"] == 1 and info["step"] == 1 and info["eval"]["pass_rate"] == 0.5
    assert checkpoint.latest(tmp_path / "run").version == 1 and trainer.returncode == 0


def test_the_controllers_part_of_a_checkpoint_comes_back_as_it_was_saved():
    counts = Counts(admitted=16, generated=14, dropped_stale=2)
    counts.trained(40, [0, 1, 1, 2], 5)
    first, second = tasks(2, start=9)
    state = keeping.RunState(
        step=3, version=3, trained=12, consumed=9, next_group=11, wall_s=12.5,
        open_groups={10: second, 9: first}, counts=counts,
        eval_curve=[{"step": 2, "version": 2, "wall_s": 4.0, "pass_rate": 0.5}],
        commit_wall={0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0}, time_to_threshold=4.0, max_trained_staleness=2,
        busy={"rollout": 10.0, "trainer": 5.0}, process={"requests": 1, "tokens": 8})
    saved = orjson.loads(orjson.dumps(state.to_dict()))  # as a checkpoint writes and reads it
    assert [g["group"] for g in saved["open_groups"]] == [9, 10]  # dispatched again in admission order
    assert keeping.RunState.of(SimpleNamespace(state=saved)) == state
    fresh = keeping.RunState.of(None)
    assert fresh == keeping.RunState() and fresh.step == fresh.version == 0 and fresh.commit_wall == {0: 0.0}


def test_a_refused_resume_puts_the_folder_back_and_leaves_a_link_of_the_users(tmp_path):
    """FolderState: the counted rows' tail and each small file come back, a file the resume made
    goes, and a symbolic link (the user's, outside what a run writes) is left where it was."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "steps.jsonl").write_bytes(b'{"step": 1}\n{"step": 2}\n')
    (folder / "summary.json").write_bytes(b'{"ended": "completed"}')
    (tmp_path / "notes.txt").write_text("mine")
    (folder / "notes.txt").symlink_to(tmp_path / "notes.txt")
    before = keeping.FolderState.of(folder, {"steps.jsonl": len(b'{"step": 1}\n')})
    (folder / "steps.jsonl").write_bytes(b'{"step": 1}\n')  # the resume cut the rows back ...
    (folder / "summary.json").write_bytes(b'{"ended": "failed: ..."}')  # ... and failed
    (folder / "trainer.log").write_text("refused")
    before.restore()
    assert (folder / "steps.jsonl").read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    assert (folder / "summary.json").read_bytes() == b'{"ended": "completed"}'
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "steps.jsonl", "summary.json"]
    assert (folder / "notes.txt").is_symlink() and (folder / "notes.txt").read_text() == "mine"


def test_the_trainers_own_refusal_of_a_checkpoint_is_read_as_one(tmp_path):
    """refused_resume reads what the real trainer sends (workers/common.py's "Type: message" of
    load_state's ValueError), not only the fakes' copy of it; another trainer failure is not one."""
    import pytest

    from areal_aio.fleet.client import worker_failed
    from areal_aio.workers.trainer.checkpoint import load_state

    (tmp_path / "state.json").write_text('{"version": 3, "base": {"path": "b", "sha256": "0123456789abcdef"}}')
    with pytest.raises(ValueError) as info:
        load_state(SimpleNamespace(lora=None), tmp_path)  # full weights against a LoRA checkpoint
    sent = wire.Error(role="trainer", message=f"{type(info.value).__name__}: {info.value}", traceback="")
    why = keeping.refused_resume(ExceptionGroup("run", [worker_failed("trainer", sent)]))
    assert why == f"{tmp_path} holds a LoRA adapter; this trainer has lora.rank = 0"
    other = wire.Error(role="trainer", message="RuntimeError: CUDA out of memory", traceback="")
    assert keeping.refused_resume(worker_failed("trainer", other)) is None
    assert keeping.refused_resume(worker_failed("rollout", sent)) is None
