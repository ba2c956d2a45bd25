"""Multi-turn episodes (agents/episodes.py) against the fake workers: the one sequence an episode
trains (exact ids, mask, log-probs, versions), staleness over trained tokens, bounds and failures
(scored 0, counted), stop and cancel mid-episode, restarts, resume; the docs' example (docs/episodes.md) on
the real workers (slow)."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest

from areal_aio import wire
from areal_aio.agents import episodes
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer, prompt_ids
from areal_aio.settings import SettingsError, build_settings
from areal_aio.store import checkpoint
from areal_aio.tasks.task import Task
from tests.conftest import Jitter, make_settings, orchestrator, tasks

TOOL_TEXT = "7"
EVAL_IDS = {t.id for t in tasks(4, start=100)}  # conftest.orchestrator's held-out set


class ReplyRollout(FakeRollout):
    """Reply k of an episode (its request id ends in .r<k>) has ids 100k + j and log-prob
    -(k + 1 + j / 10) for token j: every trained token is told apart from every other."""

    def _completion(self, rid, versions, finish, text=""):
        msg = super()._completion(rid, versions, finish, text)
        k = int(rid.split(".r")[1].split("~")[0]) if ".r" in rid else 0
        n = len(msg.completion_ids)
        return wire.Completion(msg.request_id, msg.prompt_ids, [100 * k + j for j in range(n)],
                               [-(k + 1 + j / 10) for j in range(n)], msg.versions, msg.text,
                               msg.finish, msg.interrupts, msg.gen_s)


class Jittery(Jitter, ReplyRollout):
    """Each request sleeps a random time per token: groups finish out of order."""


def watching(base: type, keep) -> type:
    """`base`, a fake rollout class, whose messages sent to it that `keep(msg)` accepts are
    also kept in its `sent`, in order."""

    class Watching(base):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.sent: list = []

        async def send(self, msg):
            if keep(msg):
                self.sent.append(msg)
            await super().send(msg)

    return Watching


def calculator_call(prompt, version) -> str:
    """A fake policy that calls the calculator on its task's two terms."""
    a, b = (int(x) for x in prompt.split("Calculate ")[1].split(".")[0].split(" + "))
    return f"<calc>{a} + {b}</calc>"


def tagged_tool_value(msg, version) -> str:
    """A fake continuation that answers with the tool turn's value, tagged."""
    return f"<answer>{msg.append[0]['content']}</answer>"


async def two_replies(task, model) -> float:
    """One tool turn between two replies; the reward: the first reply's length parity."""
    first = await model.reply()
    model.add_turn("tool", TOOL_TEXT)
    await model.reply()
    return float(len(first) % 2)


def rows(folder, kind="train"):
    return [r for r in (orjson.loads(x) for x in (folder / "samples.jsonl").read_bytes().splitlines())
            if r["kind"] == kind]


def trained_staleness(trainer: FakeTrainer) -> list[int]:
    return [b.version - min(v for v, m in zip(s.versions, s.loss_mask, strict=True) if m)
            for b in trainer.batches for s in b.samples]


async def test_an_episode_trains_one_sequence_with_exact_mask_logprobs_and_versions(tmp_path):
    trainer = FakeTrainer()
    settings = make_settings("sync", **{"run.max_steps": 2})
    summary = await orchestrator(tmp_path, settings, rollout=ReplyRollout(tokens=3), trainer=trainer,
                                 episode=two_replies).run()
    assert summary["steps"] == 2 and summary["episode_failures"] == 0
    sample = trainer.batches[1].samples[0]
    turn = list(f"<tool>{TOOL_TEXT}\n<assistant>".encode())  # the fake's rendering of the tool turn
    assert sample.completion_ids == [0, 1, 2, *turn, 100, 101, 102]
    assert sample.loss_mask == [1, 1, 1, *[0] * len(turn), 1, 1, 1]
    trained = [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m]
    assert trained == [-1.0, -1.1, -1.2, -2.0, -2.1, -2.2]  # each reply's own, in order
    assert [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m] == [1] * 6  # sync: v1 made them
    prompt = bytes(sample.prompt_ids).decode()  # the task templated once, shared by its group
    assert prompt.startswith("<user>Calculate") and prompt.endswith("\n<assistant>")
    assert trainer.batches[1].samples[1].prompt_ids == sample.prompt_ids
    row = rows(tmp_path / "run")[-1]
    assert [(t["role"], t["trained"]) for t in row["turns"]] == [("assistant", True), ("tool", False),
                                                              ("assistant", True)]
    assert [t["tokens"] for t in row["turns"]] == [3, len(turn), 3] and row["tokens"] == 6 + len(turn)
    assert summary["trained_tokens"] == 2 * 4 * 6  # the tool turns are context, not trained


