"""One protocol, three rollout clients: the same checks run against the in-process fake
(areal_aio.fleet.fakes.FakeRollout), the real subprocess (PipeWorker on embedded:tiny-random) and the
same subprocess in a Ray actor (RayWorker, on a local Ray cluster), all through the
WorkerClient surface the controller uses, so the fake cannot drift from the worker the
controller tests stand in for, nor the actor from the pipe.

What is checked is the contract, not the model: ids, lengths and versions of a Completion,
log-probs per token, Abort of an unknown and of a running request, a weight update stamping
later tokens with the new version (and a request running across it with both), greedy
determinism, a reply prefix and a chat's turns reaching the prompt, an episode's later reply
continuing from its exact ids, shutdown, and death.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
from pathlib import Path

import pytest

from areal_aio import wire
from areal_aio.fleet.client import PipeWorker, WorkerClient, WorkerFailed
from areal_aio.fleet.fakes import FakeRollout
from areal_aio.settings import build_settings
from tests.conftest import need

REPLY_TIMEOUT_S = 120.0
"""Generous: a cold worker imports torch and transformers on a busy machine."""
LONG = 1500
"""Tokens of a request still running when the next message arrives, however slow the machine:
each such request is aborted long before its end (tiny-random's context is 2048; the fake
stops at 1000 tokens, 2 s)."""
KINDS = ["fake", pytest.param("real", marks=pytest.mark.slow),
         pytest.param("ray", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module's Ray clients (they join it; it is not theirs to end)."""
    ray = need("ray")

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def v1_weights(tmp_path_factory) -> str:
    """A published version 1 (the initial weights, perturbed) the real worker can load."""
    import torch

    from areal_aio.store.weights import WeightStore
    from areal_aio.workers.models import TINY, load_model

    model, _ = load_model(TINY, seed=3)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return str(WeightStore(tmp_path_factory.mktemp("shm")).publish(model, 1))


