"""What the tests share: small settings, the fake workers' builders, the trainer's tiny samples,
a process probe, reward functions the reward processes import by name, and a cold-start model in
miniature. Tests import these from here (`from tests.conftest import ...`), never from each other."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from torch.overrides import TorchFunctionMode

from areal_aio import wire
from areal_aio.control.controller import Orchestrator
from areal_aio.fleet.fakes import FakeRollout, FakeTrainer, cut_at_stop
from areal_aio.fleet.rollout_pool import RolloutPool
from areal_aio.settings import build_settings
from areal_aio.tasks.arithmetic import arithmetic_prompt
from areal_aio.tasks.steps import render
from areal_aio.tasks.task import Task
from areal_aio.workers.models import TINY, encode_prompt

ROOT = Path(__file__).resolve().parent.parent
"""The repository."""


def tasks(n: int | None = None, start: int = 0):
    i = start
    while n is None or i < start + n:
        a, b = i % 10, (i * 7) % 10
        yield Task(id=f"t{i}", prompt=arithmetic_prompt(f"Calculate {a} + {b}."), answer=str(a + b))
        i += 1


def make_settings(mode: str = "areal", **overrides):
    raw = {
        "run": {"mode": mode, "max_steps": 6, "progress": False},
        "model": {"path": "embedded:tiny-random"},
        "task": {"eval_size": 4, "eval_every": 2},
        "rollout": {"group_size": 2},
        "trainer": {"batch_size": 4},
        "controller": {"reward_procs": 0},
    }
    sets = [f"{k}={orjson.dumps(v).decode()}" for k, v in overrides.items()]
    return build_settings(raw, sets)


def orchestrator(tmp_path, settings, rollout=None, trainer=None, **kw):
    return Orchestrator(settings, tasks=kw.pop("tasks", tasks()), eval_set=list(tasks(4, start=100)),
                        out_dir=tmp_path / "run", rollout=rollout or FakeRollout(),
                        trainer=trainer or FakeTrainer(), **kw)


WORKERS = [1, 2, 4]
"""Rollout worker counts the admission and staleness rules are checked with: global and exact."""


def rollouts(n: int, make=lambda i: FakeRollout()) -> tuple[list[FakeRollout], RolloutPool | FakeRollout]:
    """n fake rollout workers (`make(i)` builds worker i) and the client the controller gets
    for them: the one fake, or a RolloutPool of them (as placement builds for rollout.devices)."""
    fakes = [make(i) for i in range(n)]
    return fakes, fakes[0] if n == 1 else RolloutPool(fakes)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


HOST_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "tensor",
              "as_tensor"}
"""Tensor calls that wait for a device (a value read on the host) or copy host data onto it."""


class HostReads(TorchFunctionMode):
    """Records the torch calls in HOST_READS made while active (transformers' included)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def hangs(task, text):
    time.sleep(3600)
    return 1.0


def pid_of_worker(task: Task, text: str) -> float:
    return float(os.getpid())


TRAINER_SEED = 3
TRAINER_TEMPERATURE = 0.7
TRAINER_PROMPTS = ("What is 2 + 3?", "Name a colour.")
TRAINER_GROUP = 4
TRAINER_NEW_TOKENS = 10


def trainer_settings(*overrides: str) -> Any:
    return build_settings({}, (f"model.path={TINY}", f"run.seed={TRAINER_SEED}", "trainer.bf16=false",
                               f"rollout.temperature={TRAINER_TEMPERATURE}", f"rollout.group_size={TRAINER_GROUP}",
                               f"trainer.batch_size={TRAINER_GROUP * len(TRAINER_PROMPTS)}", *overrides))


def reward_of(ids: list[int]) -> float:
    """A deterministic reward with spread inside each group: share of even token ids."""
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def generate_samples(model: Any, tok: Any, version: int = 0, seed: int = 0) -> list[wire.TrainSample]:
    """TRAINER_GROUP samples per prompt with behaviour log-probs under logits / TRAINER_TEMPERATURE."""
    out = []
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for g, prompt in enumerate(TRAINER_PROMPTS):
            ids = encode_prompt(tok, prompt)
            x = torch.tensor([ids])
            res = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                 temperature=TRAINER_TEMPERATURE, top_k=0, top_p=1.0,
                                 max_new_tokens=TRAINER_NEW_TOKENS, min_new_tokens=TRAINER_NEW_TOKENS,
                                 num_return_sequences=TRAINER_GROUP, output_logits=True,
                                 return_dict_in_generate=True)
            logits = torch.stack(res.logits, 1).float()  # [G, N, V]
            comp = res.sequences[:, len(ids):]  # [G, N]
            logp = torch.log_softmax(logits / TRAINER_TEMPERATURE, -1).gather(2, comp[..., None])[..., 0]
            for k in range(TRAINER_GROUP):
                c = comp[k].tolist()
                out.append(wire.TrainSample(prompt_ids=ids, completion_ids=c,
                                            logprobs=logp[k].tolist(), versions=[version] * len(c),
                                            reward=reward_of(c), group=g))
    finally:
        torch.random.set_rng_state(gen_state)
    return out


