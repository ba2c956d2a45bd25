"""The rollout-based process reward: its pure parts computed exactly, and the controller's
continuations against a fake rollout worker whose continuations are a scripted function of
(step, continuation index)."""

from __future__ import annotations

import asyncio
import itertools
import re

import orjson
import pytest

from areal_aio import wire
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.rewards.process import (
    ID_PREFIX,
    combine,
    process_score,
    samples_continuations,
    scorable_steps,
    step_score,
)
from areal_aio.seeds import continuation_seed, sample_seed
from areal_aio.settings import ProcessSettings, build_settings
from areal_aio.tasks.steps import STEP_INSTRUCTION, parse, render
from areal_aio.tasks.task import Task
from tests.conftest import WORKERS, rollouts

# binary-exact weights, so rewards compare with ==
EXACT = ProcessSettings(mode="mixed", continuations=4, max_scored_steps=6, tau=0.5, penalty=-0.5,
                        lambda_acc=0.5, lambda_proc=0.5, format_weight=0.25, step_bonus=0.125,
                        step_bonus_cap=0.25)


# ---------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("text, k", [
    (render(["1 + 2 = 3", "3 + 4 = 7", "7 - 1 = 6"], "6"), 3),
    ("Step 1: 1 + 2 = 3\nStep 2: 3 + 4 = 7", 2),  # no answer tag: its steps still count
    ("Step 1: 1 + 2 = 3\n<answer>3</answer>\nmore", 1),  # text after the tag
    ("Step 1: a\n<answer>1</answer><answer>2</answer>", 1),
    ("Step 1: a\nStep 3: b\n<answer>1</answer>", 0),  # misnumbered: no step is trusted
    ("Well.\nStep 1: a\n<answer>1</answer>", 0),
    ("Step 1: a\nStep 2:\n<answer>1</answer>", 0),
    ("The answer is 9.", 0),
])
def test_scorable_steps(text, k):
    assert scorable_steps(parse(text)) == k


def test_step_and_process_scores():
    assert step_score([True, False, False, False]) == 0.25
    assert step_score([True, True, True, False]) == 0.75
    assert process_score([0.25, 0.75]) == 0.5
    assert process_score([]) == 0.0


def test_combine_format_step_bonus_and_mix():
    # 0.25 format + 2 steps * 0.125 + 0.5 * correct + 0.5 * R_proc
    assert combine(EXACT, correct=True, valid=True, steps=2, proc=0.5) == (0.25 + 0.25 + 0.5 + 0.25, False)
    assert combine(EXACT, correct=True, valid=True, steps=1, proc=0.0) == (0.25 + 0.125 + 0.5, False)
    assert combine(EXACT, correct=True, valid=True, steps=5, proc=1.0) == (0.25 + 0.25 + 0.5 + 0.5, False)  # capped
    # an invalid reply earns neither the format reward nor the step bonus
    assert combine(EXACT, correct=True, valid=False, steps=3, proc=0.75) == (0.5 + 0.375, False)


def test_the_gate_replaces_the_reward_only_when_the_process_is_poor_and_the_answer_wrong():
    assert combine(EXACT, correct=False, valid=True, steps=2, proc=0.25) == (-0.5, True)
    assert combine(EXACT, correct=False, valid=False, steps=0, proc=0.0) == (-0.5, True)
    assert combine(EXACT, correct=True, valid=True, steps=2, proc=0.25) == (0.25 + 0.25 + 0.5 + 0.125, False)
    assert combine(EXACT, correct=False, valid=True, steps=2, proc=0.5) == (0.25 + 0.25 + 0.25, False)  # tau itself passes
    assert combine(EXACT, correct=False, valid=True, steps=2, proc=None) == (0.25 + 0.25, False)  # no score, no gate


@pytest.mark.parametrize("mode, acc, proc, tau, samples", [
    ("off", 1.0, 0.0, 0.5, False), ("outcome", 1.0, 0.0, 0.0, False),
    ("process", 0.0, 1.0, 0.5, True), ("mixed", 0.5, 0.5, 0.5, True)])
def test_process_mode_presets(mode, acc, proc, tau, samples):
    p = build_settings({"process": {"mode": mode}}).process
    assert (p.lambda_acc, p.lambda_proc, p.tau) == (acc, proc, tau)
    assert samples_continuations(p) is samples


def test_set_wins_over_the_process_preset_and_a_gate_alone_samples():
    p = build_settings({"process": {"mode": "mixed"}}, ["process.lambda_acc=0.25"]).process
    assert (p.lambda_acc, p.lambda_proc) == (0.25, 0.5)
    gate_only = build_settings({}, ["process.mode=outcome", "process.tau=0.5"]).process
    assert gate_only.lambda_proc == 0 and samples_continuations(gate_only)


