"""Chat completions as replies of an episode (agents/chat.py), without a socket: the request's
checks, the extension rule (continue from the exact ids, or start a new sequence), tool calls
rendered and parsed, the response's fields."""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_aio import wire
from areal_aio.agents import chat
from areal_aio.agents.chat import ChatError, ChatRequest, Conversation, Message
from areal_aio.agents.model import Bounds, Model
from areal_aio.fleet.fakes import cut_at_stop, prompt_ids
from areal_aio.tasks.task import Task

TASK = Task("t0", "What is 2 + 3?", "5")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class Policy:
    """A Model's request as the fake rollout worker answers it (one id per byte of the chat, each
    reply's ids 100k + j): `replies` are its texts in order; `asks` every Generate answered.
    A call made while `hold` is set waits on it before it is answered (`held` says one did)."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.asks: list[wire.Generate] = []
        self.hold: asyncio.Event | None = None
        self.held = False

    async def __call__(self, ask) -> wire.Completion:
        if self.hold is not None:
            hold, self.hold, self.held = self.hold, None, True
            await hold.wait()
        msg = ask.generate(f"r{len(self.asks)}", TASK, 1.0, 1.0)
        k = len(self.asks)
        self.asks.append(msg)
        text = cut_at_stop(self.replies[k], msg.stop)
        n = min(len(text), msg.max_new_tokens)
        return wire.Completion(msg.request_id, prompt_ids(msg), [100 * k + j for j in range(n)],
                               [-0.5] * n, [0] * n, text, "length" if n < len(text) else "stop", 0, 0.0)


def conversation(*replies: str, turns: int = 4) -> tuple[Conversation, Policy]:
    policy = Policy(*replies)
    return Conversation(Model(Bounds(turns, 10_000, 60.0, 1000), policy), "policy", "e1"), policy


def ask(messages, **body) -> ChatRequest:
    return ChatRequest.parse({"model": "policy", "messages": messages, **body}, "policy")


USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


async def test_a_call_that_extends_the_last_continues_from_its_ids():
    conv, policy = conversation("It is", " 5.")
    first = await conv.complete(ask(USER))
    assert first["choices"][0]["message"] == {"role": "assistant", "content": "It is"}
    assert policy.asks[0].messages == USER and policy.asks[0].context_ids is None
    again = USER + [first["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    second = await conv.complete(ask(again))
    t = conv.model.transcript
    assert policy.asks[1].context_ids == t.prompt_ids + [0, 1, 2, 3, 4]  # the reply's own ids, not its text
    assert second["usage"] == {"prompt_tokens": len(t.context_ids) - 3, "completion_tokens": 3,
                               "total_tokens": len(t.context_ids)}  # the prompt: all ids before the reply
    assert policy.asks[1].append == [{"role": "user", "content": "Go on."}]
    assert t.mask == [1] * 5 + [0] * len("<user>Go on.\n<assistant>") + [1] * 3
    assert conv.sequences == 1 and conv.model.earlier == []


async def test_the_history_sent_back_is_not_parsed_again(monkeypatch):
    """Each call sends the whole history: the messages equal to the last call's and its reply
    as returned are taken as they were parsed, and only the new turn is checked and converted."""
    conv, policy = conversation(CALL_TEXT, "5")
    first = await conv.complete(ask(USER, tools=TOOLS))
    reply = json.loads(json.dumps(first["choices"][0]["message"]))  # as a client sends it back
    call_id = reply["tool_calls"][0]["id"]
    parsed = []
    message = chat._message
    monkeypatch.setattr(chat, "_message", lambda m, i: parsed.append(i) or message(m, i))
    again = ChatRequest.parse({"model": "policy", "tools": TOOLS, "messages": [
        *USER, reply, {"role": "tool", "tool_call_id": call_id, "content": "5"}]}, "policy", conv.known)
    assert parsed == [3] and again == ask(list(again.raw), tools=TOOLS)  # the same request as parsed whole
    await conv.complete(again)
    assert policy.asks[1].context_ids is not None and policy.asks[1].append == [{"role": "tool", "content": "5"}]


@pytest.mark.parametrize("change", ["rewrite", "truncate", "own_assistant", "tools"])
async def test_a_call_that_does_not_extend_starts_a_new_sequence(change):
    conv, policy = conversation("It is", " 5.")
    first = await conv.complete(ask(USER))
    reply = first["choices"][0]["message"]
    body = {}
    messages = {"rewrite": USER + [{"role": "assistant", "content": "It was"}],
                "truncate": USER[1:],
                "own_assistant": USER + [reply, {"role": "assistant", "content": "Also"}],
                "tools": USER + [reply]}[change]
    if change == "tools":
        body["tools"] = TOOLS
    await conv.complete(ask(messages, **body))
    assert policy.asks[1].context_ids is None and conv.sequences == 2
    assert len(conv.model.sequences) == 2 and conv.model.earlier[0].mask == [1] * 5
    assert conv.model.transcript.mask == [1] * 3  # the new sequence trains its own reply only


async def test_echoed_history_matches_loosely_where_clients_differ():
    """content None and "" alike, content parts joined, arguments re-serialized with other
    spacing: still the same history. Another call id is not."""
    conv, policy = conversation(CALL_TEXT, "5")
    first = await conv.complete(ask(USER, tools=TOOLS))
    call = first["choices"][0]["message"]["tool_calls"][0]
    echoed = {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": json.dumps(json.loads(call["function"]["arguments"]), indent=2)}}]}
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             USER[1]]
    await conv.complete(ask(parts + [echoed, {"role": "tool", "tool_call_id": call["id"], "content": "5"}], tools=TOOLS))
    assert policy.asks[1].context_ids is not None
    assert policy.asks[1].append == [{"role": "tool", "content": "5"}]
    other = {**echoed, "tool_calls": [{**echoed["tool_calls"][0], "id": "elsewhere"}]}
    assert not chat.extends(conv._history, ask(USER + [other], tools=TOOLS).messages)


async def test_tools_are_rendered_in_the_system_message_and_calls_parsed():
    conv, policy = conversation(f"Let me add.\n{CALL_TEXT}")
    body = await conv.complete(ask(USER, tools=TOOLS))
    system = policy.asks[0].messages[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "add"' in system["content"] and "<tool_call>" in system["content"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me add."
    assert choice["message"]["tool_calls"] == [{"id": "e1_1-0", "type": "function",
                                                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]


@pytest.mark.parametrize(("text", "calls"), [
    (CALL_TEXT + CALL_TEXT.replace("add", "sub"), 1),  # a tool not offered stays content
    ("<tool_call>{not json}</tool_call>", 0),
    ('<tool_call>{"name": "add", "arguments": 3}</tool_call>', 0),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', 1),
    ("no call", 0),
])
def test_parse_tool_calls_takes_only_well_formed_calls_of_offered_tools(text, calls):
    content, parsed = chat.parse_tool_calls(text, {"add"}, "c")
    assert len(parsed) == calls
    if not calls:
        assert content == text
    else:
        assert all(json.loads(c["function"]["arguments"]) == {"a": 2, "b": 3} or
                   json.loads(c["function"]["arguments"]) == {"a": 1} for c in parsed)


def test_a_new_sequence_renders_an_assistants_calls_back_in_the_same_format():
    m = Message("assistant", "", (("c0", "add", chat.canonical('{"b": 3, "a": 2}')),))
    assert m.text() == '<tool_call>\n{"name": "add", "arguments": {"a":2,"b":3}}\n</tool_call>'
    assert chat.parse_tool_calls(m.text(), {"add"}, "x")[1][0]["function"]["name"] == "add"


async def test_stop_max_tokens_and_logprobs():
    conv, policy = conversation("It is 5. Done", "x" * 50)
    body = await conv.complete(ask(USER, stop=[". "], logprobs=True, max_completion_tokens=20))
    assert policy.asks[0].stop == [". "] and policy.asks[0].max_new_tokens == 20
    choice = body["choices"][0]
    assert choice["message"]["content"] == "It is 5" and choice["finish_reason"] == "stop"
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in range(9)]
    assert body["usage"]["completion_tokens"] == 9  # the stop string is in the tokens, not the content
    body = await conv.complete(ask(USER + [choice["message"]], max_tokens=7))
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["logprobs"] is None
    assert policy.asks[1].context_ids is not None  # the content without the stop string still extends


async def test_the_episode_bounds_answer_400():
    conv, _ = conversation("a", "b", turns=1)
    first = await conv.complete(ask(USER))
    with pytest.raises(ChatError) as err:
        await conv.complete(ask(USER + [first["choices"][0]["message"], {"role": "user", "content": "more"}]))
    assert err.value.status == 400 and err.value.code == "episode_limit"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
    ({"model": "policy", "messages": USER, "stream": True}, 400, "stream"),
    ({"model": "policy", "messages": USER, "n": 2}, 400, "n"),
    ({"model": "policy", "messages": []}, 400, "messages"),
    ({"model": "policy", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ({"model": "policy", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"model": "policy", "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "policy", "messages": USER, "stop": ["a"] * 5}, 400, "stop"),
    ({"model": "policy", "messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": "policy", "messages": USER, "tools": TOOLS, "tool_choice": {"function": {"name": "x"}}}, 400, "tool_choice"),
    ({"model": "policy", "messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ([1, 2], 400, None),
])
def test_bad_requests_name_the_field(body, status, param):
    with pytest.raises(ChatError) as err:
        ChatRequest.parse(body, "policy")
    assert err.value.status == status and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_tool_choice_none_offers_no_tools_and_a_named_one_is_asked_for():
    assert ask(USER, tools=TOOLS, tool_choice="none").tools == ()
    chat_ = chat.chat_of(ask(USER[1:], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}))
    assert chat_[0]["role"] == "system" and chat_[0]["content"].endswith("Call the function add.")


async def test_a_new_sequence_whose_call_is_abandoned_leaves_the_one_before_to_extend():
    """The agent rewrites its history, that call is cancelled (its client went away), and the
    agent goes back to extending the first history: the abandoned sequence leaves nothing, the
    first is the current one again, and the call continues it from its exact ids."""
    conv, policy = conversation("It is", "Again")
    first = await conv.complete(ask(USER))
    before = conv.model.transcript
    rewrite = asyncio.create_task(conv.complete(ask(USER[1:])))
    policy.hold = asyncio.Event()
    while not policy.held:
        await asyncio.sleep(0)
    rewrite.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rewrite
    assert conv.model.transcript is before and conv.model.sequences == [before] and conv.sequences == 1
    again = USER + [first["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    body = await conv.complete(ask(again))
    assert body["choices"][0]["message"]["content"] == "Again" and conv.model.replies == 2
    assert policy.asks[-1].context_ids == before.prompt_ids + before.completion_ids[:5]  # continued
    assert len(conv.model.sequences) == 1 and before.mask[:5] == [1] * 5 and before.mask[-5:] == [1] * 5
    assert 0 in before.mask  # the user's turn between the replies: context, not trained


JUNK = (None, True, 0, -1, 1.5, "", "x", [], [None], [1], {}, {"a": 1}, [{}], {"name": 1}, {"function": "add"},
        {"function": {"name": 7}}, [{"function": "add"}], [{"type": "function", "function": {"name": None}}])
"""Values a careless or hostile client puts where a field belongs."""
VALID = {"model": "policy", "messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"}],
    "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
    "max_tokens": 8, "stop": ["\n"], "logprobs": True, "n": 1, "stream": False}


def _fields(value, path=()):
    """The path of every field of a request body (dict keys and list places), nested ones too."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield (*path, key)
        yield from _fields(inner, (*path, key))


