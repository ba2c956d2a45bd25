"""The groups in flight (areal_aio/control/groups.py): admitted, sent, scored, dropped, on their
own (a stub rollout side) and in runs against the fake workers."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from areal_aio import wire
from areal_aio.control import guidance
from areal_aio.control.groups import Groups
from areal_aio.control.replay import ReplayBuffer
from areal_aio.control.runlog import RunLog
from areal_aio.control.staleness import Admission
from areal_aio.control.stats import Counts, WorkerShare
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer
from areal_aio.rewards.process import StepCredit
from areal_aio.rewards.scoring import Scorer, load_rewards
from areal_aio.seeds import sample_seed
from tests.conftest import make_settings, orchestrator, tasks


class Harness:
    """A Groups with the rollout side stubbed: what it sends, aborts and starts is recorded."""

    def __init__(self, folder, mode: str = "areal", next_group: int = 0, **sets) -> None:
        self.settings = make_settings(mode, **sets)
        self.sent: list[list[wire.Generate]] = []
        self.aborted: list[str] = []
        self.spawned: list[asyncio.Task] = []
        self.ready = asyncio.Event()
        self.admission = Admission(self.settings.trainer.batch_size, self.settings.eta)
        self.counts = Counts()
        self.replay = ReplayBuffer()
        self.log = RunLog(folder, "", append=False)
        self.share = WorkerShare("cpu")
        self.groups = Groups(self.settings, self.admission, self.counts, self.replay, self.ready,
                             process=StepCredit(self.settings, self.send, self.judge), episode=None,
                             send=self.send, send_one=self.send_one, spawn=self.spawn,
                             abort=self.aborted.append, guide=guidance.load_guide(self.settings),
                             next_group=next_group)
        self.scorer = Scorer(load_rewards(self.settings.task), timeout_s=1.0, procs=0)
        self.groups.attach(self.log, self.scorer)

    async def send(self, msgs: list[wire.Generate]) -> None:
        self.sent.append(list(msgs))

    async def send_one(self, msg: wire.Generate) -> None:
        self.sent.append([msg])

    async def judge(self, task, text):
        return await self.scorer.score(task, text)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.spawned.append(task)
        return task

    def answer(self, request_id: str, text: str = "", finish: str = "stop") -> None:
        """The Completion of `request_id`, handed in as the rollout reader would."""
        self.groups.completed(wire.Completion(request_id, [1], [2, 3], [-0.1, -0.1], [0, 0], text, finish, 0, 0.01),
                              self.share)

    async def rows(self) -> list[dict]:
        await self.log.settle()
        return [orjson.loads(x) for x in (self.log.folder / "samples.jsonl").read_bytes().splitlines()]


async def test_a_group_is_sent_whole_and_enters_the_replay_buffer_once_every_sample_is_scored(tmp_path):
    h = Harness(tmp_path)
    task = next(tasks(1))
    await h.groups.admit(3, task)
    [msgs] = h.sent  # one write for the whole group
    assert [m.request_id for m in msgs] == ["g3.0", "g3.1"] and h.admission.live == 2
    assert [m.seed for m in msgs] == [sample_seed(h.settings.run.seed, 3, i, 0) for i in range(2)]
    assert set(h.groups.requests) == {"g3.0", "g3.1"} and list(h.groups.pending) == [3]
    h.answer("g3.0", f"<answer>{task.answer}</answer>")
    assert not h.replay and not h.ready.is_set()  # half a group is not trainable
    h.answer("g3.1", "<answer>-1</answer>")
    [group] = h.replay.groups()
    assert group.group_id == 3 and [s.score.passed for s in group.samples] == [True, False]
    assert h.ready.is_set() and not h.groups.requests and not h.groups.pending
    assert h.counts.generated == 2 and h.share.gen_tokens == 4


async def test_an_abort_answer_restarts_the_sample_then_drops_the_group_past_max_retries(tmp_path):
    h = Harness(tmp_path, **{"controller.on_interrupt": "restart", "controller.max_retries": 1})
    await h.groups.admit(0, next(tasks(1)))
    h.answer("g0.0", finish="abort")
    await asyncio.gather(*h.spawned)
    assert [m.request_id for m in h.sent[-1]] == ["g0.0~1"] and h.counts.restarts == 1
    assert h.sent[-1][0].seed == sample_seed(h.settings.run.seed, 0, 0, 1)  # a retry draws anew
    h.answer("g0.0~1", finish="abort")  # past max_retries: the whole group is given up
    assert h.aborted == ["g0.1"] and not h.groups.pending and not h.groups.requests
    assert h.admission.live == 0 and h.counts.dropped_interrupt == 2  # its slots are back
    assert [r["dropped"] for r in await h.rows()] == ["interrupt", "interrupt"]
    h.answer("g0.1", "<answer>0</answer>")  # the aborted request's late answer changes nothing
    assert not h.replay and h.counts.generated == 0


async def test_dynamic_sampling_skips_uniform_groups_up_to_max_in_a_row(tmp_path):
    h = Harness(tmp_path, **{"controller.dynamic_sampling": True, "controller.max_uniform_in_a_row": 1})
    for gid, task in enumerate(tasks(3)):
        await h.groups.admit(gid, task)
        for i in range(2):  # every reply right: equal rewards
            h.answer(f"g{gid}.{i}", f"<answer>{task.answer}</answer>")
    assert [g.group_id for g in h.replay.groups()] == [1]  # skipped, trained after one skip, skipped
    assert h.counts.skipped_uniform == 4 and h.admission.live == 2
    assert {r["group"] for r in await h.rows() if r["dropped"] == "uniform"} == {0, 2}


async def test_open_groups_and_ids_are_what_a_resume_admits_again(tmp_path):
    h = Harness(tmp_path, next_group=7)
    assert h.groups.peek_id() == h.groups.peek_id() == 7  # peeking uses no id
    first, second = tasks(2)
    await h.groups.admit(h.groups.next_id(), first)
    await h.groups.admit(h.groups.next_id(), second)
    for i in range(2):
        h.answer(f"g7.{i}", "<answer>-1</answer>")
    assert h.groups.peek_id() == 9 and h.groups.open_tasks() == {7: first, 8: second}  # replay and pending
    h.groups.drop_group(h.groups.pending[8], "interrupt")
    assert h.groups.open_tasks() == {7: first}


async def test_after_close_completions_are_ignored_and_episodes_cancelled(tmp_path):
    h = Harness(tmp_path)
    await h.groups.admit(0, next(tasks(1)))
    hanging = asyncio.create_task(asyncio.sleep(60))
    h.groups.pending[0].episodes.append(hanging)
    h.groups.close()
    h.answer("g0.0", "<answer>0</answer>")
    assert not h.replay and h.counts.generated == 0 and "g0.0" not in h.groups.requests
    with pytest.raises(asyncio.CancelledError):
        await hanging


async def settled(h: Harness) -> None:
    """Until the tasks the harness started (and the ones they start) are done."""
    while not all(t.done() for t in h.spawned):
        await asyncio.gather(*h.spawned)


async def test_a_guide_adds_a_tagged_copy_of_a_correct_untagged_reply_tokenized_by_the_rollout_side(tmp_path):
    h = Harness(tmp_path, **{"task.guide": "tag"})
    task = next(tasks(1))
    await h.groups.admit(0, task)
    h.answer("g0.0", f"It is {task.answer}.")
    h.answer("g0.1", "<answer>-1</answer>")
    await asyncio.sleep(0)
    [ask] = h.sent[-1]  # the written reply, to be tokenized after the prompt: no room to generate
    assert ask.request_id == "g0.w2" and ask.prefix == f"It is {task.answer}.\n<answer>{task.answer}</answer>"
    assert ask.max_context == 1 and not h.replay and list(h.groups.pending) == [0]  # pending until it is in
    h.groups.completed(wire.Completion("g0.w2", [1, 7, 8], [], [], [], "", "length", 0, 0.0), h.share)
    await settled(h)
    [group] = h.replay.groups()
    guided = group.samples[-1]
    assert len(group.samples) == 3 and guided.written == 3 and guided.completion.completion_ids == [7, 8, 3]
    assert guided.completion.prompt_ids == [1] and guided.score.strict and guided.score.reward == pytest.approx(1.2)
    assert h.admission.live == 2 and h.counts.guided == 1 and h.counts.generated == 2  # no slot, not generated
    assert h.share.requests == 0


@pytest.mark.parametrize("replies", [("<answer>{a}</answer>", "{a}"), ("-1", "-2")])
async def test_a_tag_guide_writes_nothing_where_a_correct_reply_is_tagged_or_none_is_correct(tmp_path, replies):
    h = Harness(tmp_path, **{"task.guide": "tag"})
    task = next(tasks(1))
    await h.groups.admit(0, task)
    for i, text in enumerate(replies):
        h.answer(f"g0.{i}", text.format(a=task.answer))
    await settled(h)
    [group] = h.replay.groups()
    assert len(group.samples) == 2 and h.counts.guided == 0 and len(h.sent) == 1


async def test_a_reference_guide_gives_a_group_that_failed_the_worked_answer(tmp_path):
    h = Harness(tmp_path, **{"task.guide": "reference"})
    task = next(tasks(1))
    await h.groups.admit(0, task)
    h.answer("g0.0", "<answer>-1</answer>")
    h.answer("g0.1", "<answer>-2</answer>", finish="length")
    await asyncio.sleep(0)
    [ask] = h.sent[-1]
    assert ask.prefix == f"{task.prompt.split('Calculate ')[1].split('.')[0]} = {task.answer}\n<answer>{task.answer}</answer>"
    h.groups.completed(wire.Completion("g0.w2", [1, 5], [], [], [], "", "length", 0, 0.0), h.share)
    await settled(h)
    [group] = h.replay.groups()
    assert [s.score.passed for s in group.samples] == [False, False, True] and group.samples[-1].written == 2


async def guiding(tmp_path) -> Harness:
    """A tag-guided group 0 of one correct untagged reply and one wrong one, its guided member
    sent to be tokenized and not yet answered."""
    h = Harness(tmp_path, **{"task.guide": "tag"})
    task = next(tasks(1))
    await h.groups.admit(0, task)
    h.answer("g0.0", task.answer)
    h.answer("g0.1", "-1")
    await asyncio.sleep(0)
    return h


async def test_a_guided_member_whose_ids_do_not_extend_the_prompt_is_left_out(tmp_path):
    """The written reply re-tokenized differently at the seam (its ids do not begin with the
    prompt's as sampled): no member, the group trains as sampled."""
    h = await guiding(tmp_path)
    h.groups.completed(wire.Completion("g0.w2", [9, 7], [], [], [], "", "length", 0, 0.0), h.share)
    await settled(h)
    [group] = h.replay.groups()
    assert len(group.samples) == 2 and h.counts.guided == 0


async def test_a_dropped_or_closed_group_waits_for_no_guided_member(tmp_path):
    h = await guiding(tmp_path)
    assert h.sent[-1][0].request_id == "g0.w2"
    h.groups.close()
    await asyncio.gather(*h.spawned, return_exceptions=True)
    assert all(t.done() for t in h.spawned) and not h.replay


# ---------------------------------------------------------------- in runs against the fake workers


async def test_restart_mode_resubmits_then_drops(tmp_path):
    """An interrupted reply is sent again from scratch (request id ~1) once; interrupted again
    past controller.max_retries = 1, its group is dropped; what is trained came from one version."""
    rollout = FakeRollout(tokens=8, token_delay_s=0.002)
    settings = make_settings("areal", **{"controller.on_interrupt": "restart", "controller.max_retries": 1,
                                         "run.max_steps": 5})
    trainer = FakeTrainer(step_delay_s=0.001)
    summary = await orchestrator(tmp_path, settings, rollout=rollout, trainer=trainer).run()
    sent = [rid for _, what, rid in rollout.log if what == "generate" and rid.startswith("g")]
    assert summary["steps"] == 5
    assert any(rid.endswith("~1") for rid in sent)  # resubmitted
    assert not any(rid.endswith("~2") for rid in sent)  # never past the limit
    assert summary["samples_dropped_interrupt"] > 0  # interrupted again: dropped
    assert all(len(set(s.versions)) == 1 for b in trainer.batches for s in b.samples)


async def test_failing_reward_scores_zero_and_is_counted(tmp_path):
    def reward(task, text):
        if task.id.endswith("3"):
            raise ValueError("bad scorer")
        return 1.0

    summary = await orchestrator(tmp_path, make_settings(), reward=reward).run()
    assert summary["reward_failures"] > 0 and summary["steps"] == 6
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    failed = [r for r in rows if r.get("reward_failed")]
    assert failed and all(r["reward"] == 0.0 for r in failed)


class HalfUniform(FakeRollout):
    """Groups of an even first term: every sample right (equal rewards); odd: only sample 0 right."""

    def answer(self, msg, version):
        a, b = (int(x) for x in msg.prompt.split("Calculate ")[1].split(".")[0].split(" + "))
        right = a % 2 == 0 or msg.request_id.split(".")[1].startswith("0")
        return f"<answer>{a + b if right else -1}</answer>"


@pytest.mark.parametrize("mode", ["sync", "areal"])
async def test_dynamic_sampling_trains_only_groups_whose_rewards_differ(tmp_path, mode):
    trainer = FakeTrainer()
    settings = make_settings(mode, **{"controller.dynamic_sampling": True, "run.max_steps": 4})
    summary = await orchestrator(tmp_path, settings, rollout=HalfUniform(), trainer=trainer).run()
    assert summary["steps"] == 4 and summary["dynamic_sampling"]
    groups = {}
    for b in trainer.batches:
        for s in b.samples:
            groups.setdefault(s.group, []).append(s.reward)
    assert len(groups) == 4 * 2 and all(max(r) > min(r) for r in groups.values())  # B/G = 2 groups a step
    skipped = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()
               if b'"uniform"' in x]
    assert summary["samples_skipped_uniform"] == len(skipped) > 0
    assert all(r["pass"] for r in skipped) and summary["max_staleness_trained"] <= (0 if mode == "sync" else 4)

    off = await orchestrator(tmp_path / "off", make_settings(mode, **{"run.max_steps": 4}), rollout=HalfUniform()).run()
    assert off["samples_skipped_uniform"] == 0 and off["samples_accepted"] == 4 * 4


