"""The OpenAI-compatible endpoint (agents/endpoint.py) through the real `openai` client: bad
input and load answered with OpenAI's error JSON and a 4xx, never a stalled or crashed loop; the
calculator episode written with openai tool calling, trained against the fake workers, its
trained tokens those of the same episode through model.reply(); the slow test trains it on the
real workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import tomllib

import httpx
import openai
import pytest

from areal_aio import wire
from areal_aio.agents import calculator_openai, chat, endpoint
from areal_aio.agents.calculator import calculate
from areal_aio.agents.endpoint import Endpoint
from areal_aio.agents.model import Bounds, Model
from areal_aio.control.controller import Orchestrator
from areal_aio.control.stats import Counts
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer, prompt_ids
from areal_aio.settings import EndpointSettings, SettingsError, build_settings
from areal_aio.tasks.task import Task
from tests.agents.test_episodes import rows
from tests.conftest import ROOT, make_settings, orchestrator

USER = [{"role": "user", "content": "What is 2 + 3?"}]
TASK = Task("t0", "What is 2 + 3?", "5")


class Gate:
    """A Model's request that answers "ok" once `open` is set (each Generate kept in `asks`,
    each cancelled one counted in `cancelled`)."""

    def __init__(self, open_: bool = True) -> None:
        self.open = asyncio.Event()
        if open_:
            self.open.set()
        self.asks: list[wire.Generate] = []
        self.cancelled = 0
        self.started = asyncio.Event()

    async def __call__(self, ask) -> wire.Completion:
        msg = ask.generate(f"r{len(self.asks)}", TASK, 1.0, 1.0)
        self.asks.append(msg)
        self.started.set()
        try:
            await self.open.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return wire.Completion(msg.request_id, prompt_ids(msg), [1, 2], [-0.5, -0.5], [0, 0], "ok", "stop", 0, 0.0)


@pytest.fixture
async def served():
    """A started endpoint (small limits) and one model it serves: (endpoint, model, gate, url)."""
    ep = Endpoint(EndpointSettings(max_body_bytes=4096, max_concurrent=2), counts=Counts())
    await ep.start()
    gate = Gate()
    model = Model(Bounds(4, 1000, 60.0, 64), gate)
    with ep.episode(model):
        yield ep, model, gate, model.base_url
    await ep.stop()


def client(url: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, **kw)


async def test_a_call_through_the_openai_client_is_a_reply(served):
    ep, model, gate, url = served
    async with client(url) as c:
        r = await c.chat.completions.create(model="policy", messages=USER)
        models = await c.models.list()
    assert r.choices[0].message.content == "ok" and r.choices[0].finish_reason == "stop"
    assert model.replies == 1 and gate.asks[0].messages == USER
    assert [m.id for m in models.data] == ["policy"] and ep.counts.endpoint_calls == 1


async def test_bad_input_gets_openai_errors_and_the_endpoint_keeps_serving(served):
    ep, model, gate, url = served
    async with client(url) as c, httpx.AsyncClient() as raw:
        with pytest.raises(openai.NotFoundError) as err:
            await c.chat.completions.create(model="gpt-4o", messages=USER)
        assert err.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError, match="stream"):
            await c.chat.completions.create(model="policy", messages=USER, stream=True)
        bad = await raw.post(f"{url}/chat/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "the body is not valid JSON"
        big = await raw.post(f"{url}/chat/completions", content=b" " * 5000)
        assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]["message"]
        wrong = url.replace(url.split("/")[-2], "not-an-episode")
        with pytest.raises(openai.NotFoundError) as err:
            await client(wrong).chat.completions.create(model="policy", messages=USER)
        assert err.value.code == "episode_not_found"
        r = await c.chat.completions.create(model="policy", messages=USER)  # still serving
    assert r.choices[0].message.content == "ok" and model.replies == 1
    assert ep.counts.endpoint_errors == {"404": 2, "400": 2, "413": 1}


async def test_what_aiohttp_cannot_parse_is_a_counted_400_with_no_traceback(served, capfd):
    """A request line or a header past 8,190 bytes: aiohttp answers 400 itself; it is counted,
    and nothing reaches the console. The two requests that once answered 500 answer 400."""
    ep, model, gate, url = served
    for raw in (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n"):
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        writer.write(raw)
        await writer.drain()
        assert (await reader.read(64)).startswith(b"HTTP/1.0 400")
        writer.close()
    async with httpx.AsyncClient() as c:
        for body in ({"tool_choice": {"type": "function", "function": "calculator"}, "tools": chat_tools()},
                     {"messages": [*USER, {"role": "assistant", "content": "x", "tool_calls": 5}]}):
            r = await c.post(f"{url}/chat/completions", json={"model": "policy", "messages": USER, **body})
            assert r.status_code == 400 and r.json()["error"]["param"], r.text
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Error handling request" not in out + err
    assert ep.counts.endpoint_errors == {"400": 4} and model.replies == 0


def chat_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


async def test_too_many_concurrent_calls_get_429_and_the_rest_are_answered_in_order(served):
    ep, model, gate, url = served
    gate.open.clear()
    async with client(url) as c:
        calls = [asyncio.create_task(c.chat.completions.create(model="policy", messages=USER)) for _ in range(2)]
        await gate.started.wait()
        await asyncio.sleep(0.05)  # the second waits on the episode's lock
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model="policy", messages=USER)
        gate.open.set()
        done = await asyncio.gather(*calls)
    assert [d.choices[0].message.content for d in done] == ["ok", "ok"] and model.replies == 2
    assert gate.asks[1].context_ids is None and len(model.sequences) == 2  # the same question again: a branch


async def test_a_client_that_disconnects_aborts_its_reply_and_the_episode_goes_on(served):
    ep, model, gate, url = served
    gate.open.clear()
    async with client(url, timeout=0.3) as c:
        with pytest.raises(openai.APITimeoutError):
            await c.chat.completions.create(model="policy", messages=USER)
        for _ in range(100):
            if gate.cancelled:
                break
            await asyncio.sleep(0.01)
        assert gate.cancelled == 1 and model.replies == 0 and model.transcript.turns == []
        gate.open.set()
        r = await c.chat.completions.create(model="policy", messages=USER)
    assert r.choices[0].message.content == "ok" and model.replies == 1


async def test_calls_after_the_episode_ended_get_410_and_one_in_flight_ends_with_it():
    ep = Endpoint(EndpointSettings())
    await ep.start()
    gate = Gate(open_=False)
    model = Model(Bounds(4, 1000, 60.0, 64), gate)
    try:
        async with client("http://unused") as c:
            with ep.episode(model):
                c.base_url = model.base_url
                call = asyncio.create_task(c.chat.completions.create(model="policy", messages=USER))
                await gate.started.wait()
            with pytest.raises(openai.APIStatusError) as err:
                await call
            assert (err.value.status_code, err.value.code, gate.cancelled) == (410, "episode_ended", 1)
            with pytest.raises(openai.APIStatusError) as err:
                await c.chat.completions.create(model="policy", messages=USER)
            assert (err.value.status_code, err.value.code) == (410, "episode_ended")
    finally:
        await ep.stop()


async def test_a_key_is_required_where_set_and_other_hosts_need_one(monkeypatch):
    with pytest.raises(SettingsError, match="endpoint.key_env"):
        make_settings(**{"endpoint.host": "0.0.0.0"})
    monkeypatch.setenv("TEST_ENDPOINT_KEY", "s3cret")
    settings = EndpointSettings(key_env="TEST_ENDPOINT_KEY")
    ep = Endpoint(settings, endpoint.key_of(settings))
    await ep.start()
    model = Model(Bounds(4, 1000, 60.0, 64), Gate())
    try:
        with ep.episode(model):
            with pytest.raises(openai.AuthenticationError):
                await client(model.base_url).chat.completions.create(model="policy", messages=USER)
            async with httpx.AsyncClient() as raw:  # a near miss, and bytes that are no text: 401 too
                for sent in (b"Bearer s3cre", b"Bearer s3cret\xff", "Bearer s3cr\u00e9t".encode()):
                    r = await raw.get(f"{model.base_url}/models", headers={"Authorization": sent})
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", sent
            async with model.openai(max_retries=0) as c:  # the episode's own client carries the key
                r = await c.chat.completions.create(model="policy", messages=USER)
            assert r.choices[0].message.content == "ok"
    finally:
        await ep.stop()


async def test_a_burst_of_connects_while_the_loop_is_busy_waits_in_the_kernel(served):
    """Connects arriving while the loop runs something else are completed and queued by the
    kernel up to the listen backlog; past aiohttp's default 128 a connect would wait 1 s."""
    ep, _, _, _ = served
    socks = []
    try:
        for _ in range(300):  # the loop is blocked here: nothing accepts them meanwhile
            socks.append(socket.create_connection(("127.0.0.1", ep.port), timeout=0.5))
    finally:
        for s in socks:
            s.close()
    assert len(socks) == 300