async def test_later_replies_carry_the_exact_ids_so_far_and_only_the_new_turns(tmp_path):
    rollout = watching(ReplyRollout, lambda m: isinstance(m, wire.Generate) and m.request_id.startswith("g0.0"))(
        tokens=2)
    sent = rollout.sent

    async def three(task, model):
        await model.reply()
        model.add_turn("tool", "a")
        model.add_turn("user", "b")
        await model.reply()
        await model.reply()  # no turn between: the exact ids, then a new assistant turn

    await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 1, "task.episode_turns": 3}),
                       rollout=rollout, episode=three).run()
    assert [m.request_id for m in sent] == ["g0.0.r0", "g0.0.r1", "g0.0.r2"]
    assert sent[0].context_ids is None and sent[0].append is None
    p = prompt_ids(sent[0])
    assert sent[1].context_ids == p + [0, 1]
    assert sent[1].append == [{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}]
    turns = list(b"<tool>a\n<user>b\n<assistant>")
    assert sent[2].context_ids == p + [0, 1, *turns, 100, 101] and sent[2].append is None
    assert len({m.seed for m in sent}) == 3  # each reply its own draws


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1])
async def test_staleness_bound_holds_over_multi_turn_episodes(tmp_path, eta, seed):
    trainer = FakeTrainer(step_delay_s=0.003)
    settings = make_settings("areal", **{"controller.max_staleness": eta, "run.max_steps": 8})
    summary = await orchestrator(tmp_path, settings, rollout=Jittery(seed, tokens=3), trainer=trainer,
                                 episode=two_replies).run()
    assert summary["steps"] == 8
    ages = trained_staleness(trainer)
    assert max(ages) <= eta and summary["max_staleness_trained"] == max(ages)
    # interrupting updates: some episode's replies were made by more than one version
    spans = [{v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
             for b in trainer.batches for s in b.samples]
    assert eta == 0 or any(len(v) > 1 for v in spans)


@pytest.mark.parametrize("how", ["raises", "hangs", "too_many_replies", "not_a_reward"])
async def test_an_episode_that_fails_scores_zero_and_is_counted(tmp_path, how):
    async def episode(task, model):
        await model.reply()
        if int(task.id[1:]) % 2:  # odd tasks fail, even ones return 1
            if how == "raises":
                raise ValueError("tool broke")
            if how == "hangs":
                await asyncio.sleep(3600)
            if how == "too_many_replies":
                while True:
                    await model.reply()
            return "yes"
        return 1.0

    settings = make_settings("sync", **{"run.max_steps": 2, "task.episode_timeout_s": 0.2,
                                        "task.episode_turns": 2})
    summary = await asyncio.wait_for(orchestrator(tmp_path, settings, episode=episode).run(), 30)
    trained = rows(tmp_path / "run")
    failed = [r for r in trained if int(r["task_id"][1:]) % 2]
    assert summary["steps"] == 2 and failed and len(failed) == len(trained) / 2
    assert all(r["reward"] == 0.0 and r["reward_failed"] for r in failed)
    assert all(r["reward"] == 1.0 and not r["reward_failed"] for r in trained if r not in failed)
    assert summary["episode_failures"] >= len(failed)
    if how == "too_many_replies":
        assert all(len(r["turns"]) == 2 for r in failed)  # task.episode_turns replies, then the limit
    events = [orjson.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()]
    assert any(e["event"] == "episode_failed" for e in events)


@pytest.mark.parametrize("own_s,fails", [(0.02, False), (0.2, True)])
async def test_the_time_bound_counts_the_episodes_own_time_not_its_replies(tmp_path, own_s, fails):
    """Replies slower than the whole bound (a busy rollout worker: 4 tokens of 0.05 s) do not
    time the episode out; its own code past the bound does."""

    async def talks(task, model):
        for _ in range(3):
            await model.reply()
            model.add_turn("tool", "y")
            await asyncio.sleep(own_s / 3)
        return 1.0

    settings = make_settings("sync", **{"run.max_steps": 1, "task.episode_timeout_s": 0.15, "task.episode_turns": 4})
    summary = await asyncio.wait_for(orchestrator(tmp_path, settings, episode=talks,
                                                  rollout=ReplyRollout(token_delay_s=0.05)).run(), 60)
    trained = rows(tmp_path / "run")
    assert summary["steps"] == 1 and summary["episode_failures"] == (len(trained) if fails else 0)
    assert all(len(r["turns"]) >= 5 for r in trained)  # every reply came, 0.2 s each
    assert all(r["reward"] == (0.0 if fails else 1.0) for r in trained)


async def test_the_token_bound_caps_each_reply_and_ends_the_episode(tmp_path):
    async def keeps_talking(task, model):
        while True:
            await model.reply()
            model.add_turn("tool", "more")

    turn = len(b"<tool>more\n<assistant>")
    trainer = FakeTrainer()
    settings = make_settings("sync", **{"run.max_steps": 1, "task.episode_tokens": 4 + turn + 1,
                                        "task.episode_turns": 10})
    summary = await orchestrator(tmp_path, settings, rollout=ReplyRollout(tokens=4), trainer=trainer,
                                 episode=keeps_talking).run()
    assert summary["episode_failures"] == 4 and summary["steps"] == 1
    for s in trainer.batches[0].samples:  # the second reply got the one token left, then the limit
        assert [c for c, m in zip(s.completion_ids, s.loss_mask, strict=True) if m] == [0, 1, 2, 3, 100]
        assert len(s.completion_ids) == 4 + turn + 1  # exactly task.episode_tokens
    assert [t["tokens"] for t in rows(tmp_path / "run")[0]["turns"]] == [4, turn, 1, 0]


async def test_turns_that_fill_the_token_bound_end_the_episode(tmp_path):
    async def long_tool(task, model):
        await model.reply()
        model.add_turn("tool", "x" * 50)  # more than the bound leaves
        await model.reply()
        return 1.0

    settings = make_settings("sync", **{"run.max_steps": 1, "task.episode_tokens": 30})
    summary = await orchestrator(tmp_path, settings, rollout=ReplyRollout(tokens=4), episode=long_tool).run()
    assert summary["episode_failures"] == 4 and summary["steps"] == 1
    assert all(r["reward_failed"] and [t["trained"] for t in r["turns"]] == [True, False, True]
               and r["turns"][2]["tokens"] == 0 for r in rows(tmp_path / "run"))


async def test_an_episode_without_a_reply_scores_zero_and_keeps_its_place_in_its_group(tmp_path):
    """One that raises before its first reply, and one that never calls the model (returning a
    reward of its own), fail like any episode: 0, counted, trained in their group with no token."""
    started = itertools.count()

    async def half_fail_before_replying(task, model):
        k = next(started)  # a group's episodes start one after another: each group has both
        if k % 4 == 1:
            raise ValueError("the tool server is down")
        if k % 4 == 3:
            return 1.0  # no reply: it cannot pass
        await model.reply()
        return 0.5

    trainer = FakeTrainer()
    settings = make_settings("sync", **{"run.max_steps": 2, "run.max_wall_s": 10.0})  # bounds a spin
    summary = await orchestrator(tmp_path, settings, trainer=trainer, episode=half_fail_before_replying).run()
    assert summary["steps"] == 2 and summary["samples_dropped_episode"] == 0
    assert summary["episode_failures"] == summary["reward_failures"] == 4  # two per step
    for batch in trainer.batches:
        assert [s.reward for s in batch.samples] == [0.5, 0.0] * 2
        for replied, failed in zip(batch.samples[::2], batch.samples[1::2], strict=True):
            assert failed.completion_ids == failed.logprobs == failed.versions == failed.loss_mask == []
            assert failed.prompt_ids == replied.prompt_ids and failed.group == replied.group
    failed = [r for r in rows(tmp_path / "run") if r["tokens"] == 0]
    assert len(failed) == 4 and all(r["reward"] == 0 and r["reward_failed"] and not r["pass"]
                                    and r["dropped"] is None for r in failed)


async def test_a_group_none_of_whose_episodes_replied_is_dropped_and_counted(tmp_path):
    async def episode(task, model):
        if task.id == "t1":
            return 1.0
        await model.reply()

    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 2}), episode=episode).run()
    assert summary["steps"] == 2 and summary["samples_dropped_episode"] == 2 and summary["episode_failures"] == 2
    trained = [r for r in rows(tmp_path / "run") if r["dropped"] is None]
    assert "t1" not in {r["task_id"] for r in trained} and {"t0", "t2"} <= {r["task_id"] for r in trained}
    dropped = [r for r in rows(tmp_path / "run") if r["dropped"] == "episode"]
    assert [(r["task_id"], r["reward"], r["pass"]) for r in dropped] == [("t1", 0.0, False)] * 2