async def test_dynamic_sampling_trains_a_uniform_group_after_max_in_a_row(tmp_path):
    """A task whose groups never differ (the fake's untagged replies all score 0) still makes
    steps: every max_uniform_in_a_row + 1-th group is trained."""
    settings = make_settings("sync", **{"controller.dynamic_sampling": True, "controller.max_uniform_in_a_row": 2,
                                        "run.max_steps": 3})
    summary = await asyncio.wait_for(orchestrator(tmp_path, settings).run(), 30)
    trained_groups = summary["samples_accepted"] // 2
    skipped_groups = summary["samples_skipped_uniform"] // 2
    assert summary["steps"] == 3 and trained_groups == 6
    assert 2 * (trained_groups - 1) <= skipped_groups <= 2 * (trained_groups + 1)


def test_dynamic_sampling_needs_group_advantages():
    with pytest.raises(Exception, match="controller.dynamic_sampling: needs trainer.advantage"):
        make_settings(**{"controller.dynamic_sampling": True, "trainer.advantage": "batch"})
    assert make_settings(**{"controller.dynamic_sampling": True, "trainer.advantage": "drgrpo"}).controller.dynamic_sampling


async def test_overlong_replies_are_shaped_in_training_and_never_in_eval(tmp_path):
    """Replies of 6 tokens with max_new_tokens 8 and a buffer of 4: 2 tokens into the buffer,
    each training reward 0.5 lower than the same run's unshaped one; eval rows unchanged."""
    runs = {}
    for name, sets in (("off", {}), ("on", {"task.overlong_buffer": 4})):
        settings = make_settings("sync", **{"run.max_steps": 2, "rollout.max_new_tokens": 8, **sets})
        summary = await orchestrator(tmp_path / name, settings, rollout=FakeRollout(tokens=6)).run()
        assert summary["steps"] == 2
        runs[name] = [orjson.loads(x) for x in (tmp_path / name / "run" / "samples.jsonl").read_bytes().splitlines()]
    train = {n: {r["request_id"]: r["reward"] for r in rows if r["kind"] == "train"} for n, rows in runs.items()}
    assert train["on"].keys() == train["off"].keys() and len(train["on"]) == 8
    assert all(train["on"][k] == pytest.approx(train["off"][k] - 0.5) for k in train["on"])
    assert all(r["rewards"] == {"overlong": -0.5} for r in runs["on"] if r["kind"] == "train")
    evals = {n: [r["reward"] for r in rows if r["kind"] == "eval"] for n, rows in runs.items()}
    assert evals["on"] == evals["off"] and len(evals["on"]) == 8


async def test_a_guided_run_trains_the_written_members_and_records_them_apart(tmp_path):
    """The fake policy answers correctly untagged at versions 2-3: the tag guide writes tagged
    copies, which train in their groups (written tokens) and are recorded, counted and kept out
    of the admission rule and the step's rates."""
    trainer = FakeTrainer()
    summary = await orchestrator(tmp_path, make_settings("sync", **{"task.guide": "tag", "run.max_steps": 6}),
                                 trainer=trainer).run()
    written = [s for b in trainer.batches for s in b.samples if s.written]
    assert summary["steps"] == 6 and summary["samples_guided"] == len(written) > 0
    assert all(s.written == len(s.completion_ids) and s.reward == pytest.approx(1.2) for s in written)
    assert summary["samples_accepted"] == 6 * 4  # B sampled replies a step, the guided ones besides
    rows = [orjson.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()]
    assert sum(1 for r in rows if r.get("guided")) == len(written)
    steps = [orjson.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_bytes().splitlines()]
    assert sum(r["guided"] for r in steps) == len(written) and all(r["strict_rate"] == 0 for r in steps[:3])
