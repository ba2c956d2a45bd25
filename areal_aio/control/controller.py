"""The controller: one asyncio event loop driving the rollout workers and a trainer worker.

    tasks (any iterable / async iterable)
        |
    [dispatch] --blocks on--> Admission (staleness.py): floor((live + G - 1) / B) <= version + eta
        |                      (live = ever admitted - dropped; never lowered by training)
        |  Generate x G (one group), or G [episode] tasks  ^ capacity event: commit, drop
        |  (each: Generate per model.reply, awaits it)    |
        v                                                 |
    rollout pipe(s) -> [rollout_reader] --Completion--> [score] (reward pool, timeout -> 0)
                             |  WeightsLoaded               |  process.mode: M continuations per step
                             |  continuation -------------->|  prefix, awaited (process_reward.py);
                             |    Completions               |  never trained, not admitted
                             v                              v group complete (all samples scored)
                        events.jsonl                  ReplayBuffer (oldest first)
                                                            | take(B/G groups): staleness
                                                            | measured HERE, > eta dropped
                                                            v
    [train_loop] (the one finite loop: max_steps / max_wall_s / threshold / stop())
        Train --> trainer pipe --> [trainer_reader] --Trained--> commit version = v+1
        (requests, replies and the step in flight: TrainerLink, trainer_link.py)
        --> UpdateWeights(v+1) to rollout --> capacity event --> eval every k steps
        --> keeping (Keeper, keeping.py), between steps: a new best eval's version -> best/;
            every run.checkpoint_every steps a checkpoint -> checkpoints/step-N
    [monitor]  loop lag, queue depths, progress line, row flushing

Episodes (task.episode, or the `episode` argument; control/episodes.py): a group's G samples
are G named tasks (_run_episode) in the TaskGroup, each running the user's episode function,
which sends one Generate per model.reply (_reply) and awaits its Completion (the reader hands it
over; an abort answer under on_interrupt = restart resubmits that reply, past max_retries the
group is dropped). Admission, replay and acceptance are unchanged; a sample is scored when its
episode returns, and its staleness is its oldest trained token's. A stop cancels every running
episode (_stop_generating; its reply in flight is aborted); a resume admits the open groups
again, so their episodes run again from the start. The held-out eval runs the same function
with greedy replies (_evaluate_episodes, evaluation.run_episodes; replies routed by Evals).

The rollout role is one RolloutPool however many workers it has (placement.py; a single
worker is a pool of one): it sends each group whole to its least-loaded worker, every
version to all of them, and merges their replies; nothing here assumes one rollout worker.
Admission and staleness are global: one clock, one rule, whichever worker a group ran on.
Each worker's requests, training tokens and idle fraction: the summary's rollout_workers_detail.

Who blocks on whom: dispatch waits for the baseline eval (version 0, the
rollout workers to themselves), then for capacity (version commits and drops
release it); train_loop waits for the replay buffer to hold a fresh batch and
then for the trainer (no Train is sent while a Save is out: a checkpoint's two
parts hold the same version); readers wait on their pipes. Only train_loop
ends the run: when it returns, the other tasks are cancelled. Shutdown, on
every path (normal end, threshold, max_wall_s, Ctrl-C, SIGTERM, a worker
failure): an interrupted run first finishes the evals it had in flight
(_finish_evals, bounded: EVAL_AT_STOP_TIMEOUT_S); while the rollout workers are
stopped, a trainer that is alive keeps the run (keeping.py: it finishes and
commits a step in flight, then writes model/, best/ and a final checkpoint);
then it is stopped too (asked, terminated, killed), the weight store folder is
removed and the summary written (its `ended` says how the run ended). A cancel
that arrives during the shutdown does not cut it short (_to_its_end). A worker
Error or EOF raises WorkerFailed in its reader, which cancels the TaskGroup and
takes the same shutdown path; so does RewardPoolBroken, raised by a score task
when the reward pool keeps breaking.

Resume (`resume=` a run folder): the controller state comes back from the
newest checkpoint (run_state / _restore here, the best eval and the resumes in
keeping.py), the trainer starts from its trainer part and publishes that
version, every rollout worker loads it; the groups admitted but not trained at
the checkpoint are dispatched again first (same group ids, tasks and sampling
seeds: the samples they lost in flight are counted as lost_in_flight), then
the task stream continues after the tasks it had handed out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_aio import wire
from areal_aio.control import episodes, evaluation, keeping, stats
from areal_aio.control.progress import Progress
from areal_aio.control.replay import Group, ReplayBuffer
from areal_aio.control.runlog import RunLog
from areal_aio.control.staleness import Admission, staleness
from areal_aio.control.stats import Busy, Counts
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet import placement
from areal_aio.fleet.client import WorkerClient, WorkerFailed
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.rewards import process as process_reward
from areal_aio.rewards.pool import RewardPoolBroken
from areal_aio.rewards.scoring import (
    Score,
    Scorer,
    load_rewards,
    overlong_penalty,
    shaped,
)
from areal_aio.seeds import derive, sample_seed
from areal_aio.settings import Settings, SettingsError
from areal_aio.store import checkpoint
from areal_aio.store.weights import WeightStore
from areal_aio.tasks.files import read_tasks
from areal_aio.tasks.sources import eval_tasks, training_tasks
from areal_aio.tasks.task import Task, task_stream

MONITOR_PERIOD_S = 0.05
"""Loop-lag probe period: a lag above this much is the loop being blocked."""
PROGRESS_PERIOD_S = 2.0
EVENT_QUEUE = 10_000
"""Events buffered per subscriber; a subscriber that falls further behind loses the oldest."""
UNIFORM_EPS = 1e-9
"""Rewards of a group closer than this are equal (dynamic sampling)."""
EVAL_AT_STOP_TIMEOUT_S = 60.0
"""How long an interrupted run waits for the evals it had in flight (training rollouts aborted,
the rollout workers answer only them): an in-run eval is greedy and short; one that takes longer
is lost rather than holding Ctrl-C for minutes."""


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

    @property
    def oldest_version(self) -> int:
        return self.completion.oldest_version

    @property
    def loss_mask(self) -> list[int] | None:
        """An episode's mask over completion_ids (its turns 0); None: every token trained."""
        return self.model.transcript.mask if self.model is not None else None

    @property
    def turns(self) -> list[dict] | None:
        return self.model.transcript.turns if self.model is not None else None

    @property
    def trained_tokens(self) -> int:
        mask = self.loss_mask
        return len(self.completion.completion_ids) if mask is None else sum(mask)


