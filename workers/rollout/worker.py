"""The rollout worker process: `python -m areal_aio.workers.rollout`, the Engine behind a pipe.

    Init -> configure_torch, load_model -> Ready(version 0)
    loop:
        messages (never blocking while there is work; blocking recv when idle):
            Generate      -> engine.add (prompt, or a chat's messages, through the chat template, then
                             any reply prefix; an episode's context ids, then its new turns)
            Abort         -> engine.abort -> Completion(finish="abort"); unknown ids ignored
            UpdateWeights -> pending (a newer one supersedes an older one not yet loaded); the
                             file is the whole policy, or with lora.rank > 0 an adapter, merged
                             into the base or read into peft's layers (lora.merge; workers/lora.py);
                             with rollout.quantize = int8 then requantized (rollout/int8.py)
            Shutdown, EOF -> return
        pending weights:
            interrupt on  -> load now (we are at a chunk boundary), rebuild KV (kv_on_update =
                             keep: no rebuild), WeightsLoaded
            interrupt off -> stop admitting; once no row runs: load, WeightsLoaded, admit again
        chunk_tokens engine steps -> a Completion as soon as the engine looks at a finished
                                     sequence (every step on a CPU; see Engine.advance)

The pipe is looked at only between chunks, so `rollout.chunk_tokens` decode steps are the
interrupt granularity.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from areal_aio import wire
from areal_aio.settings import Settings
from areal_aio.store.safetensors_io import load_weights
from areal_aio.workers import lora
from areal_aio.workers.common import EOF, Channel, configure_torch, serve
from areal_aio.workers.models import encode_prompt, encode_turns, load_model
from areal_aio.workers.rollout import int8
from areal_aio.workers.rollout.engine import Engine, Request
from areal_aio.workers.rollout.slots import slots_problem

IDLE_WAIT_S = 1.0
"""Blocking wait for a message when there is nothing to generate (wakes at once on a message)."""


def static_decode(setting: str, device: str, model: Any) -> bool:
    """Whether the engine decodes in slots (rollout.static_decode): "on" always (a model the
    slots cannot run is then an error: Engine); "auto" on a CUDA worker whose model they can run,
    else the dynamic batch (a sliding-window or flash-attention model still generates); "off" never."""
    if setting == "auto":
        return device.startswith("cuda") and slots_problem(model) is None
    return setting == "on"


class RolloutWorker:
    """Owns the model and the Engine; `run` is the message loop."""

    def __init__(self, init: wire.Init) -> None:
        s = Settings.from_dict(init.settings)
        ro = s.rollout
        self.device = ro.device
        self.version = 0
        self.rank = init.rank  # which of the run's rollout workers (in WeightsLoaded and the log)
        self.served = 0  # requests answered (not aborted), reported at exit
        self.interrupt = ro.interrupt
        self.chunk_tokens = ro.chunk_tokens
        self.system_prompt = s.model.system_prompt
        configure_torch(self.device, ro.threads)
        model, self.tokenizer = load_model(s.model.path, seed=s.run.seed, dtype=ro.dtype,
                                           device=self.device)
        # a LoRA run's versions are adapters, applied to this worker's own copy of the base
        load = lora.handoff(s.lora, s.model.path) if s.lora.rank else load_weights
        if s.rollout_quantize == "int8":  # generation in int8; each version requantized after its load
            load = int8.refreshing(load, int8.quantize(model))
        self.engine = Engine(model, self.tokenizer, max_batch=ro.max_batch, seed=s.run.seed, load=load,
                             keep_kv=ro.kv_on_update == "keep",
                             static=static_decode(ro.static_decode, self.device, model))
        self.pending: wire.UpdateWeights | None = None

    def run(self, channel: Channel) -> None:
        engine = self.engine
        while True:
            msg = channel.poll() if engine.busy or self.pending else channel.recv(IDLE_WAIT_S)
            while msg is not None:
                if msg is EOF or isinstance(msg, wire.Shutdown):
                    print(f"[rollout {self.rank}] served {self.served} requests", file=sys.stderr, flush=True)
                    return
                self._handle(msg, channel)
                msg = channel.poll()
            if self.pending is not None and (self.interrupt or engine.running == 0):
                self._load(channel)
            steps = self.chunk_tokens  # one chunk; each Completion leaves at the look that finds it
            while steps > 0 and engine.busy:
                taken, finished = engine.advance(steps)
                steps -= taken
                self.served += sum(done.finish != "abort" for done in finished)
                for done in finished:
                    channel.send(done)

    def _handle(self, msg: Any, channel: Channel) -> None:
        match msg:
            case wire.Generate():
                if msg.context_ids is not None:  # an episode's later reply: its exact ids, then the turns
                    closed = bool(msg.context_ids) and msg.context_ids[-1] in self.engine.eos
                    ids = msg.context_ids + encode_turns(self.tokenizer, msg.append or [], closed)
                else:
                    ids = encode_prompt(self.tokenizer, msg.messages or msg.prompt, self.system_prompt,
                                        msg.prefix)
                limit = msg.max_new_tokens
                if msg.max_context:  # an episode's token bound, its new turns counted
                    limit = min(limit, msg.max_context - len(ids))
                    if limit < 1:
                        channel.send(wire.Completion(msg.request_id, ids, [], [], [], "", "length", 0, 0.0))
                        return
                self.engine.add(Request(msg.request_id, ids, limit, msg.temperature, msg.top_p, msg.seed,
                                        tuple(msg.stop or ())))
            case wire.Abort():
                done = self.engine.abort(msg.request_id)
                if done is not None:
                    channel.send(done)
            case wire.UpdateWeights():
                self.pending = msg
                if not self.interrupt:
                    self.engine.admitting = False  # drain: rows in flight finish on old weights
            case _:
                raise wire.WireError(f"rollout: unexpected message {type(msg).__name__}")

    def _load(self, channel: Channel) -> None:
        msg, self.pending = self.pending, None
        t0 = time.perf_counter()
        loaded, done = self.engine.update_weights(msg.version, msg.path)
        self.version = msg.version
        self.engine.admitting = True
        print(f"[rollout {self.rank}] v{msg.version}: load {loaded.load_s:.2f}s, rebuilt {loaded.rebuilt} "
              f"rows in {time.perf_counter() - t0 - loaded.load_s:.2f}s", file=sys.stderr, flush=True)
        channel.send(dataclasses.replace(loaded, worker=self.rank))
        self.served += len(done)
        for completion in done:
            channel.send(completion)


def main() -> int:
    return serve("rollout", RolloutWorker)


if __name__ == "__main__":
    raise SystemExit(main())
