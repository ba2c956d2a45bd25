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
    (admitted, restarts, eval_tokens, lost_in_flight, guided: one line each where they happen)
    WorkerShare        one rollout worker's part: its requests and training tokens

Each row's fields are described beside the function that builds it (STEP_FIELDS, SAMPLE_FIELDS,
SUMMARY_FIELDS, WORKER_FIELDS; the other writers keep theirs likewise): docs/metrics.md is
generated from them, and a field written without a description fails its test.
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
    endpoint_calls: int = 0  # chat completions the OpenAI-compatible endpoint answered (agents/endpoint.py)
    guided: int = 0  # members task.guide wrote into groups (control/guidance.py): not admitted, not sampled
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


WORKER_FIELDS: dict[str, str] = {
    "worker": "The worker's index in rollout.devices (0 for a single worker).",
    "device": "The device it generated on, as it reported it at start.",
    "requests": "Completions it returned in this process: training rollouts, eval answers, an episode's replies, "
                "process-reward continuations and aborted requests.",
    "gen_tokens": "Tokens of the training replies it returned whole in this process (the workers' sum is the "
                  "summary's gen_tokens in a run that did not resume).",
    "idle_frac": "Fraction of this process's wall time it had no request out, however busy the others were; null "
                 "when no time passed.",
}
"""summary.json's rollout_workers_detail: one entry per rollout worker (`worker_rows`)."""


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


SAMPLE_FIELDS: dict[str, str] = {
    "kind": "\"train\": a training sample, trained or dropped (eval answers are \"eval\" rows).",
    "request_id": "The sample's request id, g<group>.<index>, with ~<n> after its n-th restart.",
    "sequence": "Only in an episode run, on a trained row: this sequence's place (from 0) among those its episode "
                "trained.",
    "sequences": "Only in an episode run, on a trained row: how many sequences its episode trained (more than 1 "
                 "when a call through the endpoint rewrote the episode's history).",
    "group": "The group id: the group_size samples of one prompt, whose rewards set each other's advantage.",
    "task_id": "The task's id.",
    "prompt": "The task's prompt.",
    "answer": "The task's reference answer.",
    "reply": "The reply's text (an episode's: its last reply; the others are in turns); null when no reply came "
             "back.",
    "reward": "The reward it trained with: the reward function's, shaped by task.overlong_buffer and combined "
              "with the process reward where those are on; null when it was dropped before it was scored.",
    "pass": "Whether the final answer is correct (the first reward of a weighted set decides); null when not "
            "scored.",
    "strict": "Correct and inside the answer tag; null when not scored.",
    "reward_failed": "The reward function raised or timed out, and the sample scored 0; null when not scored.",
    "rewards": "Only with a weighted set of rewards or task.overlong_buffer: each reward's own value by name, "
               "unweighted (`overlong`: the penalty, 0 or below).",
    "oldest_version": "The policy version of the reply's oldest token (-1 for a reply without a token); null "
                      "when no reply came back.",
    "newest_version": "The policy version of its newest token; above oldest_version when weights changed while "
                      "it was generated.",
    "staleness": "On a trained row: versions between the reply's oldest token (of this sequence) and the policy "
                 "that trained it; null on a dropped row.",
    "interrupts": "Weight loads the reply lived through while it was generated; null when no reply came back.",
    "retries": "Times the sample was sent again after an abort (controller.on_interrupt = restart).",
    "dropped": "Null for a trained sample; else why it was not trained: stale (older than max_staleness when its "
               "batch formed), interrupt (restarted past controller.max_retries), episode (no episode of its "
               "group replied) or uniform (dynamic sampling: its group's rewards were equal).",
    "step": "The step that trained it; null on a dropped row.",
    "guided": "Only on a guided member (task.guide): true. Its reply was written by the guide, not sampled; "
              "it trained in its group with importance weight 1.",
    "teacher_kl": "Only with a teacher (teacher.model), on a trained sequence: its mean reverse KL per trained "
                  "token, log pi_prox - log pi_teacher at the tokens it sampled.",
    "tokens": "The reply's tokens (an episode's: its replies' and turns' ids); 0 when no reply came back.",
    "process": "Only with process.mode on: the process reward's record of this reply (see the table below).",
    "turns": "Only in an episode run: the episode's record, one entry per reply and per added turn: role, text, "
             "tokens, trained (whether the loss sees it) and cut (true on a turn cut to the token bound); a text "
             "over 2000 characters keeps its head and tail.",
}
"""samples.jsonl's row of a training sample (`sample_row`), once its fate is known."""