STEP_REPLY = render(["2 + 1 = 3", "3 + 1 = 4"], "4")
"""What the model writes (a continuation from step 1 writes step 2 and the answer)."""
STEP_PROMPTS = ("Calculate 2 + 1 + 1.", "Calculate 1 + 3.")
SHARPEN = 5.0
"""Final-norm scale after training: 10 of 10 samples at temperature 0.7 were STEP_REPLY exactly."""


def build_step_model(folder: Path, steps: int = 150, lr: float = 1e-2) -> Path:
    """Train tiny-random (seed 0) to write STEP_REPLY after STEP_PROMPTS; save it with its tokenizer."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few small matmuls: more threads only contend (several x slower)
    try:
        return _build_step_model(folder, steps, lr)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def step_model(tmp_path_factory) -> Path:
    """build_step_model's folder, trained once a session: the tests that run on it only read it
    (the process-reward run and its benchmark)."""
    return build_step_model(tmp_path_factory.mktemp("step-model"))


def _build_step_model(folder: Path, steps: int, lr: float) -> Path:
    import torch

    from areal_aio.workers.models import TINY, encode_prompt, load_model

    model, tok = load_model(TINY, seed=0)
    table = model.lm_head.weight  # tied: the input embedding too
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        table[tok.eos_token_id] = torch.randn(table.shape[1], generator=gen) * table[5:1000].std()
    table.requires_grad_(False)
    reply = tok.encode(STEP_REPLY, add_special_tokens=False) + [tok.eos_token_id]
    vocab = sorted(set(reply))
    targets = torch.tensor([vocab.index(t) for t in reply] * len(STEP_PROMPTS))
    rows = [encode_prompt(tok, p) + reply for p in STEP_PROMPTS]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    predicts = torch.zeros((len(rows), width), dtype=torch.bool)  # positions whose next token is the reply's
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        predicts[i, len(row) - len(reply) - 1:len(row) - 1] = True
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[predicts]
        loss = torch.nn.functional.cross_entropy(hidden @ table[vocab].T, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    table.requires_grad_(True)
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def need(package: str) -> Any:
    """`package`, imported; a test without it skips here but fails under CI (CI=true), where the
    dev extra installs every optional package a test needs."""
    import importlib

    import pytest

    try:
        return importlib.import_module(package)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{package} is not installed: pip install -e '.[dev]' installs it", pytrace=False)
        pytest.skip(f"{package} is not installed")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread, as each worker has in a run (rollout.threads, trainer.threads): two
    threads on a shared 2-core machine only fight. Modules of worker tests ask for it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ScriptedReplies:
    """The rollout side of an episode's `Model`, scripted: answers each reply with the next of
    `texts` (two tokens, ids numbered by the reply), each cut after its first stop string as the
    engine cuts it, and records the turns and the stop strings each reply carried."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.appended: list = []
        self.stops: list = []

    async def __call__(self, ask):
        self.appended.append(ask.append)
        self.stops.append(ask.stop)
        ids = [len(self.appended)] * 2
        sent = ask.context_ids
        return wire.Completion("r", [9] if sent is None else sent + [5], ids, [-0.5, -0.5], [0, 0],
                               cut_at_stop(self.texts.pop(0), ask.stop), "stop", 0, 0.0)


class Jitter:
    """Mixed into a fake rollout: each request sleeps a random time per token (seeded), so
    groups finish out of order."""

    def __init__(self, seed: int, **kw) -> None:
        super().__init__(**kw)
        self.rng = random.Random(seed)

    def token_delay(self, request_id):
        return self.rng.choice([0.0, 0.0005, 0.002, 0.006])


def load_hook(path: Path):
    """A docs hook (docs/hooks/) as MkDocs loads it: its folder on sys.path while it runs, so it
    can import the hooks' shared module."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