async def broken_episode(task, model):
    raise KeyError("tool")


async def silent_episode(task, model):
    return 1.0


@pytest.mark.parametrize("episode,why", [(broken_episode, "raised KeyError: 'tool'"),
                                         (silent_episode, "ended without a reply")])
async def test_a_run_whose_every_episode_fails_stops_naming_the_episode(tmp_path, episode, why):
    """It must not spin (each group dropped and admitted again at once) until run.max_wall_s."""
    from areal_aio.control.groups import FAILING_GROUPS_TO_STOP, EpisodesFailing
    from areal_aio.control.stats import cause

    settings = make_settings("sync", **{"run.max_steps": 2, "run.max_wall_s": 10.0})
    orch = orchestrator(tmp_path, settings, episode=episode)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(EpisodesFailing) as info:  # as itself, as a worker's failure is
        await orch.run()
    assert asyncio.get_running_loop().time() - t0 < 5
    name = f"tests.agents.test_episodes:{episode.__name__}"
    assert cause(info.value).startswith(f"EpisodesFailing: every episode failed, {FAILING_GROUPS_TO_STOP} "
                                        f"groups in a row: {name} {why}")
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert summary["ended"].startswith("failed: EpisodesFailing") and summary["steps"] == 0
    assert summary["episode_failures"] == 2 * FAILING_GROUPS_TO_STOP  # then it stopped
    assert summary["samples_admitted"] <= 2 * (FAILING_GROUPS_TO_STOP + 2)