def test_continuation_seeds_are_distinct_and_never_a_rollout_seed():
    seeds = {continuation_seed(0, g, s, 0, i, j) for g in range(20) for s in range(8)
             for i in range(1, 7) for j in range(4)}
    assert len(seeds) == 20 * 8 * 6 * 4
    assert not seeds & {sample_seed(0, g, s, r) for g in range(20) for s in range(8) for r in range(3)}


# ---------------------------------------------------------------------- controller, fake workers


def step_tasks(start: int = 0):
    i = start
    while True:
        a, b = i % 10, (i * 7) % 10
        yield Task(id=f"t{i}", prompt=f"Calculate {a} + {b}. {STEP_INSTRUCTION}", answer=str(a + b))
        i += 1


def step_policy(prompt: str, version: int) -> str:
    """Two steps, right for an even first term, wrong (by one) for an odd one."""
    a, b = (int(x) for x in re.findall(r"\d+", prompt)[:2])
    answer = a + b + a % 2
    return render([f"{a} + {b} = {answer}", f"{answer} + 0 = {answer}"], str(answer))


def scripted_continuation(msg: wire.Generate, version: int) -> str:
    """Continuation j from step i: right for j < i * 2 - 1 (c_1 = 1/4, c_2 = 3/4) after a step
    of a right reply, always wrong after a step of a wrong one."""
    i, j = (int(x) for x in msg.request_id.split(".")[-2:])
    a, b = (int(x) for x in re.findall(r"\d+", msg.prompt)[:2])
    right = a % 2 == 0 and j < 2 * i - 1
    return f"<answer>{a + b if right else a + b + 1}</answer>"


class Recording(FakeRollout):
    """Continuation tokens are 99s (never in a trained sample); Generate and Abort are recorded."""

    def __init__(self, *, slow_continuations_s: float = 0.0, **kw) -> None:
        super().__init__(continuation=scripted_continuation, policy=step_policy, **kw)
        self.slow = slow_continuations_s
        self.sent: list = []

    async def send(self, msg):
        self.sent.append(msg)
        await super().send(msg)

    def token_delay(self, request_id):
        return self.slow if request_id.startswith(ID_PREFIX) else self.token_delay_s

    def _completion(self, rid, versions, finish, text=""):
        done = super()._completion(rid, versions, finish, text)
        if rid.startswith(ID_PREFIX):
            done = wire.Completion(**{**{k: getattr(done, k) for k in done.__slots__},
                                      "completion_ids": [99] * len(versions)})
        return done


def settings_for(mode: str, run_mode: str = "sync", **overrides):
    raw = {"run": {"mode": run_mode, "max_steps": 4, "progress": False},
           "model": {"path": "embedded:tiny-random"}, "task": {"eval_size": 4, "eval_every": 2},
           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4},
           "controller": {"reward_procs": 0},
           "process": {"mode": mode, "format_weight": 0.25, "step_bonus": 0.125, "step_bonus_cap": 0.25,
                       "penalty": -0.5}}
    return build_settings(raw, [f"{k}={orjson.dumps(v).decode()}" for k, v in overrides.items()])


def orchestrator(tmp_path, settings, rollout, trainer=None):
    return Orchestrator(settings, tasks=step_tasks(), eval_set=list(itertools.islice(step_tasks(100), 4)),
                        out_dir=tmp_path / "run", rollout=rollout, trainer=trainer or FakeTrainer())


def rows(folder, name):
    return [orjson.loads(x) for x in (folder / name).read_bytes().splitlines()]


