"""The rollout worker as a real subprocess (`python -m areal_aio.workers.rollout`) on embedded:tiny-random."""

from __future__ import annotations

import copy
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from areal_aio import wire
from areal_aio.settings import build_settings
from areal_aio.store.weights import WeightStore
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.rollout import int8
from tests.conftest import ROOT as REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


REPLY_TIMEOUT_S = 120.0
"""Generous: a cold worker imports torch and transformers on a busy 2-core machine."""
LONG = 300
"""Tokens of a 'long' request: tiny-random decodes these in well under a second, yet long
enough that an UpdateWeights sent after a short request finished lands mid-generation."""

NOISY_MAIN = """
import os, sys
from areal_aio.workers.rollout import worker as rollout
handle = rollout.RolloutWorker._handle
def noisy(self, msg, channel):
    print("stray print from python")
    os.write(1, b"stray write to fd 1\\n")
    return handle(self, msg, channel)
rollout.RolloutWorker._handle = noisy
sys.exit(rollout.main())
"""


class WorkerProcess:
    """Synchronous test client: spawn the worker, write frames to stdin, read frames from stdout."""

    def __init__(self, tmp: Path, overrides: tuple[str, ...] = (), code: str | None = None) -> None:
        # float32 generation unless a test asks for int8: most tests check log-probs against the float model
        self.settings = build_settings({}, (f"model.path={TINY}", "run.seed=3", "rollout.quantize=off", *overrides))
        self.log = tmp / "rollout.log"
        argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "areal_aio.workers.rollout"]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "wb"), env=dict(os.environ))
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.send(wire.Init(role="rollout", settings=self.settings.to_dict(), shm_dir=str(tmp)))
        self.ready = self.recv()

    def _read(self) -> None:
        try:
            while (msg := wire.read_message(self.proc.stdout)) is not None:
                self.inbox.put(msg)
        except Exception as exc:  # noqa: BLE001 - surfaces in recv
            self.inbox.put(exc)
        self.inbox.put(None)

    def send(self, msg) -> None:
        wire.write_message(self.proc.stdin, msg)

    def recv(self, timeout: float = REPLY_TIMEOUT_S):
        msg = self.inbox.get(timeout=timeout)
        if isinstance(msg, Exception):
            raise msg
        return msg

    def generate(self, rid: str, prompt: str, n: int, temperature: float = 1.0) -> None:
        self.send(wire.Generate(request_id=rid, prompt=prompt, max_new_tokens=n,
                                temperature=temperature, top_p=1.0))

    def collect(self, count: int) -> tuple[dict[str, wire.Completion], list]:
        """The next `count` Completions, and the other messages in arrival order."""
        done, other = {}, []
        while len(done) < count:
            msg = self.recv()
            assert msg is not None, self.log.read_text()
            if isinstance(msg, wire.Completion):
                done[msg.request_id] = msg
            else:
                other.append(msg)
        return done, other

    def shutdown(self) -> int:
        self.send(wire.Shutdown())
        return self.proc.wait(timeout=REPLY_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def spawn(tmp_path):
    started = []

    def start(*overrides: str, code: str | None = None) -> WorkerProcess:
        worker = WorkerProcess(tmp_path, overrides, code)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """v0 (the worker's initial weights, same seed) and a published, different v1."""
    v0, tok = load_model(TINY, seed=3)
    v1 = copy.deepcopy(v0)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    path = WeightStore(tmp_path_factory.mktemp("shm")).publish(v1, 1)
    return {0: v0, 1: v1}, tok, str(path)


def _logprobs(model, c: wire.Completion) -> list[float]:
    ids = torch.tensor([c.prompt_ids + c.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(c.prompt_ids) - 1:-1].float(), -1)
    return logp.gather(1, torch.tensor(c.completion_ids)[:, None])[:, 0].tolist()


def _check_logprobs(models: dict, c: wire.Completion, atol: float = 1e-4) -> None:
    """Each token's logprob equals a fresh forward pass of the weights of its own version."""
    ref = {v: _logprobs(models[v], c) for v in set(c.versions)}
    for i, (lp, v) in enumerate(zip(c.logprobs, c.versions, strict=True)):
        assert abs(lp - ref[v][i]) < atol, (c.request_id, i, v, lp, ref[v][i])


def test_concurrent_requests_abort_and_clean_shutdown(spawn, weights):
    """Also: stray prints (Python and fd 1) on every message never corrupt the pipe."""
    models, tok, _ = weights
    w = spawn("rollout.max_batch=4", "rollout.chunk_tokens=2", code=NOISY_MAIN)
    assert isinstance(w.ready, wire.Ready) and w.ready.version == 0 and w.ready.role == "rollout"
    lengths = {f"r{i}": 3 + 5 * i for i in range(10)}
    for i, (rid, n) in enumerate(lengths.items()):
        w.generate(rid, f"Calculate {i} + {i + 1}.", n, temperature=0.0 if i == 0 else 1.0)
    w.generate("long", "Calculate 1 + 1.", LONG)
    w.send(wire.Abort(request_id="nobody"))  # unknown ids are ignored
    done, other = w.collect(len(lengths))
    assert other == [] and "long" not in done
    for rid, n in lengths.items():
        c = done[rid]
        assert c.finish == "length" and len(c.completion_ids) == n == len(c.logprobs)
        assert c.versions == [0] * n and c.interrupts == 0
        assert c.prompt_ids == encode_prompt(tok, f"Calculate {rid[1:]} + {int(rid[1:]) + 1}.")
        _check_logprobs(models, c)
    w.send(wire.Abort(request_id="long"))
    aborted = w.collect(1)[0]["long"]
    assert aborted.finish == "abort" and 0 < len(aborted.completion_ids) < LONG
    assert w.shutdown() == 0
    log = w.log.read_text()
    assert "stray print from python" in log and "stray write to fd 1" in log


def test_interrupting_update_versions_tokens_and_rebuilds(spawn, weights):
    models, _, path = weights
    w = spawn("rollout.interrupt=true", "rollout.max_batch=8", "rollout.chunk_tokens=2")
    for i in range(4):
        w.generate(f"long{i}", f"Calculate {i} + 4.", LONG)
    w.generate("short", "Hi", 2)
    w.collect(1)  # the short one is out: the long ones are mid-generation now
    w.send(wire.UpdateWeights(version=1, path=path))
    w.generate("after", "Calculate 2 + 2.", 5)
    done, other = w.collect(5)
    (loaded,) = other
    assert isinstance(loaded, wire.WeightsLoaded) and loaded.version == 1 and loaded.rebuilt == 4
    for i in range(4):
        c = done[f"long{i}"]
        assert c.interrupts == 1 and c.versions[0] == 0 and c.versions[-1] == 1
        assert c.versions == sorted(c.versions) and len(c.versions) == LONG
        _check_logprobs(models, c)
    assert done["after"].versions == [1] * 5 and done["after"].interrupts == 0
    _check_logprobs(models, done["after"])
    assert w.shutdown() == 0


def test_int8_generation_requantizes_each_loaded_version(spawn, weights):
    """rollout.quantize = int8: every token's logprob is that of its version's int8 model
    (a float difference between a batched decode step and a whole-sequence pass may tip an
    int8 rounding, which moves an unlikely token's logprob by up to ~1e-2: hence the tolerance)."""
    models, _, path = weights
    quantized = {}
    for version, model in models.items():
        quantized[version] = copy.deepcopy(model)
        int8.quantize(quantized[version])
    w = spawn("rollout.quantize=int8", "rollout.max_batch=8", "rollout.chunk_tokens=2")
    for i in range(3):
        w.generate(f"long{i}", f"Calculate {i} + 4.", LONG)
    w.generate("short", "Hi", 2)
    w.collect(1)
    w.send(wire.UpdateWeights(version=1, path=path))
    done, other = w.collect(3)
    assert isinstance(other[0], wire.WeightsLoaded) and other[0].rebuilt == 3
    for c in done.values():
        assert c.versions[0] == 0 and c.versions[-1] == 1
        _check_logprobs(quantized, c, atol=0.03)
    assert w.shutdown() == 0


def test_non_interrupting_update_finishes_in_flight_on_old_weights(spawn, weights):
    models, _, path = weights
    w = spawn("rollout.interrupt=false", "rollout.max_batch=8", "rollout.chunk_tokens=2")
    for i in range(3):
        w.generate(f"long{i}", f"Calculate {i} + 4.", LONG // 3)
    w.generate("short", "Hi", 2)
    w.collect(1)
    w.send(wire.UpdateWeights(version=1, path=path))
    w.generate("after", "Calculate 2 + 2.", 5)
    done, other = w.collect(4)
    (loaded,) = other
    assert loaded.version == 1 and loaded.rebuilt == 0
    for i in range(3):
        c = done[f"long{i}"]
        assert c.versions == [0] * (LONG // 3) and c.interrupts == 0
        _check_logprobs(models, c)
    assert done["after"].versions == [1] * 5
    _check_logprobs(models, done["after"])
    w.proc.stdin.close()  # EOF ends the worker too
    assert w.proc.wait(timeout=REPLY_TIMEOUT_S) == 0


def test_a_crash_reaches_the_parent_as_error_with_traceback(spawn, tmp_path):
    w = spawn()
    w.send(wire.UpdateWeights(version=1, path=str(tmp_path / "v1.safetensors")))
    err = w.recv()
    assert isinstance(err, wire.Error) and err.role == "rollout"
    assert "WeightStoreError" in err.message and "Traceback" in err.traceback
    assert "load_weights" in err.traceback
    assert w.recv() is None and w.proc.wait(timeout=REPLY_TIMEOUT_S) == 1


def check_prefix_continues_the_reply(w: WorkerProcess, models: dict, tok, system: str) -> None:
    """A process-reward continuation: chat template + prefix is the prompt, only what follows
    is the completion, and its log-probs are conditioned on the prefix (`system`: the worker's
    model.system_prompt)."""
    prefix = "Step 1: 2 + 3 = 5\n"
    w.send(wire.Generate("p0.0.0.1.0", "Calculate 2 + 3 - 1.", 6, 0.0, prefix=prefix))
    w.send(wire.Generate("no-prefix", "Calculate 2 + 3 - 1.", 6, 0.0))
    done, _ = w.collect(2)
    c, plain = done["p0.0.0.1.0"], done["no-prefix"]
    assert c.prompt_ids == encode_prompt(tok, "Calculate 2 + 3 - 1.", system) + tok.encode(prefix, add_special_tokens=False)
    assert c.prompt_ids == encode_prompt(tok, "Calculate 2 + 3 - 1.", system, prefix=prefix)
    assert plain.prompt_ids == c.prompt_ids[:len(plain.prompt_ids)] and len(c.prompt_ids) > len(plain.prompt_ids)
    assert len(c.completion_ids) == 6 and c.text == tok.decode(c.completion_ids, skip_special_tokens=True)
    _check_logprobs(models, c)


def test_a_chat_is_templated_whole_with_its_system_turn(spawn, weights):
    """Generate.messages (a chat task) goes through the chat template as it is, its own system
    turn in place of model.system_prompt's; a plain prompt still gets model.system_prompt. The
    same worker then continues a reply after a prefix (check_prefix_continues_the_reply)."""
    models, tok, _ = weights
    chat = [{"role": "system", "content": "Reply with a number."},
            {"role": "user", "content": "Calculate 1 + 1."}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "Calculate 2 + 2."}]
    w = spawn("model.system_prompt='Be brief.'")
    w.send(wire.Generate("chat", chat[-1]["content"], 4, 0.0, messages=chat))
    w.send(wire.Generate("user", chat[-1]["content"], 4, 0.0, messages=chat[1:]))
    w.generate("plain", "Calculate 2 + 2.", 4, temperature=0.0)
    done, _ = w.collect(3)
    text = {rid: tok.decode(c.prompt_ids) for rid, c in done.items()}
    assert done["chat"].prompt_ids == encode_prompt(tok, chat)
    assert "Reply with a number." in text["chat"] and "Be brief." not in text["chat"]
    assert text["chat"].count("<|im_start|>user") == 2 and "<|im_start|>assistant\n2<|im_end|>" in text["chat"]
    assert text["user"].startswith("<|im_start|>system\nBe brief.") and text["user"].count("<|im_start|>user") == 2
    assert done["plain"].prompt_ids == encode_prompt(tok, "Calculate 2 + 2.", "Be brief.")
    _check_logprobs(models, done["chat"])
    check_prefix_continues_the_reply(w, models, tok, "Be brief.")
    assert w.shutdown() == 0
