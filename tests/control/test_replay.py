from dataclasses import dataclass

from areal_aio.control.replay import Group, ReplayBuffer


@dataclass
class S:
    oldest_version: int


def group(gid, *versions):
    return Group(gid, None, [S(v) for v in versions])


def test_oldest_first_each_group_once():
    buf = ReplayBuffer()
    for gid, v in [(0, 2), (1, 1), (2, 2), (3, 0)]:
        buf.put(group(gid, v, v + 1))
    batch, dropped = buf.take(2, version=2, eta=4)
    assert [g.group_id for g in batch] == [3, 1] and not dropped
    batch, _ = buf.take(2, version=2, eta=4)
    assert [g.group_id for g in batch] == [0, 2]  # same version: admission (group id) order
    assert buf.take(1, version=2, eta=4) == ([], []) and len(buf) == 0


def test_same_version_groups_leave_in_admission_order_whatever_their_arrival():
    buf = ReplayBuffer()
    for gid in (5, 3, 4):
        buf.put(group(gid, 1))
    batch, _ = buf.take(3, version=1, eta=0)
    assert [g.group_id for g in batch] == [3, 4, 5]


def test_take_drops_stale_groups_whole_and_returns_them():
    buf = ReplayBuffer()
    buf.put(group(0, 1, 3))   # oldest token at v1: staleness 3 at v4
    buf.put(group(1, 3, 3))
    buf.put(group(2, 4, 4))
    batch, dropped = buf.take(2, version=4, eta=2)
    assert [g.group_id for g in dropped] == [0]
    assert [g.group_id for g in batch] == [1, 2]


def test_not_enough_fresh_groups_returns_empty_batch_but_still_drops():
    buf = ReplayBuffer()
    buf.put(group(0, 0))
    buf.put(group(1, 5))
    batch, dropped = buf.take(2, version=5, eta=1)
    assert batch == [] and [g.group_id for g in dropped] == [0] and len(buf) == 1


def test_stale_groups_leave_oldest_first_and_the_fresh_keep_their_order():
    buf = ReplayBuffer()
    for gid, v in [(0, 3), (1, 0), (2, 4), (3, 2), (4, 1), (5, 3)]:
        buf.put(group(gid, v))
    assert [g.group_id for g in buf.drop_stale(version=4, eta=1)] == [1, 4, 3]  # v0, v1, v2
    assert buf.drop_stale(version=4, eta=1) == [] and len(buf) == 3
    batch, dropped = buf.take(3, version=4, eta=1)
    assert [g.group_id for g in batch] == [0, 5, 2] and dropped == []