@pytest.mark.parametrize("run_mode", ["sync", "areal"])
async def test_process_mode_trains_exact_rewards_and_never_continuations(tmp_path, run_mode):
    rollout, trainer = Recording(tokens=4), FakeTrainer()
    summary = await orchestrator(tmp_path, settings_for("process", run_mode), rollout, trainer).run()
    assert summary["steps"] == 4 and summary["error"] is None and summary["process_mode"] == "process"
    trained = [s for b in trainer.batches for s in b.samples]
    assert len(trained) == 16 and all(99 not in s.completion_ids for s in trained)
    train_rows = [r for r in rows(tmp_path / "run", "samples.jsonl") if r["kind"] == "train" and r["step"]]
    assert len(train_rows) == 16
    for r in train_rows:
        even = int(re.findall(r"\d+", r["prompt"])[0]) % 2 == 0
        p = r["process"]
        assert p["steps"] == 2 and p["valid"] and p["c"] == ([0.25, 0.75] if even else [0.0, 0.0])
        # process preset: 0.25 format + 2 * 0.125 steps + R_proc 0.5; a wrong reply is gated
        assert r["reward"] == (1.0 if even else -0.5) and p["gated"] is (not even)
        assert p["tokens"] == 2 * 4 * 4 and p["versions"][0] <= p["versions"][1]
    assert sorted(s.reward for s in trained) == sorted(r["reward"] for r in train_rows)
    # counters: every continuation the worker was sent, its tokens, and the cost multiple
    sent = [m for m in rollout.sent if isinstance(m, wire.Generate) and m.prefix]
    assert summary["continuation_requests"] == len(sent) == 8 * summary["process_replies"]
    done = [rid for _, what, rid in rollout.log if what == "done" and rid.startswith(ID_PREFIX)]
    assert summary["continuation_tokens"] == 4 * len(done)
    assert summary["gen_tokens"] == 4 * summary["samples_generated"]
    assert summary["cost_multiple"] == (summary["gen_tokens"] + summary["continuation_tokens"]) / summary["gen_tokens"]
    assert summary["continuation_s"] > 0 and summary["process_gated"] >= 8
    assert all(m.temperature == 0.7 and m.prefix in {parse(step_policy(m.prompt, 0)).prefix(i) for i in (1, 2)}
               for m in sent)
    for row in rows(tmp_path / "run", "steps.jsonl"):
        mine = [r["process"] for r in train_rows if r["step"] == row["step"]]
        assert row["process_mean"] == sum(p["proc"] for p in mine) / 4
        assert row["gated_frac"] == sum(p["gated"] for p in mine) / 4
        assert row["cost_multiple"] == (row["gen_tokens"] + row["continuation_tokens"]) / row["gen_tokens"]


async def test_continuations_carry_their_prefix_seed_and_id(tmp_path):
    rollout = Recording(tokens=4)
    settings = settings_for("mixed", **{"run.max_steps": 1, "process.continuations": 2,
                                        "process.max_scored_steps": 1})
    summary = await orchestrator(tmp_path, settings, rollout).run()
    sent = {m.request_id: m for m in rollout.sent if isinstance(m, wire.Generate) and m.prefix}
    assert summary["continuation_requests"] == len(sent) == 2 * summary["process_replies"]
    first = sent[f"{ID_PREFIX}0.1.0.1.1"]  # group 0, sample 1, retry 0, step 1, continuation 1
    assert first.prefix == parse(step_policy(first.prompt, 0)).prefix(1)
    assert first.seed == continuation_seed(settings.run.seed, 0, 1, 0, 1, 1)
    assert first.max_new_tokens == settings.rollout.max_new_tokens and first.top_p == settings.rollout.top_p


async def test_outcome_mode_samples_no_continuations(tmp_path):
    rollout, trainer = Recording(tokens=4), FakeTrainer()
    summary = await orchestrator(tmp_path, settings_for("outcome"), rollout, trainer).run()
    assert not [m for m in rollout.sent if isinstance(m, wire.Generate) and m.prefix]
    assert summary["continuation_requests"] == 0 and summary["cost_multiple"] == 1.0
    rewards = sorted({s.reward for b in trainer.batches for s in b.samples})
    assert rewards == [0.25 + 0.25, 0.25 + 0.25 + 1.0]  # format + steps (+ 1 when correct); no gate


@pytest.mark.parametrize("workers", WORKERS)
async def test_continuations_live_through_weight_updates_keeping_their_versions(tmp_path, workers):
    _, rollout = rollouts(workers, lambda i: Recording(tokens=4, slow_continuations_s=0.004))
    settings = settings_for("process", "areal", **{"run.max_steps": 8})
    summary = await orchestrator(tmp_path, settings, rollout, FakeTrainer(step_delay_s=0.005)).run()
    assert summary["steps"] == 8
    spans = [r["process"]["versions"] for r in rows(tmp_path / "run", "samples.jsonl")
             if r.get("process") and r["process"]["versions"]]
    assert any(lo < hi for lo, hi in spans)  # finished under newer weights, not restarted
    assert summary["max_staleness_trained"] <= settings.eta


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_run_stopped_mid_continuation_aborts_them_and_ends_cleanly(tmp_path, workers):
    fakes, rollout = rollouts(workers, lambda i: Recording(tokens=4, slow_continuations_s=1000.0))  # never finish
    orch = orchestrator(tmp_path, settings_for("process", "areal", **{"run.max_steps": 10}), rollout)
    run = asyncio.create_task(orch.run())
    while orch._process.requests == 0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)
    orch.stop()
    summary = await asyncio.wait_for(run, 10)
    assert summary["error"] is None and summary["steps"] == 0
    for fake in fakes:  # each continuation aborted on the worker it runs on
        sent = {m.request_id for m in fake.sent if isinstance(m, wire.Generate) and m.prefix}
        aborted = {m.request_id for m in fake.sent if isinstance(m, wire.Abort)}
        assert sent <= aborted
    assert any(isinstance(m, wire.Generate) and m.prefix for f in fakes for m in f.sent)
    assert summary["continuation_tokens"] == 0 and summary["eval_curve"][-1]["step"] == 0