async def test_groups_that_only_fail_now_and_then_do_not_stop_the_run(tmp_path):
    from areal_aio.control.groups import FAILING_GROUPS_TO_STOP

    groups = itertools.count()

    async def fails_but_in_every_fourth_group(task, model):
        await model.reply()
        if next(groups) // 2 % 4:
            raise RuntimeError("flaky")
        return 1.0

    settings = make_settings("sync", **{"run.max_steps": FAILING_GROUPS_TO_STOP})
    summary = await orchestrator(tmp_path, settings, episode=fails_but_in_every_fourth_group).run()
    assert summary["steps"] == FAILING_GROUPS_TO_STOP and summary["ended"] == "completed"


async def test_returning_none_lets_task_reward_score_the_last_reply(tmp_path):
    async def episode(task, model):
        await model.reply()
        model.add_turn("tool", "42")
        await model.reply()

    trainer = FakeTrainer()
    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 6}),
                                 episode=episode, trainer=trainer).run()
    # the fake policy answers correctly from version 2 on: the answer reward sees the last reply
    assert summary["steps"] == 6 and trainer.batches[-1].samples[0].reward > 0
    assert trainer.batches[0].samples[0].reward == 0


async def test_a_stop_mid_episode_cancels_every_episode_and_ends(tmp_path):
    started = asyncio.Event()

    async def waits_for_a_tool(task, model):
        await model.reply()
        if task.id in EVAL_IDS:  # the held-out eval's episodes end: only training's hang
            return 1.0
        started.set()
        await asyncio.Event().wait()  # a tool that never answers

    orch = orchestrator(tmp_path, make_settings("areal", **{"run.max_steps": 5, "task.episode_timeout_s": 3600}),
                        episode=waits_for_a_tool)
    run = asyncio.create_task(orch.run())
    await asyncio.wait_for(started.wait(), 10)
    orch.stop()
    summary = await asyncio.wait_for(run, 10)
    assert summary["ended"] == "stopped" and summary["steps"] == 0
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("episode-")]


