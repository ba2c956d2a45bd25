"""The eval command's rollout client: one worker, or one per rollout.devices entry (fakes)."""

from __future__ import annotations

from areal_aio.control.evaluation import eval_rollout, greedy_completions, model_settings
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


def test_eval_scores_a_model_as_saved_unless_int8_is_named(tmp_path):
    """A run generates in int8 on a CPU (quantize = auto); `eval MODEL` scores the float model."""
    assert model_settings("embedded:tiny-random", None, [])[0].rollout_quantize == "off"
    assert model_settings("embedded:tiny-random", None, ["rollout.quantize=int8"])[0].rollout_quantize == "int8"
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "steps.jsonl").write_text("")
    (run / "settings.toml").write_text('[rollout]\nquantize = "auto"\n')
    assert model_settings(str(run), None, [])[0].rollout.quantize == "off"
