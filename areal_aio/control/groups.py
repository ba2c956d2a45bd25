"""The groups in flight: from admission to the replay buffer, what happens to each sample.

    dispatch --admit(gid, task)--> PendingGroup: G Samples (g<gid>.<i>), in `pending`
        --generate--> one Generate each (seed: run.seed, group, index, retries), all written
                      together; each in `requests` until its Completion comes back
        (an episode run: G episode tasks instead, `_play`; each reply one Generate, `_reply`)
    rollout reader --Completion--> completed:
        a dropped group's, or any after `close` --> ignored
        an episode's reply --> handed to the episode awaiting it
        abort answer (on_interrupt = restart) --> the same sample again under a new id
            (g<gid>.<i>~<retries>); past controller.max_retries the whole group is dropped
        whole reply --> score (the reward pool, inline when it can be; process.mode:
            continuations per step prefix, awaited while the other groups go on) --> scored
    scored: task.overlong_buffer shapes a single reply's reward; once every sample of a group is
        scored, dynamic sampling skips a group whose rewards are all equal (dropped "uniform"),
        any other enters the ReplayBuffer and wakes the train loop (`ready`)
    drop_group / drop: the admission slots are given back (staleness.Admission.drop), the drop
        is counted (stats.Counts.dropped) and each sample gets its samples.jsonl row

A group is kept, dropped and trained whole: GRPO normalizes within it. An episode (agents/episodes.py)
is one sample: it is scored when the user's function returns; one that raises, times out,
passes a bound or ends without a reply scores 0, is counted and keeps its place in its group
(one without a reply has no token: it trains nothing, its 0 counts in the group's advantages);
a group none of whose episodes replied has nothing to train and is dropped ("episode");
FAILING_GROUPS_TO_STOP groups in a row whose every episode failed end the run
(EpisodesFailing); a dropped group or a stop cancels an episode (its reply in flight is
aborted). The
open groups (`open_tasks`: pending or waiting in the replay buffer) and the next group id are
what a checkpoint keeps of this (keeping.RunState): a resume admits those groups again under the
same ids, so their sampling seeds are the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

from areal_aio import wire
from areal_aio.agents import episodes
from areal_aio.control import guidance, stats
from areal_aio.control.awaited import Awaited
from areal_aio.control.replay import Group, ReplayBuffer
from areal_aio.control.staleness import Admission
from areal_aio.rewards.scoring import Score, Scorer, overlong_penalty, shaped
from areal_aio.seeds import derive, sample_seed
from areal_aio.settings import Settings
from areal_aio.tasks.task import Task

if TYPE_CHECKING:
    from areal_aio.control.runlog import RunLog
    from areal_aio.rewards.process import StepCredit

FAILING_GROUPS_TO_STOP = 16
"""Groups in a row whose every episode failed that end the run (EpisodesFailing). Their rewards
are all 0, so they teach nothing: a run of them is a broken episode function, not a hard task.
It is stopped within milliseconds when the episode fails before its first reply (such a group
is dropped and the next admitted at once), while an episode that works and fails a share p of
the time ends a run this way with odds p^(group_size x 16) per stretch: 2e-10 for p = 0.5 and
two samples a group (the default has eight)."""


class EpisodesFailing(stats.RunFailed):
    """Every episode of FAILING_GROUPS_TO_STOP groups in a row failed: the run ends (its
    __cause__ is the last failure, whose traceback error.log keeps)."""


@dataclass(slots=True)
class Sample:
    """One admitted rollout: its task, its group, and (once back) its completion and score."""

    request_id: str
    group_id: int
    task: Task
    index: int = 0  # position in its group (with group_id and retries: the sampling seed)
    retries: int = 0
    completion: wire.Completion | None = None
    score: Score | None = None
    process: dict | None = None  # process.mode: the process reward's record of this reply
    model: episodes.Model | None = None  # an episode's: its transcript (the sequence, its turns)
    waiting: asyncio.Future | None = None  # an episode's reply in flight: its Completion
    failure: str | None = None  # an episode's failure (episodes.why_failed); None: it did not fail
    no_token_version: int = 0  # without a token (an episode that never replied): its group's oldest
    written: int = 0  # a guided member (task.guide): its completion's tokens, all written, none sampled

    @property
    def oldest_version(self) -> int:
        """Of its oldest token; a sample without one is as old as its group (it trains nothing)."""
        return self.completion.oldest_version if self.completion.versions else self.no_token_version

    @property
    def loss_mask(self) -> list[int] | None:
        """An episode's mask over completion_ids (its turns 0); None: every token trained."""
        return self.model.transcript.mask if self.model is not None else None

    @property
    def turns(self) -> list[dict] | None:
        return self.model.transcript.turns if self.model is not None else None