async def test_a_wildcard_host_is_named_once_not_per_episode(monkeypatch):
    """getfqdn may ask DNS, which blocks the loop: looked up at start, not for every episode."""
    names = []
    monkeypatch.setattr(endpoint.socket, "getfqdn", lambda: names.append(1) or "box.example")
    ep = Endpoint(EndpointSettings(host="0.0.0.0", key_env="KEY"), "k")
    await ep.start()
    try:
        for _ in range(3):
            model = Model(Bounds(4, 1000, 60.0, 64), Gate())
            with ep.episode(model):
                assert model.base_url.startswith(f"http://box.example:{ep.port}/")
    finally:
        await ep.stop()
    assert len(names) == 1


async def test_an_agent_elsewhere_posts_the_reward(served):
    ep, model, gate, url = served
    root = url.removesuffix("/v1")
    async with httpx.AsyncClient() as raw:
        waiting = asyncio.create_task(model.posted_reward())
        assert (await raw.post(f"{root}/reward", json={"reward": "high"})).status_code == 400
        assert (await raw.post(f"{root}/reward", json={"reward": 0.75})).status_code == 200
        assert (await raw.post(f"{root}/reward", json={"reward": 1})).status_code == 409
    assert await waiting == 0.75


# ---------------------------------------------------------------------- trained end to end (fakes)


