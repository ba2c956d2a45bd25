"""The wire: every message between the controller and its workers, and how it is framed.

One frame = 4-byte big-endian length + an orjson object with a `type` field.
Pipes carry control messages and token lists only; weights travel as files in
/dev/shm and a message carries their path and `version`. Anything whose meaning
depends on weights carries a version.

    controller -> rollout : Init, Generate, Abort, UpdateWeights, Shutdown
    rollout -> controller : Ready, Completion, WeightsLoaded, Error
    controller -> trainer : Init, Train, Save, Shutdown
    trainer -> controller : Ready, Trained, Saved, Error

A run that resumes starts its trainer with `Init.resume` (the checkpoint's trainer part) and
then sends the rollout worker UpdateWeights with the checkpoint's policy file.
"""

from __future__ import annotations

import asyncio
import struct
import typing
from dataclasses import dataclass, field
from typing import IO

import orjson

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024
"""Frames above this are a protocol error (weights never travel through a pipe)."""


class WireError(RuntimeError):
    """A malformed or unexpected frame; the pipe is no longer trustworthy."""


@dataclass(frozen=True, slots=True)
class Init:
    """First message to a worker: what to load and where weights live."""

    role: str  # "rollout" or "trainer"
    settings: dict  # Settings.to_dict() of the run
    shm_dir: str  # the run's private folder under /dev/shm (weight store)
    resume: str = ""  # trainer: a checkpoint's trainer/ folder to continue from ("" = fresh start)
    rank: int = 0  # this worker's index among its role's workers (trainer: its torch.distributed rank)
    world: int = 1  # how many workers its role has
    dist_addr: str = ""  # trainer with world > 1: the tcp://host:port of the process group's store


@dataclass(frozen=True, slots=True)
class Ready:
    """A worker finished loading and takes requests."""

    role: str
    pid: int
    load_s: float  # cold start: process start to model ready
    device: str
    version: int  # policy version of the weights it holds (0 = initial)


@dataclass(frozen=True, slots=True)
class Generate:
    """Start one sequence. temperature 0 = greedy (eval).

    With a `prefix` the reply is taken to have begun with it (a process-reward continuation):
    the worker tokenizes the chat template of `prompt` (with its generation prompt) followed by
    `prefix`; the Completion's prompt_ids hold both, its completion_ids and text only what
    was generated after the prefix.

    With `context_ids` (an episode's later replies: areal_aio/agents/model.py) the worker
    templates nothing it was given before: it continues from exactly these ids (the episode's
    prompt, replies and turns so far), after the `append` turns rendered by the chat template
    as messages that follow the last reply (with the generation prompt); the Completion's
    prompt_ids are context_ids + the appended turns' ids.

    With `stop` strings a reply also ends at the token whose text completes the first of them,
    which stays in its tokens and text (an episode's tool call ends the reply: `</calc>`)."""

    request_id: str
    prompt: str  # user message; the worker applies the chat template
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None  # sampling seed (areal_aio.seeds); None: the worker assigns one
    messages: list | None = None  # a chat task's {role, content} turns (the last is `prompt`): templated instead
    prefix: str = ""  # start of the assistant's reply to continue from ("" = a fresh reply)
    context_ids: list[int] | None = None  # an episode's exact ids so far; `prompt` is then only a label
    append: list | None = None  # {role, content} turns after context_ids (a tool's answer), templated
    max_context: int = 0  # > 0: the reply stops before prompt_ids + reply pass this many ids (none left: empty)
    stop: list | None = None  # strings that end the reply at the token completing the first one (kept, finish "stop")


@dataclass(frozen=True, slots=True)
class Save:
    """Write what the trainer holds into `path` (a new folder) and answer Saved.

    kind "model": the policy as a plain HF folder (config, safetensors, tokenizer with its chat
    template, generation config); with `weights` (a weight-store file of an older version)
    those weights instead of the live ones. kind "checkpoint": the trainer's part of a
    checkpoint (fp32 policy, optimizer state, torch RNG, version). Taken between Train
    messages, so it holds the version of the last Trained.
    """

    kind: str  # "model" | "checkpoint"
    path: str
    weights: str = ""  # kind "model": export this v<N>.safetensors instead of the live policy