@dataclass(slots=True)
class PendingGroup:
    task: Task
    samples: list[Sample]
    scored: int = 0
    dropped: bool = False
    episodes: list[asyncio.Task] = dataclasses.field(default_factory=list)  # its samples' episodes
    guided: list[Sample] = dataclasses.field(default_factory=list)  # members a guide wrote (task.guide)

    @property
    def whole(self) -> bool:
        """Every sample is scored and the group was not given up: it leaves `pending` now."""
        return self.scored == len(self.samples) and not self.dropped


class Groups:
    """Owns the admitted groups until they enter the replay buffer or are dropped: `pending`
    (by group id), `requests` (training requests in flight, by request id), the group ids, and
    dynamic sampling's run of skipped groups.

    Given what it changes: the admission rule (slots taken and given back), the counters, the
    replay buffer and the event that wakes the train loop; `process` (the process reward),
    `episode` (the user's function, or None: one reply per sample). Given how to reach the
    rollout workers, all from the controller: `send(msgs)` writes Generates together and
    `send_one(msg)` one (both counted busy), `abort(request_id)` drops a request from code that
    cannot wait; `spawn(coro, name)` starts a task of the run. The run log and the scorer come
    once the run has opened them (`attach`)."""

    def __init__(self, settings: Settings, admission: Admission, counts: stats.Counts, replay: ReplayBuffer,
                 ready: asyncio.Event, *, process: StepCredit, episode: episodes.Episode | None,
                 send: Callable[[list[wire.Generate]], Awaitable[None]],
                 send_one: Callable[[wire.Generate], Awaitable[None]],
                 spawn: Callable[[Coroutine, str], asyncio.Task], abort: Callable[[str], None],
                 guide: guidance.Guide | None = None, next_group: int = 0) -> None:
        self.settings = settings
        self.size = settings.rollout.group_size
        self.admission = admission
        self.counts = counts
        self.replay = replay
        self._ready = ready
        self._process = process
        self.episode = episode
        self.guide = guide
        self._written = Awaited()  # guided members' texts being tokenized
        self._send = send
        self._send_one = send_one
        self._spawn = spawn
        self._abort = abort
        self.pending: dict[int, PendingGroup] = {}
        self.requests: dict[str, Sample] = {}
        self.closing = False  # the train loop is done: in-flight rollouts are abandoned
        self._ids = itertools.count(next_group)
        self._uniform_in_a_row = 0  # dynamic sampling: groups skipped since the last one trained
        self._failing_in_a_row = 0  # groups whose every episode failed, since one that did not
        self.log: RunLog | None = None  # set by attach
        self.scorer: Scorer | None = None

    def attach(self, log: RunLog, scorer: Scorer) -> None:
        """The run's log and scorer, once open (before the first group is admitted)."""
        self.log, self.scorer = log, scorer

    # ------------------------------------------------------------------ admitted

    def next_id(self) -> int:
        return next(self._ids)

    def peek_id(self) -> int:
        """The group id the next admitted group gets (peeked without using it)."""
        gid = next(self._ids)
        self._ids = itertools.count(gid)
        return gid

    async def admit(self, gid: int, task: Task) -> None:
        """Group `gid` of `task`: its G admission slots taken, its samples sent (or its episodes
        started), pending until scored."""
        samples = [Sample(f"g{gid}.{i}", gid, task, i) for i in range(self.size)]
        group = self.pending[gid] = PendingGroup(task, samples)
        self.admission.admit(self.size)
        if self.episode is None:
            await self.generate(*samples)
            return
        for sample in samples:
            group.episodes.append(self._spawn(self._play(sample, group), f"episode-{sample.request_id}"))

    async def generate(self, *samples: Sample) -> None:
        """One Generate per sample, written together (one pipe drain for a whole group)."""
        r = self.settings.rollout
        msgs = []
        for sample in samples:
            self.requests[sample.request_id] = sample
            seed = sample_seed(self.settings.run.seed, sample.group_id, sample.index, sample.retries)
            msgs.append(wire.Generate(sample.request_id, sample.task.text, r.max_new_tokens,
                                      r.temperature, r.top_p, seed, sample.task.messages))
        await self._send(msgs)

    def completed(self, msg: wire.Completion, share: stats.WorkerShare) -> None:
        """A training request's Completion (what evals and continuations left), from `share`'s worker."""
        if self._written.deliver(msg):
            return
        sample = self.requests.pop(msg.request_id, None)
        if sample is None:
            return  # an abort answer for a sample already given up
        group = self.pending.get(sample.group_id)
        if group is None or group.dropped or self.closing:
            return
        if sample.model is not None:  # an episode's reply: its episode takes it from here
            if msg.finish != "abort":
                self.counts.replied(msg)
                share.gen_tokens += len(msg.completion_ids)
            if sample.waiting is not None and not sample.waiting.done():
                sample.waiting.set_result(msg)
            return
        if msg.finish == "abort":
            if self._restart(sample, group):
                self._spawn(self.generate(sample), f"restart-{sample.request_id}")
            return
        sample.completion = msg
        self.counts.completed(msg)
        share.gen_tokens += len(msg.completion_ids)
        if self.scorer.inline and not self._process.enabled:
            self.scored(sample, group, self.scorer.score_inline(sample.task, msg.text))
        else:
            self._spawn(self.score(sample, group), f"score-{msg.request_id}")

    def close(self) -> None:
        """No more training rollouts: Completions from now on are ignored, every episode is
        cancelled (the caller aborts what is still in `requests`)."""
        self.closing = True
        self._written.cancel()
        for group in self.pending.values():
            for task in group.episodes:
                task.cancel()

    def _restart(self, sample: Sample, group: PendingGroup) -> bool:
        """on_interrupt = restart, after an abort answer: True, the sample is to be sent again
        (its new request id set); False, past the retry limit, its group is dropped."""
        if sample.retries >= self.settings.controller.max_retries:
            self.drop_group(group, "interrupt")
            return False
        sample.retries += 1
        self.counts.restarts += 1
        sample.request_id = f"{sample.request_id.split('~')[0]}~{sample.retries}"
        return True

    def open_tasks(self) -> dict[int, Task]:
        """The groups admitted and not trained (pending or in the replay buffer): group id -> task."""
        open_groups = {gid: g.task for gid, g in self.pending.items() if not g.dropped}
        open_groups.update({g.group_id: g.task for g in self.replay.groups()})
        return open_groups

    # ------------------------------------------------------------------ episodes

    async def _play(self, sample: Sample, group: PendingGroup) -> None:
        """One sample as a multi-turn episode (agents/episodes.py): the user's function under
        task.episode_timeout_s, then its score. One that raises, times out, passes a bound or
        ends without a reply scores 0 and is counted; a dropped group or a stop cancels it (its
        reply in flight is aborted). Once its group is whole, a run of groups that only failed
        ends the run (EpisodesFailing)."""
        bounds = episodes.Bounds.of(self.settings)
        model = sample.model = episodes.Model(bounds, lambda ask: self._reply(sample, group, ask))
        score, failure = await episodes.play(self.episode, sample.task, model, bounds.timeout_s)
        if failure is not None:
            sample.failure = episodes.why_failed(failure)
            self.counts.episode_failures += 1
            self.log.events.info("episode_failed", request_id=sample.request_id, replies=model.replies,
                                 error=f"{type(failure).__name__}: {failure}"[:500])
        sample.completion = model.transcript.completion()
        if sample.completion is not None:
            self.counts.generated += 1
            if score is None:
                score = await self.scorer.score(sample.task, sample.completion.text)
        self.scored(sample, group, score)
        if group.whole:
            self._count_failing(group, failure)

    def _count_failing(self, group: PendingGroup, last: Exception | None) -> None:
        """A whole group's episodes are in: count a group whose every episode failed, and end
        the run at FAILING_GROUPS_TO_STOP in a row (`last`: the failure that completed it)."""
        if any(s.failure is None for s in group.samples):
            self._failing_in_a_row = 0
            return
        self._failing_in_a_row += 1
        if self._failing_in_a_row >= FAILING_GROUPS_TO_STOP:
            raise EpisodesFailing(
                f"every episode failed, {FAILING_GROUPS_TO_STOP} groups in a row: "
                f"{episodes.name_of(self.episode)} {group.samples[-1].failure}") from last

    async def _reply(self, sample: Sample, group: PendingGroup, ask: episodes.ReplyRequest) -> wire.Completion:
        """One reply of an episode: a Generate, its Completion. An abort answer (on_interrupt =
        restart) resubmits the reply, or past controller.max_retries drops the group."""
        r = self.settings.rollout
        loop = asyncio.get_running_loop()
        turn = sample.model.replies
        base = f"g{sample.group_id}.{sample.index}.r{turn}"
        while True:
            rid = base if not sample.retries else f"{base}~{sample.retries}"
            seed = sample_seed(self.settings.run.seed, sample.group_id, sample.index, sample.retries)
            if turn:  # each reply its own draws, the same on a resume
                seed = derive(seed, turn)
            sample.request_id, sample.waiting = rid, loop.create_future()
            self.requests[rid] = sample
            await self._send_one(ask.generate(rid, sample.task, r.temperature, r.top_p, seed))
            try:
                msg = await sample.waiting
            except asyncio.CancelledError:  # a timeout or a dropped group: the reply is not wanted
                if not self.closing and self.requests.pop(rid, None) is not None:
                    self._abort(rid)
                raise
            if msg.finish != "abort":
                return msg
            if sample.retries >= self.settings.controller.max_retries:
                self.drop_group(group, "interrupt")
                raise asyncio.CancelledError  # the group is given up: this episode ends with it
            sample.retries += 1
            self.counts.restarts += 1

    # ------------------------------------------------------------------ scored

    async def score(self, sample: Sample, group: PendingGroup) -> None:
        """A whole reply's reward (and, with process.mode on, its step credit), then `scored`."""
        score = await self.scorer.score(sample.task, sample.completion.text)
        if self._process.enabled:  # may await continuations: this group waits, the others go on
            scored = await self._process.score(sample.task, sample.completion.text, score,
                                               group=sample.group_id, index=sample.index,
                                               retry=sample.retries)
            if scored is None:
                return  # the run stopped while its continuations were out
            score, sample.process = scored
        self.scored(sample, group, score)

    def scored(self, sample: Sample, group: PendingGroup, score: Score) -> None:
        """A sample's reward is in (shaped by task.overlong_buffer for a single reply); a group
        whose every sample is scored enters the replay buffer."""
        t = self.settings.task
        if t.overlong_buffer and sample.model is None and sample.completion is not None:
            score = shaped(score, overlong_penalty(len(sample.completion.completion_ids),
                                                   self.settings.rollout.max_new_tokens,
                                                   t.overlong_buffer, t.overlong_penalty))
        sample.score = score
        self.counts.scored(score)
        group.scored += 1
        if group.whole:
            if not _fill_no_replies(group.samples):
                del self.pending[sample.group_id]
                self.drop(group.samples, "episode")  # no episode replied: nothing to train
                return
            if self.guide is not None and self.episode is None:
                self._spawn(self._guided(sample.group_id, group), f"guide-g{sample.group_id}")
                return
            self._enter(sample.group_id, group)

    def _enter(self, gid: int, group: PendingGroup) -> None:
        """A whole group (its guided members in) leaves `pending`: dynamic sampling may skip it,
        else it enters the replay buffer."""
        del self.pending[gid]
        if self.skips([*group.samples, *group.guided]):
            self.drop(group.samples, "uniform")
            return
        self.replay.put(Group(gid, group.task, [*group.samples, *group.guided]))
        self._ready.set()

    # ------------------------------------------------------------------ guided

    async def _guided(self, gid: int, group: PendingGroup) -> None:
        """task.guide's members of a whole group (control/guidance.py): each text tokenized by a
        rollout worker, ended with the EOS its sampled replies ended with, and scored; then the
        group enters the buffer. A group none of whose replies ended with an EOS gets none."""
        sampled = group.samples
        texts = guidance.texts(self.guide, group.task, [s.completion.text for s in sampled],
                               [s.score.passed for s in sampled])
        eos = next((s.completion.completion_ids[-1] for s in sampled
                    if s.completion.finish == "stop" and s.completion.completion_ids), None)
        if texts and eos is not None:
            for k, text in enumerate(texts):
                member = await self._write(gid, group, len(sampled) + k, text, eos)
                if member is None or group.dropped or self.closing:
                    continue
                member.score = await self.scorer.score(group.task, text)
                self.counts.reward_failures += member.score.failed
                group.guided.append(member)
                self.counts.guided += 1
        if not group.dropped and not self.closing and gid in self.pending:
            self._enter(gid, group)

    async def _write(self, gid: int, group: PendingGroup, index: int, text: str, eos: int) -> Sample | None:
        """A guided member of group `gid`: `text` tokenized after the group's prompt by a rollout
        worker (a Generate with no room to generate: its Completion holds the ids and nothing
        sampled); None where the ids do not begin with the prompt's as they were sampled."""
        rid = f"g{gid}.w{index}"
        future = self._written.expect(rid)
        await self._send_one(wire.Generate(rid, group.task.text, 1, 0.0, 1.0, None, group.task.messages,
                                           prefix=text, max_context=1))
        try:
            msg = await future
        finally:
            self._written.forget(rid)
        prompt = group.samples[0].completion.prompt_ids
        if msg.prompt_ids[:len(prompt)] != prompt or len(msg.prompt_ids) == len(prompt):
            return None
        ids = [*msg.prompt_ids[len(prompt):], eos]
        oldest = min(s.oldest_version for s in group.samples)
        completion = wire.Completion(rid, list(prompt), ids, [0.0] * len(ids), [oldest] * len(ids), text, "stop",
                                     0, 0.0)
        return Sample(rid, gid, group.task, index, completion=completion, written=len(ids))

    def skips(self, samples: list[Sample]) -> bool:
        """Dynamic sampling (controller.dynamic_sampling): a whole group whose rewards are all
        equal teaches nothing (zero advantage) and is not trained, unless max_uniform_in_a_row
        such groups were skipped just before it."""
        c = self.settings.controller
        if not c.dynamic_sampling:
            return False
        if stats.has_spread([s.score.reward for s in samples]) or self._uniform_in_a_row >= c.max_uniform_in_a_row:
            self._uniform_in_a_row = 0
            return False
        self._uniform_in_a_row += 1
        return True

    # ------------------------------------------------------------------ dropped

    def drop_group(self, group: PendingGroup, why: str) -> None:
        """Give a whole pending group up: its requests aborted, its other episodes cancelled."""
        group.dropped = True
        self.pending.pop(group.samples[0].group_id, None)  # a stream that ends can still end the run
        self.drop(group.samples, why)
        for other in group.samples:
            if self.requests.pop(other.request_id, None) is not None:
                self._abort(other.request_id)
        for task in group.episodes:
            if task is not asyncio.current_task():
                task.cancel()

    def drop(self, samples: list[Sample], why: str) -> None:
        """Give the admission slots back and record the drop (a guided member took no slot)."""
        admitted = sum(1 for s in samples if not s.written)
        self.admission.drop(admitted)
        self.counts.dropped(admitted, why)
        self.log.rows("samples", (stats.sample_row(s, dropped=why) for s in samples))


def _fill_no_replies(samples: list[Sample]) -> bool:
    """A whole group: each sample without a completion (an episode that never replied) gets an
    empty one after the group's prompt (episodes.no_reply), as old as the group's oldest token,
    so it trains nothing and counts in the group's advantages. False: no sample has a reply."""
    replied = [s for s in samples if s.completion is not None]
    if not replied:
        return False
    if len(replied) < len(samples):
        oldest = min(s.oldest_version for s in replied)
        for s in samples:
            if s.completion is None:
                s.completion = episodes.no_reply(s.request_id, replied[0].completion.prompt_ids)
                s.no_token_version = oldest
    return True