def sample_row(s: Any, *, staleness: int | None = None, step: int | None = None,
               dropped: str | None = None, sequence: Any = None, teacher_kl: float | None = None) -> dict[str, Any]:
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
        **({"guided": True} if getattr(s, "written", 0) else {}),
        **({"teacher_kl": teacher_kl} if teacher_kl is not None else {}),
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


STEP_FIELDS: dict[str, str] = {
    "step": "The step, from 1: steps committed so far, a skipped update included.",
    "version": "The policy version this step committed (the trainer publishes it; the rollout workers load it "
               "next).",
    "wall_s": "The run's wall seconds at the commit, counted from its start (a resumed run goes on from the "
              "checkpoint's).",
    "train_s": "Seconds from the Train request to its commit: the trainer's update, publishing the weights, "
               "and the pipe.",
    "wait_s": "Seconds the train loop waited for a fresh batch before it sent Train: near 0 when generation "
              "keeps ahead of training.",
    "reward_mean": "Mean reward of the batch's samples, as trained (the trainer's own figure replaces it, see "
                   "below).",
    "reward/<name>": "Only with a weighted set of rewards or task.overlong_buffer: each reward's own mean over "
                     "the batch, unweighted (`reward/overlong`: the mean penalty).",
    "pass_rate": "Fraction of the batch's samples whose final answer is correct.",
    "strict_rate": "Fraction of the batch's samples correct and inside the answer tag.",
    "groups": "Groups in the batch (trainer.batch_size / rollout.group_size).",
    "spread_frac": "Fraction of the batch's groups whose rewards differ: the only ones a group-relative "
                   "advantage learns from.",
    "solved_frac": "Fraction of the batch's groups whose every reply passes.",
    "unsolved_frac": "Fraction of the batch's groups where no reply passes.",
    "guided": "Guided members (task.guide) trained in this step's groups besides the sampled replies; the "
              "rates above leave them out.",
    "staleness_max": "The batch's largest staleness: versions between a sample's oldest token and the policy "
                     "that trains it (at most the run's max_staleness, in summary.json).",
    "staleness_mean": "The batch's mean staleness.",
    "replay_groups": "Groups scored and waiting in the replay buffer at the commit, beyond this batch.",
    "in_flight": "Training requests out with the rollout workers at the commit.",
    "gen_tokens_per_s": "Tokens generated so far (training rollouts and evals) per wall second of the run: an "
                        "average since the start, not this step's rate.",
    "train_tokens_per_s": "Tokens trained so far per wall second of the run, averaged likewise.",
}
"""steps.jsonl's row of a committed step, the controller's part (`step_row`); the trainer's stats
(workers/trainer/worker.py TRAIN_STATS) and, in process mode, the process reward's
(rewards/process.py) join it."""


def step_row(step: int, version: int, wall: float, train_s: float, wait_s: float, samples: Sequence[Any],
             stale: list[int], counts: Counts, trained: wire.Trained, **queues: int) -> dict[str, Any]:
    """The steps.jsonl row of a committed step; `queues`: depths at the commit (replay_groups, in_flight).
    Its rates are the sampled replies' (a guided member, task.guide, is counted in `guided` only)."""
    guided = sum(1 for s in samples if getattr(s, "written", 0))
    samples = [s for s in samples if not getattr(s, "written", 0)]
    scores = [s.score for s in samples]
    rewards = [sc.reward for sc in scores]
    return {"step": step, "version": version, "wall_s": round(wall, 3),
            "train_s": round(train_s, 3), "wait_s": round(wait_s, 3),
            "reward_mean": sum(rewards) / len(rewards), **component_means(scores),
            "pass_rate": sum(sc.passed for sc in scores) / len(samples),
            "strict_rate": sum(sc.strict for sc in scores) / len(samples),
            **group_fields((s.group_id, s.score.reward, s.score.passed) for s in samples),
            "guided": guided,
            "staleness_max": max(stale), "staleness_mean": sum(stale) / len(stale),
            **queues,
            "gen_tokens_per_s": (counts.gen_tokens + counts.eval_tokens) / max(wall, 1e-9),
            "train_tokens_per_s": counts.trained_tokens / max(wall, 1e-9),
            **{k: v for k, v in trained.stats.items() if k not in ("step", "version")}}