async def start(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[WorkerClient, str]:
    """A started rollout client (interrupting updates, two-token chunks) and a v1 weights path."""
    settings = build_settings({}, ("model.path=embedded:tiny-random", "run.seed=3", "rollout.interrupt=true",
                                   "rollout.max_batch=8", "rollout.chunk_tokens=2"))
    if kind == "fake":
        client, path = FakeRollout(tokens=1000, token_delay_s=0.002), str(tmp_path / "v1.safetensors")
    elif kind == "real":
        client, path = PipeWorker("rollout", tmp_path / "rollout.log"), request.getfixturevalue("v1_weights")
    else:
        from areal_aio.fleet.ray_workers import RayWorker

        request.getfixturevalue("ray_cluster")
        client = RayWorker("rollout", 0, build_settings({}, ["ray.address=local"]), tmp_path / "rollout.log")
        path = request.getfixturevalue("v1_weights")
    assert await client.prepare(settings.model.path) in (None, 0.0)
    ready = await asyncio.wait_for(client.start(wire.Init("rollout", settings.to_dict(), str(tmp_path))),
                                   REPLY_TIMEOUT_S)
    assert isinstance(ready, wire.Ready) and ready.role == "rollout" and ready.version == 0
    return client, path


async def collect(client: WorkerClient, count: int) -> tuple[dict[str, wire.Completion], list]:
    """The next `count` Completions by id, and the other messages in arrival order."""
    done, other = {}, []
    while len(done) < count:
        msg = await asyncio.wait_for(client.recv(), REPLY_TIMEOUT_S)
        if not isinstance(msg, (wire.Completion, wire.WeightsLoaded)):
            raise client.failure(msg)
        if isinstance(msg, wire.Completion):
            done[msg.request_id] = msg
        else:
            other.append(msg)
    return done, other


def generate(rid: str, prompt: str, n: int, temperature: float = 1.0, **kw) -> wire.Generate:
    return wire.Generate(rid, prompt, n, temperature, 1.0, seed=7, **kw)


def check_shape(c: wire.Completion, n: int, version: int | None = 0) -> None:
    """One log-prob and one version per token, log-probs of a sampled token (finite, <= 0)."""
    assert len(c.completion_ids) == len(c.logprobs) == len(c.versions) and c.prompt_ids
    assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs), c.logprobs
    assert c.versions == sorted(c.versions) and isinstance(c.text, str)
    if c.finish != "abort":
        assert 0 < len(c.completion_ids) <= n and c.finish in ("stop", "length")
        assert c.finish == "stop" or len(c.completion_ids) == n
    if version is not None:
        assert set(c.versions) <= {version} and c.interrupts == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_rollout_worker_keeps_the_protocol(kind, tmp_path, request):
    client, v1 = await start(kind, tmp_path, request)
    try:
        # Generate -> Completion; an unknown Abort is ignored (nothing comes back for it)
        await client.send(wire.Abort("nobody"))
        await client.send_many([generate("a", "Calculate 1 + 2.", 5), generate("b", "Calculate 3 + 4.", 3)])
        first, other = await collect(client, 2)
        assert other == [] and set(first) == {"a", "b"}
        check_shape(first["a"], 5)
        check_shape(first["b"], 3)

        # greedy is deterministic; a prefix and a chat's turns are part of the prompt
        chat = [{"role": "user", "content": "Calculate 1 + 1."}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "Calculate 1 + 2."}]
        await client.send_many([generate("g1", "Calculate 1 + 2.", 6, 0.0), generate("g2", "Calculate 1 + 2.", 6, 0.0),
                                generate("pre", "Calculate 1 + 2.", 4, 0.0, prefix="Step 1: 1 + 2 = 3\n"),
                                generate("chat", "Calculate 1 + 2.", 4, 0.0, messages=chat)])
        done, _ = await collect(client, 4)
        g1, g2, pre, chat_c = done["g1"], done["g2"], done["pre"], done["chat"]
        assert (g1.completion_ids, g1.text) == (g2.completion_ids, g2.text)
        # two rows of one batch: the same tokens, log-probs equal to float32 rounding (a row's
        # padding and place in the batch move the last bits, ~1e-6 seen on a Ray worker)
        assert g1.logprobs == pytest.approx(g2.logprobs, abs=1e-4)
        assert g1.prompt_ids == first["a"].prompt_ids  # same prompt, same ids
        assert pre.prompt_ids[:len(g1.prompt_ids)] == g1.prompt_ids and len(pre.prompt_ids) > len(g1.prompt_ids)
        assert len(chat_c.prompt_ids) > len(g1.prompt_ids) and chat_c.prompt_ids != g1.prompt_ids
        for c in (pre, chat_c):
            check_shape(c, 4)

        # Abort of a running request: its tokens so far come back, finish "abort"
        await client.send_many([generate("long", "Calculate 5 + 5.", LONG), generate("short", "Hi", 2)])
        await collect(client, 1)  # the short one is out: the long one is mid-generation now
        await client.send(wire.Abort("long"))
        aborted = (await collect(client, 1))[0]["long"]
        assert aborted.finish == "abort" and len(aborted.completion_ids) < LONG
        check_shape(aborted, LONG)

        # a weight update: a request running across it gets both versions, later ones only v1
        await client.send_many([generate("across", "Calculate 6 + 1.", LONG), generate("short2", "Hi", 2)])
        await collect(client, 1)
        await client.send(wire.UpdateWeights(1, v1))
        await client.send(generate("after", "Calculate 2 + 2.", 5))
        done, other = await collect(client, 1)  # "after": "across" decoded beside it, under v1
        await client.send(wire.Abort("across"))
        aborted, more = await collect(client, 1)
        (loaded,) = other + more
        assert isinstance(loaded, wire.WeightsLoaded) and loaded.version == 1 and loaded.rebuilt == 1
        across = aborted["across"]
        check_shape(across, LONG, version=None)
        assert across.versions[0] == 0 and across.versions[-1] == 1 and across.interrupts == 1
        check_shape(done["after"], 5, version=1)
    finally:
        await client.stop()
    # shutdown: the stream ends, a send fails the one way a dead worker fails
    assert await asyncio.wait_for(client.recv(), REPLY_TIMEOUT_S) is None
    with pytest.raises(WorkerFailed, match="rollout worker failed"):
        for _ in range(3):  # a pipe can take a write or two before it reports the reader gone
            await client.send(wire.Abort("late"))
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_episodes_later_reply_continues_from_its_exact_ids(kind, tmp_path, request):
    """A Generate with context_ids and append: the prompt is those ids as given, then the
    appended turns (and a new assistant turn); the reply follows them."""
    client, _ = await start(kind, tmp_path, request)
    try:
        await client.send(generate("e0", "Calculate 6 * 7.", 4, 0.0))
        first = (await collect(client, 1))[0]["e0"]
        context = first.prompt_ids + first.completion_ids
        tool = [{"role": "tool", "content": "42"}]
        await client.send_many([generate("e1", "Calculate 6 * 7.", 4, 0.0, context_ids=context, append=tool),
                                generate("e1b", "Calculate 6 * 7.", 4, 0.0, context_ids=context, append=tool),
                                generate("e2", "Calculate 6 * 7.", 4, 0.0, context_ids=context)])
        done, _ = await collect(client, 3)
        e1, e1b, e2 = done["e1"], done["e1b"], done["e2"]
        for c in (e1, e2):
            check_shape(c, 4)
            assert c.prompt_ids[:len(context)] == context and len(c.prompt_ids) > len(context)
        assert len(e1.prompt_ids) > len(e2.prompt_ids)  # the tool turn's own ids are in e1's
        # the same ids; log-probs to float noise, as the two may share a batch with other rows or not
        assert (e1.prompt_ids, e1.completion_ids) == (e1b.prompt_ids, e1b.completion_ids)
        assert e1.logprobs == pytest.approx(e1b.logprobs, abs=1e-4)
        # max_context: the reply gets what the context leaves, nothing when nothing is left
        await client.send_many([generate("room", "Calculate 6 * 7.", 4, 0.0, context_ids=context, append=tool,
                                         max_context=len(e1.prompt_ids) + 2),
                                generate("full", "Calculate 6 * 7.", 4, 0.0, context_ids=context, append=tool,
                                         max_context=len(e1.prompt_ids))])
        done, _ = await collect(client, 2)
        assert done["room"].completion_ids == e1.completion_ids[:2] and done["room"].finish == "length"
        full = done["full"]
        assert (full.prompt_ids, full.completion_ids, full.finish) == (e1.prompt_ids, [], "length")
    finally:
        await client.stop()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_killed_rollout_worker_fails_the_same_way(kind, tmp_path, request):
    client, _ = await start(kind, tmp_path, request)
    try:
        await client.send(generate("x", "Calculate 1 + 2.", LONG))
        if kind == "fake":
            client.kill()
        else:
            os.kill(client.pid, signal.SIGKILL)
        msg = await asyncio.wait_for(client.recv(), REPLY_TIMEOUT_S)
        while isinstance(msg, wire.Completion):  # finished before the kill: still delivered
            msg = await asyncio.wait_for(client.recv(), REPLY_TIMEOUT_S)
        assert msg is None
        for _ in range(3000):  # the exit status can lag the end of the stream (30 s at most)
            failure = client.failure(msg)
            if "exited" in str(failure):
                break
            await asyncio.sleep(0.01)
        assert isinstance(failure, WorkerFailed) and failure.role == "rollout"
        assert "rollout worker failed: exited with code -9" in str(failure)
        said = "rollout worker failed" + ("" if kind == "ray" else ": exited with code -9")
        with pytest.raises(WorkerFailed, match=said):  # a write names the exit code too
            for _ in range(3):
                await client.send(wire.Abort("x"))
                await asyncio.sleep(0.05)
    finally:
        await client.stop()
