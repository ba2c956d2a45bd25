"""OpenAI chat completions as replies of an episode's Model: the request's checks, the rule that
keeps token-in/token-out, tool calls, and the response. No HTTP here (agents/endpoint.py
serves it); what a call means is decided here, so it is tested without a socket.

Token-in/token-out. A Conversation keeps the messages of its current sequence as the agent will
send them back: the request that produced the last reply, then that reply as returned. A request
whose messages extend them exactly (that history, then only new tool, user or system turns, and
the same `tools`) continues the sequence: the new turns go to `model.add_turn` and the reply
comes from the exact ids so far; what the model generated is never tokenized again. Any other
request (the agent rewrote, truncated or branched its history, changed its tools, or added an
assistant turn of its own) starts a new sequence from its messages (`Model.start`); each
sequence trains as its own sample with the episode's reward (agents/episodes.py).

Compared as the agent echoes them: content None and "" alike, content parts joined, a tool
call's arguments as parsed JSON (a framework that re-serializes them with other spacing still
extends); tool call ids must match.

Tools. The controller has no tokenizer, so `tools` are rendered into the system message in one
format, Qwen2.5's (Hermes): the signatures in <tools></tools>, one call per
<tool_call>{"name": ..., "arguments": {...}}</tool_call>. A reply's well-formed calls naming an
offered tool become `tool_calls` (finish_reason "tool_calls"), the rest of its text the content;
an assistant message with tool_calls in a new sequence's history is rendered back into that
format, and a tool message is a "tool" turn (in the context, out of the loss).

Sampling is the run's: the policy's temperature and top_p, so the replies are on-policy samples
to train on; a request's temperature, top_p, seed, penalties are accepted and ignored.
`max_tokens` / `max_completion_tokens` lower a reply's limit, `stop` ends it at a string (cut
from the returned content, kept in the trained tokens), `logprobs` returns the behaviour
log-prob of each token as "token_id:<id>" (no tokenizer here; top_logprobs > 0 is refused),
`n` must be 1, `stream` is refused (400).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from areal_aio.agents.model import EpisodeLimit, Model

ROLES = ("system", "developer", "user", "assistant", "tool")
TURN_ROLES = ("system", "user", "tool")
"""Roles of turns that continue a sequence (an assistant turn the agent writes itself rewrites it)."""
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and "
                "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


class ChatError(Exception):
    """A request the endpoint answers with an OpenAI error body: its HTTP status, message, type,
    the parameter at fault and a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message as compared and rendered: content as one string, tool calls as
    (id, name, arguments as canonical JSON) triples."""

    role: str
    content: str
    calls: tuple[tuple[str, str, str], ...] = ()
    call_id: str = ""

    def text(self) -> str:
        """What the chat template gets: an assistant's calls written back as <tool_call> blocks."""
        blocks = [f"<tool_call>\n{{\"name\": {json.dumps(name)}, \"arguments\": {args}}}\n</tool_call>"
                  for _, name, args in self.calls]
        return "\n".join([self.content, *blocks] if self.content else blocks)


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked POST /v1/chat/completions body (what this endpoint reads of it)."""

    messages: tuple[Message, ...]
    tools: tuple[dict[str, Any], ...]  # each {"type": "function", "function": {...}}; none under tool_choice "none"
    tool_choice: str | None  # a function's name the agent asks for, "required", or None
    max_tokens: int | None
    stop: tuple[str, ...]
    logprobs: bool
    raw: tuple[Any, ...] = field(default=(), compare=False)  # the messages as sent (JSON values)

    @classmethod
    def parse(cls, body: Any, model_name: str, known: tuple[tuple[Any, Message], ...] = ()) -> ChatRequest:
        """The request, or ChatError naming the field at fault (404 for another model).
        `known`: (message as sent, Message) pairs of the conversation so far (Conversation.known):
        the leading messages equal to theirs, the history an agent sends back with every call,
        are not checked and converted again; each call then parses only what it adds."""
        if not isinstance(body, dict):
            raise ChatError(400, "the body must be a JSON object")
        if body.get("model") != model_name:
            raise ChatError(404, f"The model `{body.get('model')}` does not exist; this endpoint serves "
                                 f"`{model_name}`", param="model", code="model_not_found")
        if body.get("stream"):
            raise ChatError(400, "stream = true is not supported: ask without streaming", param="stream")
        if body.get("n", 1) != 1:
            raise ChatError(400, "only n = 1 is supported (one completion per call)", param="n")
        if body.get("top_logprobs"):
            raise ChatError(400, "top_logprobs is not supported (the endpoint holds no tokenizer)",
                            param="top_logprobs")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ChatError(400, "messages must be a non-empty list", param="messages")
        tools, choice = _tools(body.get("tools"), body.get("tool_choice"))
        same = 0
        while same < min(len(messages), len(known)) and messages[same] == known[same][0]:
            same += 1
        parsed = [m for _, m in known[:same]] + [_message(m, i) for i, m in enumerate(messages[same:], same)]
        return cls(tuple(parsed), tools, choice, _max_tokens(body), _stop(body.get("stop")),
                   bool(body.get("logprobs")), tuple(messages))


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ChatError(400, f"{where}: an object whose role is one of {', '.join(ROLES)}", param=where)
    content = m.get("content")
    if isinstance(content, list):  # content parts: their text, joined
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ChatError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise ChatError(400, f"{where}.content: a string, a list of text parts or null", param=f"{where}.content")
    role = "system" if m["role"] == "developer" else m["role"]
    raw_calls = m.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise ChatError(400, f"{where}.tool_calls: a list of tool calls", param=f"{where}.tool_calls")
    calls = tuple(_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(raw_calls or ()))
    if calls and role != "assistant":
        raise ChatError(400, f"{where}: only an assistant message has tool_calls", param=where)
    call_id = m.get("tool_call_id") or ""
    if role == "tool" and not isinstance(call_id, str):
        raise ChatError(400, f"{where}.tool_call_id: a string", param=f"{where}.tool_call_id")
    return Message(role, content or "", calls, call_id if role == "tool" else "")


def _call(c: Any, where: str) -> tuple[str, str, str]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError(400, f"{where}: {{id, type: function, function: {{name, arguments}}}}", param=where)
    return str(c.get("id") or ""), fn["name"], canonical(fn.get("arguments"))


def canonical(arguments: Any) -> str:
    """A call's arguments as one JSON text (keys sorted, no spacing of its own): a string that
    holds JSON parsed first, any other string kept as JSON text of itself."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return json.dumps(arguments)
    return json.dumps(arguments if arguments is not None else {}, sort_keys=True, separators=(",", ":"))