def tool_call_policy(prompt: str, version: int) -> str:
    """A fake policy that calls the calculator on its task's two terms, in the <tool_call> format."""
    a, b = (int(x) for x in prompt.split("Calculate ")[1].split(".")[0].split(" + "))
    call = {"name": "calculator", "arguments": {"expression": f"{a} + {b}"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def answer_tool_value(msg: wire.Generate, version: int) -> str:
    return f"<answer>{msg.append[-1]['content']}</answer>"


async def same_through_model_reply(task: Task, model: Model) -> None:
    """calculator_openai.episode written against model.reply() / model.add_turn(): the chat
    the endpoint renders (tools in the system message), each call answered as a tool turn."""
    request = chat.ChatRequest.parse({"model": "policy", "tools": calculator_openai.TOOLS, "messages": [
        {"role": "system", "content": calculator_openai.INSTRUCTION}, {"role": "user", "content": task.text}]},
        "policy")
    model.start(chat.chat_of(request))
    text = await model.reply()
    while (calls := chat.parse_tool_calls(text, {"calculator"}, "c")[1]) and model.replies_left:
        for call in calls:
            model.add_turn("tool", calculate(json.loads(call["function"]["arguments"])["expression"]))
        text = await model.reply()


async def trained(tmp_path, episode, policy=tool_call_policy, **sets) -> tuple[dict, list[wire.TrainSample]]:
    """A 2-step sync run of `episode` on the fake workers: its summary and every trained sample."""
    trainer = FakeTrainer()
    settings = make_settings("sync", **{"run.max_steps": 2, "task.eval_every": 100, **sets})
    orch = orchestrator(tmp_path, settings, FakeRollout(policy=policy, continuation=answer_tool_value,
                                                        tokens=6), trainer, episode=episode)
    summary = await orch.run()
    return summary, [s for b in trainer.batches for s in b.samples]


async def test_the_openai_calculator_trains_and_its_tokens_are_those_of_model_reply(tmp_path):
    summary, samples = await trained(tmp_path / "a", calculator_openai.episode)
    assert summary["steps"] == 2 and summary["episode_failures"] == 0
    assert summary["endpoint_errors"] == {} and summary["endpoint_calls"] >= 2 * len(samples)
    assert all(s.reward == pytest.approx(1.2) for s in samples)  # tagged and correct: the tool's value
    for s in samples:  # reply | tool turn | reply: the turn in the context, out of the loss
        mask = s.loss_mask
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1
    _, direct = await trained(tmp_path / "b", same_through_model_reply)
    fields = ("prompt_ids", "completion_ids", "logprobs", "versions", "loss_mask", "reward", "group")
    assert [[getattr(s, f) for f in fields] for s in samples] == [[getattr(s, f) for f in fields] for s in direct]


async def test_an_agent_that_rewrites_its_history_trains_each_sequence(tmp_path):
    """Two sequences in one episode: both are trained, with the episode's reward."""

    async def branching(task: Task, model: Model) -> float:
        async with model.openai(max_retries=0) as c:
            first = [{"role": "user", "content": task.text}]
            await c.chat.completions.create(model=model.model_name, messages=first)
            await c.chat.completions.create(model=model.model_name, messages=[
                {"role": "system", "content": "Again."}, *first])
        return 1.0

    summary, samples = await trained(tmp_path, branching)
    assert summary["episode_failures"] == 0
    settings = make_settings("sync")
    per_step = settings.trainer.batch_size * 2  # each episode trains two samples
    assert len(samples) == 2 * per_step and all(s.reward == 1.0 for s in samples)
    assert {len(s.loss_mask) for s in samples} == {6} and all(sum(s.loss_mask) == 6 for s in samples)
    # every trained sequence is a row of its own, placed in its episode, and counted
    rows = [r for r in train_rows(tmp_path) if r.get("step")]
    assert len(rows) == len(samples) == summary["sequences_trained"] == 2 * summary["samples_accepted"]
    by_episode: dict[str, list[int]] = {}
    for r in rows:
        by_episode.setdefault(r["request_id"], []).append(r["sequence"])
        assert r["sequences"] == 2 and r["reward"] == 1.0 and r["tokens"] == 6
    assert all(sorted(v) == [0, 1] for v in by_episode.values())


def train_rows(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "samples.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


async def test_a_new_sequence_refused_keeps_the_earlier_one_and_the_reward(tmp_path):
    """A call that starts a new sequence past task.episode_turns is refused (400 episode_limit):
    the sequence before it trains, with the episode's reward; the episode does not fail."""

    async def refused_second(task: Task, model: Model) -> float:
        async with model.openai(max_retries=0) as c:
            first = [{"role": "user", "content": task.text}]
            await c.chat.completions.create(model=model.model_name, messages=first)
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=model.model_name, messages=[
                    {"role": "system", "content": "Again."}, *first])
            assert err.value.code == "episode_limit"
        return 1.0

    summary, samples = await trained(tmp_path, refused_second, **{"task.episode_turns": 1})
    assert summary["episode_failures"] == 0 and summary["samples_dropped_episode"] == 0
    assert len(samples) == 2 * make_settings("sync").trainer.batch_size  # one sequence an episode
    assert all(s.reward == 1.0 and sum(s.loss_mask) == 6 for s in samples)
    assert summary["endpoint_errors"] == {"400": summary["endpoint_calls"]}  # each episode: one answered, one refused
    assert all(r["sequence"] == 0 and r["sequences"] == 1 for r in train_rows(tmp_path) if r.get("step"))


async def test_the_summary_counts_the_endpoints_answers_by_status(tmp_path):
    async def asks_another_model_first(task: Task, model: Model) -> float:
        async with model.openai(max_retries=0) as c:
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="gpt-4o", messages=USER)
            await c.chat.completions.create(model=model.model_name,
                                            messages=[{"role": "user", "content": task.text}])
        return 1.0

    summary, samples = await trained(tmp_path, asks_another_model_first)
    assert summary["endpoint_calls"] >= len(samples) and summary["episode_failures"] == 0
    assert summary["endpoint_errors"] == {"404": summary["endpoint_calls"]}  # one per episode, eval's too
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["endpoint_errors"] == {
        "404": summary["endpoint_calls"]}


def test_the_endpoint_settings_are_documented():
    """docs/agents.md's [endpoint] block names every setting with its default."""
    names = {f.name for f in dataclasses.fields(EndpointSettings)}
    assert {"host", "port", "key_env", "max_body_bytes", "max_concurrent", "model_name", "enabled"} <= names
    page = (ROOT / "docs" / "agents.md").read_text()
    block = page.split("```toml\n[endpoint]\n", 1)[1].split("```", 1)[0]
    assert tomllib.loads(block) == dataclasses.asdict(EndpointSettings())


# ---------------------------------------------------------------------- the real workers (slow)


def real_settings(**extra):
    sets = ["model.path=embedded:tiny-random", "run.max_steps=2", "run.progress=false", "rollout.group_size=2",
            "trainer.batch_size=4", "rollout.max_new_tokens=6", "task.eval_size=2", "task.eval_every=2",
            "controller.reward_procs=0", "run.checkpoint_every=0"]
    return build_settings({}, sets + [f"{k}={v}" for k, v in extra.items()])


async def tool_turn_through_openai(task: Task, model: Model) -> None:
    """Two calls with a tool message between, whatever the (random) model replied: the second
    must continue the first's sequence on the real tokenizer's text round trip."""
    async with model.openai(max_retries=0) as c:
        messages = [{"role": "system", "content": calculator_openai.INSTRUCTION}, {"role": "user", "content": task.text}]
        first = await c.chat.completions.create(model=model.model_name, messages=messages,
                                                tools=calculator_openai.TOOLS)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "c0", "content": "7"}]
        await c.chat.completions.create(model=model.model_name, messages=messages, tools=calculator_openai.TOOLS)


