"""What an episode talks to: the `Model` a user's `async def episode(task, model)` calls, and the
one sequence it trains.

An episode is a piece of the user's asyncio code that talks to the policy several times. The
controller runs each sample of a group as one asyncio task and plays it (agents/episodes.py); the
episode gets a `Model` and calls:

    await model.reply()            -> one Generate to the rollout workers, awaits its Completion,
                                      returns the reply's text (stop=[...]: it ends at the first
                                      of these strings, kept, e.g. a tool call's closing tag)
    model.add_turn(role, text)     -> a tool or environment turn, sent with the next reply

and returns its reward (a float or a Score) or None: task.reward then scores the last reply.

Token ids grow; the chat is never templated again after the prompt. The first reply's prompt is
the task templated by the worker (as for one reply); every later Generate carries the exact ids
so far (`context_ids`) and the turns added since (`append`), which the worker renders with the
chat template as messages after the last reply (workers/models.py encode_turns) and returns
as the tail of the Completion's prompt_ids. So the sequence a sample trains on is:

    prompt_ids     = the task's prompt (the same for the whole group: the packed layout holds)
    completion_ids = reply 1 | turn ids | reply 2 | turn ids | ... | reply n
    loss_mask      = 1 .. 1  | 0 ..  0  | 1 .. 1  | ...
    logprobs       = the replies' behaviour log-probs; 0.0 on turn ids (never read)
    versions       = the replies' token versions; on turn ids the version of the reply before
                     (never read, and min(versions) stays the oldest trained token's: the
                     sample's staleness is its episode's oldest trained token)

The episode's record, each samples.jsonl row's `turns`: {role, text, tokens, trained} per reply
and per added turn (turns sent together are rendered together: the first one's row holds their
ids; "cut": true on a turn cut to the bound); a turn's text there is an excerpt past
RECORD_TEXT_CHARS; turns added after the last reply are in this record only. Bounds (task.*):
`episode_turns` replies, `episode_tokens` tokens after the prompt (replies and turns: a later
reply's Generate carries max_context = prompt + episode_tokens, and the worker, which knows the
new turns' length, gives the reply at most what is left; each reply also at most
rollout.max_new_tokens; turns that leave no room end the episode), `episode_timeout_s` seconds
of the episode's own time: its code and its tools, the clock stopped while it awaits a reply
(the reply's generation, queued behind the other sequences of a busy rollout worker, says
nothing about the episode; a timed-out episode would score 0 and train the policy away from
whatever made it wait, such as a tool call). An episode that passes one, raises, or returns something
that is not a reward scores 0 and is counted (episode_failures), as a failing reward is.

What turns add is held to the token bound twice: their text is cut to TURN_BYTES_PER_TOKEN bytes
per token left before it is sent (the pipe and the tokenizer never get a 2 MB tool output), and
their ids are cut to the tokens left before they join the sequence (`Transcript.add_reply`), so
completion_ids never hold more than episode_tokens ids, whatever a turn's text was.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from areal_aio import wire
from areal_aio.settings import Settings
from areal_aio.tasks.task import Task

Episode = Callable[[Task, "Model"], Awaitable[Any]]

TURN_BYTES_PER_TOKEN = 128
"""A turn's text is cut to this many UTF-8 bytes per token the episode has left before it is
sent: no token of a byte-level vocabulary covers more (SmolLM2's longest, a newline and 80
spaces, covers 81), so a turn that could fit is never cut, and the worker is never handed
megabytes to render and tokenize only for them to be cut."""
RECORD_TEXT_CHARS = 2000
"""The most of a turn's text its record keeps (samples.jsonl rows, eval rows): its head and its
tail, the middle left out. Every sample of a group writes its own turns at every step."""


@dataclass(frozen=True, slots=True)
class ReplyRequest:
    """One reply a Model asks for: the ids so far (None: the first reply, from the task's
    prompt), the turns to append before it, its token limit, the context bound (0: none) and its
    stop strings."""

    context_ids: list[int] | None
    append: list[dict[str, str]] | None
    max_new_tokens: int
    max_context: int
    stop: list[str] | None
    messages: list[dict[str, str]] | None = None  # a first reply's own chat (Model.start), not the task's

    def generate(self, request_id: str, task: Task, temperature: float, top_p: float,
                 seed: int | None = None) -> wire.Generate:
        """The Generate that asks for it: the first reply templates the task (its chat, if it is
        one) or the chat Model.start gave; a later one continues from the ids."""
        chat = self.messages if self.messages is not None else task.messages
        text = task.text if self.messages is None else self.messages[-1]["content"]
        return wire.Generate(request_id, text, self.max_new_tokens, temperature, top_p, seed,
                             chat if self.context_ids is None else None,
                             context_ids=self.context_ids, append=self.append, max_context=self.max_context,
                             stop=self.stop)


Request = Callable[[ReplyRequest], Awaitable[wire.Completion]]
"""How a Model gets a reply: the caller sends the request's Generate (its own id and sampling)
and returns the reply's Completion (the controller also retries aborts)."""


