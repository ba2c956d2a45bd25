"""What a run counts and writes: the sample counters, the rows of samples.jsonl and
steps.jsonl, and the summary (worker busy time comes from fleet/busy.py).

The controller decides *when* something happened (a completion arrived, a group was dropped, a
step committed); this module owns *what is recorded* for it, so a counter has one place that
changes it and every row one place that builds it:

    Counts.completed   a training rollout came back       generated, gen_tokens, interrupts
    Counts.scored      its reward is in                   reward_failures, reward_sum
    Counts.replied     an episode's reply came back        gen_tokens, interrupts (completed: + generated)
    Counts.dropped     rollouts given up                   dropped_stale, dropped_interrupt, dropped_episode,
                                                           skipped_uniform
    (episode_failures: an episode that raised or passed a bound, scored 0)
    Counts.trained     a batch committed                  accepted, sequences_trained, trained_tokens,
                                                           staleness_hist
    Counts.stepped     a step committed                   steps_skipped, skipped_in_a_row
    Counts.answered    the endpoint answered a call       endpoint_calls, endpoint_errors (by status)
    (admitted, restarts, eval_tokens, lost_in_flight: one line each where they happen)
    WorkerShare        one rollout worker's part: its requests and training tokens
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from areal_aio import wire
from areal_aio.fleet.client import WorkerFailed
from areal_aio.rewards.pool import RewardPoolBroken
from areal_aio.rewards.scoring import Score, component_means
from areal_aio.settings import Settings

SKIPPED_IN_A_ROW_MAX = 3
"""Steps in a row that took no update (the trainer skips one whose loss or gradient norm is not
finite) that stop the run: one is a bad batch, several in a row a run that cannot go on (its
rewards, its learning rate, its model), and going on would spend the rest of it on no update."""


class RunFailed(RuntimeError):
    """Something in the run itself (not a worker, not the reward pool) ends it as failed, with
    one line; raised to the caller as itself, not inside an exception group (Failure)."""


class TrainingDiverged(RunFailed):
    """SKIPPED_IN_A_ROW_MAX steps in a row took no update; the run stops as failed."""


@dataclass(slots=True)
class Counts:
    admitted: int = 0
    generated: int = 0
    accepted: int = 0
    dropped_stale: int = 0
    dropped_interrupt: int = 0
    interrupts: int = 0
    restarts: int = 0
    sequences_trained: int = 0  # trained sequences: samples_accepted, plus the earlier sequences of episodes
    reward_failures: int = 0
    gen_tokens: int = 0
    eval_tokens: int = 0
    trained_tokens: int = 0
    reward_sum: float = 0.0
    lost_in_flight: int = 0  # rollouts admitted, not trained, lost by a stop and redone on resume
    episode_failures: int = 0  # episodes that raised, timed out or passed a bound (reward 0)
    dropped_episode: int = 0  # samples of groups dropped because an episode ended without a reply
    skipped_uniform: int = 0  # samples of groups not trained for equal rewards (controller.dynamic_sampling)
    steps_skipped: int = 0  # committed steps whose update the trainer skipped (not finite)
    skipped_in_a_row: int = 0  # the last steps_skipped, back to 0 at a step that updated
    endpoint_calls: int = 0  # chat completions the OpenAI-compatible endpoint answered (control/endpoint.py)
    endpoint_errors: dict[str, int] = field(default_factory=dict)  # its error answers by HTTP status ("429": n)
    staleness_hist: Counter = field(default_factory=Counter)

    def completed(self, msg: wire.Completion) -> None:
        """A training rollout came back whole (not aborted)."""
        self.generated += 1
        self.replied(msg)

    def replied(self, msg: wire.Completion) -> None:
        """A reply came back whole: one of an episode's, or a whole rollout's (`completed`)."""
        self.gen_tokens += len(msg.completion_ids)
        self.interrupts += msg.interrupts  # per sample in samples.jsonl; rebuilds in weights_loaded

    def scored(self, score: Score) -> None:
        self.reward_failures += score.failed
        self.reward_sum += score.reward

    def dropped(self, n: int, why: str) -> None:
        """`n` admitted rollouts given up: `why` is "stale", "interrupt", "episode" or "uniform"
        (dynamic sampling: equal rewards, scored and not trained)."""
        if why == "stale":
            self.dropped_stale += n
        elif why == "episode":
            self.dropped_episode += n
        elif why == "uniform":
            self.skipped_uniform += n
        else:
            self.dropped_interrupt += n

    def trained(self, tokens: int, stale: list[int], sequences: int) -> None:
        """A committed batch: `stale` holds each sample's staleness, `sequences` counts what it
        trained (an episode that rewrote its history trains one sequence of each version)."""
        self.accepted += len(stale)
        self.sequences_trained += sequences
        self.trained_tokens += tokens
        self.staleness_hist.update(stale)

    def stepped(self, trained: wire.Trained) -> None:
        """A committed step; skipped when the trainer took no optimizer step in some mini-batch
        of it (its stats' `skipped`: a loss or gradient norm that was not finite)."""
        skipped = bool(trained.stats.get("skipped"))
        self.steps_skipped += skipped
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0

    def answered(self, status: int) -> None:
        """The endpoint answered a chat completion (200) or any request with an error (`status`)."""
        if status == 200:
            self.endpoint_calls += 1
        else:
            self.endpoint_errors[str(status)] = self.endpoint_errors.get(str(status), 0) + 1

    def diverged(self, step: int) -> TrainingDiverged | None:
        """Why the run must stop after `step`, when SKIPPED_IN_A_ROW_MAX steps in a row skipped."""
        n = self.skipped_in_a_row
        if n < SKIPPED_IN_A_ROW_MAX:
            return None
        return TrainingDiverged(f"steps {step - n + 1}-{step} took no update: their loss or gradient norm "
                                f"was not finite (steps.jsonl: skipped); model/ keeps the last finite weights")

    def state(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(counts, staleness_hist) as a checkpoint stores them."""
        counts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "staleness_hist"}
        return counts, {str(k): v for k, v in self.staleness_hist.items()}

    @classmethod
    def from_state(cls, counts: dict[str, Any], hist: dict[str, int]) -> Counts:
        return cls(**counts, staleness_hist=Counter({int(k): v for k, v in hist.items()}))


@dataclass(slots=True)
class WorkerShare:
    """One rollout worker's part of the run (the summary's rollout_workers_detail)."""

    device: str
    requests: int = 0  # Completions it returned: training, eval, continuations, aborted
    gen_tokens: int = 0  # its training rollouts' tokens: the workers' sum is Counts.gen_tokens


def worker_rows(shares: Sequence[WorkerShare], busy_s: Sequence[float], wall: float) -> list[dict[str, Any]]:
    """rollout_workers_detail: per worker, its share and its idle fraction over `wall` (the
    time it had no request out, however busy the others were). A resumed run counts them
    afresh, over its own wall: its rollout.devices may differ from the checkpoint's."""
    return [{"worker": i, "device": w.device, "requests": w.requests, "gen_tokens": w.gen_tokens,
             "idle_frac": 1 - b / wall if wall else None}
            for i, (w, b) in enumerate(zip(shares, busy_s, strict=True))]


def trained_tokens(c: wire.Completion, mask: list[int] | None) -> int:
    """The tokens of a sequence its loss trains (an episode's turns are masked out)."""
    return len(c.completion_ids) if mask is None else sum(mask)


def sample_row(s: Any, *, staleness: int | None = None, step: int | None = None,
               dropped: str | None = None, sequence: Any = None) -> dict[str, Any]:
    """The samples.jsonl row of a training sample (groups.Sample), trained or dropped; a trained
    episode has one row per sequence it trained (`sequence`: an episodes.Sequence; its place
    among the episode's sequences in `sequence` and `sequences`, `request_id` the episode's)."""
    c = s.completion if sequence is None else sequence.completion
    turns = getattr(s, "turns", None) if sequence is None else sequence.turns
    place = {"sequence": sequence.index, "sequences": sequence.of} if sequence is not None and s.model else {}
    return {
        "kind": "train", "request_id": s.request_id, **place, "group": s.group_id, "task_id": s.task.id,
        "prompt": s.task.prompt, "answer": s.task.answer, "reply": c.text if c else None,
        "reward": s.score.reward if s.score else None, "pass": s.score.passed if s.score else None,
        "strict": s.score.strict if s.score else None,
        "reward_failed": s.score.failed if s.score else None,
        **({"rewards": s.score.components} if s.score and s.score.components else {}),
        "oldest_version": c.oldest_version if c else None, "newest_version": c.newest_version if c else None,
        "staleness": staleness, "interrupts": c.interrupts if c else None, "retries": s.retries,
        "dropped": dropped, "step": step, "tokens": len(c.completion_ids) if c else 0,
        **({"process": s.process} if s.process is not None else {}),
        **({"turns": turns} if turns else {})}


UNIFORM_EPS = 1e-9
"""Rewards closer than this are equal: a group of them has no GRPO advantage (dynamic sampling
skips it; steps.jsonl counts it out of `spread_frac`)."""


def has_spread(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ, so that its group-relative advantages are not all zero."""
    return max(rewards) - min(rewards) > UNIFORM_EPS


def group_fields(outcomes: Iterable[tuple[Hashable, float, bool]]) -> dict[str, Any]:
    """A batch's groups from its samples' (group id, reward, passed): how many (`groups`), and
    the shares whose rewards differ (`spread_frac`: the only ones a GRPO step learns from), whose
    replies all pass (`solved_frac`) and none passes (`unsolved_frac`); None where there are none."""
    groups: dict[Hashable, list[tuple[float, bool]]] = {}
    for group, reward, passed in outcomes:
        groups.setdefault(group, []).append((reward, passed))
    n = len(groups)
    if not n:
        return {"groups": 0, "spread_frac": None, "solved_frac": None, "unsolved_frac": None}
    members = list(groups.values())
    return {"groups": n, "spread_frac": sum(has_spread([r for r, _ in g]) for g in members) / n,
            "solved_frac": sum(all(p for _, p in g) for g in members) / n,
            "unsolved_frac": sum(not any(p for _, p in g) for g in members) / n}


def step_row(step: int, version: int, wall: float, train_s: float, wait_s: float, samples: Sequence[Any],
             stale: list[int], counts: Counts, trained: wire.Trained, **queues: int) -> dict[str, Any]:
    """The steps.jsonl row of a committed step; `queues`: depths at the commit (replay_groups, in_flight)."""
    scores = [s.score for s in samples]
    rewards = [sc.reward for sc in scores]
    return {"step": step, "version": version, "wall_s": round(wall, 3),
            "train_s": round(train_s, 3), "wait_s": round(wait_s, 3),
            "reward_mean": sum(rewards) / len(rewards), **component_means(scores),
            "pass_rate": sum(sc.passed for sc in scores) / len(samples),
            "strict_rate": sum(sc.strict for sc in scores) / len(samples),
            **group_fields((s.group_id, s.score.reward, s.score.passed) for s in samples),
            "staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
            **queues,
            "gen_tokens_per_s": (counts.gen_tokens + counts.eval_tokens) / max(wall, 1e-9),
            "train_tokens_per_s": counts.trained_tokens / max(wall, 1e-9),
            **{k: v for k, v in trained.stats.items() if k not in ("step", "version")}}


def summarize(s: Settings, c: Counts, *, wall: float, steps: int, version: int, cold_start: dict,
              max_trained_staleness: int, resumes: list[dict], best: dict, eval_curve: list[dict],
              time_to_threshold: float | None, process: dict, rollout_busy_s: float,
              trainer_busy_s: float, rollout_workers_detail: list[dict[str, Any]], lag_max_s: float,
              folder: str, error: BaseException | None, reason: str | None = None) -> dict[str, Any]:
    """summary.json: the run's settings that matter, its counts, rates and eval curve;
    `rollout_workers_detail`: worker_rows; `ended`: how it ended (`ended`, from `error` and the
    train loop's `reason`)."""
    unused = c.admitted - c.accepted - c.dropped_stale - c.dropped_interrupt - c.dropped_episode - c.skipped_uniform
    return {
        "mode": s.run.mode, "max_staleness": num(s.eta), "objective": s.trainer.objective,
        "interrupt": s.rollout.interrupt, "seed": s.run.seed, "model": s.model.path,
        **cold_start, "wall_s": round(wall, 3), "steps": steps, "final_version": version,
        "samples_admitted": c.admitted, "samples_generated": c.generated, "samples_accepted": c.accepted,
        "sequences_trained": c.sequences_trained,
        "samples_dropped_stale": c.dropped_stale, "samples_dropped_interrupt": c.dropped_interrupt,
        "samples_unused": unused, "interrupts": c.interrupts, "restarts": c.restarts,
        "reward_failures": c.reward_failures, "episode_failures": c.episode_failures,
        "samples_dropped_episode": c.dropped_episode, "samples_skipped_uniform": c.skipped_uniform,
        "steps_skipped": c.steps_skipped,
        "endpoint_calls": c.endpoint_calls, "endpoint_errors": dict(sorted(c.endpoint_errors.items())),
        "dynamic_sampling": s.controller.dynamic_sampling, "max_staleness_trained": max_trained_staleness,
        "lost_in_flight": c.lost_in_flight, "resumes": resumes,
        "best_eval": best if best["version"] is not None else None,
        "staleness_hist": {str(k): v for k, v in sorted(c.staleness_hist.items())},
        "eval_curve": sorted(eval_curve, key=lambda r: r["step"]),
        "threshold": s.run.threshold or None, "time_to_threshold_s": time_to_threshold,
        "reward_per_1k_tokens": 1000 * c.reward_sum / c.gen_tokens if c.gen_tokens else 0.0,
        "gen_tokens": c.gen_tokens, "eval_tokens": c.eval_tokens, "trained_tokens": c.trained_tokens,
        "process_mode": s.process.mode, **process,
        "gen_tokens_per_s": (c.gen_tokens + c.eval_tokens) / wall if wall else 0.0,
        "train_tokens_per_s": c.trained_tokens / wall if wall else 0.0,
        "rollout_idle_frac": 1 - rollout_busy_s / wall if wall else None,
        "trainer_idle_frac": 1 - trainer_busy_s / wall if wall else None,
        "rollout_workers_detail": rollout_workers_detail,
        "loop_lag_max_ms": round(1000 * lag_max_s, 2),
        "sandbox": sandbox_in_force(s),
        "folder": folder,
        "ended": ended(error, reason),
        "error": None if error is None or interrupted(error) else (str(error) or type(error).__name__),
    }


def sandbox_in_force(s: Settings) -> dict[str, str] | None:
    """The sandbox's layers a run's programs ran under, a line each (rewards/sandbox.py); None for
    a run that executes no program."""
    if not s.runs_programs:
        return None
    from areal_aio.rewards import sandbox

    return sandbox.layers().in_force()


ENDINGS = ("completed", "exhausted", "threshold", "max_wall", "stopped", "interrupted")
"""How a run ends, besides "failed: <cause>": completed (run.max_steps), exhausted (the task
source ran out), threshold (a held-out eval reached run.threshold), max_wall (run.max_wall_s),
stopped (Orchestrator.stop()), interrupted (cancelled: Ctrl-C, SIGTERM, a caller's cancel)."""


def ended(error: BaseException | None, reason: str | None) -> str:
    """The summary's `ended`: a run cancelled by its user (Ctrl-C, SIGTERM) was interrupted, not
    failed; one that stopped by itself says why (`reason`, from its train loop)."""
    if interrupted(error):
        return "interrupted"
    if error is not None:
        return f"failed: {cause(error)}"
    return reason or "completed"


def interrupted(error: BaseException | None) -> bool:
    """Cancelled by its user (Ctrl-C, SIGTERM, a caller's cancel): a stop, not an error."""
    return isinstance(error, (asyncio.CancelledError, KeyboardInterrupt))


def finished_by_itself(summary: dict[str, Any]) -> bool:
    """A summary of a run that ran to one of its own ends (not interrupted, not failed).
    A summary written before `ended` existed: its `error` was set for both."""
    if not isinstance(summary, dict) or summary.get("error") is not None:
        return False
    return summary.get("ended", "completed") in ENDINGS and summary.get("ended") != "interrupted"


Failure = WorkerFailed | RewardPoolBroken | RunFailed
"""What ends a run from inside its TaskGroup and is raised as itself, not as an exception group."""


def worker_failure(error: BaseException | None) -> Failure | None:
    """The WorkerFailed, RewardPoolBroken or RunFailed (TrainingDiverged, EpisodesFailing)
    inside a TaskGroup's ExceptionGroup, if that is what ended the run."""
    if isinstance(error, Failure):
        return error
    if isinstance(error, BaseExceptionGroup):
        for exc in error.exceptions:
            found = worker_failure(exc)
            if found is not None:
                return found
    return None


def cause(exc: BaseException) -> str:
    """A failure in one line: the first leaf of an exception group, its type (unless it names its
    own cause, as 'trainer worker failed: ...' does) and first line. The one line a failed
    command prints (app.runner) and a summary's `ended`."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    first = (str(exc).strip().splitlines() or [""])[0]
    return first if isinstance(exc, WorkerFailed) else f"{type(exc).__name__}: {first}".rstrip(": ")


def num(x: float) -> float | int | None:
    """eta as JSON: None for unbounded."""
    return None if math.isinf(x) else int(x)
