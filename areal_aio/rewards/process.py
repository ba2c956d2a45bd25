"""The rollout-based process reward (ProcessThinker, arXiv 2606.11209): step credit from the policy.

    trained reply --steps.parse--> K scorable steps (labelled 1..K in order, before the answer)
      for i in 1..min(K, K_max), prefix s_1..s_i:
        M continuations = Generate(prompt, prefix=s_1..s_i) at rollout.temperature and top_p, each
            up to rollout.max_new_tokens, seeds
            continuation_seed(run seed, group, sample, retry, i, j), ids p<group>.<sample>.<retry>.<i>.<j>
        c_i = share of them whose final answer (prefix + continuation, the run's scorer) is correct
      R_proc = mean of the c_i (0 for a reply with no scorable step)
    R = format_weight * valid + (min(step_bonus * K, step_bonus_cap) if valid else 0)
        + lambda_acc * R_acc + lambda_proc * R_proc            (R_acc = 1 for a correct final answer)
    gate: R_proc < tau and the final answer wrong  ->  R = penalty

Continuations are a request kind of their own. They never enter the replay buffer or a batch
and do not count toward admission: the staleness rule bounds training rollouts, and a
continuation only occupies a rollout slot while its reply's group waits for it (the group
enters the replay buffer once every sample is scored; other groups go on meanwhile). Each
keeps the versions that sampled it: a weight update mid-continuation interrupts it like a
training rollout with on_interrupt = continue (it finishes under the new weights; with
interrupts off, as in sync mode, it finishes on the old ones first). They are counted apart:
requests, tokens, the wall time with at least one in flight, and
cost_multiple = (training-rollout tokens + continuation tokens) / training-rollout tokens.

The pure functions (scorable_steps, step_score, process_score, combine) need no workers.
StepCredit is the async part the controller calls to score a finished reply: it sends the
continuations through a callable and awaits their Completions, which the controller's rollout
reader hands to `deliver`. At a stop `close` answers every waiting reply with None (it is then
never scored) and returns the request ids to abort, so no score task waits on a worker that
will not answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from areal_aio import wire
from areal_aio.rewards.scoring import Score
from areal_aio.seeds import continuation_seed
from areal_aio.settings import ProcessSettings, Settings
from areal_aio.tasks.steps import StepReply, parse
from areal_aio.tasks.task import Task

ID_PREFIX = "p"
"""Continuation request ids start with this (training rollouts 'g', eval requests 'eval')."""
PROBE_ANSWER = "<answer>0</answer>"
"""Put after a reply's steps to ask steps.parse whether the steps alone are well formed."""


# ---------------------------------------------------------------------- pure parts


def scorable_steps(reply: StepReply) -> int:
    """K: the reply's step count when its steps are well formed (labelled 1..K in order, none
    empty, nothing before Step 1), whatever is wrong after them (a missing, doubled or empty
    answer tag, text after it); 0 otherwise."""
    k = len(reply.steps)
    if reply.valid or k == 0:
        return k
    return k if parse(reply.prefix(k) + PROBE_ANSWER).valid else 0


def step_score(correct: Sequence[bool]) -> float:
    """c_i: the share of a step's continuations that reached the correct final answer."""
    return sum(correct) / len(correct)


def process_score(scores: Sequence[float]) -> float:
    """R_proc: the mean step score; 0 for a reply with no scored step."""
    return sum(scores) / len(scores) if scores else 0.0


def samples_continuations(p: ProcessSettings) -> bool:
    """Whether replies get continuations: the process term or the gate needs R_proc."""
    return p.mode != "off" and (p.lambda_proc > 0 or p.tau > 0)


def combine(p: ProcessSettings, *, correct: bool, valid: bool, steps: int,
            proc: float | None) -> tuple[float, bool]:
    """(reward, gated) of one reply. `proc` None: no process score (outcome-only: no gate and
    no process term). The step bonus is paid only to a reply in the valid format."""
    if proc is not None and proc < p.tau and not correct:
        return p.penalty, True
    bonus = min(p.step_bonus * steps, p.step_bonus_cap) if valid else 0.0
    reward = p.format_weight * valid + bonus + p.lambda_acc * correct + p.lambda_proc * (proc or 0.0)
    return reward, False