def _replaced(body, path, junk):
    import copy

    out = copy.deepcopy(body)
    place = out
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = junk
    return out


def test_every_field_of_a_request_given_junk_answers_a_4xx_or_parses():
    """Each field of a full request (tools, calls, messages, their parts), in turn, given each
    junk value: the request parses, or is refused as a client error naming a field; never an
    exception of another kind (a 500 at the endpoint)."""
    assert ChatRequest.parse(VALID, "policy").tool_choice == "add"
    tried = 0
    for path in _fields(VALID):
        for junk in JUNK:
            tried += 1
            try:
                ChatRequest.parse(_replaced(VALID, path, junk), "policy")
            except ChatError as err:
                assert 400 <= err.status < 500 and err.body()["error"]["message"]
            except Exception as exc:  # noqa: BLE001 - what this test is looking for
                pytest.fail(f"{'.'.join(map(str, path))} = {junk!r}: {type(exc).__name__}: {exc}")
    assert tried > 500


@pytest.mark.parametrize(("change", "param"), [
    ({"tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
    ({"messages": [*USER, {"role": "assistant", "content": "x", "tool_calls": 5}]}, "messages[2].tool_calls"),
])
def test_the_two_requests_that_answered_500_name_their_field(change, param):
    with pytest.raises(ChatError) as err:
        ChatRequest.parse({"model": "policy", "messages": USER, "tools": TOOLS, **change}, "policy")
    assert err.value.status == 400 and err.value.param == param