@dataclass(slots=True)
class PendingGroup:
    task: Task
    samples: list[Sample]
    scored: int = 0
    dropped: bool = False
    episodes: list[asyncio.Task] = dataclasses.field(default_factory=list)  # its samples' episodes


class Orchestrator:
    """Runs one training run inside the caller's event loop.

    `tasks`: any iterable or async iterable of Task (default: settings' task stream);
    `reward`: any sync or async callable (task, completion_text) -> float | Score, or a list of
    rewards.Reward (summed with their weights, each logged as reward/<name>); default: what
    task.reward names;
    `episode`: an `async def episode(task, model)` (areal_aio/control/episodes.py): each sample
    is a multi-turn episode; default: what task.episode names (none: one reply per task);
    `rollout` / `trainer`: WorkerClient instances (default: the real subprocesses);
    `resume`: a run folder (or one of its checkpoints) to continue; `settings` may differ from
    the checkpoint's only in checkpoint.RESUMABLE keys. A resumed run with its own `tasks`
    skips as many tasks as the run had taken from its source (give the same source).
    Cancel the task awaiting `run()` to stop: workers are shut down, nothing is left behind.
    """

    def __init__(self, settings: Settings, *, tasks: Iterable[Task] | AsyncIterable[Task] | None = None,
                 reward: Callable[..., Any] | None = None, eval_set: list[Task] | None = None,
                 out_dir: str | Path | None = None, rollout: WorkerClient | None = None,
                 trainer: WorkerClient | None = None,
                 resume: str | Path | checkpoint.Checkpoint | None = None,
                 episode: episodes.Episode | None = None) -> None:
        self.settings = settings
        self.eta = settings.eta
        self.max_in_flight = settings.max_in_flight
        self.B = settings.trainer.batch_size
        self.G = settings.rollout.group_size
        self._ckpt = keeping.resume_from(resume, settings)
        state = self._ckpt.state if self._ckpt is not None else {}
        consumed = state.get("consumed", 0)
        self._skip = consumed if tasks is not None else 0  # a caller's source: skip what was taken
        rows = read_tasks(settings.task) if tasks is None or eval_set is None else None  # read once
        self._tasks = tasks if tasks is not None else training_tasks(settings, start=consumed, rows=rows)
        self._reward = reward if reward is not None else load_rewards(settings.task)
        spec = episodes.episode_spec(settings)
        self._episode = episode if episode is not None else episodes.load_episode(spec) if spec else None
        if self._episode is not None and settings.process.mode != "off":
            raise SettingsError("process.mode: scores single replies; an episode run needs process.mode = off")
        self._eval_set = eval_set if eval_set is not None else eval_tasks(settings, rows=rows)
        name = settings.run.name or f"{settings.run.mode}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.folder = Path(out_dir) if out_dir is not None else Path(settings.run.out_dir) / name
        if self._ckpt is not None:
            self.folder = self._ckpt.path.parent.parent
            name = self.folder.name
        self._name = name
        self.rollout = RolloutPool.of(rollout or placement.rollout_client(settings, self.folder))
        self.trainer = trainer or placement.trainer_client(settings, self.folder)
        # the admission rule's state (live, trained, version, capacity): areal_aio.control.staleness
        self.admission = Admission(self.B, self.eta, self.max_in_flight,
                                   version=state.get("version", 0), trained=state.get("trained", 0))
        self.step = 0
        self.counts = Counts()
        self.replay = ReplayBuffer()
        self.summary: dict[str, Any] = {}
        self._groups: dict[int, PendingGroup] = {}
        self._uniform_in_a_row = 0  # dynamic sampling: groups skipped since the last one trained
        self._requests: dict[str, Sample] = {}
        # held-out evals between their first request and their row (outlive a stop): evaluation.Evals
        self._open_evals = evaluation.Evals()
        self._batch_ready = asyncio.Event()
        self._baseline_done = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_reason: str | None = None  # what asked the run to stop: threshold, max_wall, stopped
        self._ended: str | None = None  # why the train loop ended (the summary's `ended`)
        self._source_done = False
        self._closing = False  # the train loop is done: in-flight rollouts are abandoned
        self._group_ids = itertools.count()
        # the rollout role is busy while any of its workers has a request out (its idle fraction:
        # the time none had work); how they share it is the pool's routing
        self._rollout_busy = Busy(lambda on: self.log.events.info("busy", worker="rollout", busy=on))
        self._trainer_busy = Busy(lambda on: self.log.events.info("busy", worker="trainer", busy=on))
        # per rollout worker: its requests and tokens here (its busy time: the pool's); counted
        # afresh by a resumed run, whose rollout.devices may differ
        self._shares: list[stats.WorkerShare] = []
        # Train and Save requests, their replies, the step in flight: areal_aio.control.trainer_link
        self.link = TrainerLink(self.trainer, self._trainer_busy, self._commit)
        # checkpoints, resume, model/ and best/, the best eval: areal_aio.control.keeping
        self.keeper = keeping.Keeper(self.folder, settings, self.link, self._ckpt,
                                     position=lambda: keeping.Position(self.step, self.version),
                                     controller_state=self.run_state)
        self._subscribers: list[asyncio.Queue] = []
        self.eval_curve: list[dict] = []
        self._evals: set[asyncio.Task] = set()
        self._commit_wall: dict[int, float] = {0: 0.0}
        self._time_to_threshold: float | None = None
        self._lag_max = 0.0
        self._t0 = 0.0
        self._cold_start = {}
        self._max_trained_staleness = 0
        self.log: RunLog | None = None
        self.store: WeightStore | None = None
        self._consumed = 0  # tasks taken from the source (resume skips them)
        self._workers_up = False
        self._lock = None
        self._redispatch: list[tuple[int, Task]] = []
        self._spent = 0.0  # wall seconds of the run before this process (resume)
        self._process = process_reward.StepCredit(settings, self._send_generates,
                                                  lambda task, text: self._scorer.score(task, text))
        if self._ckpt is not None:
            self._restore(state)
        r = settings.run
        self._watch = Progress(r.max_steps, self.folder, show=r.progress,
                               completions_every=r.log_completions_every, evals=self.eval_curve)

    # ------------------------------------------------------------------ public

    @property
    def version(self) -> int:
        """The committed policy version (owned by `admission`; only a commit advances it)."""
        return self.admission.version

    def stop(self) -> None:
        """Ask the run to end after the current step (then final eval, summary: ended "stopped")."""
        self._request_stop("stopped")

    def _request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()
        self._batch_ready.set()

    async def events(self) -> AsyncIterator[dict]:
        """Stream of event, step and eval rows until the run ends."""
        queue: asyncio.Queue = asyncio.Queue(EVENT_QUEUE)
        self._subscribers.append(queue)
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._subscribers.remove(queue)

    async def run(self) -> dict:
        """Prepare, start both workers, train until a stop condition; returns the summary.

        Raises checkpoint.CheckpointError, before touching anything, when the folder already
        holds a run (without resume) or another run is using it. Once cancelled, the run stops
        (_shutdown) to its end before this returns: a second cancel cannot cut the stop short."""
        self._lock = self.keeper.claim()
        self.log = RunLog(self.folder, self.settings.to_toml(), append=self._ckpt is not None)
        self._scorer = Scorer(self._reward, timeout_s=self.settings.controller.reward_timeout_s,
                              procs=self.settings.controller.reward_procs,
                              log_path=self.folder / "reward.log")
        error: BaseException | None = None
        try:
            prep = [await w.prepare(self.settings.model.path) for w in (self.rollout, self.trainer)]
            if any(p is not None for p in prep):
                self._cold_start["prepare_s"] = round(sum(p or 0.0 for p in prep), 3)
            self.store = WeightStore.create(self._name.replace("/", "_"))
            self.keeper.attach(self.log, self.store)
            await self._start_workers()
            self._t0 = time.perf_counter() - self._spent
            if self._ckpt is not None:  # the groups to dispatch again lost their samples in flight
                self.counts.lost_in_flight += (lost := self.G * len(self._redispatch))
                self.keeper.resumed(lost, self._spent)
            self._emit("run_start", mode=self.settings.run.mode, eta=stats.num(self.eta))
            await self._supervise()
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                await _to_its_end(self._shutdown(error))
            finally:
                self._lock.close()
        return self.summary

    # ------------------------------------------------------------------ lifecycle

    async def _start_workers(self) -> None:
        t0 = time.perf_counter()
        settings = self.settings.to_dict()
        resume = str(self._ckpt.trainer) if self._ckpt is not None else ""
        ready = await asyncio.gather(
            self.rollout.start(wire.Init("rollout", settings, str(self.store.root))),
            self.trainer.start(wire.Init("trainer", settings, str(self.store.root), resume)))
        rollouts = self.rollout.readies
        self._workers_up = True
        if ready[1].version != self.version:
            raise WorkerFailed("trainer", f"started at version {ready[1].version}, the checkpoint "
                                          f"holds {self.version}")
        if self.version:  # resumed: the trainer published this version; every rollout worker loads it first
            await self.rollout.send(wire.UpdateWeights(self.version, str(self.store.path(self.version))))
        self._cold_start.update(cold_start_s=round(time.perf_counter() - t0, 3),
                                rollout_load_s=round(ready[0].load_s, 3),
                                trainer_load_s=round(ready[1].load_s, 3),
                                rollout_device=ready[0].device, trainer_device=ready[1].device,
                                rollout_workers=len(rollouts), rollout_devices=[r.device for r in rollouts])
        self._shares = [stats.WorkerShare(r.device) for r in rollouts]
        for worker, r in [*enumerate(rollouts), (0, ready[1])]:
            self.log.events.info("worker_ready", role=r.role, worker=worker, pid=r.pid,
                                 load_s=round(r.load_s, 3), device=r.device)

    async def _supervise(self) -> None:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._dispatcher = tg.create_task(self._dispatch(), name="dispatch")
            helpers = [self._dispatcher] + [tg.create_task(coro, name=name) for name, coro in (
                ("rollout_reader", self._rollout_reader()), ("trainer_reader", self.link.read()),
                ("monitor", self._monitor()))]
            await tg.create_task(self._train_loop(), name="train_loop")
            for task in helpers:
                task.cancel()

    async def _shutdown(self, error: BaseException | None) -> None:
        for task in list(self._evals):
            task.cancel()
        failure = _worker_failure(error)
        try:
            if isinstance(error, asyncio.CancelledError) and self._workers_up and \
                    (self._open_evals.open or self._open_evals.interrupted):
                await self._finish_evals()
            await asyncio.gather(self.rollout.stop(),
                                 self.keeper.keep_and_stop_trainer(failure, self._workers_up),
                                 return_exceptions=True)
            await self._scorer.aclose()
        finally:
            if self.store is not None:
                self.store.close()
        self.summary = self._summarize(failure or error)
        if self.log is not None:
            self.log.events.info("run_end", ended=self.summary["ended"],
                                 error=None if error is None else type(error).__name__)
            await self.log.settle()
            self.log.write_summary(self.summary)
        for queue in self._subscribers:
            _put_latest(queue, None)
        if failure is not None and failure is not error:
            raise failure from None

    # ------------------------------------------------------------------ dispatch

    async def _dispatch(self) -> None:
        """Admit one group at a time while the rate rule allows; the only caller of `admit`."""
        stream = task_stream(self._tasks, self._skip)
        await self._baseline_done.wait()
        for gid, task in self._redispatch:  # admitted before the stop: admitted again first
            await self._admit(gid, task)
        self._redispatch = []
        while True:
            await self.admission.wait(self.G)
            try:
                task = await anext(stream)
            except StopAsyncIteration:
                self._source_done = True
                self._batch_ready.set()  # let train_loop notice it can never fill a batch
                return
            self._consumed += 1
            self.counts.admitted += self.G
            await self._admit(next(self._group_ids), task)
            await asyncio.sleep(0)  # a pipe with room never blocks: let readers in between groups

    async def _admit(self, gid: int, task: Task) -> None:
        samples = [Sample(f"g{gid}.{i}", gid, task, i) for i in range(self.G)]
        group = self._groups[gid] = PendingGroup(task, samples)
        self.admission.admit(self.G)
        if self._episode is None:
            await self._generate(*samples)
            return
        for sample in samples:
            group.episodes.append(self._tg.create_task(self._run_episode(sample, group),
                                                       name=f"episode-{sample.request_id}"))

    async def _generate(self, *samples: Sample) -> None:
        """One Generate per sample, written together (one pipe drain for a whole group)."""
        r = self.settings.rollout
        msgs = []
        for sample in samples:
            self._requests[sample.request_id] = sample
            seed = sample_seed(self.settings.run.seed, sample.group_id, sample.index, sample.retries)
            msgs.append(wire.Generate(sample.request_id, sample.task.text, r.max_new_tokens,
                                      r.temperature, r.top_p, seed, sample.task.messages))
        await self._send_generates(msgs)

    # ------------------------------------------------------------------ rollout side

    async def _rollout_reader(self) -> None:
        while True:
            msg = await self.rollout.recv()
            match msg:
                case wire.Completion():
                    self._rollout_busy.down()
                    share = self._shares[self.rollout.source]
                    share.requests += 1
                    if not self._open_evals.deliver(msg) and not self._process.deliver(msg):
                        self._on_completion(msg, share)
                case wire.WeightsLoaded():
                    self.log.events.info("weights_loaded", version=msg.version, worker=msg.worker,
                                         load_s=round(msg.load_s, 4), rebuilt=msg.rebuilt)
                    self._emit("weights_loaded", version=msg.version, worker=msg.worker, load_s=msg.load_s,
                               rebuilt=msg.rebuilt)
                case _:
                    raise self.rollout.failure(msg)

    def _on_completion(self, msg: wire.Completion, share: stats.WorkerShare) -> None:
        sample = self._requests.pop(msg.request_id, None)
        if sample is None:
            return  # an abort answer for a sample already given up
        group = self._groups.get(sample.group_id)
        if group is None or group.dropped or self._closing:
            return
        if sample.model is not None:  # an episode's reply: its episode takes it from here
            if msg.finish != "abort":
                self.counts.replied(msg)
                share.gen_tokens += len(msg.completion_ids)
            if sample.waiting is not None and not sample.waiting.done():
                sample.waiting.set_result(msg)
            return
        if msg.finish == "abort":
            self._restart(sample, group)
            return
        sample.completion = msg
        self.counts.completed(msg)
        share.gen_tokens += len(msg.completion_ids)
        if self._scorer.inline and not self._process.enabled:
            self._scored(sample, group, self._scorer.score_inline(sample.task, msg.text))
        else:
            self._tg.create_task(self._score(sample, group), name=f"score-{msg.request_id}")

    def _restart(self, sample: Sample, group: PendingGroup) -> None:
        """on_interrupt = restart: resubmit from scratch, or drop the group past the retry limit."""
        if sample.retries >= self.settings.controller.max_retries:
            self._drop_group(group, "interrupt")
            return
        sample.retries += 1
        self.counts.restarts += 1
        sample.request_id = f"{sample.request_id.split('~')[0]}~{sample.retries}"
        self._tg.create_task(self._generate(sample), name=f"restart-{sample.request_id}")

    async def _score(self, sample: Sample, group: PendingGroup) -> None:
        score = await self._scorer.score(sample.task, sample.completion.text)
        if self._process.enabled:  # may await continuations: this group waits, the others go on
            scored = await self._process.score(sample.task, sample.completion.text, score,
                                               group=sample.group_id, index=sample.index,
                                               retry=sample.retries)
            if scored is None:
                return  # the run stopped while its continuations were out
            score, sample.process = scored
        self._scored(sample, group, score)

    # ------------------------------------------------------------------ episodes

    async def _run_episode(self, sample: Sample, group: PendingGroup) -> None:
        """One sample as a multi-turn episode (areal_aio/control/episodes.py): the user's function
        under task.episode_timeout_s, then its score. One that raises, times out or passes a
        bound scores 0 and is counted; a dropped group or a stop cancels it (its reply in flight
        is aborted); one that ends without a reply drops its group (nothing to train)."""
        bounds = episodes.Bounds.of(self.settings)
        model = sample.model = episodes.Model(bounds, lambda ask: self._reply(sample, group, ask))
        score, failure = await episodes.play(self._episode, sample.task, model, bounds.timeout_s)
        if failure is not None:
            self.counts.episode_failures += 1
            self.log.events.info("episode_failed", request_id=sample.request_id, replies=model.replies,
                                 error=f"{type(failure).__name__}: {failure}"[:500])
        sample.completion = model.transcript.completion()
        if sample.completion is None:  # no reply: nothing to train, so the group is lost now
            if not group.dropped:
                self._drop_group(group, "episode")
            return
        self.counts.generated += 1
        if score is None:
            score = await self._scorer.score(sample.task, sample.completion.text)
        self._scored(sample, group, score)

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
            self._requests[rid] = sample
            self._rollout_busy.up()
            await self.rollout.send(ask.generate(rid, sample.task, r.temperature, r.top_p, seed))
            try:
                msg = await sample.waiting
            except asyncio.CancelledError:  # a timeout or a dropped group: the reply is not wanted
                if not self._closing and self._requests.pop(rid, None) is not None:
                    self._abort_soon(rid)
                raise
            if msg.finish != "abort":
                return msg
            if sample.retries >= self.settings.controller.max_retries:
                self._drop_group(group, "interrupt")
                raise asyncio.CancelledError  # the group is given up: this episode ends with it
            sample.retries += 1
            self.counts.restarts += 1

    async def _send_generates(self, msgs: list[wire.Generate]) -> None:
        """Generates written together (a group's, or process reward's continuations), counted busy."""
        self._rollout_busy.up(len(msgs))
        await self.rollout.send_many(msgs)

    def _scored(self, sample: Sample, group: PendingGroup, score: Score) -> None:
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
        if group.scored == len(group.samples) and not group.dropped:
            del self._groups[sample.group_id]
            if self._skips(group.samples):
                self._drop(group.samples, "uniform")
                return
            self.replay.put(Group(sample.group_id, group.task, group.samples))
            self._batch_ready.set()

    def _skips(self, samples: list[Sample]) -> bool:
        """Dynamic sampling (controller.dynamic_sampling): a whole group whose rewards are all
        equal teaches nothing (zero advantage) and is not trained, unless max_uniform_in_a_row
        such groups were skipped just before it."""
        c = self.settings.controller
        if not c.dynamic_sampling:
            return False
        rewards = [s.score.reward for s in samples]
        if max(rewards) - min(rewards) > UNIFORM_EPS or self._uniform_in_a_row >= c.max_uniform_in_a_row:
            self._uniform_in_a_row = 0
            return False
        self._uniform_in_a_row += 1
        return True

    def _abort_soon(self, rid: str) -> None:
        """Abort a request from code that cannot wait (its answer is ignored: not in _requests)."""
        coro = self.rollout.send(wire.Abort(rid))
        try:
            self._tg.create_task(coro, name=f"abort-{rid}")
        except RuntimeError:  # the run's TaskGroup is ending: the rollout workers stop with it
            coro.close()

    def _drop_group(self, group: PendingGroup, why: str) -> None:
        """Give a whole pending group up: its requests aborted, its other episodes cancelled."""
        group.dropped = True
        self._groups.pop(group.samples[0].group_id, None)  # a stream that ends can still end the run
        self._drop(group.samples, why)
        for other in group.samples:
            if self._requests.pop(other.request_id, None) is not None:
                self._abort_soon(other.request_id)
        for task in group.episodes:
            if task is not asyncio.current_task():
                task.cancel()

    def _drop(self, samples: list[Sample], why: str) -> None:
        """Give the admission slots back and record the drop."""
        self.admission.drop(len(samples))
        self.counts.dropped(len(samples), why)
        self.log.rows("samples", (stats.sample_row(s, dropped=why) for s in samples))

    # ------------------------------------------------------------------ training side

    async def _next_batch(self) -> list[Group] | None:
        """Wait for B/G fresh groups; staleness is measured and enforced here."""
        n_groups = self.B // self.G
        while True:
            batch, dropped = self.replay.take(n_groups, self.version, self.eta)
            for group in dropped:
                self.log.events.info("dropped_stale", group=group.group_id, version=self.version,
                                     oldest=group.oldest_version)
                self._drop(list(group.samples), "stale")
            if batch:
                return batch
            if self._stop.is_set():
                return None
            if self._source_done and not self._requests and not self._groups:
                return None
            self._batch_ready.clear()
            await self._batch_ready.wait()

    async def _train_loop(self) -> None:
        """The finite loop that decides when the run ends."""
        every = self.settings.run.checkpoint_every
        if self._ckpt is None:
            # The baseline eval runs alone on version 0, before any training rollout is dispatched.
            await self._evaluate(0, 0)
        elif self.step % self.settings.task.eval_every == 0 and \
                not any(row["step"] == self.step for row in self.eval_curve):
            self._start_eval()  # the checkpoint's own eval was in flight: this version is loaded
        self._baseline_done.set()
        while self.step < self.settings.run.max_steps and not self._should_stop():
            t_wait = time.perf_counter()
            batch = await self._next_batch()
            if batch is None:
                if self._source_done:
                    self.log.events.info("source_exhausted", step=self.step)
                break
            wait_s = time.perf_counter() - t_wait
            await self._train_step(batch, wait_s)
            last = self.step >= self.settings.run.max_steps or self._should_stop()
            if self.step % self.settings.task.eval_every == 0 and not last:
                self._start_eval()
            if self.keeper.best_pending is not None:
                await self.keeper.export_best()
            if every and self.step % every == 0 and not last:
                await self.keeper.checkpoint()
        self._ended = self._stop_reason or ("completed" if self.step >= self.settings.run.max_steps
                                            else "exhausted")
        # the final eval gets the rollout workers to themselves: training rollouts end first
        await self._stop_generating()
        if not any(row["step"] == self.step for row in self.eval_curve) and \
                not any(t.get_name() == f"eval-{self.step}" for t in self._evals):
            self._start_eval()
        if self._evals:
            await asyncio.gather(*self._evals)

    async def _stop_generating(self) -> None:
        """No more training rollouts: the final eval gets the rollout workers to themselves.
        Continuations in flight are aborted too, and their replies are left unscored."""
        self._closing = True
        self._dispatcher.cancel()
        for group in self._groups.values():  # episodes end here: their replies are dropped now
            for task in group.episodes:
                task.cancel()
        abandoned, self._open_evals.abandoned = self._open_evals.abandoned, []
        if aborts := [wire.Abort(rid) for rid in [*self._requests, *self._process.close(), *abandoned]]:
            await self.rollout.send_many(aborts)  # each to the worker that holds it

    def _should_stop(self) -> bool:
        if not self._stop.is_set() and time.perf_counter() - self._t0 >= self.settings.run.max_wall_s:
            self._request_stop("max_wall")
        return self._stop.is_set()

    async def _train_step(self, batch: list[Group], wait_s: float) -> None:
        samples = [s for g in batch for s in g.samples]
        stale = [staleness(self.version, s.oldest_version) for s in samples]
        train_samples = [wire.TrainSample(s.completion.prompt_ids, s.completion.completion_ids,
                                          s.completion.logprobs, s.completion.versions,
                                          s.score.reward, s.group_id, s.loss_mask) for s in samples]
        step = self.step + 1
        # committed by the link (self._commit) before it returns; a stop keeps it in flight
        trained = await self.link.train(wire.Train(step, self.version, train_samples),
                                        (step, samples, stale, wait_s, time.perf_counter()))
        await self.rollout.send(wire.UpdateWeights(self.version, trained.path))
        if self.settings.controller.on_interrupt == "restart" and self._requests:
            await self.rollout.send_many([wire.Abort(rid) for rid in self._requests])

    def _commit(self, record: tuple, trained: wire.Trained) -> None:
        """Advance the clock to a Trained version and record its step (the rollout workers are
        told by the train loop, after this); `record` is (step, samples, stale, wait_s, t0)."""
        step, samples, stale, wait_s, t0 = record
        train_s = time.perf_counter() - t0
        if trained.version != self.version + 1:
            raise WorkerFailed("trainer", f"reported version {trained.version} after {self.version}")
        # Commit: the controller is the only writer of the clock, and tells the rollout workers only now.
        self.step = step
        self.admission.commit(trained.version, len(samples))
        wall = time.perf_counter() - self._t0
        self._commit_wall[self.version] = wall
        self.keeper.retain()
        self.counts.trained(sum(s.trained_tokens for s in samples), stale)
        self._max_trained_staleness = max(self._max_trained_staleness, *stale)
        self.log.rows("samples", (stats.sample_row(s, staleness=st, step=self.step)
                                  for s, st in zip(samples, stale, strict=True)))
        row = stats.step_row(self.step, self.version, wall, train_s, wait_s, samples, stale, self.counts,
                             trained, replay_groups=len(self.replay), in_flight=len(self._requests))
        if self._process.enabled:
            row |= process_reward.step_fields([s.process for s in samples], self.counts.gen_tokens,
                                              self._process)
        self.log.row("steps", row)
        self.log.events.info("version_commit", version=self.version, step=self.step)
        self._publish({"kind": "step", **row})
        self._watch.step(row, samples)

    # ------------------------------------------------------------------ resuming

    def run_state(self) -> dict[str, Any]:
        """The controller's part of a checkpoint, at one instant after a commit (areal_aio.control.keeping
        adds the best eval, the resumes, the row files' sizes and the settings)."""
        open_groups = {gid: g.task for gid, g in self._groups.items() if not g.dropped}
        open_groups.update({g.group_id: g.task for g in self.replay.groups()})
        counts, hist = self.counts.state()
        return {
            "step": self.step, "version": self.version, "trained": self.admission.trained, "consumed": self._consumed,
            "next_group": self._next_group(), "wall_s": time.perf_counter() - self._t0,
            "open_groups": [{"group": gid, "task": dataclasses.asdict(task)}
                            for gid, task in sorted(open_groups.items())],
            "counts": counts, "staleness_hist": hist,
            "eval_curve": self.eval_curve, "commit_wall": {str(k): v for k, v in self._commit_wall.items()},
            "time_to_threshold": self._time_to_threshold, "max_trained_staleness": self._max_trained_staleness,
            "busy": {"rollout": self._rollout_busy.seconds(), "trainer": self._trainer_busy.seconds()},
            "process": self._process.state()}

    def _next_group(self) -> int:
        """The group id the next admitted group gets (peeked without using it)."""
        gid = next(self._group_ids)
        self._group_ids = itertools.count(gid)
        return gid

    def _restore(self, state: dict[str, Any]) -> None:
        """The controller as it was at the checkpoint; its open groups are dispatched again."""
        self.step = state["step"]  # version and trained: self.admission, made from this state
        self._consumed = state["consumed"]
        self._group_ids = itertools.count(state["next_group"])
        self._spent = state["wall_s"]
        self.counts = Counts.from_state(state["counts"], state["staleness_hist"])
        self.eval_curve = list(state["eval_curve"])
        self._commit_wall = {int(k): v for k, v in state["commit_wall"].items()}
        self._time_to_threshold = state["time_to_threshold"]
        self._max_trained_staleness = state["max_trained_staleness"]
        self._rollout_busy.total, self._trainer_busy.total = state["busy"]["rollout"], state["busy"]["trainer"]
        self._redispatch = [(g["group"], Task(**g["task"])) for g in state["open_groups"]]
        self._process.restore(state.get("process"))

    # ------------------------------------------------------------------ evaluation

    def _start_eval(self) -> None:
        task = self._tg.create_task(self._evaluate(self.step, self.version), name=f"eval-{self.step}")
        self._evals.add(task)
        task.add_done_callback(self._evals.discard)

    async def _evaluate(self, step: int, version: int) -> None:
        """Greedy answers on the held-out set (areal_aio.control.evaluation); never enters training.
        A stop that cancels this leaves the eval open: _finish_evals completes it. An episode
        run's eval is greedy episodes (_evaluate_episodes)."""
        if self._episode is not None:
            await self._evaluate_episodes(step, version)
            return
        pending = self._open_evals.begin(step, version, evaluation.requests(self._eval_set, step, self.settings))
        self.keeper.eval_starts[step] = version
        await self._send_eval(pending)
        await pending.answered.wait()
        await self._record_eval(pending)

    async def _evaluate_episodes(self, step: int, version: int, label: str = "") -> None:
        """One greedy episode per held-out task (evaluation.run_episodes). A stop that cancels it
        leaves it in Evals.interrupted: _finish_evals runs it again (label "s": new request ids,
        the cancelled replies are aborted)."""
        self.keeper.eval_starts[step] = version
        try:
            done = await evaluation.run_episodes(self._episode, self._eval_set, step, self.settings,
                                                 self._scorer, self._ask_eval, label)
        except asyncio.CancelledError:
            self._open_evals.interrupted[step] = version
            raise
        self._eval_row(step, version, done.completions, done.scores, done.turns,
                       episode_failures=done.failures)

    async def _ask_eval(self, msg: wire.Generate) -> wire.Completion:
        """One reply of an episode eval: sent, then awaited (the rollout reader delivers it)."""
        answer = self._open_evals.expect(msg.request_id)
        self._rollout_busy.up()
        try:
            await self.rollout.send(msg)
            return await answer
        finally:
            self._open_evals.forget(msg.request_id)  # cancelled: aborted by _stop_generating

    async def _send_eval(self, pending: evaluation.PendingEval) -> None:
        """The requests of an eval not sent yet, one by one (a pool spreads them over its workers)."""
        while pending.sent < len(pending.requests):
            msg = pending.requests[pending.sent]
            pending.sent += 1  # sent once asked for, even if cancelled while it waits (WorkerClient.send_many)
            self._rollout_busy.up()
            await self.rollout.send(msg)

    async def _record_eval(self, pending: evaluation.PendingEval) -> None:
        """An eval with every answer in: scored, then its row everywhere it goes."""
        completions = pending.answers
        scores = await evaluation.score(self._scorer, self._eval_set, completions)
        self._open_evals.end(pending)
        self._eval_row(pending.step, pending.version, completions, scores)

    def _eval_row(self, step: int, version: int, completions: list[wire.Completion], scores: list[Score],
                  turns: list[list[dict]] | None = None, **extra: Any) -> None:
        """A finished eval's row, everywhere it goes: samples, eval curve, events, best, threshold."""
        del self.keeper.eval_starts[step]
        self.counts.eval_tokens += sum(len(c.completion_ids) for c in completions)
        # With interrupts on, an eval answer can finish under newer weights than it started with;
        # the row is stamped with the newest version used, at the time that version was committed.
        newest = max(version, *(c.newest_version for c in completions))
        oldest = min((c.oldest_version for c in completions if c.versions), default=version)
        row = {"step": step, "version": newest, "wall_s": round(self._commit_wall[newest], 3),
               "done_s": round(time.perf_counter() - self._t0, 3), **evaluation.rates(scores),
               "versions": [oldest, newest], **extra}
        self.log.rows("samples", evaluation.sample_rows(step, self._eval_set, completions, scores, turns))
        self.keeper.evaluated(row)  # a new best: exported by the train loop (or at the stop)
        self.eval_curve.append(row)
        self.log.events.info("eval", **row)
        self._publish({"kind": "eval", **row})
        threshold = self.settings.run.threshold
        if threshold > 0 and row["pass_rate"] >= threshold:
            if self._time_to_threshold is None or row["wall_s"] < self._time_to_threshold:
                self._time_to_threshold = row["wall_s"]
            self._request_stop("threshold")

    async def _finish_evals(self) -> None:
        """An interrupted run finishes the evals it had in flight, within EVAL_AT_STOP_TIMEOUT_S,
        before it writes model/ and its final checkpoint (so their rows are in it): they measure
        the weights they started on, which a resume no longer has. Training rollouts and
        continuations are aborted first; the rollout reader was cancelled, so one runs here.
        An eval not finished in time (or a worker that fails now) is lost and logged."""
        evals = list(self._open_evals.open.values())
        reruns, self._open_evals.interrupted = self._open_evals.interrupted, {}
        reader = asyncio.create_task(self._rollout_reader(), name="rollout_reader_at_stop")
        answered = asyncio.ensure_future(asyncio.gather(*(e.answered.wait() for e in evals)))
        episode_evals: list[asyncio.Future] = []
        done: asyncio.Future | None = None
        try:
            async with asyncio.timeout(EVAL_AT_STOP_TIMEOUT_S):
                await self._stop_generating()  # before the reader runs: it drops training answers
                for pending in evals:
                    await self._send_eval(pending)
                episode_evals = [asyncio.ensure_future(self._evaluate_episodes(step, version, "s"))
                                 for step, version in reruns.items()]
                done = asyncio.ensure_future(asyncio.gather(answered, *episode_evals))
                await asyncio.wait([reader, done], return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()  # a worker that failed meanwhile: raised here
                done.result()
                for pending in evals:
                    await self._record_eval(pending)
        except Exception as exc:  # noqa: BLE001 - the stop goes on without the eval
            lost = [e.step for e in self._open_evals.open.values()] + \
                [step for step in reruns if not any(row["step"] == step for row in self.eval_curve)]
            self.log.events.info("eval_lost", steps=lost, error=f"{type(exc).__name__}: {exc}")
        finally:
            waited = [answered, reader, *episode_evals, *([done] if done is not None else [])]
            for task in waited:
                task.cancel()
            await asyncio.gather(*waited, return_exceptions=True)

    # ------------------------------------------------------------------ monitoring

    async def _monitor(self) -> None:
        try:
            await self._monitor_loop()
        finally:
            self._watch.close()

    async def _monitor_loop(self) -> None:
        last_progress = time.perf_counter()
        expected = time.perf_counter() + MONITOR_PERIOD_S
        while True:
            await asyncio.sleep(MONITOR_PERIOD_S)
            now = time.perf_counter()
            self._lag_max = max(self._lag_max, now - expected)
            expected = now + MONITOR_PERIOD_S
            if now - self._t0 >= self.settings.run.max_wall_s:
                self._request_stop("max_wall")
            if now - last_progress >= PROGRESS_PERIOD_S:
                last_progress = now
                self.log.events.info("queues", in_flight=len(self._requests), replay_groups=len(self.replay),
                                     pending_groups=len(self._groups), live=self.admission.live, version=self.version)
                await self.log.flush()
                self._watch.refresh()

    def _emit(self, event: str, **fields: Any) -> None:
        self._publish({"kind": "event", "event": event, **fields})

    def _publish(self, item: dict) -> None:
        for queue in self._subscribers:
            _put_latest(queue, item)

    # ------------------------------------------------------------------ summary

    def _summarize(self, error: BaseException | None) -> dict:
        busy = [b.seconds() for b in self.rollout.busy]
        wall = time.perf_counter() - self._t0 if self._t0 else 0.0  # after `busy`: never below it
        detail = stats.worker_rows(self._shares, busy, wall - self._spent) if self._shares else []
        return stats.summarize(
            self.settings, self.counts, wall=wall,
            steps=self.step, version=self.version, cold_start=self._cold_start,
            max_trained_staleness=self._max_trained_staleness, resumes=self.keeper.resumes, best=self.keeper.best,
            eval_curve=self.eval_curve, time_to_threshold=self._time_to_threshold,
            process=self._process.stats(self.counts.gen_tokens), rollout_busy_s=self._rollout_busy.seconds(),
            trainer_busy_s=self._trainer_busy.seconds(), rollout_workers_detail=detail,
            lag_max_s=self._lag_max, folder=str(self.folder),
            error=error, reason=self._ended)


async def _to_its_end(stopping: Any) -> None:
    """Await the coroutine `stopping` to its end, whatever cancels the caller meanwhile (a second
    Ctrl-C, a caller that cancels twice): a stop cut short leaves workers, /dev/shm files and
    half-written folders behind, and the stop is bounded by its own timeouts. A cancel that
    arrived meanwhile is raised once it has ended."""
    task = asyncio.ensure_future(stopping)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    task.result()  # what the stop raises (the failure that ended the run)
    if cancelled:
        raise asyncio.CancelledError


def _worker_failure(error: BaseException | None) -> WorkerFailed | RewardPoolBroken | None:
    """The WorkerFailed (or RewardPoolBroken) inside a TaskGroup's ExceptionGroup, if that is
    what ended the run."""
    if isinstance(error, (WorkerFailed, RewardPoolBroken)):
        return error
    if isinstance(error, BaseExceptionGroup):
        for exc in error.exceptions:
            found = _worker_failure(exc)
            if found is not None:
                return found
    return None


def _put_latest(queue: asyncio.Queue, item: Any) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