def _tools(tools: Any, choice: Any) -> tuple[tuple[dict[str, Any], ...], str | None]:
    if tools is None:
        return (), None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ChatError(400, "tools: a list of {type: function, function: {name, description, parameters}}",
                        param="tools")
    if choice in (None, "auto"):
        return tuple(tools), None
    if choice == "none":
        return (), None
    if choice == "required":
        return tuple(tools), "required"
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None
    if name not in {t["function"]["name"] for t in tools}:
        raise ChatError(400, "tool_choice: auto, none, required or {type: function, function: {name}} "
                             "naming one of the tools", param="tool_choice")
    return tuple(tools), name


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ChatError(400, f"{key}: a positive integer", param=key)
        return value
    return None


def _stop(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ChatError(400, "stop: a string or a list of up to 4 non-empty strings", param="stop")
    return tuple(stops)


def render_tools(tools: tuple[dict[str, Any], ...], choice: str | None) -> str:
    """The tools block a system message ends with (Qwen2.5's format; module docstring)."""
    lines = "\n".join(json.dumps({"type": "function", "function": t["function"]}) for t in tools)
    must = {None: "", "required": "\n\nCall at least one function."}.get(choice, f"\n\nCall the function {choice}.")
    return TOOLS_HEADER + lines + TOOLS_FOOTER + must


def chat_of(request: ChatRequest) -> list[dict[str, str]]:
    """A new sequence's chat as the worker templates it: {role, content} strings, the tools
    block at the end of the system message (one is put first when there is none)."""
    chat = [{"role": m.role, "content": m.text()} for m in request.messages]
    if request.tools:
        block = render_tools(request.tools, request.tool_choice)
        if chat[0]["role"] == "system":
            chat[0] = {"role": "system", "content": f"{chat[0]['content']}\n\n{block}".lstrip()}
        else:
            chat.insert(0, {"role": "system", "content": block})
    return chat


def parse_tool_calls(text: str, names: set[str], prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply: each well-formed <tool_call> block naming one of
    `names` becomes a call (ids `prefix`-0, -1, ...) and leaves the content; anything else stays
    in it. Content None when nothing else is left."""
    calls, kept, at = [], [], 0
    for match in CALL.finditer(text):
        call = _parsed_call(match.group(1), names)
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        name, args = call
        calls.append({"id": f"{prefix}-{len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    if not calls:
        return text, calls
    return ("".join(kept) + text[at:]).strip() or None, calls


def _parsed_call(body: str, names: set[str]) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return call["name"], args if isinstance(args, str) else json.dumps(args)


def extends(history: tuple[Message, ...], messages: tuple[Message, ...]) -> bool:
    """Whether `messages` continue `history` (the sequence's messages and its last reply as
    returned): all of it, in order, then only turns of TURN_ROLES (none: a new assistant turn
    right after the reply)."""
    n = len(history)
    return (len(messages) >= n and messages[:n] == history
            and all(m.role in TURN_ROLES for m in messages[n:]))


class Conversation:
    """One episode's chat completions (the endpoint answers its requests one at a time): each
    call a reply of `model`, continuing its sequence or starting a new one (module docstring)."""

    def __init__(self, model: Model, model_name: str, call_prefix: str = "call") -> None:
        self.model = model
        self.model_name = model_name
        self._prefix = call_prefix
        self._history: tuple[Message, ...] | None = None  # the current sequence, as the agent echoes it
        self.known: tuple[tuple[Any, Message], ...] = ()  # the last request's messages and its reply, as sent
        self._tools: tuple[dict[str, Any], ...] = ()
        self.calls = 0
        self.sequences = 0  # sequences started through this conversation

    async def complete(self, request: ChatRequest) -> dict[str, Any]:
        """The chat.completion body for `request`, after its reply. ChatError for a call the
        episode's bounds refuse (400: context_length_exceeded, or episode_limit past its replies)."""
        model = self.model
        before = None  # a new sequence's call: the conversation it leaves, put back if it gets no reply
        if self._history is not None and request.tools == self._tools and extends(self._history, request.messages):
            for m in request.messages[len(self._history):]:
                model.add_turn(m.role, m.text())
        else:  # start leaves the sequence _history names: none to extend until this reply comes
            before, self._history = (self._history, self.known, self._tools), None
            model.start(chat_of(request))
            self.sequences += 1
        try:
            text = await model.reply(max_new_tokens=request.max_tokens, stop=list(request.stop) or None)
        except EpisodeLimit as exc:
            self._abandon(before)
            code = "episode_limit" if model.replies_left <= 0 else "context_length_exceeded"
            raise ChatError(400, str(exc), param="messages", code=code) from None
        except asyncio.CancelledError:  # the client went away: its reply was aborted
            self._abandon(before)
            raise
        seq = model.transcript
        last = seq.last
        self.calls += 1
        content, calls, finish = self._answer(text, last.finish, request)
        self._history = (*request.messages, Message("assistant", content or "", tuple(
            (c["id"], c["function"]["name"], canonical(c["function"]["arguments"])) for c in calls)))
        self._tools = request.tools
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        self.known = (*zip(request.raw, request.messages, strict=False), (message, self._history[-1]))
        logprobs = None
        if request.logprobs:  # one dict per token: built only for a client that asks
            logprobs = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                    for t, lp in zip(last.completion_ids, last.logprobs, strict=True)]}
        prompt_tokens = len(seq.prompt_ids) + len(seq.completion_ids) - len(last.completion_ids)  # no copy of the ids
        return {"id": f"chatcmpl-{self._prefix}-{self.calls}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": logprobs}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(last.completion_ids),
                          "total_tokens": prompt_tokens + len(last.completion_ids)}}

    def _abandon(self, before: tuple | None) -> None:
        """A new sequence's call that got no reply: the sequence before it is current again,
        and later calls may extend it as before (`before`: None for a call that extended)."""
        if before is not None:
            self.model.abandon()
            self._history, self.known, self._tools = before
            self.sequences -= 1

    def _answer(self, text: str, finish: str, request: ChatRequest) -> tuple[str | None, list, str]:
        """(content, tool_calls, finish_reason) of a reply: a stop string cut off its end (the
        trained tokens keep it), tool calls parsed out."""
        for s in request.stop:
            if finish == "stop" and text.endswith(s):
                text = text[:-len(s)]
                break
        names = {t["function"]["name"] for t in request.tools}
        content, calls = parse_tool_calls(text, names, f"{self._prefix}_{self.calls}") if names else (text, [])
        return content, calls, "tool_calls" if calls else ("length" if finish == "length" else "stop")
