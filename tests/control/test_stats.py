import math

from areal_aio import wire
from areal_aio.control.stats import (
    Counts,
    WorkerShare,
    group_fields,
    has_spread,
    num,
    sample_row,
    step_row,
    summarize,
    worker_rows,
)
from areal_aio.rewards.scoring import Score
from areal_aio.settings import Settings
from areal_aio.tasks.task import Task


class _Sample:
    def __init__(self, reward: float, completion: wire.Completion | None) -> None:
        self.request_id, self.group_id, self.retries, self.process = "g0.0", 0, 0, None
        self.task = Task(id="t", prompt="1 + 1", answer="2")
        self.completion = completion
        self.score = Score(reward, passed=reward > 0, strict=False)


def _completion(n: int, versions: list[int]) -> wire.Completion:
    return wire.Completion("g0.0", [1], list(range(n)), [-1.0] * n, versions, "x", "stop", 1, 0.0)


def test_counts_change_in_one_place_each_and_survive_a_checkpoint():
    c = Counts(admitted=4)
    c.completed(_completion(3, [0, 0, 1]))
    c.scored(Score(1.0, True, True, failed=False))
    c.scored(Score(0.0, False, False, failed=True))
    c.dropped(2, "stale")
    c.dropped(1, "interrupt")
    c.trained(tokens=3, stale=[1, 0], sequences=3)  # an episode of the two trained two sequences
    assert (c.generated, c.gen_tokens, c.interrupts, c.reward_failures, c.reward_sum) == (1, 3, 1, 1, 1.0)
    assert (c.dropped_stale, c.dropped_interrupt, c.accepted, c.trained_tokens) == (2, 1, 2, 3)
    assert c.sequences_trained == 3
    assert Counts.from_state(*c.state()) == c


def test_rows_and_summary_read_the_counts():
    s = Settings()
    samples = [_Sample(1.0, _completion(2, [0, 1])), _Sample(0.0, _completion(2, [1, 1]))]
    c = Counts(admitted=4, gen_tokens=4)
    c.trained(4, [1, 0], 2)
    trained = wire.Trained(step=1, version=2, path="", stats={"loss": 0.5, "step": 1})
    row = step_row(1, 2, 2.0, 0.5, 0.1, samples, [1, 0], c, trained, replay_groups=3, in_flight=5)
    assert row["reward_mean"] == 0.5 and row["pass_rate"] == 0.5 and row["staleness_max"] == 1
    assert row["loss"] == 0.5 and row["version"] == 2 and row["in_flight"] == 5
    assert row["train_tokens_per_s"] == 2.0
    assert (row["groups"], row["spread_frac"], row["solved_frac"], row["unsolved_frac"]) == (1, 1.0, 0.0, 0.0)
    dropped = sample_row(_Sample(0.0, None), dropped="interrupt")
    assert dropped["reply"] is None and dropped["tokens"] == 0 and dropped["dropped"] == "interrupt"
    summary = summarize(s, c, wall=2.0, steps=1, version=2, cold_start={}, max_trained_staleness=1,
                        resumes=[], best={"version": None}, eval_curve=[], time_to_threshold=None,
                        process={}, rollout_busy_s=1.0, trainer_busy_s=0.5,
                        rollout_workers_detail=worker_rows([WorkerShare("cuda:0", 3, 4), WorkerShare("cuda:1")],
                                                           [1.5, 0.0], 2.0),
                        lag_max_s=0.0, folder="f", error=None)
    assert summary["samples_unused"] == 2 and summary["rollout_idle_frac"] == 0.5
    assert summary["rollout_workers_detail"] == [
        {"worker": 0, "device": "cuda:0", "requests": 3, "gen_tokens": 4, "idle_frac": 0.25},
        {"worker": 1, "device": "cuda:1", "requests": 0, "gen_tokens": 0, "idle_frac": 1.0}]
    assert summary["best_eval"] is None and summary["error"] is None
    assert num(math.inf) is None and num(2.0) == 2


def test_a_batch_s_groups_are_counted_by_whether_their_rewards_differ_and_their_replies_pass():
    outcomes = [("a", 1.2, True), ("a", 0.0, False),  # spread
                ("b", 1.2, True), ("b", 1.0, True),  # solved, and spread: the format bonus differs
                ("c", 1.2, True), ("c", 1.2, True),  # solved, no spread
                ("d", 0.0, False), ("d", 0.0, False), ("d", 0.0, False)]  # unsolved, no spread
    assert group_fields(outcomes) == {"groups": 4, "spread_frac": 0.5, "solved_frac": 0.5, "unsolved_frac": 0.25}
    assert group_fields([]) == {"groups": 0, "spread_frac": None, "solved_frac": None, "unsolved_frac": None}
    assert has_spread([0.5, 0.5 + 1e-6]) and not has_spread([0.5, 0.5 + 1e-12]) and not has_spread([1.0])


def test_the_summary_names_the_sandbox_layers_of_a_run_that_executes_programs(monkeypatch):
    from areal_aio.control.stats import sandbox_in_force
    from areal_aio.sandbox import sandbox
    from areal_aio.settings import build_settings

    monkeypatch.setattr(sandbox, "layers", lambda: sandbox.Layers("root", namespaces=("pid", "net"), seccomp=True))
    assert sandbox_in_force(build_settings({})) is None  # arithmetic runs no program
    got = sandbox_in_force(build_settings({"task": {"name": "functions"}}))
    assert got == sandbox.layers().in_force() and set(got) == {"namespaces", "uid", "filter", "memory"}
    assert got["namespaces"] == "pid, net" and got["filter"].startswith("seccomp:")
    coded = build_settings({"task": {"name": "jsonl", "path": "x.jsonl", "reward": "areal_aio.rewards.code:reward"}})
    assert sandbox_in_force(coded) is not None  # the code reward on a file's rows
