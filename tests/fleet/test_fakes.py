"""The fake workers themselves: what they keep for the tests that read them, and that a
benchmark's pair keeps nothing."""

from __future__ import annotations

import pytest

from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from tests.conftest import make_settings, orchestrator


@pytest.mark.parametrize("record", [True, False])
@pytest.mark.parametrize("instant", [True, False])
async def test_fakes_keep_their_records_only_when_asked(tmp_path, record, instant):
    rollout = FakeRollout(instant=instant, record=record)
    trainer = FakeTrainer(record=record)
    summary = await orchestrator(tmp_path, make_settings("areal"), rollout=rollout, trainer=trainer).run()
    assert summary["steps"] == 6 and summary["samples_accepted"] == 6 * 4
    kept = (len(rollout.log), len(trainer.log), len(trainer.batches), len(trainer.saves))
    if record:  # every request started and done, every step started and ended, every batch, the saves
        assert kept[0] >= 2 * summary["samples_generated"] and kept[1:3] == (2 * 6, 6) and kept[3] >= 1
    else:
        assert kept == (0, 0, 0, 0)
