"""Data parallelism: the split of a mini-batch's rows over ranks (workers/trainer/packing.py, planned in
workers/trainer/microbatch.py), and two gloo ranks (workers/trainer/data_parallel.py) taking
the very updates one rank takes (real trainer subprocesses over pipes, areal_aio.fleet.trainer_ranks)."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from areal_aio import wire
from areal_aio.fleet import placement
from areal_aio.fleet.trainer_ranks import TrainerRanks
from areal_aio.settings import build_settings
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.trainer.data_parallel import Ranks
from areal_aio.workers.trainer.microbatch import plan_micro_batches
from areal_aio.workers.trainer.packing import split

# ---- the split ---------------------------------------------------------------------------------


def test_split_is_largest_first_to_the_least_loaded_rank() -> None:
    #          0   1  2  3   4  5
    costs = [10, 70, 40, 30, 20, 5]
    # 70 -> r0; 40 -> r1; 30 -> r1 (now 70, 70); 20 -> r0 (tie: the lower rank); 10 -> r1; 5 -> r1
    assert split(costs, 2) == [[1, 4], [0, 2, 3, 5]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("world", [2, 3])
def test_split_deals_every_micro_batch_once_and_balances_the_tokens(seed: int, world: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    costs = torch.randint(1, 500, (int(torch.randint(1, 20, (1,), generator=gen)),), generator=gen).tolist()
    shares = split(costs, world)
    assert len(shares) == world
    assert sorted(itertools.chain(*shares)) == list(range(len(costs)))  # each exactly once
    assert all(s == sorted(s) for s in shares)  # in plan order within a rank
    loads = [sum(costs[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(costs)  # greedy: never more than one item apart
    assert split(costs, world) == shares  # the same on every rank


def test_a_rank_may_get_nothing_and_ties_go_to_the_lower_rank() -> None:
    assert split([7], 3) == [[0], [], []]
    assert split([], 2) == [[], []]
    assert split([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("parts", [2, 3])
def test_each_rank_plans_its_own_rows_and_together_they_plan_the_mini_batch(packed: bool, parts: int) -> None:
    gen = torch.Generator().manual_seed(parts)
    samples = []
    for g in range(5):  # groups of 3 sharing a prompt, replies of 1-40 tokens
        prompt = torch.randint(0, 100, (int(torch.randint(3, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(3):
            n = int(torch.randint(1, 40, (1,), generator=gen))
            samples.append(wire.TrainSample(prompt, torch.randint(0, 100, (n,), generator=gen).tolist(),
                                            [-1.0] * n, [0] * n, 0.0, g))
    adv = torch.zeros(len(samples))
    kw = {"packed": packed, "max_tokens": 4096, "pad_id": 0, "device": "cpu"}
    whole = plan_micro_batches(samples, 0, 15, adv, **kw)
    assert len(whole) == 1  # the budget makes one micro-batch of it all: a split of micro-batches idles
    shares = [plan_micro_batches(samples, 0, 15, adv, part=r, parts=parts, **kw) for r in range(parts)]
    index = [sorted(i for mb in share for i in mb.index) for share in shares]
    assert sorted(itertools.chain(*index)) == list(range(15))  # each sample on exactly one rank
    assert all(index)  # 5 groups (15 rows unpacked) give every rank work
    if packed:  # groups stay whole
        assert all(set(idx) >= {i // 3 * 3 + j for j in range(3)} for idx in index for i in idx)
    assert sum(mb.tokens for share in shares for mb in share) == whole[0].tokens


def test_one_rank_totals_are_its_own() -> None:
    zero = torch.zeros((), dtype=torch.float64)
    got = Ranks().totals({"a": zero + 2, "b": zero + 3}, {"lo": zero - 1}, {"hi": zero + 5})
    assert got == {"a": 2.0, "b": 3.0, "lo": -1.0, "hi": 5.0}


# ---- one rank and two gloo ranks take the same updates -------------------------------------------

SEED = 3
TEMPERATURE = 0.7
PROMPTS = ("What is 2 + 3?", "Name a colour.", "Add 17 and 25, then double it.", "Hi",
           "Why is the sky blue?", "Count to five.")
GROUP = 4
LENGTHS = (14, 9, 5, 2)
"""Completion lengths inside a group (rotated per group): uneven rows and groups."""
STEPS = 3
WEIGHTS_ATOL = 1e-5
STATS_RTOL = 1e-5
TIMED = ("seconds", "prox_s", "publish_s", "reduce_s")
LAYOUT = ("computed_tokens",)
"""Positions computed, padding included: each rank pads its own micro-batches, so the ranks
together may pad less or more than one rank does (the work, not the update)."""


@pytest.fixture(scope="module")
def batches() -> list[list[wire.TrainSample]]:
    """STEPS batches of GROUP sampled replies per prompt, cut to uneven lengths, with their
    behaviour log-probs under logits / TEMPERATURE; batch k was sampled by version k (sync)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared 2-core box only fight
    try:
        return _uneven_batches(*load_model(TINY, seed=SEED))
    finally:
        torch.set_num_threads(threads)


