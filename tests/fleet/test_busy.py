import types

import pytest

from areal_aio.fleet import busy
from areal_aio.fleet.busy import Busy


@pytest.fixture
def clock(monkeypatch):
    """The module's clock, moved by hand: `clock.now = t`."""
    fake = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(busy, "time", types.SimpleNamespace(perf_counter=lambda: fake.now))
    return fake


def test_busy_integrates_overlapping_work_once(clock):
    changes = []
    b = Busy(changes.append)
    b.up()  # t=0: one piece
    clock.now = 1.0
    b.up()  # t=1: two at once, [1, 3] overlapping the first
    clock.now = 3.0
    b.down()
    assert b.active == 1 and changes == [True] and b.seconds() == 3.0 and b.total == 0.0
    clock.now = 4.0
    b.down()  # busy from 0 to 4: counted once, not 4 + 2
    assert changes == [True, False] and b.total == 4.0
    clock.now = 10.0  # idle time adds nothing
    assert b.seconds() == 4.0
    b.up()
    clock.now = 10.5
    assert b.seconds() == 4.5  # a piece in hand counts up to now
    b.down()
    assert b.total == 4.5 and changes == [True, False, True, False]


def test_busy_counts_a_whole_group_at_once_and_nothing_for_none(clock):
    changes = []
    b = Busy(changes.append)
    b.up(0)
    clock.now = 1.0
    assert b.active == 0 and changes == [] and b.seconds() == 0.0
    b.up(3)
    clock.now = 2.0
    b.down()
    b.down()
    assert b.active == 1 and changes == [True]
    clock.now = 3.0
    b.down()
    assert changes == [True, False] and b.total == 2.0