async def test_a_cancel_mid_reply_leaves_no_episode_task(tmp_path):
    orch = orchestrator(tmp_path, make_settings("areal", **{"run.max_steps": 1000}),
                        rollout=ReplyRollout(tokens=50, token_delay_s=0.001), episode=two_replies)
    run = asyncio.create_task(orch.run())
    while orch.step < 2:
        assert not run.done()
        await asyncio.sleep(0.002)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("episode-")]
    assert orjson.loads((tmp_path / "run" / "summary.json").read_bytes())["ended"] == "interrupted"


async def test_restart_on_interrupt_resubmits_the_reply_not_the_episode(tmp_path):
    trainer = FakeTrainer(step_delay_s=0.002)
    settings = make_settings("areal", **{"controller.on_interrupt": "restart", "controller.max_retries": 50,
                                         "run.max_steps": 6})
    summary = await orchestrator(tmp_path, settings, rollout=ReplyRollout(tokens=4, token_delay_s=0.001),
                                 trainer=trainer, episode=two_replies).run()
    assert summary["steps"] == 6 and summary["restarts"] > 0
    for b in trainer.batches:
        for s in b.samples:  # whatever was restarted, the sequence is two whole replies and the turn
            assert [c for c, m in zip(s.completion_ids, s.loss_mask, strict=True) if m] == [0, 1, 2, 3,
                                                                                            100, 101, 102, 103]


async def test_resume_runs_the_episodes_in_flight_again(tmp_path):
    folder = tmp_path / "r"
    settings = make_settings("areal", **{"run.checkpoint_every": 3, "run.max_steps": 3})
    await Orchestrator(settings, tasks=tasks(), eval_set=list(tasks(4, start=100)), out_dir=folder,
                       rollout=FakeRollout(), trainer=FakeTrainer(), episode=two_replies).run()
    state = checkpoint.latest(folder).state
    assert state["open_groups"]
    rollout = FakeRollout()
    summary = await Orchestrator(make_settings("areal", **{"run.checkpoint_every": 3, "run.max_steps": 5}),
                                 tasks=tasks(), eval_set=list(tasks(4, start=100)), resume=folder,
                                 rollout=rollout, trainer=FakeTrainer(), episode=two_replies).run()
    first = [rid for _, what, rid in rollout.log if what == "generate" and rid.startswith("g")]
    expected = {f"g{g['group']}.{i}.r0" for g in state["open_groups"] for i in range(2)}
    assert expected <= set(first[:2 * len(expected)])  # the episodes in flight start again, first
    assert summary["steps"] == 5 and summary["lost_in_flight"] == len(expected)


