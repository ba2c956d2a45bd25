"""The controller: one asyncio event loop driving the rollout workers and a trainer worker.

The run's tasks ([name], one TaskGroup), what each waits on (<...>), and the owners they call:

    tasks (any iterable / async iterable)
      |
    [dispatch] <capacity: staleness.Admission, floor((live + G - 1) / B) <= version + eta>
      |  groups.admit: a group's G Generates written together        ^ a commit or a drop
      |  (an episode run: G [episode-*] tasks, one Generate per reply)  | gives capacity
      v                                                                |
    rollout pipe(s) --> [rollout_reader] --Completion--+--> an eval's: evaluation.Evaluator
      (RolloutPool)       | WeightsLoaded -> events    +--> a continuation's: rewards/process.py
                                                        +--> groups.completed --> [score-*]
                                                             (abort answer: [restart-*] or drop)
                                  groups.scored, a whole group --> ReplayBuffer <ready event>
                                                                     | take(B/G groups):
                                                                     | STALENESS measured here,
                                                                     v > eta dropped
    [train_loop] the one finite loop (run.max_steps, max_wall_s, threshold, stop())
        Train --> trainer pipe --> [trainer_reader] (TrainerLink) --Trained--> _commit: v+1
        --> UpdateWeights(v+1) to every rollout worker (only after the commit)
        between steps: [eval-<step>] every task.eval_every (Evaluator); best/ and
        checkpoints/step-N (keeping.Keeper)
    [monitor]  loop lag, max_wall_s, queue depths, progress line, row flushing

    what is recorded: stats (counters, rows, summary) into runlog.RunLog's files; the same rows
    to Orchestrator.events() subscribers (events.EventStream)

Who blocks on whom: dispatch waits for the baseline eval (version 0, the rollout workers to
themselves), then for capacity; train_loop waits for the replay buffer to hold a fresh batch,
then for the trainer (no Train is sent while a Save is out: a checkpoint's two parts hold the
same version); readers wait on their pipes, score tasks on the reward pool, episodes on their
replies. Admission bounds staleness before a rollout starts; the replay buffer enforces it when
a batch is formed (a sample's staleness: the version now minus its oldest token's).

The rollout role is one RolloutPool however many workers it has (placement.py; one worker is
a pool of one): each group whole to its least-loaded worker, every version to all of them,
their replies merged. Admission and staleness are global: one clock, one rule.

A step the trainer skipped (its loss or gradient norm not finite: no update, the version
advances on the same weights) is counted; stats.SKIPPED_IN_A_ROW_MAX of them in a row end the
run as failed (stats.TrainingDiverged), keeping the last finite weights as model/.

Shutdown. Only train_loop ends the run: it stops generating (groups.close: episodes
cancelled, training requests and continuations aborted), awaits the final eval and returns;
the other tasks are cancelled. Then, on every path (normal end, threshold, max_wall_s,
Ctrl-C, SIGTERM, a worker failure): an interrupted run finishes the evals it had in flight
(Evaluator.finish, bounded); the rollout workers are stopped while a trainer that is alive
keeps the run (keeping.py: it commits a step in flight, writes model/, best/ and a final
checkpoint), then the trainer is stopped too (asked, terminated, killed); the weight store
folder is removed, the summary written (its `ended` says how the run ended) and the event
stream closed. A cancel during the shutdown does not cut it short (_to_its_end). A worker
Error or EOF raises WorkerFailed in its reader, which cancels the TaskGroup and takes the
same path; so does RewardPoolBroken, from a score task when the reward pool keeps breaking.

Resume (`resume=` a run folder): the owners are built from the newest checkpoint's controller
part (keeping.RunState); the trainer starts from its own part and publishes that version,
which every rollout worker loads before anything else; the groups open at the checkpoint are
admitted again first, then the task stream continues after the tasks it had handed out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from areal_aio import wire
from areal_aio.agents import endpoint, episodes
from areal_aio.control import evaluation, guidance, judging, keeping, stats
from areal_aio.control.events import EventStream
from areal_aio.control.groups import Groups
from areal_aio.control.progress import Progress
from areal_aio.control.replay import Group, ReplayBuffer
from areal_aio.control.runlog import RunLog
from areal_aio.control.sources import eval_tasks, read_tasks, training_tasks
from areal_aio.control.staleness import Admission, is_stale, staleness
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet import placement
from areal_aio.fleet.busy import Busy
from areal_aio.fleet.client import WorkerClient, WorkerFailed
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.rewards import process as process_reward
from areal_aio.rewards.scoring import Scorer, load_rewards
from areal_aio.settings import Settings, SettingsError
from areal_aio.store import checkpoint
from areal_aio.store.weights import WeightStore
from areal_aio.tasks.task import Task, task_stream

MONITOR_PERIOD_S = 0.05
"""Loop-lag probe period: a lag above this much is the loop being blocked."""
PROGRESS_PERIOD_S = 2.0

COLD_START_FIELDS: dict[str, str] = {
    "prepare_s": "Only where the workers have model files to make ready (real workers do): seconds spent "
                 "downloading or converting the model before they start; 0.0 when it was cached.",
    "cold_start_s": "Seconds from starting the workers to both being ready (model loads included).",
    "rollout_load_s": "Seconds from a rollout worker's process start to its being ready (the slowest worker's).",
    "trainer_load_s": "Seconds from the trainer's process start to its being ready (resuming: its checkpoint "
                      "part loaded).",
    "rollout_device": "The rollout workers' devices, comma-separated.",
    "trainer_device": "The trainer's device.",
    "rollout_workers": "Rollout workers (one per rollout.devices entry).",
    "rollout_devices": "Each rollout worker's device.",
}
"""What summary.json says of the start (`_start_workers`); absent when the run failed before its
workers were ready."""


class Orchestrator:
    """Runs one training run inside the caller's event loop.

    `tasks`: any iterable or async iterable of Task (default: settings' task stream);
    `reward`: any sync or async callable (task, completion_text) -> float | Score, or a list of
    rewards.Reward (summed with their weights, each logged as reward/<name>); default: what
    task.reward names;
    `episode`: an `async def episode(task, model)` (areal_aio/agents/episodes.py): each sample
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
        at = keeping.RunState.of(self._ckpt)  # where this run starts: fresh, or the checkpoint's
        self._skip = at.consumed if tasks is not None else 0  # a caller's source: skip what was taken
        rows = read_tasks(settings.task) if tasks is None or eval_set is None else None  # read once
        self._tasks = tasks if tasks is not None else training_tasks(settings, start=at.consumed, rows=rows)
        self._reward = reward if reward is not None else load_rewards(settings.task, settings.judge)
        spec = episodes.episode_spec(settings)
        self._episode = episode if episode is not None else episodes.load_episode(spec) if spec else None
        if self._episode is not None and settings.process.mode != "off":
            raise SettingsError("process.mode: scores single replies; an episode run needs process.mode = off")
        self._eval_set = eval_set if eval_set is not None else eval_tasks(settings, rows=rows)
        name = keeping.run_name(settings)
        self.folder = Path(out_dir) if out_dir is not None else Path(settings.run.out_dir) / name
        if self._ckpt is not None:
            self.folder = self._ckpt.path.parent.parent
            name = self.folder.name
        self._name = name
        self.rollout = RolloutPool.of(rollout or placement.rollout_client(settings, self.folder))
        self.trainer = trainer or placement.trainer_client(settings, self.folder)
        # the admission rule's state (live, trained, version, capacity): areal_aio.control.staleness
        self.admission = Admission(self.B, self.eta, self.max_in_flight, version=at.version, trained=at.trained)
        self.step = at.step
        self.counts = at.counts
        self.replay = ReplayBuffer()
        self.summary: dict[str, Any] = {}
        self._batch_ready = asyncio.Event()
        self._baseline_done = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_reason: str | None = None  # what asked the run to stop: threshold, max_wall, stopped
        self._ended: str | None = None  # why the train loop ended (the summary's `ended`)
        self._source_done = False
        # the rollout role is busy while any of its workers has a request out (its idle fraction:
        # the time none had work); how they share it is the pool's routing
        self._rollout_busy = Busy(lambda on: self.log.events.info("busy", worker="rollout", busy=on))
        self._trainer_busy = Busy(lambda on: self.log.events.info("busy", worker="trainer", busy=on))
        self._rollout_busy.total, self._trainer_busy.total = at.busy["rollout"], at.busy["trainer"]
        # per rollout worker: its requests and tokens here (its busy time: the pool's); counted
        # afresh by a resumed run, whose rollout.devices may differ
        self._shares: list[stats.WorkerShare] = []
        # Train and Save requests, their replies, the step in flight: areal_aio.control.trainer_link
        self.link = TrainerLink(self.trainer, self._trainer_busy, self._commit)
        # checkpoints, resume, model/ and best/, the best eval: areal_aio.control.keeping
        self.keeper = keeping.Keeper(self.folder, settings, self.link, self._ckpt,
                                     position=lambda: keeping.Position(self.step, self.version),
                                     controller_state=self.run_state)
        self.stream = EventStream()  # what events() yields: areal_aio.control.events
        self._commit_wall = at.commit_wall  # version -> the run's wall seconds at its commit
        self._lag_max = 0.0
        self._t0 = 0.0
        self._cold_start = {}
        self._max_trained_staleness = at.max_trained_staleness
        self.log: RunLog | None = None
        self.store: WeightStore | None = None
        self._consumed = at.consumed  # tasks taken from the source (resume skips them)
        self._workers_up = False
        self._lock = None
        self._redispatch = list(at.open_groups.items())  # admitted, not trained at the checkpoint
        self._spent = at.wall_s  # wall seconds of the run before this process (resume)
        self._process = process_reward.StepCredit(settings, self._send_generates,
                                                  lambda task, text: self._scorer.score(task, text))
        self._process.restore(at.process)
        # the admitted groups until they are trained or dropped (their samples, requests,
        # episodes, scores, drops): areal_aio.control.groups
        self.groups = Groups(settings, self.admission, self.counts, self.replay, self._batch_ready,
                             process=self._process, episode=self._episode, send=self._send_generates,
                             send_one=self._send_generate, abort=self._abort_soon,
                             spawn=lambda coro, name: self._tg.create_task(coro, name=name),
                             guide=guidance.load_guide(settings), next_group=at.next_group)
        # held-out evals, their rows, the eval curve: areal_aio.control.evaluation
        self.evals = evaluation.Evaluator(
            settings, self._eval_set, self._episode, self.keeper, self.counts, send=self._send_generate,
            publish=self.stream.publish, on_threshold=lambda: self._request_stop("threshold"),
            commit_wall=self._commit_wall, clock=lambda: time.perf_counter() - self._t0,
            curve=at.eval_curve, time_to_threshold=at.time_to_threshold)
        r = settings.run
        self._watch = Progress(r.max_steps, self.folder, show=r.progress,
                               completions_every=r.log_completions_every, evals=self.evals.curve)

    # ------------------------------------------------------------------ public

    @property
    def version(self) -> int:
        """The committed policy version (owned by `admission`; only a commit advances it)."""
        return self.admission.version

    @property
    def eval_curve(self) -> list[dict]:
        """The eval rows so far (owned by `evals`)."""
        return self.evals.curve

    def stop(self) -> None:
        """Ask the run to end after the current step (then final eval, summary: ended "stopped")."""
        self._request_stop("stopped")

    def _request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()
        self._batch_ready.set()

    def events(self) -> AsyncIterator[dict]:
        """Stream of event, step and eval rows until the run ends (areal_aio.control.events)."""
        return self.stream.subscribe()

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
        self.groups.attach(self.log, self._scorer)
        self.evals.attach(self.log, self._scorer)
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
            self.stream.emit("run_start", mode=self.settings.run.mode, eta=stats.num(self.eta))
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
        # an episode run serves its OpenAI-compatible endpoint while its tasks run (agents/endpoint.py)
        # a local judge (task.reward = "judge" without judge.url) is served by a worker of its own
        async with (endpoint.serving(self.settings.endpoint, self._episode is not None, self.counts),
                    judging.serving(self.settings, self._reward, self.folder / "judge.log",
                                    self.log.events) as judge_reader,
                    asyncio.TaskGroup() as tg):
            self._tg = tg
            self._dispatcher = tg.create_task(self._dispatch(), name="dispatch")
            readers = (("rollout_reader", self._rollout_reader()), ("trainer_reader", self.link.read()),
                       ("monitor", self._monitor()), *([("judge_reader", judge_reader)] if judge_reader else []))
            helpers = [self._dispatcher] + [tg.create_task(coro, name=name) for name, coro in readers]
            await tg.create_task(self._train_loop(), name="train_loop")
            for task in helpers:
                task.cancel()

    async def _shutdown(self, error: BaseException | None) -> None:
        self.evals.cancel()
        failure = stats.worker_failure(error)
        try:
            if isinstance(error, asyncio.CancelledError) and self._workers_up and self.evals.unfinished:
                await self.evals.finish(self._rollout_reader, self._stop_generating)
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
        self.stream.close()
        if failure is not None and failure is not error:
            raise failure from None

    # ------------------------------------------------------------------ dispatch

    async def _dispatch(self) -> None:
        """Admit one group at a time while the rate rule allows; the only caller of `admit`."""
        stream = task_stream(self._tasks, self._skip)
        await self._baseline_done.wait()
        for gid, task in self._redispatch:  # admitted before the stop: admitted again first
            await self.groups.admit(gid, task)
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
            await self.groups.admit(self.groups.next_id(), task)
            await asyncio.sleep(0)  # a pipe with room never blocks: let readers in between groups

    # ------------------------------------------------------------------ rollout side

    async def _rollout_reader(self) -> None:
        while True:
            msg = await self.rollout.recv()
            match msg:
                case wire.Completion():
                    self._rollout_busy.down()
                    share = self._shares[self.rollout.source]
                    share.requests += 1
                    if not self.evals.in_flight.deliver(msg) and not self._process.deliver(msg):
                        self.groups.completed(msg, share)
                case wire.WeightsLoaded():
                    self.log.events.info("weights_loaded", version=msg.version, worker=msg.worker,
                                         load_s=round(msg.load_s, 4), rebuilt=msg.rebuilt)
                    self.stream.emit("weights_loaded", version=msg.version, worker=msg.worker,
                                     load_s=msg.load_s, rebuilt=msg.rebuilt)
                case _:
                    raise self.rollout.failure(msg)

    async def _send_generate(self, msg: wire.Generate) -> None:
        """One Generate (an episode's reply, an eval request), counted busy."""
        self._rollout_busy.up()
        await self.rollout.send(msg)

    async def _send_generates(self, msgs: list[wire.Generate]) -> None:
        """Generates written together (a group's, or process reward's continuations), counted busy."""
        self._rollout_busy.up(len(msgs))
        await self.rollout.send_many(msgs)

    def _abort_soon(self, rid: str) -> None:
        """Abort a request from code that cannot wait (its answer is ignored: not in groups.requests)."""
        coro = self.rollout.send(wire.Abort(rid))
        try:
            self._tg.create_task(coro, name=f"abort-{rid}")
        except RuntimeError:  # the run's TaskGroup is ending: the rollout workers stop with it
            coro.close()

    # ------------------------------------------------------------------ training side

    async def _next_batch(self) -> list[Group] | None:
        """Wait for B/G fresh groups; staleness is measured and enforced here."""
        n_groups = self.B // self.G
        while True:
            batch, dropped = self.replay.take(n_groups, self.version, self.eta)
            for group in dropped:
                self.log.events.info("dropped_stale", group=group.group_id, version=self.version,
                                     oldest=group.oldest_version)
                self.groups.drop(list(group.samples), "stale")
            if batch:
                return batch
            if self._stop.is_set():
                return None
            if self._source_done and not self.groups.requests and not self.groups.pending:
                return None
            self._batch_ready.clear()
            await self._batch_ready.wait()

    async def _train_loop(self) -> None:
        """The finite loop that decides when the run ends."""
        every = self.settings.run.checkpoint_every
        if self._ckpt is None:
            # The baseline eval runs alone on version 0, before any training rollout is dispatched.
            await self.evals.run(0, 0)
        elif self.step % self.settings.task.eval_every == 0 and not self.evals.ran(self.step):
            # the checkpoint's own eval was in flight: this version is loaded
            self.evals.start(self._tg, self.step, self.version)
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
                self.evals.start(self._tg, self.step, self.version)
            if self.keeper.best_pending is not None:
                await self.keeper.export_best()
            if every and self.step % every == 0 and not last:
                await self.keeper.checkpoint()
        self._ended = self._stop_reason or ("completed" if self.step >= self.settings.run.max_steps
                                            else "exhausted")
        # the final eval gets the rollout workers to themselves: training rollouts end first
        await self._stop_generating()
        await self.evals.last(self._tg, self.step, self.version)

    async def _stop_generating(self) -> None:
        """No more training rollouts: the final eval gets the rollout workers to themselves.
        Continuations in flight are aborted too, and their replies are left unscored."""
        self.groups.close()  # episodes end here: their replies are dropped now
        self._dispatcher.cancel()
        abandoned = self.evals.take_abandoned()
        if aborts := [wire.Abort(rid) for rid in [*self.groups.requests, *self._process.close(), *abandoned]]:
            await self.rollout.send_many(aborts)  # each to the worker that holds it

    def _should_stop(self) -> bool:
        if not self._stop.is_set() and time.perf_counter() - self._t0 >= self.settings.run.max_wall_s:
            self._request_stop("max_wall")
        return self._stop.is_set()

    async def _train_step(self, batch: list[Group], wait_s: float) -> None:
        samples = [s for g in batch for s in g.samples]
        stale = [staleness(self.version, s.oldest_version) for s in samples if not s.written]  # the admitted ones
        fresh = lambda c: not is_stale(self.version, c.oldest_version, self.eta)  # noqa: E731
        seqs = [(s, q, staleness(self.version, q.completion.oldest_version if q.completion.versions
                                 else s.oldest_version))
                for s in samples for q in episodes.sequences(s.completion, s.loss_mask, s.model, fresh)]
        train_samples = [wire.TrainSample(q.completion.prompt_ids, q.completion.completion_ids, q.completion.logprobs,
                                          q.completion.versions, s.score.reward, s.group_id, q.mask,
                                          written=s.written)
                         for s, q, _ in seqs]
        step = self.step + 1
        # committed by the link (self._commit) before it returns; a stop keeps it in flight
        trained = await self.link.train(wire.Train(step, self.version, train_samples),
                                        (step, samples, seqs, stale, wait_s, time.perf_counter()))
        if diverged := self.counts.diverged(self.step):
            raise diverged  # the run fails; the trainer's weights are the last finite ones
        await self.rollout.send(wire.UpdateWeights(self.version, trained.path))
        if self.settings.controller.on_interrupt == "restart" and self.groups.requests:
            await self.rollout.send_many([wire.Abort(rid) for rid in self.groups.requests])

    def _commit(self, record: tuple, trained: wire.Trained) -> None:
        """Advance the clock to a Trained version and record its step (the rollout workers are
        told by the train loop, after this); `record` is (step, samples, their trained sequences
        as (sample, episodes.Sequence, its staleness), stale, wait_s, t0)."""
        step, samples, seqs, stale, wait_s, t0 = record
        train_s = time.perf_counter() - t0
        if trained.version != self.version + 1:
            raise WorkerFailed("trainer", f"reported version {trained.version} after {self.version}")
        # Commit: the controller is the only writer of the clock, and tells the rollout workers only now.
        self.step = step
        self.admission.commit(trained.version, len(stale))  # guided members took no admission slot
        wall = time.perf_counter() - self._t0
        self._commit_wall[self.version] = wall
        self.keeper.retain()
        self.counts.trained(sum(stats.trained_tokens(q.completion, q.mask) for _, q, _ in seqs), stale, len(seqs))
        self.counts.stepped(trained)
        self._max_trained_staleness = max(self._max_trained_staleness, *stale)
        teacher_kl = trained.stats.pop("teacher_kl_seq", None) or [None] * len(seqs)  # teacher.model: per sequence
        self.log.rows("samples", (stats.sample_row(s, staleness=st, step=self.step, sequence=q, teacher_kl=kl)
                                  for (s, q, st), kl in zip(seqs, teacher_kl, strict=True)))
        row = stats.step_row(self.step, self.version, wall, train_s, wait_s, samples, stale, self.counts,
                             trained, replay_groups=len(self.replay), in_flight=len(self.groups.requests))
        if self._process.enabled:
            row |= process_reward.step_fields([s.process for s in samples], self.counts.gen_tokens,
                                              self._process)
        self.log.row("steps", row)
        self.log.events.info("version_commit", version=self.version, step=self.step)
        self.stream.publish({"kind": "step", **row})
        self._watch.step(row, samples)

    # ------------------------------------------------------------------ resuming

    def run_state(self) -> dict[str, Any]:
        """The controller's part of a checkpoint (keeping.RunState), at one instant after a commit."""
        return keeping.RunState(
            step=self.step, version=self.version, trained=self.admission.trained, consumed=self._consumed,
            next_group=self.groups.peek_id(), wall_s=time.perf_counter() - self._t0,
            open_groups=self.groups.open_tasks(), counts=self.counts, eval_curve=self.evals.curve,
            commit_wall=self._commit_wall, time_to_threshold=self.evals.time_to_threshold,
            max_trained_staleness=self._max_trained_staleness, process=self._process.state(),
            busy={"rollout": self._rollout_busy.seconds(), "trainer": self._trainer_busy.seconds()}).to_dict()

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
                self.log.events.info("queues", in_flight=len(self.groups.requests), replay_groups=len(self.replay),
                                     pending_groups=len(self.groups.pending), live=self.admission.live,
                                     version=self.version)
                await self.log.flush()
                # the next probe from here: the flush waited on a write, not on a blocked loop; the
                # redraw below does block the loop, and the next probe counts it
                expected = time.perf_counter() + MONITOR_PERIOD_S
                self._watch.refresh()

    # ------------------------------------------------------------------ summary

    def _summarize(self, error: BaseException | None) -> dict:
        busy = [b.seconds() for b in self.rollout.busy]
        wall = time.perf_counter() - self._t0 if self._t0 else 0.0  # after `busy`: never below it
        detail = stats.worker_rows(self._shares, busy, wall - self._spent) if self._shares else []
        return stats.summarize(
            self.settings, self.counts, wall=wall,
            steps=self.step, version=self.version, cold_start=self._cold_start,
            max_trained_staleness=self._max_trained_staleness, resumes=self.keeper.resumes, best=self.keeper.best,
            eval_curve=self.evals.curve, time_to_threshold=self.evals.time_to_threshold,
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
