"""Held-out evaluation: one protocol, used inside a run and by `python -m areal_aio eval`.

    eval set (tasks.eval_tasks: the held-out prompts of the run's task settings)
      -> one greedy Generate per prompt (temperature 0, rollout.max_new_tokens, same engine);
         in an episode run (task.episode, task.name = calculator) one greedy episode per prompt
         instead (run_episodes: the run's episode function, its bounds, every reply greedy)
      -> the run's scorer (what task.reward names: AnswerReward with task.format_bonus by default)
      -> pass rate, strict rate (tagged and correct), mean reward

Inside a run the controller sends the requests and routes the answers (its rollout reader
owns the pipe); `evaluate_model` starts a rollout worker of its own (one per rollout.devices
entry, as a run would), so any HF folder, embedded spec or run folder is scored exactly as the
run scored its versions. It writes eval.json, and its workers' logs beside it, where `eval_file`
says: --out, the run folder scored, or runs/eval-<time>-<pid>/.

Inside a run, the Evaluator runs them:

    train loop --start(step, version)--> [eval-<step>] task: requests --send--> rollout workers
        (the baseline on version 0 and the final eval are awaited; the others run beside training)
    rollout reader --Completion--> in_flight.deliver (an Evals): the eval's answers, by request id
    every answer in --> scored --> its row: samples.jsonl, the eval curve, events, the event
        stream, the Keeper (a new best), run.threshold (a pass rate at or above it stops the run)
    an interrupted stop --> finish: the evals in flight are completed (EVAL_AT_STOP_TIMEOUT_S)

An in-run eval is a PendingEval from its first request to its row, kept in the run's Evals
(not in the task that awaits it): a stop can finish it (Evaluator.finish). An episode
eval's replies are asked for one at a time as its episodes go (Evals.expect); what its
episodes would still ask is not known at a stop, so a stop runs that eval again from its
start, within the same bound (its row says which versions answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from areal_aio import wire
from areal_aio.agents import endpoint, episodes
from areal_aio.control.sources import eval_tasks
from areal_aio.control.stats import Counts
from areal_aio.fleet.client import PipeWorker, WorkerClient
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.rewards.scoring import (
    Score,
    Scorer,
    component_means,
    load_rewards,
    only_answer_check,
)
from areal_aio.settings import Settings, SettingsError, load_settings, resolved_settings
from areal_aio.tasks.task import Task

if TYPE_CHECKING:
    from areal_aio.control.keeping import Keeper
    from areal_aio.control.runlog import RunLog

EVAL_AT_STOP_TIMEOUT_S = 60.0
"""How long an interrupted run waits for the evals it had in flight (training rollouts aborted,
the rollout workers answer only them): an in-run eval is greedy and short; one that takes longer
is lost rather than holding Ctrl-C for minutes."""


def requests(eval_set: list[Task], step: int, settings: Settings) -> list[wire.Generate]:
    """The greedy requests of the eval at `step` (ids eval<step>.<i>)."""
    r = settings.rollout
    return [wire.Generate(f"eval{step}.{i}", task.text, r.max_new_tokens, 0.0, 1.0, messages=task.messages)
            for i, task in enumerate(eval_set)]


async def score(scorer: Scorer, eval_set: list[Task], completions: list[wire.Completion]) -> list[Score]:
    return list(await asyncio.gather(*(scorer.score(t, c.text)
                                       for t, c in zip(eval_set, completions, strict=True))))


Ask = Callable[[wire.Generate], Awaitable[wire.Completion]]
"""Send one greedy Generate to the rollout workers and await its Completion."""


@dataclass(slots=True)
class EpisodeEval:
    """An episode eval's answers, in the order of the eval set."""

    completions: list[wire.Completion]
    scores: list[Score]
    turns: list[list[dict[str, Any]]]  # each episode's record (episodes.Transcript.turns)
    failed: list[bool]  # each episode raised, timed out, passed a bound or never replied (scored 0)

    @property
    def failures(self) -> int:
        return sum(self.failed)