async def test_task_name_calculator_runs_the_calculator_episode(tmp_path):
    """The fake model calls the calculator first, then answers with the value it was given."""
    seen: list[wire.Generate] = []

    def answers(msg, version):
        seen.append(msg)
        return tagged_tool_value(msg, version)

    trainer = FakeTrainer()
    summary = await orchestrator(tmp_path, make_settings("sync", **{"task.name": "calculator", "run.max_steps": 2}),
                                 rollout=FakeRollout(policy=calculator_call, continuation=answers), trainer=trainer).run()
    assert summary["steps"] == 2 and summary["episode_failures"] == 0
    assert all(m.append[0]["role"] == "tool" for m in seen)
    trained = rows(tmp_path / "run")
    assert all(r["pass"] and r["reward"] > 1 for r in trained)  # right and tagged: the answer reward
    assert all(r["turns"][1]["text"] == r["answer"] for r in trained)
    assert all(s.loss_mask.count(0) > 0 for b in trainer.batches for s in b.samples)
    assert all(m.stop == ["</calc>"] for m in seen)  # every reply ends at a complete call


def code_tasks(n: int | None = None, start: int = 0):
    """add(a, b) problems with argument/output tests (a code task's JSONL rows, as Tasks)."""
    i = start
    while n is None or i < start + n:
        tests = [{"args": [i, k], "output": i + k} for k in (1, 2)]
        yield Task(id=f"c{i}", prompt=f"Write add(a, b) returning a + b (e.g. add({i}, 1)).", answer="",
                   extra={"tests": tests, "entry_point": "add"})
        i += 1


async def test_the_code_feedback_episode_trains_a_fixed_program_with_its_feedback_masked(tmp_path):
    """task.episode = code_feedback on the fakes, each program judged in the sandbox: the first
    reply subtracts, the failure's reason comes back as a user turn, the second adds and passes."""
    def first(prompt, version):
        return "```python\ndef add(a, b):\n    return a - b\n```"

    def fixed(msg, version):
        assert msg.append[0]["role"] == "user" and "wrong output" in msg.append[0]["content"]
        return "```python\ndef add(a, b):\n    return a + b\n```"

    trainer = FakeTrainer()
    settings = make_settings("areal", **{"run.max_steps": 2, "task.eval_every": 2,
                                         "task.episode": "areal_aio.agents.code_feedback:episode",
                                         "controller.reward_procs": 1})
    summary = await Orchestrator(settings, tasks=code_tasks(), eval_set=list(code_tasks(2, start=100)),
                                 out_dir=tmp_path / "run", rollout=FakeRollout(policy=first, continuation=fixed),
                                 trainer=trainer).run()
    assert summary["steps"] == 2 and summary["episode_failures"] == 0 and summary["reward_failures"] == 0
    trained = rows(tmp_path / "run")
    assert trained and all(r["pass"] and r["reward"] == 1.0 for r in trained)
    assert all([t["role"] for t in r["turns"]] == ["assistant", "user", "assistant"] for r in trained)
    assert all([t["trained"] for t in r["turns"]] == [True, False, True] for r in trained)
    masks = [[k for k, _ in itertools.groupby(s.loss_mask)] for b in trainer.batches for s in b.samples]
    assert masks and all(m == [1, 0, 1] for m in masks)  # reply, feedback (never trained), reply
    assert [e["pass_rate"] for e in summary["eval_curve"]] == [1.0, 1.0]


async def test_an_episode_runs_eval_is_greedy_episodes_with_their_turns(tmp_path):
    """The held-out eval of a calculator run runs the calculator episode too: every reply greedy,
    the tool's answer between, scored by the last reply; its rows keep their turns."""
    rollout = watching(FakeRollout, lambda m: isinstance(m, wire.Generate) and m.request_id.startswith("eval"))(
        policy=calculator_call, continuation=tagged_tool_value)
    seen = rollout.sent
    settings = make_settings("sync", **{"task.name": "calculator", "run.max_steps": 2})
    summary = await orchestrator(tmp_path, settings, rollout=rollout).run()
    assert [e["step"] for e in summary["eval_curve"]] == [0, 2]
    assert all(e["pass_rate"] == 1.0 and e["episode_failures"] == 0 for e in summary["eval_curve"])
    assert sorted(m.request_id for m in seen if m.request_id.startswith("eval0.")) == \
        [f"eval0.{i}.r{k}" for i in range(4) for k in range(2)]
    assert {m.temperature for m in seen} == {0.0}
    evals = rows(tmp_path / "run", "eval")
    assert len(evals) == 8 and all(r["turns"][1] == {"role": "tool", "text": r["answer"], "tokens": r["turns"][1]["tokens"],
                                                     "trained": False} for r in evals)
    assert all(r["reply"] == f"<answer>{r['answer']}</answer>" for r in evals)