@dataclass(frozen=True, slots=True)
class Saved:
    """A Save is on disk (files fsynced)."""

    kind: str
    path: str
    version: int  # the trainer's version when it saved (of `weights` when given: the controller knows it)
    bytes: int  # total size written
    seconds: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request; the worker answers with a Completion whose finish is 'abort'."""

    request_id: str


@dataclass(frozen=True, slots=True)
class UpdateWeights:
    """Load v<version>.safetensors from `path`; sent only after the controller committed it."""

    version: int
    path: str


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """The rollout worker now generates with `version`."""

    version: int
    load_s: float  # reading the file and copying it into the model
    rebuilt: int  # unfinished sequences whose KV cache was recomputed (interrupted)
    worker: int = 0  # which rollout worker (its Init.rank): with several, each loads every version


@dataclass(frozen=True, slots=True)
class Completion:
    """One finished sequence. versions[i] is the policy version that sampled completion_ids[i]."""

    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # log-prob of each token under the distribution it was sampled from
    versions: list[int]
    text: str
    finish: str  # "stop" (EOS or a stop string) | "length" | "abort"
    interrupts: int  # weight loads this sequence lived through
    gen_s: float  # admission to finish, seconds

    @property
    def oldest_version(self) -> int:
        return min(self.versions, default=-1)

    @property
    def newest_version(self) -> int:
        return max(self.versions, default=-1)


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One trajectory as the trainer sees it (a Completion plus its reward and group).

    An episode's (areal_aio/agents/model.py) completion_ids hold its replies and the turns
    between them; `loss_mask` marks the replies' tokens, the only ones trained: the turns'
    logprobs and versions are placeholders, never read. A guided member's (task.guide:
    areal_aio/control/guidance.py) tokens were `written`: no sampler drew them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per completion token
    versions: list[int]  # behaviour versions, one per completion token
    reward: float
    group: int  # samples of one prompt share a group (GRPO normalization)
    loss_mask: list[int] | None = None  # per completion token: 1 trained, 0 context only; None: all 1
    written: int = 0  # the last this many completion tokens were written, not sampled (a guided member):
    # their logprobs are placeholders; the trainer takes their behaviour log-prob to be its pi_prox


@dataclass(frozen=True, slots=True)
class Train:
    """Take one PPO-family (or supervised) update on these samples, then publish v<version+1>."""

    step: int
    version: int  # the controller's clock: the trainer's weights are this version
    samples: list[TrainSample] = field(default_factory=list)
    objective: str = ""  # "" = trainer.objective; "sft": the completions' negative log-likelihood
    publish: bool = True  # False: keep v<version+1> in the trainer only (Trained.path is "")


@dataclass(frozen=True, slots=True)
class Trained:
    """New weights are in the store; the controller commits `version` on receipt."""

    step: int
    version: int
    path: str
    stats: dict  # loss, entropy, clip_frac, ..., tokens, seconds (see workers/trainer/worker.py)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Finish what is in hand, release everything, exit 0."""


@dataclass(frozen=True, slots=True)
class Error:
    """A worker failed; it exits after sending this."""

    role: str
    message: str
    traceback: str


Message = (Init | Ready | Generate | Abort | UpdateWeights | WeightsLoaded | Completion
           | Train | Trained | Save | Saved | Shutdown | Error)
"""The closed set of frames; TrainSample travels only inside Train."""
TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}
"""Frame `type` -> its class: decoding knows exactly the union's members."""


def encode(msg: Message) -> bytes:
    """A message as one frame (header + body)."""
    name = type(msg).__name__
    if name not in TYPES:
        raise WireError(f"not a wire message: {msg!r}")
    body = {"type": name}
    for key in msg.__slots__:
        body[key] = getattr(msg, key)
    data = orjson.dumps(body)
    return HEADER.pack(len(data)) + data


def decode(data: bytes) -> Message:
    """A frame body back into its message."""
    try:
        body = orjson.loads(data)
        cls = TYPES[body.pop("type")]
        if cls is Train:
            body["samples"] = [TrainSample(**s) for s in body["samples"]]
        return cls(**body)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise WireError(f"malformed frame ({exc}): {data[:200]!r}") from None


def _length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return n


def write_message(stream: IO[bytes], msg: Message) -> None:
    """Blocking write of one message (worker side)."""
    stream.write(encode(msg))
    stream.flush()


def read_message(stream: IO[bytes]) -> Message | None:
    """Blocking read of one message; None at a clean end of stream (worker side)."""
    header = _read_exactly(stream, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(stream, _length(header))
    if body is None:
        raise WireError("stream ended inside a frame")
    return decode(body)


def _read_exactly(stream: IO[bytes], n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            if got:
                raise WireError("stream ended inside a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Messages from one asyncio stream, a `read` at a time; None at a clean end of stream.

    A read cancelled between a frame's header and its body keeps the header: the next read goes
    on with that frame. Two bare readexactly calls would drop it, and every read after would
    take a body for a header (a stop cancels the readers at any point, then reads the replies
    still owed on the same stream)."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.stream = stream
        self._header: bytes | None = None  # a frame's header read, its body not yet

    async def read(self) -> Message | None:
        if self._header is None:
            try:
                self._header = await self.stream.readexactly(HEADER.size)  # consumes nothing until whole
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise WireError("stream ended inside a frame") from None
                return None
        try:
            body = await self.stream.readexactly(_length(self._header))
        except asyncio.IncompleteReadError:
            raise WireError("stream ended inside a frame") from None
        self._header = None
        return decode(body)