def _uneven_batches(model: Any, tok: Any) -> list[list[wire.TrainSample]]:
    out = []
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        samples = []
        for g, prompt in enumerate(PROMPTS):
            ids = encode_prompt(tok, prompt)
            x = torch.tensor([ids])
            res = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True,
                                 temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=max(LENGTHS),
                                 min_new_tokens=max(LENGTHS), num_return_sequences=GROUP,
                                 output_logits=True, return_dict_in_generate=True)
            logits = torch.stack(res.logits, 1).float()  # [G, N, V]
            comp = res.sequences[:, len(ids):]  # [G, N]
            logp = torch.log_softmax(logits / TEMPERATURE, -1).gather(2, comp[..., None])[..., 0]
            for k in range(GROUP):
                n = LENGTHS[(k + g) % len(LENGTHS)]
                c = comp[k, :n].tolist()
                samples.append(wire.TrainSample(
                    prompt_ids=ids, completion_ids=c, logprobs=logp[k, :n].tolist(),
                    versions=[step] * n, reward=sum(i % 2 == 0 for i in c) / n, group=g))
        out.append(samples)
    return out


async def train(client: Any, settings: Any, shm: Path, batches: list[list[wire.TrainSample]],
                objective: str) -> list[wire.Trained]:
    """Start the trainer, send one Train per batch (sync: each at the trainer's version), stop."""
    replies = []
    try:
        ready = await client.start(wire.Init("trainer", settings.to_dict(), str(shm)))
        assert ready.version == 0
        for step, samples in enumerate(batches):
            await client.send(wire.Train(step=step + 1, version=step, samples=samples, objective=objective))
            reply = await client.recv()
            assert isinstance(reply, wire.Trained), client.failure(reply)
            replies.append(reply)
    finally:
        await client.stop()
    return replies


@pytest.mark.slow
@pytest.mark.parametrize(("objective", "variant"), [
    ("", ("trainer.share_prompts=on", "trainer.micro_tokens=80", "trainer.minibatches=2", "trainer.kl_coef=0.1")),
    # unpacked rows, one sample per mini-batch: rank 1 gets no row and still takes every reduction
    ("", ("trainer.share_prompts=off", "trainer.micro_tokens=4096", "trainer.minibatches=24")),
    # the supervised objective; a budget that holds each mini-batch (2 groups) in one micro-batch
    ("sft", ("trainer.share_prompts=on", "trainer.micro_tokens=4096", "trainer.minibatches=3")),
], ids=["packed-two-minibatches-kl", "rows-rank-1-idle", "sft-budget-of-one-micro-batch"])
async def test_two_gloo_ranks_reach_the_weights_of_one_rank(tmp_path, capsys, batches, objective, variant) -> None:
    t0 = time.perf_counter()
    base = (f"model.path={TINY}", f"run.seed={SEED}", "trainer.bf16=off", "trainer.lr=1e-3",
            f"rollout.temperature={TEMPERATURE}", f"rollout.group_size={GROUP}", "rollout.dtype=float32",
            f"trainer.batch_size={GROUP * len(PROMPTS)}", "trainer.threads=1", *variant)
    one, two = build_settings({}, base), build_settings({}, (*base, "trainer.devices=2"))
    clients = {"one": placement.trainer_client(one, tmp_path), "two": placement.trainer_client(two, tmp_path)}
    assert isinstance(clients["two"], TrainerRanks) and not isinstance(clients["one"], TrainerRanks)
    for name in clients:
        (tmp_path / name).mkdir()
    got = await asyncio.gather(*(train(clients[name], s, tmp_path / name, batches, objective)
                                 for name, s in (("one", one), ("two", two))))
    for a, b in zip(*got, strict=True):
        assert (a.step, a.version) == (b.step, b.version) and Path(b.path).parent == tmp_path / "two"
        for key, value in a.stats.items():
            if key not in TIMED + LAYOUT:
                assert b.stats[key] == pytest.approx(value, rel=STATS_RTOL, abs=1e-7), key
    v0, _ = load_model(TINY, seed=SEED)
    start = {name: p.detach() for name, p in v0.named_parameters()}
    w1, w2 = (load_file(r[-1].path) for r in got)
    assert w1.keys() == w2.keys()
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = max((w1[k] - start[k]).abs().max().item() for k in w1 if k in start)
    assert diff <= WEIGHTS_ATOL < moved / 100, (diff, moved)
    assert got[0][-1].stats["tokens"] == sum(LENGTHS) * len(PROMPTS)
    with capsys.disabled():
        print(f"\n[data parallel] {objective or 'rl'} {variant}: max |w1 - w2| {diff:.2e} (weights moved {moved:.2e}), "
              f"{time.perf_counter() - t0:.1f}s")