async def test_an_eval_episode_that_fails_scores_zero_and_is_counted_in_its_row(tmp_path):
    async def fails_on_held_out(task, model):
        await model.reply()
        if task.id in EVAL_IDS and task.id != "t100":
            raise RuntimeError("a tool that breaks")
        return 1.0

    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 2}),
                                 episode=fails_on_held_out).run()
    assert summary["steps"] == 2 and summary["episode_failures"] == 0  # training's count only
    assert [(e["pass_rate"], e["episode_failures"]) for e in summary["eval_curve"]] == [(0.25, 3)] * 2


async def test_an_eval_episode_without_a_reply_cannot_pass(tmp_path):
    async def answers_held_out_without_the_model(task, model):
        if task.id in EVAL_IDS:
            return 1.0
        await model.reply()

    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 2}),
                                 episode=answers_held_out_without_the_model).run()
    assert [(e["pass_rate"], e["episode_failures"]) for e in summary["eval_curve"]] == [(0.0, 4)] * 2
    assert all(r["tokens"] == 0 and not r["pass"] for r in rows(tmp_path / "run", "eval"))


@pytest.mark.parametrize("bound_s,delay_s,kept", [(60.0, 0.002, True), (0.3, 0.05, False)])  # a reply: 64 tokens
async def test_a_cancel_during_an_episode_eval_runs_it_again_within_the_bound(tmp_path, monkeypatch, bound_s,
                                                                             delay_s, kept):
    """SIGTERM's path (the run task cancelled) while the baseline eval's episodes wait on replies:
    the stop aborts those replies and runs the eval again from its start (new request ids), so
    its row is kept; past the stop's eval bound it is logged as lost instead, and the run ends."""
    from areal_aio.control import evaluation

    monkeypatch.setattr(evaluation, "EVAL_AT_STOP_TIMEOUT_S", bound_s)
    rollout = watching(ReplyRollout, lambda m: isinstance(m, wire.Abort))(tokens=100, token_delay_s=delay_s)
    orch = orchestrator(tmp_path, make_settings("areal"), rollout=rollout, episode=two_replies)
    run = asyncio.create_task(orch.run())
    while not any(rid.startswith("eval0.") for _, what, rid in rollout.log if what == "generate"):
        assert not run.done()
        await asyncio.sleep(0.005)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 30)
    sent = [rid for _, what, rid in rollout.log if what == "generate"]
    assert not [rid for rid in sent if rid.startswith("g")]  # the baseline eval goes first
    answered = {rid for _, what, rid in rollout.log if what == "done"}
    aborted = {m.request_id for m in rollout.sent}
    assert {rid for rid in sent if rid.startswith("eval0.")} <= aborted | answered  # none left running
    events = [orjson.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_bytes().splitlines()]
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert summary["ended"] == "interrupted"
    if kept:
        assert [e["step"] for e in summary["eval_curve"]] == [0] and not [e for e in events if e["event"] == "eval_lost"]
        assert {rid.split(".")[0] for rid in sent if rid.startswith("eval")} == {"eval0", "eval0s"}
        assert len(rows(tmp_path / "run", "eval")) == 4
    else:
        assert summary["eval_curve"] == []
        assert [e["steps"] for e in events if e["event"] == "eval_lost"] == [[0]]