COUNTER_FIELDS: dict[str, str] = {
    "gen_tokens": "Tokens of the training replies that came back whole so far (evals and continuations not "
                  "counted).",
    "continuation_tokens": "Tokens of the continuations generated so far (an aborted one's included).",
    "continuation_requests": "Continuations sent so far.",
    "continuation_s": "Wall seconds so far with at least one continuation in flight.",
    "cost_multiple": "(gen_tokens + continuation_tokens) / gen_tokens: what the process reward multiplies "
                     "generation by; null before any token.",
    "process_replies": "Replies scored with continuations so far (those with a scorable step).",
    "process_gated": "Replies gated so far: wrong, with a process score below process.tau (rewarded "
                     "process.penalty).",
    "continuation_reward_failures": "Continuations whose reward call failed so far (counted as not correct).",
}
"""The process reward's counters (`StepCredit.stats`), the run's so far: in summary.json always (0
with process.mode off), in each steps.jsonl row with it on."""
STEP_FIELDS: dict[str, str] = {
    "process_mean": "Only with process.mode on: the mean process score (R_proc) of the batch's replies that "
                    "have one; null when none has.",
    "gated_frac": "Only with process.mode on: fraction of the batch's replies gated.",
    "format_valid_frac": "Only with process.mode on: fraction of the batch's replies in the step format.",
    **{k: f"Only with process.mode on: {v[0].lower()}{v[1:]}" for k, v in COUNTER_FIELDS.items()},
}
"""What a steps.jsonl row adds in process mode (`step_fields`)."""
RECORD_FIELDS: dict[str, str] = {
    "steps": "Scorable steps of the reply (K): well-formed steps before its answer.",
    "valid": "Whether the reply is in the step format (what format_weight and the step bonus pay for).",
    "problem": "Why it is not in the format; \"\" when it is.",
    "c": "Each scored step's share of continuations that reached the correct answer, steps 1 to "
         "min(K, process.max_scored_steps); [] without continuations.",
    "proc": "The process score R_proc, the mean of c; null when no continuations are sampled (outcome mode, "
            "a failed reward).",
    "gated": "Whether the gate replaced its reward with process.penalty.",
    "tokens": "Tokens of its continuations.",
    "versions": "[oldest, newest] policy versions of its continuations' tokens; null when none.",
}
"""A samples.jsonl training row's `process`: the record `StepCredit.score` keeps of one reply."""


def step_fields(details: Sequence[dict | None], gen_tokens: int, credit: StepCredit) -> dict[str, Any]:
    """What a steps.jsonl row adds in process mode: the batch's process score and gate rate, and
    the run's token counts so far (curves against generated tokens read them)."""
    scored = [d for d in details if d is not None]
    procs = [d["proc"] for d in scored if d["proc"] is not None]
    return {"process_mean": sum(procs) / len(procs) if procs else None,
            "gated_frac": sum(d["gated"] for d in scored) / len(scored) if scored else None,
            "format_valid_frac": sum(d["valid"] for d in scored) / len(scored) if scored else None,
            **credit.stats(gen_tokens)}


# ---------------------------------------------------------------------- continuations


