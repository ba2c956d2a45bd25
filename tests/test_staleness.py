import math

from areal_aio.staleness import is_stale, may_admit, staleness


def test_sync_admits_exactly_one_batch_per_version():
    B, G = 8, 2
    live = 0
    while may_admit(live, G, B, version=0, eta=0):
        live += G
    assert live == B
    assert may_admit(live, G, B, version=1, eta=0)


def test_eta_allows_eta_batches_ahead():
    B, G = 4, 2
    for eta in range(5):
        live = 0
        while may_admit(live, G, B, version=3, eta=eta):
            live += G
        assert live == (3 + eta + 1) * B


def test_group_admitted_whole_or_not_at_all():
    # 6 live with B = 8: a group of 4 would straddle into the next batch
    assert not may_admit(6, 4, 8, version=0, eta=0)
    assert may_admit(4, 4, 8, version=0, eta=0)


def test_unbounded_never_blocks():
    assert may_admit(10**9, 8, 8, version=0, eta=math.inf)


def test_staleness_and_acceptance():
    assert staleness(5, 3) == 2
    assert not is_stale(5, 3, eta=2) and is_stale(5, 2, eta=2)
    assert not is_stale(5, 0, eta=math.inf)