class EpisodeLimit(RuntimeError):
    """The episode passed one of its bounds (task.episode_turns / episode_tokens)."""


@dataclass(frozen=True, slots=True)
class Bounds:
    turns: int  # model replies per episode
    tokens: int  # tokens after the prompt: replies and turns
    timeout_s: float  # seconds of the episode's own time (the clock stops while a reply is generated)
    max_new_tokens: int  # per reply (rollout.max_new_tokens)

    @classmethod
    def of(cls, settings: Settings) -> Bounds:
        t = settings.task
        return cls(t.episode_turns, t.episode_tokens, t.episode_timeout_s, settings.rollout.max_new_tokens)


@dataclass(slots=True)
class Transcript:
    """The episode's sequence so far (module docstring) and its turns' record."""

    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # role, text, tokens, trained
    last: wire.Completion | None = None  # the last reply
    interrupts: int = 0
    gen_s: float = 0.0

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add_reply(self, msg: wire.Completion, sent: list[int] | None, added: list[dict[str, Any]],
                  room: int) -> None:
        """A reply's Completion: `sent` the context_ids its Generate carried (None: the first),
        `added` the turn rows it appended, `room` the tokens the bound left before them. The ids
        between are the turns' own; past `room` they are cut to it, and the reply, which had no
        room after them, is kept empty."""
        if sent is None:
            self.prompt_ids = list(msg.prompt_ids)
        else:
            if msg.prompt_ids[:len(sent)] != sent:
                raise RuntimeError(f"{msg.request_id}: the worker did not continue from the episode's ids")
            turn_ids = msg.prompt_ids[len(sent):]
            if len(turn_ids) > room:
                turn_ids = turn_ids[:room]
                msg = replace(msg, completion_ids=[], logprobs=[], versions=[], text="")
                if added:
                    added[0]["cut"] = True
            self.completion_ids += turn_ids
            self.logprobs += [0.0] * len(turn_ids)
            self.versions += [self.versions[-1]] * len(turn_ids)
            self.mask += [0] * len(turn_ids)
            if added:  # turns sent together are rendered together: the first row holds their ids
                added[0]["tokens"] = len(turn_ids)
        self.completion_ids += msg.completion_ids
        self.logprobs += msg.logprobs
        self.versions += msg.versions
        self.mask += [1] * len(msg.completion_ids)
        self.turns.append({"role": "assistant", "text": msg.text, "tokens": len(msg.completion_ids),
                           "trained": True})
        self.last = msg
        self.interrupts += msg.interrupts
        self.gen_s += msg.gen_s

    def completion(self) -> wire.Completion | None:
        """The whole episode as one Completion (what rows and counters read), or None before a reply."""
        if self.last is None:
            return None
        return wire.Completion(request_id=self.last.request_id, prompt_ids=self.prompt_ids,
                               completion_ids=self.completion_ids, logprobs=self.logprobs,
                               versions=self.versions, text=self.last.text, finish=self.last.finish,
                               interrupts=self.interrupts, gen_s=self.gen_s)