async def test_a_cancelled_run_with_continuations_in_flight_does_not_hang(tmp_path):
    rollout = Recording(tokens=4, slow_continuations_s=1000.0)
    orch = orchestrator(tmp_path, settings_for("process", "areal"), rollout)
    run = asyncio.create_task(orch.run())
    while orch._process.requests == 0:
        await asyncio.sleep(0.005)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)
    assert (tmp_path / "run" / "summary.json").exists()


async def test_a_resumed_run_continues_the_continuation_counters_and_scores_alike(tmp_path):
    import shutil

    from areal_aio.store import checkpoint

    folder = tmp_path / "run"
    settings = settings_for("process", **{"run.checkpoint_every": 2, "run.keep_checkpoints": 2})
    await orchestrator(tmp_path, settings, Recording(tokens=4)).run()
    shutil.rmtree(folder / "checkpoints" / "step-000004")  # as if it died after step 2's checkpoint
    saved = checkpoint.latest(folder).state["process"]
    assert saved["requests"] > 0 and saved["tokens"] > 0
    rollout = Recording(tokens=4)
    summary = await Orchestrator(settings, tasks=step_tasks(), eval_set=list(itertools.islice(step_tasks(100), 4)),
                                 resume=folder, rollout=rollout, trainer=FakeTrainer()).run()
    sent = [m for m in rollout.sent if isinstance(m, wire.Generate) and m.prefix]
    assert summary["continuation_requests"] == saved["requests"] + len(sent)
    whole = tmp_path / "whole"
    await Orchestrator(settings, tasks=step_tasks(), eval_set=list(itertools.islice(step_tasks(100), 4)),
                       out_dir=whole, rollout=Recording(tokens=4), trainer=FakeTrainer()).run()

    def trained(path):
        return [(r["step"], r["request_id"], r["reward"], r["process"]["c"])
                for r in rows(path, "samples.jsonl") if r["kind"] == "train" and r["step"]]

    assert trained(folder) == trained(whole)


# ---------------------------------------------------------------------- real workers


@pytest.mark.slow
async def test_process_mode_on_the_real_workers_scores_steps_and_counts_continuations(tmp_path, step_model):
    from tests.conftest import STEP_PROMPTS as PROMPTS
    from tests.conftest import STEP_REPLY as REPLY

    answers = ("4", "5")  # the model always answers 4: one task right, one wrong
    tasks = itertools.cycle([Task(f"t{i}", p, a) for i, (p, a) in enumerate(zip(PROMPTS, answers, strict=True))])
    settings = build_settings({}, [
        f"model.path={orjson.dumps(str(step_model)).decode()}", "process.mode=process",
        "process.continuations=2", "process.max_scored_steps=2", "rollout.max_new_tokens=40",
        "rollout.group_size=4", "trainer.batch_size=8", "run.max_steps=2", "task.eval_every=2",
        "run.progress=false", "run.checkpoint_every=0", "controller.reward_procs=0", "trainer.bf16=false"])
    orch = Orchestrator(settings, tasks=tasks, eval_set=[Task("e0", PROMPTS[0], "4")], out_dir=tmp_path / "run")
    summary = await asyncio.wait_for(orch.run(), 300)
    assert summary["error"] is None and summary["steps"] == 2
    assert summary["continuation_requests"] > 0 and summary["continuation_tokens"] > 0
    assert summary["cost_multiple"] == (summary["gen_tokens"] + summary["continuation_tokens"]) / summary["gen_tokens"] > 1
    trained = [r for r in rows(tmp_path / "run", "samples.jsonl") if r["kind"] == "train" and r["step"]]
    assert len(trained) == 16 and all(r["process"] is not None for r in trained)
    exact = [r for r in trained if r["reply"] == REPLY]
    assert len(exact) >= 8  # the model writes its reply; continuations from its steps write the rest
    for r in exact:
        p = r["process"]
        assert p["steps"] == 2 and p["valid"] and len(p["c"]) == 2 and p["tokens"] > 0
        if r["answer"] == "4":  # every continuation ends in 4: c = [1, 1]; format + 2 steps + R_proc
            assert p["c"] == [1.0, 1.0] and r["reward"] == pytest.approx(0.2 + 0.1 + 1.0)
        else:  # no continuation can be right: R_proc 0 < tau with a wrong answer: gated
            assert p["c"] == [0.0, 0.0] and p["gated"] and r["reward"] == 0.0
    assert not orch.store.root.exists()