async def run_episodes(episode: episodes.Episode, eval_set: list[Task], step: int, settings: Settings,
                       scorer: Scorer, ask: Ask, label: str = "") -> EpisodeEval:
    """Each held-out task as one episode of the run's episode function, with every reply greedy
    (ids eval<step><label>.<i>.r<reply>), under the run's episode bounds; scored as a training
    episode is (its own reward, else task.reward on the last reply; one that fails, or ends
    without a reply, scores 0)."""
    bounds = episodes.Bounds.of(settings)

    async def one(i: int, task: Task) -> tuple[wire.Completion, Score, list[dict[str, Any]], bool]:
        replies = itertools.count()

        def request(reply: episodes.ReplyRequest) -> Awaitable[wire.Completion]:
            return ask(reply.generate(f"eval{step}{label}.{i}.r{next(replies)}", task, 0.0, 1.0))

        model = episodes.Model(bounds, request)
        score, failure = await episodes.play(episode, task, model, bounds.timeout_s)
        # one that never replied failed (episodes.play): it cannot pass, whatever it returned
        completion = model.transcript.completion() or episodes.no_reply(f"eval{step}.{i}")
        if score is None:
            score = await scorer.score(task, completion.text)
        return completion, score, model.transcript.turns, failure is not None

    done = await asyncio.gather(*(one(i, task) for i, task in enumerate(eval_set)))
    return EpisodeEval([d[0] for d in done], [d[1] for d in done], [d[2] for d in done], [d[3] for d in done])


RATE_FIELDS: dict[str, str] = {
    "pass_rate": "Fraction of the held-out prompts answered correctly (greedy).",
    "strict_rate": "Fraction answered correctly inside the answer tag.",
    "reward_mean": "Mean reward over the held-out set: task.reward's, never shaped (no overlong penalty, no "
                   "process reward).",
    "reward/<name>": "Only with a weighted set of rewards: each reward's own mean, unweighted.",
}
"""What `rates` gives: an eval row's and eval.json's scores."""
EVAL_FIELDS: dict[str, str] = {
    "step": "The step after which the eval started: 0 is the baseline on the untrained model, then every "
            "task.eval_every steps and the last step.",
    "version": "The newest policy version that answered (with interrupts an answer can finish on newer weights "
               "than the eval started on).",
    "wall_s": "The run's wall seconds when that version was committed: plot pass_rate against it for time to "
              "quality (the eval's own time is not in it).",
    "done_s": "The run's wall seconds when the eval's row was written.",
    **RATE_FIELDS,
    "versions": "[oldest, newest] policy versions among the answers' tokens.",
    "episode_failures": "Only in an episode run: held-out episodes that failed (each scored 0).",
}
"""An eval row (`Evaluator._row`): summary.json's eval_curve, the `eval` event, the trackers."""


def rates(scores: list[Score]) -> dict[str, float]:
    """pass_rate, strict_rate, reward_mean and, for a weighted set of rewards, reward/<name>."""
    n = len(scores)
    return {"pass_rate": sum(s.passed for s in scores) / n, "strict_rate": sum(s.strict for s in scores) / n,
            "reward_mean": sum(s.reward for s in scores) / n, **component_means(scores)}


EVAL_SAMPLE_FIELDS: dict[str, str] = {
    "kind": "\"eval\": one held-out prompt's answer.",
    "step": "The eval's step (0 in eval.json).",
    "task_id": "The task's id.",
    "prompt": "The task's prompt.",
    "answer": "The task's reference answer.",
    "reply": "The greedy reply's text (an episode's: its last reply).",
    "reward": "Its reward (task.reward's, never shaped).",
    "pass": "Whether its final answer is correct.",
    "strict": "Correct and inside the answer tag.",
    "rewards": "Only with a weighted set of rewards: each reward's own value by name, unweighted.",
    "tokens": "The reply's tokens (an episode's: its replies' and turns' ids).",
    "turns": "Only in an episode run: the episode's record, as a training row's.",
}
"""samples.jsonl's row of one held-out answer (`sample_rows`); eval.json's samples too."""