class StepCredit:
    """Scores finished replies with ProcessThinker's reward, sampling continuations as needed.

    `send(msgs)` puts continuation requests on the rollout worker (the controller also counts
    them as rollout work); `judge(task, text)` is the run's scorer (its `passed` is what
    "correct" means, for the reply and for every continuation).
    """

    def __init__(self, settings: Settings, send: Callable[[list[wire.Generate]], Awaitable[None]],
                 judge: Callable[[Task, str], Awaitable[Score]]) -> None:
        self.p = settings.process
        self.enabled = self.p.mode != "off"
        self.sampling = samples_continuations(self.p)
        self._rollout = settings.rollout
        self._seed = settings.run.seed
        self._send = send
        self._judge = judge
        self._waiters: dict[str, asyncio.Future] = {}
        self._closed = False
        self.requests = 0
        self.tokens = 0
        self.replies = 0  # replies scored with continuations (at least one scorable step)
        self.gated = 0
        self.failures = 0  # continuations whose reward call failed (counted as not correct)
        self._in_flight_s = 0.0
        self._since = 0.0

    async def score(self, task: Task, text: str, outcome: Score, *, group: int, index: int,
                    retry: int) -> tuple[Score, dict] | None:
        """The reply's Score with the combined reward, and what a sample row records of it;
        None when the run stopped while its continuations were out (the reply is not scored)."""
        reply = parse(text)
        k = scorable_steps(reply)
        detail = {"steps": k, "valid": reply.valid, "problem": reply.problem, "c": [], "proc": None,
                  "gated": False, "tokens": 0, "versions": None}
        if outcome.failed:  # the reward contract: a failed reward scores 0, nothing on top
            return outcome, detail
        proc = None
        if self.sampling:
            found = await self._step_scores(task, reply, min(k, self.p.max_scored_steps),
                                            (group, index, retry))
            if found is None:
                return None
            detail["c"], detail["tokens"], detail["versions"] = found
            proc = detail["proc"] = process_score(detail["c"])
        reward, gated = combine(self.p, correct=outcome.passed, valid=reply.valid, steps=k, proc=proc)
        detail["gated"] = gated
        self.gated += gated
        return dataclasses.replace(outcome, reward=reward), detail

    async def _step_scores(self, task: Task, reply: StepReply, n: int,
                           key: tuple[int, int, int]) -> tuple[list[float], int, list[int] | None] | None:
        """([c_1..c_n], continuation tokens, [oldest, newest] version) of one reply; None if closed."""
        if n == 0:
            return [], 0, None
        if self._closed:
            return None
        r, m = self._rollout, self.p.continuations
        prefixes = [reply.prefix(i) for i in range(1, n + 1)]
        msgs = [wire.Generate(f"{ID_PREFIX}{key[0]}.{key[1]}.{key[2]}.{i}.{j}", task.text,
                              r.max_new_tokens, r.temperature, r.top_p,
                              continuation_seed(self._seed, *key, i, j), task.messages, prefix=prefixes[i - 1])
                for i in range(1, n + 1) for j in range(m)]
        futures = [self._wait(msg.request_id) for msg in msgs]
        self.requests += len(msgs)
        self.replies += 1
        await self._send(msgs)
        completions = await asyncio.gather(*futures)
        if any(c is None for c in completions):
            return None
        scores = await asyncio.gather(*(self._judge(task, prefixes[n_done // m] + comp.text)
                                        for n_done, comp in enumerate(completions)))
        self.failures += sum(s.failed for s in scores)
        c = [step_score([s.passed for s in scores[i * m:(i + 1) * m]]) for i in range(n)]
        versions = [v for comp in completions for v in comp.versions]
        return c, sum(len(comp.completion_ids) for comp in completions), \
            ([min(versions), max(versions)] if versions else None)

    def _wait(self, request_id: str) -> asyncio.Future:
        if not self._waiters:
            self._since = time.perf_counter()
        future = self._waiters[request_id] = asyncio.get_running_loop().create_future()
        return future

    def _settle(self, request_id: str) -> asyncio.Future | None:
        future = self._waiters.pop(request_id, None)
        if future is not None and not self._waiters:
            self._in_flight_s += time.perf_counter() - self._since
        return future

    def deliver(self, msg: wire.Completion) -> bool:
        """Take a continuation's Completion (True), or leave any other request's (False). One that
        comes back after `close` (aborted, or finished meanwhile) is counted and dropped."""
        if not msg.request_id.startswith(ID_PREFIX):
            return False
        self.tokens += len(msg.completion_ids)
        future = self._settle(msg.request_id)
        if future is not None and not future.done():
            future.set_result(msg)
        return True

    def close(self) -> list[str]:
        """The run stops: every waiting reply gets None, no new continuation is sent; returns the
        ids still in flight (the caller aborts them on the worker)."""
        self._closed = True
        in_flight = list(self._waiters)
        for request_id in in_flight:
            future = self._settle(request_id)
            if not future.done():
                future.set_result(None)
        return in_flight

    def seconds(self) -> float:
        """Wall seconds with at least one continuation in flight."""
        return self._in_flight_s + (time.perf_counter() - self._since if self._waiters else 0.0)

    def stats(self, gen_tokens: int) -> dict[str, Any]:
        """Counters for the summary and step rows; `gen_tokens`: training-rollout tokens so far."""
        cost = (gen_tokens + self.tokens) / gen_tokens if gen_tokens else None
        return {"gen_tokens": gen_tokens, "continuation_tokens": self.tokens,
                "continuation_requests": self.requests, "continuation_s": round(self.seconds(), 3),
                "cost_multiple": cost, "process_replies": self.replies, "process_gated": self.gated,
                "continuation_reward_failures": self.failures}

    def state(self) -> dict[str, Any]:
        """The counters a checkpoint keeps (continuations in flight are lost with their groups)."""
        return {"requests": self.requests, "tokens": self.tokens, "replies": self.replies,
                "gated": self.gated, "failures": self.failures, "seconds": self.seconds()}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state:
            self.requests, self.tokens, self.replies = state["requests"], state["tokens"], state["replies"]
            self.gated, self.failures, self._in_flight_s = state["gated"], state["failures"], state["seconds"]