class Model:
    """What an episode talks to: the policy, one reply at a time, and the turns between replies.

    Served by the OpenAI-compatible endpoint (agents/endpoint.py, docs/agents.md) while its
    episode plays: `base_url` is the episode's own URL there and `openai()` a client bound to it;
    both None / an error where no endpoint runs (endpoint.enabled = false). A call through the
    endpoint is a reply of this Model (agents/chat.py); a call that rewrites the conversation
    starts a new sequence (`start`), and every sequence trains as a sample (`sequences`)."""

    def __init__(self, bounds: Bounds, request: Request) -> None:
        self._bounds = bounds
        self._request = request
        self._pending: list[tuple[dict[str, Any], str]] = []  # (record row, text) of turns added since the last reply
        self._chat: list[dict[str, str]] | None = None  # the next first reply's own chat (start)
        self.transcript = Transcript()
        self.earlier: list[Transcript] = []  # sequences the episode left (start), each trained
        self.replies = 0
        self.base_url: str | None = None  # set by the endpoint while the episode is served
        self.api_key: str = ""  # the key that endpoint wants ("" = none)
        self.model_name: str = ""  # the model id it serves (endpoint.model_name)
        self._posted: asyncio.Future[float] | None = None  # post_reward's value
        self.clock: asyncio.Timeout | None = None  # the episode's time bound, stopped during replies (episodes.play)

    @property
    def sequences(self) -> list[Transcript]:
        """Every sequence of the episode with a reply, the current one last: each trains as its
        own sample with the episode's reward."""
        return [t for t in (*self.earlier, self.transcript) if t.last is not None]

    def openai(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client bound to this episode's base URL (pip install openai);
        `kwargs` go to its constructor. RuntimeError where no endpoint serves the episode."""
        if self.base_url is None:
            raise RuntimeError("no endpoint serves this episode: it runs with endpoint.enabled = true "
                               "in an episode run (task.episode, or Orchestrator(episode=...))")
        import openai  # only episodes that talk through the endpoint need the package

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused", **kwargs)

    def post_reward(self, reward: float) -> bool:
        """Report the episode's reward from outside it (the endpoint's POST <episode>/reward, for
        an agent in another process); False if one was posted already."""
        if self._posted is None:
            self._posted = asyncio.get_running_loop().create_future()
        if self._posted.done():
            return False
        self._posted.set_result(reward)
        return True

    async def posted_reward(self) -> float:
        """The reward post_reward reports, once it does: an episode that hands its base_url to
        an agent elsewhere returns `await model.posted_reward()`."""
        if self._posted is None:
            self._posted = asyncio.get_running_loop().create_future()
        return await self._posted

    def start(self, messages: list[dict[str, str]]) -> None:
        """Begin a new sequence from a chat of {role, content} turns (the last one's reply is the
        next): the next reply templates it instead of the task's prompt. The sequence so far, if
        it has a reply, is kept in `earlier` and still trained; turns added since it are dropped.
        Replies count over the whole episode, tokens (task.episode_tokens) per sequence."""
        if not messages or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                   for m in messages):
            raise TypeError("start(messages) takes a non-empty list of {role, content} strings")
        if self.transcript.last is not None:
            self.earlier.append(self.transcript)
        self.transcript, self._pending = Transcript(), []
        self._chat = [{"role": m["role"], "content": m["content"]} for m in messages]

    def abandon(self) -> None:
        """The sequence `start` began got no reply (its call refused, or its client gone): it is
        dropped, and the sequence before it, if any, is the current one again (its turns added
        since dropped), still trained with the episode's reward."""
        if self.transcript.last is None and self.earlier:
            self.transcript, self._pending, self._chat = self.earlier.pop(), [], None

    @property
    def replies_left(self) -> int:
        """Replies the episode may still ask for (task.episode_turns)."""
        return self._bounds.turns - self.replies

    @property
    def tokens_left(self) -> int:
        """Tokens the episode may still add after its prompt (task.episode_tokens)."""
        return self._bounds.tokens - len(self.transcript.completion_ids)

    def add_turn(self, role: str, text: str) -> None:
        """A turn after the last reply (a tool's answer: role "tool"; an environment's: "user"),
        sent with the next reply; it is in the context, never trained."""
        if self.transcript.last is None:
            raise ValueError("add_turn before the first reply: the task's prompt is the first turn")
        if not isinstance(role, str) or not role or not isinstance(text, str):
            raise TypeError(f"add_turn(role, text) takes two strings, got {role!r}, {text!r}")
        row = {"role": role, "text": excerpt(text), "tokens": 0, "trained": False}
        self._pending.append((row, text))
        self.transcript.turns.append(row)

    async def reply(self, max_new_tokens: int | None = None, stop: list[str] | None = None) -> str:
        """The policy's next reply (its text), after the turns added since the last one (none
        added: a new assistant turn right after the last reply). `max_new_tokens` lowers this
        reply's limit; `stop` strings end it at the token that completes the first of them (the
        string stays in the reply, which then has no EOS: the next turn follows it). EpisodeLimit
        past task.episode_turns or task.episode_tokens."""
        if stop is not None and (isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)):
            raise TypeError(f"reply(stop=...) takes a list of non-empty strings, got {stop!r}")
        b = self._bounds
        if self.replies >= b.turns:
            raise EpisodeLimit(f"a reply past task.episode_turns = {b.turns}")
        if self.tokens_left <= 0:
            raise EpisodeLimit(f"a reply past task.episode_tokens = {b.tokens}")
        limit = min(b.max_new_tokens, self.tokens_left, max_new_tokens or b.max_new_tokens)
        first = self.transcript.last is None
        sent = None if first else self.transcript.context_ids
        room = 0 if first else len(self.transcript.prompt_ids) + b.tokens
        added, self._pending = self._pending, []
        turns = self._turns_to_send(added)
        left = self.tokens_left
        ask = ReplyRequest(sent, turns, limit, room, list(stop) if stop else None, self._chat if first else None)
        bound_left = self._stop_clock()
        try:
            msg = await self._request(ask)
        except asyncio.CancelledError:  # the reply is not wanted: its turns never joined the sequence
            rows = [row for row, _ in added]
            self.transcript.turns = [t for t in self.transcript.turns if not any(t is r for r in rows)]
            raise
        finally:
            self._restart_clock(bound_left)
        self.replies += 1
        self.transcript.add_reply(msg, sent, [row for row, _ in added], left)
        reply = self.transcript.last
        if not reply.completion_ids:
            raise EpisodeLimit(f"the turns left no room for a reply in task.episode_tokens = {b.tokens}")
        return reply.text

    def _stop_clock(self) -> float | None:
        """Stop the episode's time bound while a reply is generated; the seconds it had left."""
        if self.clock is None or self.clock.when() is None:
            return None
        left = self.clock.when() - asyncio.get_running_loop().time()
        self.clock.reschedule(None)
        return left

    def _restart_clock(self, left: float | None) -> None:
        """Give the episode's time bound back the seconds it had left, unless its block has ended:
        a reply asked through the endpoint runs in the call's task, which the episode's end
        cancels only after the bound's block is gone."""
        if left is None or self.clock is None:
            return
        with contextlib.suppress(RuntimeError):  # asyncio.Timeout: expired or its block exited
            self.clock.reschedule(asyncio.get_running_loop().time() + left)

    def _turns_to_send(self, added: list[tuple[dict[str, Any], str]]) -> list[dict[str, str]] | None:
        """The turns added since the last reply as the Generate appends them, their texts cut
        to TURN_BYTES_PER_TOKEN bytes per token left, all of them together (a cut turn's row
        says "cut")."""
        budget = self.tokens_left * TURN_BYTES_PER_TOKEN
        turns = []
        for row, text in added:
            data = text.encode()
            if len(data) > budget:
                text, row["cut"] = data[:budget].decode(errors="ignore"), True
            budget -= min(len(data), budget)
            turns.append({"role": row["role"], "content": text})
        return turns or None


def excerpt(text: str, most: int = RECORD_TEXT_CHARS) -> str:
    """`text`, or past `most` characters its head and tail with how much was left out between."""
    if len(text) <= most:
        return text
    half = most // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"
