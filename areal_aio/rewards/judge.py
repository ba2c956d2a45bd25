"""A judge model as the reward (task.reward = "judge", [judge] settings, docs/judge.md).

    reply --rubric (judge.rubric: {prompt}, {reply}, {answer})--> one user message
          --complete (a port: an OpenAI-compatible URL, or a local worker the run starts)--> verdict text
          --parse (judge.verdict: choice | score)--> Score (reward in 0..1; passed at >= 0.5)

The judge is an async reward: the scorer awaits it on the event loop like any other async reward,
so a slow judge delays its own group, never the loop (its own calls: at most
judge.max_concurrent in flight, each bounded by controller.reward_timeout_s). A verdict that
does not parse scores 0 and is counted (Score.failed: reward_failures), and the judge's reply is
kept (`record`: the run's events.jsonl, judge_unparsed).

Where the verdicts come from is a port, `complete(messages, max_tokens) -> str`:
  * judge.url: `http_complete`, POST <url>/chat/completions (greedy, non-streaming, urllib in a thread), here;
  * a local judge.model: the controller serves it with a rollout worker of its own
    (control/judging.py) and binds its port with `bind`.
"""

from __future__ import annotations

import asyncio
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from areal_aio.rewards.score import Score
from areal_aio.settings import JudgeSettings
from areal_aio.tasks.task import Task

Complete = Callable[[list[dict[str, str]], int], Awaitable[str]]
"""The judge's port: its reply to a chat (a list of {role, content}), at most max_tokens tokens."""

PASS_WORDS = ("pass", "yes", "correct", "true")
FAIL_WORDS = ("fail", "no", "incorrect", "wrong", "false")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
FIRST_WORD = re.compile(r"[A-Za-z]+")
HTTP_TIMEOUT_S = 60.0
"""The most one HTTP exchange may take, socket timeout (the scorer's reward timeout is usually the
tighter bound; a call it gave up ends in its thread by this one)."""


class JudgeUnbound(RuntimeError):
    """A local judge asked before the run served it (control/judging.py binds it)."""


def parse(verdict: str, kind: str, scale: float) -> float | None:
    """The reward in a judge's reply, or None where it says nothing parseable: `choice`, its
    first word (PASS_WORDS 1.0, FAIL_WORDS 0.0); `score`, its first number / scale, within 0..1."""
    if kind == "choice":
        word = FIRST_WORD.search(verdict)
        if word is None:
            return None
        w = word.group(0).lower()
        return 1.0 if w in PASS_WORDS else 0.0 if w in FAIL_WORDS else None
    number = NUMBER.search(verdict)
    if number is None:
        return None
    value = float(number.group(0)) / scale
    return value if 0.0 <= value <= 1.0 else None


def rubric(template: str, task: Task, reply: str) -> str:
    """The judge's prompt: `template` with {prompt}, {reply} and {answer} filled in (other braces kept)."""
    fields = {"prompt": task.prompt, "reply": reply, "answer": task.answer or ""}
    return re.sub(r"\{(prompt|reply|answer)\}", lambda m: fields[m.group(1)], template)


class Judge:
    """task.reward = "judge": called as judge(task, completion) -> Score (async)."""

    def __init__(self, cfg: JudgeSettings) -> None:
        self.cfg = cfg
        self._complete: Complete | None = http_complete(cfg.url, cfg.model, cfg.key_env) if cfg.url else None
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.record: Callable[[dict[str, Any]], None] | None = None
        self.calls = self.unparsed = 0

    @property
    def local(self) -> bool:
        """True for a judge the run serves itself (no judge.url): it needs `bind` first."""
        return not self.cfg.url

    def bind(self, complete: Complete, record: Callable[[dict[str, Any]], None] | None = None) -> None:
        """The port its verdicts come from (a local judge's worker), and where unparsed ones go."""
        self._complete = complete
        self.record = record

    async def __call__(self, task: Task, completion: str) -> Score:
        if self._complete is None:
            raise JudgeUnbound("judge.model: a local judge is served inside `run` only; give judge.url "
                               "to judge elsewhere")
        messages = [{"role": "user", "content": rubric(self.cfg.rubric, task, completion)}]
        async with self._slots:
            self.calls += 1
            verdict = await self._complete(messages, self.cfg.max_tokens)
        value = parse(verdict, self.cfg.verdict, self.cfg.scale)
        if value is None:
            self.unparsed += 1
            if self.record is not None:
                self.record({"task_id": task.id, "reply": completion[-2000:], "verdict": verdict[:2000]})
            return Score(0.0, False, failed=True)
        return Score(value, value >= 0.5)


def key_header(key_env: str) -> dict[str, str]:
    """The Authorization header of judge.key_env's key ({} without one)."""
    key = os.environ.get(key_env) if key_env else None
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_complete(url: str, model: str, key_env: str = "") -> Complete:
    """The port of an OpenAI-compatible server at base URL `url` (http or https): a greedy,
    non-streaming chat completion per call, its first choice's content. Each call is one
    urllib request in a thread of its own (the loop never waits on the socket)."""
    base = urllib.parse.urlsplit(url.rstrip("/"))
    if base.scheme not in ("http", "https") or not base.hostname:
        raise ValueError(f"judge.url: {url!r} is not an http(s) URL")
    endpoint = f"{url.rstrip('/')}/chat/completions"

    def post(body: bytes) -> bytes:
        request = urllib.request.Request(endpoint, body, {"Content-Type": "application/json", **key_header(key_env)})
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"judge.url answered HTTP {exc.code}: {exc.read()[:200]!r}") from None

    async def complete(messages: list[dict[str, str]], max_tokens: int) -> str:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                **({"model": model} if model else {})}
        content = orjson.loads(await asyncio.to_thread(post, orjson.dumps(body)))["choices"][0]["message"]["content"]
        return content if isinstance(content, str) else ""

    return complete
