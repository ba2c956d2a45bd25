"""The eval command's rollout client: one worker, or one per rollout.devices entry (fakes)."""

from __future__ import annotations

from areal_aio.control.evaluation import eval_rollout, greedy_completions
from areal_aio.fleet.client import PipeWorker
from areal_aio.fleet.fakes import FakeRollout, solving_policy
from areal_aio.fleet.rollout_pool import RolloutPool
from tests.conftest import make_settings, tasks


def test_one_device_is_one_worker_and_several_are_a_pool_with_a_log_each(tmp_path):
    log = tmp_path / "eval-rollout.log"
    one = eval_rollout(make_settings(), log)
    assert isinstance(one, PipeWorker) and one.log_path == log
    pool = eval_rollout(make_settings(**{"rollout.devices": ["cpu", "cuda:1"]}), log)
    assert isinstance(pool, RolloutPool) and pool.devices == ["cpu", "cuda:1"]
    assert [w.log_path.name for w in pool.workers] == ["eval-rollout-0.log", "eval-rollout-1.log"]


async def test_greedy_answers_spread_over_the_workers_and_come_back_in_task_order(tmp_path):
    fakes = [FakeRollout(tokens=2, token_delay_s=0.003 * (i + 1)) for i in range(2)]  # finish out of order
    prompts = list(tasks(6))
    done = await greedy_completions(make_settings(), prompts, tmp_path / "unused.log", RolloutPool(fakes))
    assert [c.request_id for c in done] == [f"eval0.{i}" for i in range(6)]
    assert [c.text for c in done] == [solving_policy(t.text, 0) for t in prompts]
    assert [sum(what == "generate" for _, what, _ in f.log) for f in fakes] == [3, 3]
    assert all(f.returncode == 0 for f in fakes)  # stopped