@pytest.mark.slow
@pytest.mark.parametrize("episode", [calculator_openai.episode, tool_turn_through_openai])
async def test_openai_episodes_train_on_the_real_workers(tmp_path, episode):
    """tiny-random in both subprocesses, areal mode: the openai calculator trains end to end, and
    a tool message between two calls joins one sequence (one trained sample per episode: reply,
    tool turn out of the loss, reply)."""
    orch = Orchestrator(real_settings(**{"task.name": "calculator"}), episode=episode, out_dir=tmp_path / "run")
    summary = await asyncio.wait_for(orch.run(), 300)
    assert summary["steps"] == 2 and summary["episode_failures"] == 0, summary.get("error")
    if episode is tool_turn_through_openai:
        trained = [r for r in rows(tmp_path / "run") if r["dropped"] is None and r["step"] is not None]
        assert len(trained) == 8
        for r in trained:
            assert [(t["role"], t["trained"]) for t in r["turns"]] == [("assistant", True), ("tool", False),
                                                                      ("assistant", True)]


async def test_eval_and_sft_play_an_openai_agent_through_the_endpoint(tmp_path, monkeypatch):
    """The greedy episodes of `eval` and `sft` serve the endpoint as a run does: the openai
    calculator plays, calls the tool and passes, with no episode failed."""
    from areal_aio.control.evaluation import greedy_episodes
    from areal_aio.rewards.scoring import Scorer, load_rewards

    settings = build_settings({}, ["task.name=calculator", "task.episode=areal_aio.agents.calculator_openai:episode"])
    tasks = [Task(f"e{i}", f"Calculate {i} + 3.", str(i + 3)) for i in range(3)]
    scorer = Scorer(load_rewards(settings.task), timeout_s=5.0, procs=0)
    rollout = FakeRollout(policy=tool_call_policy, continuation=answer_tool_value, tokens=6)
    played = await greedy_episodes(settings, tasks, tmp_path / "eval.log", calculator_openai.episode, scorer, rollout)
    assert played.failures == 0 and [s.passed for s in played.scores] == [True] * 3
    assert all(any(t.get("role") == "tool" for t in turns) for turns in played.turns)  # the tool was called
    assert endpoint.CURRENT.get() is None  # served for the eval alone
