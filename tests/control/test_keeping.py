"""The Keeper (areal_aio/control/keeping.py) on its own: it is given what it reads (a folder,
settings, the trainer link, the controller's clock as two callables), never the controller."""

from __future__ import annotations

import ast

import orjson

from areal_aio import wire
from areal_aio.control import keeping
from areal_aio.control.runlog import RunLog
from areal_aio.control.stats import Busy
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet.fakes import FakeTrainer
from areal_aio.store import checkpoint
from areal_aio.store.weights import WeightStore
from tests.conftest import ROOT, make_settings


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