SUMMARY_FIELDS: dict[str, str] = {
    "mode": "run.mode: sync, one_step or areal.",
    "max_staleness": "The staleness bound in force (eta: 0 for sync, 1 for one_step, controller.max_staleness "
                     "for areal); null for unbounded.",
    "objective": "trainer.objective.",
    "interrupt": "rollout.interrupt: whether new weights load in the middle of a reply.",
    "seed": "run.seed.",
    "model": "model.path.",
    "wall_s": "The run's wall seconds, start to summary, the processes before a resume included.",
    "steps": "Steps committed.",
    "final_version": "The last committed policy version (what model/ holds).",
    "samples_admitted": "Training rollouts admitted (group_size per task taken from the source).",
    "samples_generated": "Training rollouts that came back whole (an episode: once, when it ended with a reply).",
    "samples_accepted": "Samples trained.",
    "sequences_trained": "Sequences trained: samples_accepted, plus the earlier sequences of episodes whose history "
                         "was rewritten through the endpoint.",
    "samples_dropped_stale": "Samples dropped when their batch formed: older than max_staleness.",
    "samples_dropped_interrupt": "Samples dropped with their group after a restart past controller.max_retries.",
    "samples_unused": "Samples admitted and neither trained nor dropped: still generating, scoring or waiting in the "
                      "replay buffer when the run stopped.",
    "interrupts": "Weight loads lived through by the training replies that came back whole, summed.",
    "restarts": "Samples sent again after an abort (controller.on_interrupt = restart).",
    "reward_failures": "Reward calls that raised or timed out (each scored 0).",
    "episode_failures": "Episodes that raised, timed out, passed a bound or never replied (each scored 0).",
    "samples_dropped_episode": "Samples of groups dropped because none of their episodes replied.",
    "samples_skipped_uniform": "Samples scored and not trained because their group's rewards were equal "
                               "(controller.dynamic_sampling).",
    "samples_guided": "Members task.guide wrote into groups (a tagged copy of a correct reply, a reference "
                      "reply): trained beside the sampled ones, never admitted, so not in samples_admitted.",
    "steps_skipped": "Steps whose update the trainer skipped: a loss or gradient norm that was not finite.",
    "endpoint_calls": "Chat completions the OpenAI-compatible endpoint answered (episode runs).",
    "endpoint_errors": "The endpoint's error answers by HTTP status, {\"429\": n, ...}; {} when none.",
    "dynamic_sampling": "controller.dynamic_sampling.",
    "max_staleness_trained": "The largest staleness of any trained sample.",
    "lost_in_flight": "Samples of the groups admitted and not trained at the checkpoints this run resumed from: "
                      "generated again first, under the same seeds.",
    "resumes": "One entry per resume, in order (see the table below); [] for a run never resumed.",
    "best_eval": "The held-out eval with the highest pass rate of a trained version (see the table below); null "
                 "when no trained version was evaluated.",
    "staleness_hist": "Trained samples by staleness, {\"0\": n, \"1\": n, ...}.",
    "eval_curve": "Every held-out eval's row, by step (the eval rows below).",
    "threshold": "run.threshold; null when off (0).",
    "time_to_threshold_s": "The smallest wall_s of an eval at or above run.threshold: the commit time of the "
                           "version that reached it; null when none did.",
    "reward_per_1k_tokens": "Reward of every scored training sample, summed, per 1000 generated training tokens; "
                            "0.0 before any.",
    "gen_tokens": "Tokens of the training replies that came back whole (evals and continuations not counted).",
    "eval_tokens": "Tokens of the held-out evals' answers.",
    "trained_tokens": "Tokens the loss trained (an episode's added turns are masked out).",
    "process_mode": "process.mode.",
    "gen_tokens_per_s": "(gen_tokens + eval_tokens) / wall_s; 0.0 when no time passed.",
    "train_tokens_per_s": "trained_tokens / wall_s; 0.0 when no time passed.",
    "rollout_idle_frac": "Fraction of the wall time no rollout worker had a request out; null when no time "
                         "passed.",
    "trainer_idle_frac": "Fraction of the wall time the trainer had no Train or Save out; null when no time passed.",
    "rollout_workers_detail": "One entry per rollout worker (see the table below); [] when the workers never "
                              "started.",
    "loop_lag_max_ms": "The longest the controller's event loop was held past its probe period, in milliseconds: "
                       "a few ms is normal, hundreds mean something blocks the loop.",
    "sandbox": "The sandbox's layers the run's programs ran under, a line each by layer; null for a run that "
               "executes no program.",
    "folder": "The run folder.",
    "ended": "How the run ended: completed, exhausted, threshold, max_wall, stopped, interrupted or "
             "\"failed: <cause>\".",
    "error": "The failure in one line; null when the run ended by itself or was interrupted.",
}
"""summary.json (`summarize`), the controller's part; the cold start's fields (control/controller.py
COLD_START_FIELDS) and the process reward's counters (rewards/process.py) join it."""


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
        "steps_skipped": c.steps_skipped, "samples_guided": c.guided,
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
    """The sandbox's layers a run's programs ran under, a line each (sandbox/sandbox.py); None for
    a run that executes no program."""
    if not s.runs_programs:
        return None
    from areal_aio.sandbox import sandbox

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