def sample_rows(step: int, eval_set: list[Task], completions: list[wire.Completion],
                scores: list[Score], turns: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One samples.jsonl row per prompt (kind "eval"); an episode's keeps its `turns`."""
    return [{"kind": "eval", "step": step, "task_id": task.id, "prompt": task.prompt, "answer": task.answer,
             "reply": c.text, "reward": s.reward, "pass": s.passed, "strict": s.strict,
             **({"rewards": s.components} if s.components else {}), "tokens": len(c.completion_ids),
             **({"turns": t} if t else {})}
            for task, c, s, t in zip(eval_set, completions, scores, turns or [None] * len(eval_set), strict=True)]


class PendingEval:
    """One in-run eval from its first request to its row. It lives in `Evals`, not in the task
    that runs it, so a stop that cancels that task can still finish it (the controller's
    Evaluator.finish): which requests are sent, which answers are in."""

    def __init__(self, step: int, version: int, requests: list[wire.Generate]) -> None:
        self.step, self.version, self.requests = step, version, requests
        self.sent = 0  # requests[:sent] are with the rollout workers
        self.answers: list[wire.Completion] = [None] * len(requests)  # type: ignore[list-item]
        self.missing = len(requests)
        self.answered = asyncio.Event()  # set once every answer is in


class Evals:
    """The run's evals in flight, by step; `deliver` hands each eval answer to its eval (the
    rollout reader calls it for every Completion)."""

    def __init__(self) -> None:
        self.open: dict[int, PendingEval] = {}
        self._of: dict[str, tuple[PendingEval, int]] = {}  # request id -> (its eval, its index)
        self._waiting: dict[str, asyncio.Future] = {}  # an episode eval's reply -> its Completion
        self.abandoned: list[str] = []  # episode eval replies given up (cancelled): to abort
        self.interrupted: dict[int, int] = {}  # episode evals a stop cancelled: step -> version

    def expect(self, request_id: str) -> asyncio.Future:
        """The future an episode eval's reply `request_id` is delivered to."""
        future = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, request_id: str) -> None:
        """An episode eval's reply no longer wanted: one still awaited is to be aborted."""
        if self._waiting.pop(request_id, None) is not None:
            self.abandoned.append(request_id)

    def begin(self, step: int, version: int, requests: list[wire.Generate]) -> PendingEval:
        pending = self.open[step] = PendingEval(step, version, requests)
        self._of.update((msg.request_id, (pending, i)) for i, msg in enumerate(requests))
        return pending

    def deliver(self, msg: wire.Completion) -> bool:
        """Take an eval request's answer (True), or leave any other request's (False)."""
        if (future := self._waiting.pop(msg.request_id, None)) is not None:
            if not future.done():
                future.set_result(msg)
            return True
        found = self._of.pop(msg.request_id, None)
        if found is None:
            return False
        pending, i = found
        pending.answers[i] = msg
        pending.missing -= 1
        if not pending.missing:
            pending.answered.set()
        return True

    def end(self, pending: PendingEval) -> None:
        """Its row is written: no longer in flight."""
        self.open.pop(pending.step, None)
        for msg in pending.requests:
            self._of.pop(msg.request_id, None)


