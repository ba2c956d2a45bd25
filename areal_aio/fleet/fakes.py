"""In-process fake workers with the `WorkerClient` surface: the controller's test seam.

They speak the real wire messages without a model: the fake rollout worker
emits `tokens` tokens per request, one per `token_delay_s`, each stamped with
the version it holds at that moment, and follows the interrupt rule of the
real one (interrupt: switch versions at once; otherwise hold new requests, let
the ones in flight finish on the old weights, load, then start the held ones). Its answer to a prompt comes from `policy(prompt, version)`; a continuation
(a Generate with a reply prefix) and an episode's later reply (with context ids) are answered
by `continuation(msg, version)`.
The fake trainer answers Train after `step_delay_s` with the next version (a step in
`skip_steps` answered as the real trainer answers one whose loss was not finite: skipped, NaN
loss and gradient norm), and
Save by writing small stand-in files (a checkpoint part it can resume from: its
version; a "model" folder with a config.json). Both record what happened (`log`; the trainer
also every Train in `batches` and every Save in `saves`) so tests can check ordering and
overlap; `record=False` keeps nothing, as a real worker keeps nothing in the controller's
process (a benchmark of the controller would otherwise time the garbage collector walking the
fakes' records).
`stop()` (or Shutdown) and `kill()` end either one the way a subprocess ends: recv gives None
after what was already sent, a send raises WorkerFailed, and `failure` names the exit code
(-9 when killed), as PipeWorker's does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from areal_aio import wire
from areal_aio.fleet.client import WorkerFailed, worker_failed


@functools.lru_cache(maxsize=4096)
def solving_policy(prompt: str, version: int) -> str:
    """Answers `a + b` correctly once the policy is at version >= 2, tagged from version 4."""
    numbers = [int(x) for x in re.findall(r"\d+", prompt)[:2]]
    ops = re.findall(r"\d\s*([-+*/])\s*\d", prompt)
    value = sum(numbers) if not ops or ops[0] == "+" else numbers[0] - numbers[1]
    answer = value if version >= 2 else value + 1
    return f"<answer>{answer}</answer>" if version >= 4 else f"It is {answer}."


def cut_at_stop(text: str, stop: list[str] | None) -> str:
    """`text` up to and including the first of the `stop` strings it holds (the engine's cut)."""
    ends = [text.find(s) + len(s) for s in stop or () if s in text]
    return text[:min(ends)] if ends else text


def policy_continuation(msg: wire.Generate, version: int) -> str:
    """The default continuation: what the policy would answer, whatever the prefix."""
    return solving_policy(msg.prompt, version)


def prompt_ids(msg: wire.Generate) -> list[int]:
    """Stand-in token ids of what the real worker feeds the model: the chat (the task's turns,
    or the prompt as one user turn), then any reply prefix; one id per UTF-8 byte. An episode's
    later reply: its context ids as given, then its appended turns and the generation prompt."""
    if msg.context_ids is not None:
        turns = "".join(f"<{t['role']}>{t['content']}\n" for t in msg.append or [])
        return list(msg.context_ids) + list((turns + "<assistant>").encode())
    if not msg.messages:  # the common case, and a group's samples share it: tokenized once
        return list(_prompt_bytes(msg.prompt, msg.prefix))
    text = "".join(f"<{t['role']}>{t['content']}\n" for t in msg.messages)
    return list((text + "<assistant>" + msg.prefix).encode())


@functools.lru_cache(maxsize=4096)
def _prompt_bytes(prompt: str, prefix: str) -> bytes:
    return f"<user>{prompt}\n<assistant>{prefix}".encode()


KILLED = -9
"""The exit code a killed fake reports (a subprocess killed by SIGKILL)."""


class _FakeWorker:
    role: str
    returncode: int | None = None  # set once the fake "process" is gone
    record: bool  # False: keep no log (and no batches or saves: a real worker keeps none here)
    log: list[tuple[float, str, Any]]
    _out: asyncio.Queue

    def _note(self, what: str, about: Any) -> None:
        if self.record:
            self.log.append((time.perf_counter(), what, about))

    async def prepare(self, model: str) -> None:
        """No model files: a fake needs none."""
        return None

    async def send(self, msg: Any) -> None:
        raise NotImplementedError

    def _alive(self) -> None:
        if self.returncode is not None:
            raise worker_failed(self.role, None, self.returncode)

    def failure(self, msg: Any) -> WorkerFailed:
        return worker_failed(self.role, msg, self.returncode)

    def kill(self) -> None:
        """Die now: work in hand is lost, recv ends with None after what was already sent."""
        self._exit(KILLED)

    async def stop(self) -> None:
        """Exit as a worker asked to (Shutdown) does: work in hand is dropped, recv ends."""
        self._exit(0)

    def _exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._cancel()
            self._out.put_nowait(None)

    def _cancel(self) -> None:
        raise NotImplementedError

    async def send_many(self, msgs: list[Any]) -> None:
        """One `send` each, in order (a subclass that watches `send` sees every message)."""
        for msg in msgs:
            await self.send(msg)


class FakeRollout(_FakeWorker):
    role = "rollout"

    def __init__(self, *, tokens: int = 4, token_delay_s: float = 0.0, interrupt: bool = True,
                 policy: Callable[[str, int], str] = solving_policy, fail_on: str | None = None,
                 instant: bool = False, record: bool = True,
                 continuation: Callable[[wire.Generate, int], str] = policy_continuation) -> None:
        """instant: answer each Generate inside `send` (no task, no token loop): the cheapest
        possible worker, so a benchmark of the controller times the controller alone."""
        self.tokens = tokens
        self.instant = instant
        self.record = record
        self.token_delay_s = token_delay_s
        self.interrupt = interrupt
        self.policy = policy
        self.continuation = continuation
        self.fail_on = fail_on  # a request id whose arrival makes the worker send Error
        self.version = 0
        self.rank = 0  # Init.rank: which of the run's rollout workers this is
        self._pending_update: wire.UpdateWeights | None = None
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._running: dict[str, asyncio.Task] = {}
        self._waiting: list[wire.Generate] = []
        self._interrupts: dict[str, int] = {}
        self._requests: dict[str, wire.Generate] = {}  # started and not answered
        self._progress: dict[str, list[int]] = {}  # running: the versions of its tokens so far
        self.log = []

    async def start(self, init: wire.Init) -> wire.Ready:
        self.interrupt = bool(init.settings["rollout"]["interrupt"])
        self.rank = init.rank
        return wire.Ready(role=self.role, pid=os.getpid(), load_s=0.0, device="fake", version=0)

    async def send(self, msg: Any) -> None:
        self._alive()
        match msg:
            case wire.Generate(request_id=rid):
                if rid == self.fail_on:
                    await self._out.put(wire.Error(self.role, "boom", "Traceback: fake failure"))
                    return
                if self._pending_update is not None:  # interrupt off: new work waits for the load
                    self._waiting.append(msg)
                    return
                self._start(msg)
            case wire.Abort(request_id=rid):
                waiting = [m for m in self._waiting if m.request_id == rid]
                if waiting:
                    self._waiting.remove(waiting[0])
                    self._requests[rid] = waiting[0]
                    await self._out.put(self._completion(rid, [], "abort"))
                task = self._running.pop(rid, None)
                if task is not None:
                    task.cancel()  # like the real worker: the tokens made so far come back
                    await self._out.put(self._completion(rid, self._progress.pop(rid, []), "abort"))
                    if not self._running:  # drained by aborts: a held update loads now
                        await self._load()
            case wire.UpdateWeights():
                self._pending_update = msg
                if self.interrupt or not self._running:
                    await self._load()
            case wire.Shutdown():
                await self.stop()
            case _:
                raise wire.WireError(f"fake rollout got {msg!r}")

    def _start(self, msg: wire.Generate) -> None:
        self._note("generate", msg.request_id)
        self._interrupts[msg.request_id] = 0
        self._requests[msg.request_id] = msg
        if self.instant:
            versions = [self.version] * min(self.tokens, self._limit(msg))
            text = self.answer(msg, self.version)
            self._out.put_nowait(self._completion(msg.request_id, versions, self._finish(msg, text), text))
            self._note("done", msg.request_id)
            return
        self._running[msg.request_id] = asyncio.create_task(self._generate(msg))

    async def _load(self) -> None:
        update, self._pending_update = self._pending_update, None
        if update is None:
            return
        for rid in self._running:
            self._interrupts[rid] += 1
        self.version = update.version
        self._note("load", update.version)
        await self._out.put(wire.WeightsLoaded(version=update.version, load_s=0.0,
                                               rebuilt=len(self._running) if self.interrupt else 0,
                                               worker=self.rank))
        waiting, self._waiting = self._waiting, []
        for msg in waiting:
            self._start(msg)

    def answer(self, msg: wire.Generate, version: int) -> str:
        if msg.prefix or msg.context_ids is not None:
            return cut_at_stop(self.continuation(msg, version), msg.stop)
        return cut_at_stop(self.policy(msg.prompt, version), msg.stop)

    def token_delay(self, request_id: str) -> float:
        """Seconds per token of this request (override for uneven timings)."""
        return self.token_delay_s

    def _finish(self, msg: wire.Generate, text: str) -> str:
        """`tokens` is where the fake's reply ends (its EOS); max_new_tokens (or max_context) can
        cut it first, unless a stop string did (the text holds one)."""
        if msg.stop and any(s in text for s in msg.stop):
            return "stop"
        return "length" if self._limit(msg) <= self.tokens else "stop"

    def _limit(self, msg: wire.Generate) -> int:
        """The most tokens a request may get: max_new_tokens, and what max_context leaves."""
        if not msg.max_context:
            return msg.max_new_tokens
        return max(0, min(msg.max_new_tokens, msg.max_context - len(prompt_ids(msg))))

    async def next_token(self, request_id: str, i: int, delay: float) -> None:
        """Wait for token i of a request (override to tie a request to events, not to time):
        `delay` each, or with none one yield before the first."""
        if delay or not i:
            await asyncio.sleep(delay)

    async def _generate(self, msg: wire.Generate) -> None:
        delay = self.token_delay(msg.request_id)
        versions = self._progress[msg.request_id] = []
        for i in range(min(self.tokens, self._limit(msg))):
            await self.next_token(msg.request_id, i, delay)
            versions.append(self.version)
        text = self.answer(msg, versions[-1]) if versions else ""  # no room left: an empty reply
        self._running.pop(msg.request_id, None)
        del self._progress[msg.request_id]
        await self._out.put(self._completion(msg.request_id, versions, self._finish(msg, text), text))
        self._note("done", msg.request_id)
        if not self.interrupt and not self._running:
            await self._load()

    def _completion(self, rid: str, versions: list[int], finish: str, text: str = "") -> wire.Completion:
        """Token i of a reply is id i; each has log-prob -1 and the version it was made under."""
        msg = self._requests.pop(rid)
        return wire.Completion(request_id=rid, prompt_ids=prompt_ids(msg), completion_ids=list(range(len(versions))),
                               logprobs=[-1.0] * len(versions), versions=list(versions), text=text,
                               finish=finish, interrupts=self._interrupts.pop(rid, 0), gen_s=0.0)

    async def recv(self) -> Any | None:
        return await self._out.get()

    def _cancel(self) -> None:
        for task in self._running.values():
            task.cancel()
        self._running.clear()


class FakeTrainer(_FakeWorker):
    role = "trainer"

    def __init__(self, *, step_delay_s: float = 0.0, fail_at_step: int | None = None, record: bool = True,
                 skip_steps: Collection[int] = ()) -> None:
        self.step_delay_s = step_delay_s
        self.skip_steps = skip_steps
        self.record = record
        self.fail_at_step = fail_at_step
        self.version = 0
        self.batches: list[wire.Train] = []
        self.saves: list[wire.Save] = []
        self.log = []
        self._out: asyncio.Queue[Any] = asyncio.Queue()
        self._shm_dir = ""
        self._task: asyncio.Task | None = None

    async def start(self, init: wire.Init) -> wire.Ready:
        self._shm_dir = init.shm_dir
        if init.resume:
            self.version = json.loads((Path(init.resume) / "state.json").read_text())["version"]
        return wire.Ready(role=self.role, pid=os.getpid(), load_s=0.0, device="fake", version=self.version)

    async def send(self, msg: Any) -> None:
        self._alive()
        match msg:
            case wire.Train():
                if msg.version != self.version:
                    await self._out.put(wire.Error(self.role, f"version {msg.version} != {self.version}", ""))
                    return
                self._task = asyncio.create_task(self._train(msg))
            case wire.Save():
                if self.record:
                    self.saves.append(msg)
                await self._after_train()  # a real trainer answers in order: Train first
                folder = Path(msg.path)
                folder.mkdir(parents=True, exist_ok=True)
                if msg.kind == "checkpoint":
                    (folder / "state.json").write_text(json.dumps({"version": self.version}))
                else:
                    (folder / "config.json").write_text(json.dumps({"version": self.version,
                                                                    "weights": msg.weights}))
                size = sum(p.stat().st_size for p in folder.iterdir())
                await self._out.put(wire.Saved(msg.kind, str(folder), self.version, size, 0.0))
            case wire.Shutdown():
                await self.stop()
            case _:
                raise wire.WireError(f"fake trainer got {msg!r}")

    async def _train(self, msg: wire.Train) -> None:
        self._note("start", msg.step)
        if msg.step == self.fail_at_step:
            await self._out.put(wire.Error(self.role, "RuntimeError: fake trainer failure",
                                           "Traceback (most recent call last):\nRuntimeError"))
            return
        if self.record:
            self.batches.append(msg)
        await asyncio.sleep(self.step_delay_s)
        self.version += 1
        tokens = sum(len(s.completion_ids) for s in msg.samples)
        self._note("end", msg.step)
        await self._out.put(wire.Trained(step=msg.step, version=self.version,
                                         path=os.path.join(self._shm_dir, f"v{self.version}.safetensors"),
                                         stats=self._stats(msg.step, tokens)))

    def _stats(self, step: int, tokens: int) -> dict[str, Any]:
        skipped = step in self.skip_steps
        nan = float("nan")
        return {"loss": nan if skipped else 0.0, "grad_norm": nan if skipped else 0.0, "tokens": tokens,
                "seconds": self.step_delay_s, "skipped": int(skipped)}

    async def _after_train(self) -> None:
        if self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def recv(self) -> Any | None:
        return await self._out.get()

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
