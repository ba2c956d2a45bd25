"""Held-out evals: a run's (the Evaluator, on its own and in a run), and the eval command's
rollout client: one worker, or one per rollout.devices entry (fakes)."""

from __future__ import annotations

from areal_aio import wire
from areal_aio.control.evaluation import Evaluator, eval_rollout, greedy_completions, model_settings
from areal_aio.control.runlog import RunLog
from areal_aio.control.stats import Counts
from areal_aio.fleet.client import PipeWorker
from areal_aio.fleet.fakes import FakeRollout, solving_policy
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.rewards.scoring import Scorer, load_rewards
from tests.conftest import make_settings, orchestrator, tasks


class Keeper:
    """What an Evaluator asks of the Keeper: the version each eval started on, and every row."""

    def __init__(self) -> None:
        self.eval_starts: dict[int, int] = {}
        self.rows: list[dict] = []

    def evaluated(self, row: dict) -> None:
        self.rows.append(row)


async def test_an_eval_is_sent_answered_scored_and_its_row_goes_everywhere(tmp_path):
    settings = make_settings(**{"run.threshold": 0.5})
    eval_set = list(tasks(2, start=100))
    keeper, counts, published, stops, sent = Keeper(), Counts(), [], [], []

    async def send(msg: wire.Generate) -> None:  # answered at once: the first right, the second wrong
        sent.append(msg.request_id)
        i = int(msg.request_id.split(".")[1])
        text = f"<answer>{eval_set[i].answer if i == 0 else -1}</answer>"
        evaluator.in_flight.deliver(wire.Completion(msg.request_id, [1], [2, 3, 4], [-0.1] * 3, [1, 2, 2],
                                                    text, "stop", 1, 0.01))

    evaluator = Evaluator(settings, eval_set, None, keeper, counts, send=send, publish=published.append,
                          on_threshold=lambda: stops.append("threshold"), commit_wall={0: 0.0, 1: 1.5, 2: 3.25},
                          clock=lambda: 4.0)
    evaluator.attach(RunLog(tmp_path, "", append=False), Scorer(load_rewards(settings.task), timeout_s=1.0, procs=0))
    await evaluator.run(step=2, version=1)
    assert sent == ["eval2.0", "eval2.1"]
    [row] = evaluator.curve
    # stamped with the newest version that answered, at the wall time that version was committed
    assert row["step"] == 2 and row["version"] == 2 and row["versions"] == [1, 2] and row["wall_s"] == 3.25
    assert row["done_s"] == 4.0 and row["pass_rate"] == 0.5 and counts.eval_tokens == 6
    assert keeper.rows == [row] and not keeper.eval_starts and published == [{"kind": "eval", **row}]
    assert stops == ["threshold"] and evaluator.time_to_threshold == 3.25
    assert evaluator.ran(2) and not evaluator.unfinished


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


async def test_threshold_stops_early_and_records_time(tmp_path):
    settings = make_settings(**{"run.threshold": 0.9, "run.max_steps": 50, "task.eval_every": 1})
    summary = await orchestrator(tmp_path, settings).run()
    assert summary["time_to_threshold_s"] is not None and summary["steps"] < 50
    first = next(r for r in summary["eval_curve"] if r["pass_rate"] >= 0.9)
    assert first["version"] >= 2 and summary["eval_curve"][0]["pass_rate"] == 0.0