class Evaluator:
    """The run's held-out evals, from their start to their row; owns the eval curve and the time
    to threshold, and the evals in flight (`in_flight`, whose `deliver` the rollout reader calls).

    Given what it reads and calls, never the controller: the Keeper (which version each eval
    started on, the best eval), the counters (eval tokens); `send(msg)` hands one Generate to
    the rollout workers (counted busy), `publish(row)` puts a row on the event stream,
    `on_threshold()` asks the run to stop; `commit_wall` (version -> the run's wall seconds at
    its commit, kept by the controller) and `clock()` (the run's wall seconds now) stamp a row.
    The run log and the scorer come once the run has opened them (`attach`)."""

    def __init__(self, settings: Settings, eval_set: list[Task], episode: episodes.Episode | None,
                 keeper: Keeper, counts: Counts, *, send: Callable[[wire.Generate], Awaitable[None]],
                 publish: Callable[[dict], None], on_threshold: Callable[[], None],
                 commit_wall: dict[int, float], clock: Callable[[], float],
                 curve: list[dict] | None = None, time_to_threshold: float | None = None) -> None:
        self.settings = settings
        self.eval_set = eval_set
        self.episode = episode
        self.keeper = keeper
        self.counts = counts
        self._send_one = send
        self._publish = publish
        self._on_threshold = on_threshold
        self._commit_wall = commit_wall
        self._clock = clock
        self.curve: list[dict] = curve if curve is not None else []  # one row per eval, as it ends
        self.time_to_threshold = time_to_threshold
        # held-out evals between their first request and their row (outlive a stop)
        self.in_flight = Evals()
        self.tasks: set[asyncio.Task] = set()  # the evals running beside training (eval-<step>)
        self.log: RunLog | None = None  # set by attach
        self.scorer: Scorer | None = None

    def attach(self, log: RunLog, scorer: Scorer) -> None:
        """The run's log and scorer, once open (before the baseline eval)."""
        self.log, self.scorer = log, scorer

    # ------------------------------------------------------------------ during the run

    def start(self, tg: asyncio.TaskGroup, step: int, version: int) -> None:
        """The eval of `step` (on `version`) as a task of the run, beside training."""
        task = tg.create_task(self.run(step, version), name=f"eval-{step}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def ran(self, step: int) -> bool:
        """The eval of `step` has its row."""
        return any(row["step"] == step for row in self.curve)

    async def last(self, tg: asyncio.TaskGroup, step: int, version: int) -> None:
        """The final eval (unless that step's ran or is running), then every eval still running."""
        if not self.ran(step) and not any(t.get_name() == f"eval-{step}" for t in self.tasks):
            self.start(tg, step, version)
        if self.tasks:
            await asyncio.gather(*self.tasks)

    async def run(self, step: int, version: int) -> None:
        """Greedy answers on the held-out set; never enters training. A stop that cancels this
        leaves the eval open: `finish` completes it. An episode run's eval is greedy episodes."""
        if self.episode is not None:
            await self._run_episodes(step, version)
            return
        pending = self.in_flight.begin(step, version, requests(self.eval_set, step, self.settings))
        self.keeper.eval_starts[step] = version
        await self._send(pending)
        await pending.answered.wait()
        await self._record(pending)

    async def _run_episodes(self, step: int, version: int, label: str = "") -> None:
        """One greedy episode per held-out task (run_episodes). A stop that cancels it leaves it
        in Evals.interrupted: `finish` runs it again (label "s": new request ids, the cancelled
        replies are aborted)."""
        self.keeper.eval_starts[step] = version
        try:
            done = await run_episodes(self.episode, self.eval_set, step, self.settings,
                                      self.scorer, self._ask, label)
        except asyncio.CancelledError:
            self.in_flight.interrupted[step] = version
            raise
        self._row(step, version, done.completions, done.scores, done.turns, episode_failures=done.failures)

    async def _ask(self, msg: wire.Generate) -> wire.Completion:
        """One reply of an episode eval: sent, then awaited (the rollout reader delivers it)."""
        answer = self.in_flight.expect(msg.request_id)
        try:
            await self._send_one(msg)
            return await answer
        finally:
            self.in_flight.forget(msg.request_id)  # cancelled: aborted by the stop (take_abandoned)

    async def _send(self, pending: PendingEval) -> None:
        """The requests of an eval not sent yet, one by one (a pool spreads them over its workers)."""
        while pending.sent < len(pending.requests):
            msg = pending.requests[pending.sent]
            pending.sent += 1  # sent once asked for, even if cancelled while it waits (WorkerClient.send_many)
            await self._send_one(msg)

    async def _record(self, pending: PendingEval) -> None:
        """An eval with every answer in: scored, then its row everywhere it goes."""
        completions = pending.answers
        scores = await score(self.scorer, self.eval_set, completions)
        self.in_flight.end(pending)
        self._row(pending.step, pending.version, completions, scores)

    def _row(self, step: int, version: int, completions: list[wire.Completion], scores: list[Score],
             turns: list[list[dict]] | None = None, **extra: Any) -> None:
        """A finished eval's row, everywhere it goes: samples, eval curve, events, best, threshold."""
        del self.keeper.eval_starts[step]
        self.counts.eval_tokens += sum(len(c.completion_ids) for c in completions)
        # With interrupts on, an eval answer can finish under newer weights than it started with;
        # the row is stamped with the newest version used, at the time that version was committed.
        newest = max(version, *(c.newest_version for c in completions))
        oldest = min((c.oldest_version for c in completions if c.versions), default=version)
        row = {"step": step, "version": newest, "wall_s": round(self._commit_wall[newest], 3),
               "done_s": round(self._clock(), 3), **rates(scores),
               "versions": [oldest, newest], **extra}
        self.log.rows("samples", sample_rows(step, self.eval_set, completions, scores, turns))
        self.keeper.evaluated(row)  # a new best: exported by the train loop (or at the stop)
        self.curve.append(row)
        self.log.events.info("eval", **row)
        self._publish({"kind": "eval", **row})
        threshold = self.settings.run.threshold
        if threshold > 0 and row["pass_rate"] >= threshold:
            if self.time_to_threshold is None or row["wall_s"] < self.time_to_threshold:
                self.time_to_threshold = row["wall_s"]
            self._on_threshold()

    # ------------------------------------------------------------------ at a stop

    @property
    def unfinished(self) -> bool:
        """Evals in flight, or episode evals a stop cancelled: what `finish` would complete."""
        return bool(self.in_flight.open or self.in_flight.interrupted)

    def cancel(self) -> None:
        """The stop begins: the eval tasks end (their evals stay in flight for `finish`)."""
        for task in list(self.tasks):
            task.cancel()

    def take_abandoned(self) -> list[str]:
        """The episode eval replies given up since the last call (their requests to abort)."""
        abandoned, self.in_flight.abandoned = self.in_flight.abandoned, []
        return abandoned

    async def finish(self, read: Callable[[], Awaitable[None]], stop_generating: Callable[[], Awaitable[None]]) -> None:
        """An interrupted run finishes the evals it had in flight, within EVAL_AT_STOP_TIMEOUT_S,
        before it writes model/ and its final checkpoint (so their rows are in it): they measure
        the weights they started on, which a resume no longer has. Training rollouts and
        continuations are aborted first (`stop_generating`); the run's rollout reader was
        cancelled, so `read` runs one here. An eval not finished in time (or a worker that fails
        now) is lost and logged."""
        evals = list(self.in_flight.open.values())
        reruns, self.in_flight.interrupted = self.in_flight.interrupted, {}
        reader = asyncio.create_task(read(), name="rollout_reader_at_stop")
        answered = asyncio.ensure_future(asyncio.gather(*(e.answered.wait() for e in evals)))
        episode_evals: list[asyncio.Future] = []
        done: asyncio.Future | None = None
        try:
            async with asyncio.timeout(EVAL_AT_STOP_TIMEOUT_S):
                await stop_generating()  # before the reader runs: it drops training answers
                for pending in evals:
                    await self._send(pending)
                episode_evals = [asyncio.ensure_future(self._run_episodes(step, version, "s"))
                                 for step, version in reruns.items()]
                done = asyncio.ensure_future(asyncio.gather(answered, *episode_evals))
                await asyncio.wait([reader, done], return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()  # a worker that failed meanwhile: raised here
                done.result()
                for pending in evals:
                    await self._record(pending)
        except Exception as exc:  # noqa: BLE001 - the stop goes on without the eval
            lost = [e.step for e in self.in_flight.open.values()] + [step for step in reruns if not self.ran(step)]
            self.log.events.info("eval_lost", steps=lost, error=f"{type(exc).__name__}: {exc}")
        finally:
            waited = [answered, reader, *episode_evals, *([done] if done is not None else [])]
            for task in waited:
                task.cancel()
            await asyncio.gather(*waited, return_exceptions=True)


# ---------------------------------------------------------------- the eval command


RUN_MARKERS = ("summary.json", "steps.jsonl", "events.jsonl")
"""Beside settings.toml, any of these makes a folder a run folder (a model folder has none)."""


def model_settings(model: str, settings_path: str | None,
                   overrides: list[str]) -> tuple[Settings, str, Path | None]:
    """(settings, model.path, the run folder MODEL is or None) for `eval MODEL`.

    A run folder (settings.toml beside its rows) is scored by its model/ with its own settings
    unless a settings file is given; a run folder without model/ is a SettingsError naming it.
    Anything else is a model spec (an HF folder, embedded:NAME, a hub id), checked by preflight.
    The model is scored as saved: rollout.quantize = auto is off here (int8 only when named)."""
    settings, spec, folder = _model_settings(model, settings_path, overrides)
    if settings.rollout.quantize == "auto":
        settings = dataclasses.replace(settings, rollout=dataclasses.replace(settings.rollout, quantize="off"))
    return settings, spec, folder


def _model_settings(model: str, settings_path: str | None,
                    overrides: list[str]) -> tuple[Settings, str, Path | None]:
    folder = Path(model)
    if (folder / "settings.toml").is_file() and any((folder / name).exists() for name in RUN_MARKERS):
        spec = str(folder / "model")
        if not (folder / "model" / "config.json").is_file():
            raise SettingsError(f"MODEL: {model} is a run folder without model/ (the run committed no "
                                "update, was killed before writing it, or model/ was removed); "
                                "`run --resume` it to write one, or give a model folder")
        if settings_path is None:
            import tomllib

            try:
                tree = tomllib.loads((folder / "settings.toml").read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise SettingsError(f"MODEL: {folder / 'settings.toml'} is not a settings file ({exc})") from None
            return resolved_settings(tree, [*overrides, f"model.path={_quoted(spec)}"]), spec, folder
        return load_settings(settings_path, [*overrides, f"model.path={_quoted(spec)}"]), spec, folder
    return load_settings(settings_path, [*overrides, f"model.path={_quoted(model)}"]), model, None


def eval_file(settings: Settings, run_folder: Path | None, out: str | None) -> Path:
    """Where `eval` writes eval.json (its logs go beside it): `--out` (a .json file, else a
    folder), else the run folder scored, else a folder of its own under run.out_dir
    (eval-<time>-<pid>), never the current folder."""
    if out is not None:
        path = Path(out)
        return path if path.suffix == ".json" else path / "eval.json"
    if run_folder is not None:
        return run_folder / "eval.json"
    return Path(settings.run.out_dir) / f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}" / "eval.json"


def _quoted(text: str) -> str:
    return orjson.dumps(text).decode()


def eval_rollout(settings: Settings, log: Path) -> WorkerClient:
    """The eval's own rollout client, placed as a run places its rollout workers: one worker
    (its log: `log`), or a RolloutPool of one per rollout.devices entry (eval-rollout-0.log ...)."""
    devices, threads = settings.rollout_devices, settings.rollout.threads
    if devices == [settings.rollout.device]:
        return PipeWorker("rollout", log, threads)
    logs = [log] if len(devices) == 1 else [log.with_name(f"{log.stem}-{i}{log.suffix}") for i in range(len(devices))]
    return RolloutPool([PipeWorker("rollout", path, threads) for path in logs], devices)


@contextlib.asynccontextmanager
async def rollout_session(settings: Settings, log: Path,
                          rollout: WorkerClient | None = None) -> AsyncIterator[WorkerClient]:
    """A rollout client (default: eval_rollout's, logging to `log`) started on
    settings.model.path for the block, stopped after it whatever it raised."""
    worker = rollout or eval_rollout(settings, log)
    try:
        await worker.prepare(settings.model.path)
        await worker.start(wire.Init("rollout", settings.to_dict(), ""))
        yield worker
    finally:
        await worker.stop()


async def answers(worker: WorkerClient, msgs: list[wire.Generate]) -> list[wire.Completion]:
    """The Completions of `msgs` from a started rollout client, in the order of `msgs` (sent one
    by one: a pool spreads them over its workers); a worker's failure is raised."""
    for msg in msgs:
        await worker.send(msg)
    got: dict[str, wire.Completion] = {}
    while len(got) < len(msgs):
        msg = await worker.recv()
        if not isinstance(msg, wire.Completion):
            raise worker.failure(msg)
        got[msg.request_id] = msg
    return [got[msg.request_id] for msg in msgs]


async def greedy_completions(settings: Settings, tasks: list[Task], log: Path,
                             rollout: WorkerClient | None = None) -> list[wire.Completion]:
    """settings.model.path's greedy replies to `tasks` (the eval requests), from a rollout
    client of its own (rollout_session), in the order of `tasks`."""
    async with rollout_session(settings, log, rollout) as worker:
        return await answers(worker, requests(tasks, 0, settings))


async def greedy_episodes(settings: Settings, tasks: list[Task], log: Path, episode: episodes.Episode,
                          scorer: Scorer, rollout: WorkerClient | None = None) -> EpisodeEval:
    """settings.model.path's greedy episodes on `tasks` (run_episodes), from a rollout client of
    its own (rollout_session), the endpoint served as a run serves it (endpoint.serving: an
    agent written against the OpenAI API plays here as in training)."""
    evals = Evals()

    async with (rollout_session(settings, log, rollout) as worker,
                endpoint.serving(settings.endpoint, True, Counts())):

        async def ask(msg: wire.Generate) -> wire.Completion:
            answer = evals.expect(msg.request_id)
            await worker.send(msg)
            return await answer

        async def read() -> None:
            while True:
                msg = await worker.recv()
                if not isinstance(msg, wire.Completion):
                    raise worker.failure(msg)
                evals.deliver(msg)

        reader = asyncio.ensure_future(read())
        run = asyncio.ensure_future(run_episodes(episode, tasks, 0, settings, scorer, ask))
        try:
            await asyncio.wait([reader, run], return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # the worker failed: raised here
            return run.result()
        finally:
            for task in (reader, run):
                task.cancel()
            await asyncio.gather(reader, run, return_exceptions=True)


EVAL_FILE_FIELDS: dict[str, str] = {
    "model": "The model scored (model.path: a run's model/, an HF folder, embedded:NAME, a hub id).",
    **RATE_FIELDS,
    "n": "Held-out prompts scored.",
    "eval_seed": "task.eval_seed: which held-out set.",
    "max_new_tokens": "rollout.max_new_tokens of the greedy replies.",
    "episode": "Only in an episode run: the episode function (task.episode).",
    "episode_failures": "Only in an episode run: episodes that failed (each scored 0).",
    "quantize": "Only when generation ran quantized: \"int8\".",
    "seconds": "Wall seconds of the eval, workers' start included.",
    "samples": "One row per held-out prompt, as samples.jsonl's eval rows (step 0).",
}
"""eval.json, what `python -m areal_aio eval` writes (`evaluate_model`)."""


async def evaluate_model(settings: Settings, out_file: Path) -> dict[str, Any]:
    """Score settings.model.path on the held-out set with the in-run protocol (greedy episodes
    in an episode run); write `out_file`."""
    eval_set = await asyncio.to_thread(eval_tasks, settings)  # code items: sandbox runs, off the loop
    reward = load_rewards(settings.task, settings.judge)
    builtin = only_answer_check(reward)
    scorer = Scorer(reward, timeout_s=settings.controller.reward_timeout_s,
                    procs=0 if builtin else settings.controller.reward_procs,
                    log_path=out_file.with_name("eval-reward.log"))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    spec = episodes.episode_spec(settings)
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    turns = None
    try:
        if spec:
            done = await greedy_episodes(settings, eval_set, out_file.with_name("eval-rollout.log"),
                                         episodes.load_episode(spec), scorer)
            completions, scores, turns = done.completions, done.scores, done.turns
            extra = {"episode": spec, "episode_failures": done.failures}
        else:
            completions = await greedy_completions(settings, eval_set, out_file.with_name("eval-rollout.log"))
            scores = await score(scorer, eval_set, completions)
    finally:
        await scorer.aclose()
    result = {"model": settings.model.path, **rates(scores), "n": len(eval_set),
              "eval_seed": settings.task.eval_seed, "max_new_tokens": settings.rollout.max_new_tokens,
              **extra, **({"quantize": settings.rollout_quantize} if settings.rollout_quantize != "off" else {}),
              "seconds": round(time.perf_counter() - t0, 3),
              "samples": sample_rows(0, eval_set, completions, scores, turns)}
    out_file.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result
