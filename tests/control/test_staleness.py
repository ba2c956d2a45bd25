import asyncio
import math

from areal_aio.control.staleness import Admission, is_stale, may_admit, staleness


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


def test_admission_admits_drops_and_commits():
    adm = Admission(batch_size=4, eta=0)
    assert adm.may_admit(4) and not adm.may_admit(5)
    adm.admit(4)
    assert adm.live == 4 and adm.outstanding == 4 and not adm.may_admit(1)
    adm.drop(2)  # slots come back
    assert adm.live == 2 and adm.may_admit(2) and not adm.may_admit(3)
    adm.admit(2)
    adm.commit(version=1, trained=4)
    # training never lowers live: version 1 opens exactly one more batch
    assert (adm.version, adm.trained, adm.live, adm.outstanding) == (1, 4, 4, 0)
    assert adm.may_admit(4) and not adm.may_admit(5)


def test_admission_caps_outstanding_and_restores_from_a_checkpoint():
    adm = Admission(batch_size=2, eta=math.inf, max_outstanding=4, version=3, trained=6)
    assert (adm.live, adm.outstanding) == (6, 0)  # a resume counts only what was trained
    adm.admit(4)
    assert not adm.may_admit(1)
    adm.commit(4, trained=2)
    assert adm.may_admit(2) and not adm.may_admit(3)


def test_admission_wait_blocks_until_a_commit_or_a_drop():
    async def scenario() -> list[str]:
        adm = Admission(batch_size=2, eta=0)
        adm.admit(2)
        seen = []

        async def dispatcher() -> None:
            await adm.wait(2)
            seen.append(f"admitted at v{adm.version} live {adm.live}")
            adm.admit(2)
            await adm.wait(2)
            seen.append(f"admitted at v{adm.version} live {adm.live}")

        task = asyncio.create_task(dispatcher())
        await asyncio.sleep(0.01)
        assert not seen  # blocked: the first batch fills version 0
        adm.commit(1, trained=2)
        await asyncio.sleep(0.01)
        assert seen == ["admitted at v1 live 2"] and not task.done()
        adm.drop(2)
        await asyncio.wait_for(task, 10)
        return seen

    assert asyncio.run(scenario())[-1] == "admitted at v1 live 2"