async def test_the_eval_command_runs_greedy_episodes(tmp_path):
    """evaluate_model of an episode run's settings: greedy episodes on its own rollout client."""
    from areal_aio.control import evaluation
    from areal_aio.rewards.scoring import Scorer, load_rewards

    settings = make_settings("sync", **{"task.name": "calculator"})
    rollout = FakeRollout(policy=lambda prompt, v: "<calc>2 * 3</calc>", continuation=tagged_tool_value)
    scorer = Scorer(load_rewards(settings.task), timeout_s=5, procs=0)
    done = await evaluation.greedy_episodes(settings, list(tasks(3)), tmp_path / "unused.log",
                                            episodes.load_episode(episodes.CALCULATOR), scorer, rollout)
    await scorer.aclose()
    assert [c.text for c in done.completions] == ["<answer>6</answer>"] * 3 and done.failures == 0
    assert [t[1]["text"] for t in done.turns] == ["6"] * 3
    assert rollout.returncode == 0  # stopped


def test_task_episode_is_checked_like_task_reward(tmp_path):
    with pytest.raises(SettingsError, match="process.mode"):
        Orchestrator(make_settings(**{"task.name": "calculator", "process.mode": "outcome"}), tasks=tasks(),
                     eval_set=list(tasks(4)), out_dir=tmp_path / "run", rollout=FakeRollout(),
                     trainer=FakeTrainer())
    with pytest.raises(SettingsError, match="task.episode"):
        build_settings({}, ["task.episode=not a spec"])
    settings = build_settings({}, ["task.episode=areal_aio.agents.calculator:calculate"])
    with pytest.raises(SettingsError, match="task.episode: .* not an async function"):
        episodes.load_episode(settings.task.episode)
    with pytest.raises(SettingsError, match="task.episode: cannot import 'no_such_module'"):
        episodes.load_episode("no_such_module:episode")
    assert episodes.episode_spec(build_settings({}, ["task.name=calculator"])) == episodes.CALCULATOR
    assert episodes.episode_spec(build_settings({}, [])) == ""
    assert episodes.load_episode(episodes.CALCULATOR).__name__ == "episode"


async def test_a_turn_before_the_first_reply_is_refused(tmp_path):
    async def early(task, model):
        model.add_turn("tool", "x")

    summary = await orchestrator(tmp_path, make_settings("sync", **{"run.max_steps": 1}),
                                 tasks=tasks(8), episode=early).run()
    # 8 tasks x 2, every episode fails before a reply: each group has nothing to train
    assert summary["episode_failures"] == 16 and summary["steps"] == 0
    assert summary["samples_dropped_episode"] == 16


# ---------------------------------------------------------------- real workers


@pytest.mark.slow
async def test_episodes_train_on_the_real_workers(tmp_path):
    """tiny-random in both subprocesses: every episode has a tool turn between two replies, in
    areal mode (interrupting updates); the trained tokens are exactly the replies'."""
    settings = build_settings({}, ["model.path=embedded:tiny-random", "run.max_steps=3", "run.progress=false",
                                   "rollout.group_size=2", "trainer.batch_size=4", "rollout.max_new_tokens=6",
                                   "task.eval_size=2", "task.eval_every=3", "controller.reward_procs=0",
                                   "run.checkpoint_every=0"])
    orch = Orchestrator(settings, tasks=tasks(), episode=two_replies, out_dir=tmp_path / "run")
    summary = await asyncio.wait_for(orch.run(), 300)
    assert summary["steps"] == 3 and summary["episode_failures"] == 0, summary.get("error")
    trained = [r for r in rows(tmp_path / "run") if r["dropped"] is None and r["step"] is not None]
    assert len(trained) == 12
    for r in trained:
        assert [(t["role"], t["trained"]) for t in r["turns"]] == [("assistant", True), ("tool", False),
                                                                  ("assistant", True)]
        assert r["tokens"] == sum(t["tokens"] for t in r["turns"]) and r["turns"][1]["tokens"] > 0
    replies = sum(t["tokens"] for r in trained for t in r["turns"] if t["trained"])
    assert summary["trained_tokens"] == replies
