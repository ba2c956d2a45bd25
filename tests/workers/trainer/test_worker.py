"""workers/trainer/worker.py: in-process on embedded:tiny-random, then as a real subprocess.

The samples come from `model.generate` with behaviour log-probs taken under
logits / temperature (what the rollout worker reports), or from the real
rollout worker; with both sides on the same fp32 weights the trainer's
recomputation must agree (mismatch_kl ~ 0).
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from areal_aio import wire
from areal_aio.store.safetensors_io import load_weights
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.trainer.microbatch import (
    build_micro_batch,
    build_packed_micro_batch,
    group_row_length,
    prompt_groups,
)
from areal_aio.workers.trainer.worker import Trainer
from tests.conftest import ROOT as REPO
from tests.conftest import TRAINER_GROUP as GROUP
from tests.conftest import TRAINER_NEW_TOKENS as NEW_TOKENS
from tests.conftest import TRAINER_PROMPTS as PROMPTS
from tests.conftest import TRAINER_SEED as SEED
from tests.conftest import TRAINER_TEMPERATURE as TEMPERATURE
from tests.conftest import HostReads, generate_samples, reward_of
from tests.conftest import trainer_settings as settings

REPLY_TIMEOUT_S = 120.0
"""Generous: a cold worker imports torch and transformers on a busy 2-core machine."""
MISMATCH_KL_MAX = 1e-6




@pytest.fixture(scope="module")
def batch(one_thread) -> list[wire.TrainSample]:
    model, tok = load_model(TINY, seed=SEED)
    return generate_samples(model, tok)


def make_trainer(tmp_path: Path, *overrides: str) -> Trainer:
    tmp_path.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(TINY, seed=SEED)
    return Trainer(settings(*overrides).to_dict(), tmp_path, model=model, tokenizer=tok)


def weighted_logp(trainer: Trainer, samples: list[wire.TrainSample]) -> float:
    """sum_i A_i * sum_t log pi(token) with GRPO advantages: what policy gradient raises."""
    from areal_aio.workers.trainer.losses import advantages

    adv = advantages(torch.tensor([s.reward for s in samples]),
                     torch.tensor([s.group for s in samples]))
    mb = build_micro_batch(samples, list(range(len(samples))), adv, trainer.pad_id, "cpu")
    return float((trainer.logprobs(mb) * mb.adv).sum())


# ---- in-process --------------------------------------------------------------------------------

def test_one_update_publishes_v1_with_sane_stats(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    reply = trainer.train(wire.Train(step=0, version=0, samples=batch))
    assert reply.version == 1 and trainer.version == 1
    assert Path(reply.path) == tmp_path / "v1.safetensors" and Path(reply.path).exists()
    st = reply.stats
    assert st["mismatch_kl"] is not None and 0 <= st["mismatch_kl"] < MISMATCH_KL_MAX
    # decoupled PPO, one mini-batch: pi_theta = pi_prox exactly on the only step
    assert st["ratio_min"] == st["ratio_max"] == 1.0 and st["clip_frac"] == 0.0
    assert abs(st["behav_w_mean"] - 1.0) < 1e-4 and st["capped_frac"] == 0.0
    assert st["tokens"] == GROUP * len(PROMPTS) * NEW_TOKENS and st["seqs"] == len(batch)
    assert st["grad_norm"] > 0 and st["entropy"] > 0 and "kl" not in st
    for key, value in st.items():
        assert value is None or type(value) in (int, float), key
    changed = any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert changed


def test_host_reads_of_an_update_do_not_grow_with_its_micro_batches(tmp_path) -> None:
    """Stats stay on the device until the update's end, and padded rows get their 4D mask
    from the trainer: on a GPU each read of a value waits for every kernel queued before it,
    so one per micro-batch would stall the pipeline. (A micro-batch without padding still
    costs one read inside transformers; see Trainer._attention_mask.)"""
    reads, plans = [], []
    for micro_tokens in (4096, 400):
        trainer = make_trainer(tmp_path / str(micro_tokens), f"trainer.micro_tokens={micro_tokens}",
                               "trainer.minibatches=2", "trainer.kl_coef=0.1", "trainer.kl_ref=ref",
                               "trainer.share_prompts=off")
        samples = mixed_samples(trainer.model.config.vocab_size)
        plan = trainer._micro_batches
        trainer._micro_batches = lambda *a, plan=plan: plans.append(out := plan(*a)) or out
        with HostReads() as seen:
            trainer.train(wire.Train(step=0, version=0, samples=samples))
        reads.append(Counter(name for name in seen.seen if name not in ("tensor", "as_tensor")))
    assert [len(p) for p in plans] == [1, 1, 3, 4]
    assert all(mb.padded for p in plans for mb in p)
    assert reads[0] == reads[1] and reads[0]["tolist"] == 1  # the stats: one read per update


def test_missing_store_folder_is_a_clear_error(tmp_path) -> None:
    model, tok = load_model(TINY, seed=SEED)
    with pytest.raises(FileNotFoundError, match="weight store folder"):
        Trainer(settings().to_dict(), tmp_path / "absent", model=model, tokenizer=tok)


def test_version_must_match(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="version 1"):
        trainer.train(wire.Train(step=0, version=1, samples=batch))


def test_malformed_sample_is_refused_before_any_change(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path)
    bad = wire.TrainSample(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-1.0],
                           versions=[0, 0], reward=1.0, group=0)
    with pytest.raises(ValueError, match="1 logprobs"):
        trainer.train(wire.Train(step=0, version=0, samples=[*batch, bad]))
    assert trainer.version == 0 and not list(tmp_path.iterdir())


def test_mismatch_kl_counts_only_tokens_of_the_current_version(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path)
    old = [wire.TrainSample(s.prompt_ids, s.completion_ids, s.logprobs, [7] * len(s.versions),
                            s.reward, s.group) for s in batch]
    stats = trainer.train(wire.Train(step=0, version=0, samples=old)).stats
    assert stats["mismatch_kl"] is None and stats["mismatch_k1"] is None


def test_mismatch_k1_and_k3_estimate_the_same_kl(tmp_path, batch) -> None:
    """Behaviour log-probs moved by a known d per token (r = log pi_prox - log pi_behav becomes
    r0 - d, r0 ~ 0 here: the same weights sampled them): k1 = mean(-r), k3 = mean(e^r - 1 - r)."""
    exact = make_trainer(tmp_path / "a").train(wire.Train(step=0, version=0, samples=batch)).stats
    d = [0.1, -0.2, 0.3]
    moved = [dataclasses.replace(s, logprobs=[lp + d[j % 3] for j, lp in enumerate(s.logprobs)]) for s in batch]
    st = make_trainer(tmp_path / "b").train(wire.Train(step=0, version=0, samples=moved)).stats
    ds = [d[j % 3] for s in batch for j in range(len(s.logprobs))]
    assert abs(exact["mismatch_k1"]) < 1e-4 and exact["mismatch_kl"] < 1e-6
    assert st["mismatch_k1"] == pytest.approx(exact["mismatch_k1"] + sum(ds) / len(ds), abs=1e-4)
    assert st["mismatch_kl"] == pytest.approx(sum(math.expm1(-x) + x for x in ds) / len(ds), rel=1e-2)


def test_micro_batching_does_not_change_the_update(tmp_path, batch) -> None:
    """Token-level aggregation: loss and gradient are the same however the batch is cut."""
    whole = make_trainer(tmp_path / "a", "trainer.micro_tokens=100000")
    split = make_trainer(tmp_path / "b", "trainer.micro_tokens=64")
    a = whole.train(wire.Train(step=0, version=0, samples=batch)).stats
    b = split.train(wire.Train(step=0, version=0, samples=batch)).stats
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-6)


def ragged(batch: list[wire.TrainSample]) -> list[wire.TrainSample]:
    """The batch with completions cut to lengths 1..NEW_TOKENS, so rows pad differently."""
    out = []
    for k, s in enumerate(batch):
        n = 1 + (k * 3) % NEW_TOKENS
        out.append(wire.TrainSample(s.prompt_ids, s.completion_ids[:n], s.logprobs[:n],
                                    s.versions[:n], s.reward, s.group))
    return out


def test_shared_prompt_forward_equals_the_unshared_one(tmp_path, batch) -> None:
    """Prompts of two lengths, ragged completions: every token's log-prob and the gradient agree."""
    samples = ragged(batch)
    assert len({len(s.prompt_ids) for s in samples}) == 2
    trainer = make_trainer(tmp_path)
    adv = torch.linspace(-1, 1, len(samples))
    plain = build_micro_batch(samples, list(range(len(samples))), adv, trainer.pad_id, "cpu")
    groups = prompt_groups(samples, 0, len(samples))
    assert [len(g) for g in groups] == [GROUP] * len(PROMPTS)
    shared = build_packed_micro_batch(samples, groups, adv, trainer.pad_id, "cpu")
    assert shared.shared and shared.index == plain.index and torch.equal(shared.targets, plain.targets)
    grads = []
    for mb in (plain, shared):
        trainer.model.zero_grad(set_to_none=True)
        logp, entropy = trainer._forward(trainer.model, mb)
        (logp * mb.adv).sum().backward()
        grads.append((logp.detach(), entropy, [p.grad.clone() for p in trainer.params]))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = grads
    assert torch.allclose(lp_a, lp_b, atol=1e-5) and torch.allclose(ent_a, ent_b, atol=1e-5)
    for a, b in zip(g_a, g_b, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_shared_and_unshared_updates_agree(tmp_path, batch) -> None:
    samples = ragged(batch)
    shared = make_trainer(tmp_path / "a")
    plain = make_trainer(tmp_path / "b", "trainer.share_prompts=off")
    assert shared.share_prompts and not plain.share_prompts
    a = shared.train(wire.Train(step=0, version=0, samples=samples)).stats
    b = plain.train(wire.Train(step=0, version=0, samples=samples)).stats
    assert a["tokens"] == b["tokens"] == sum(len(s.completion_ids) for s in samples)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert a["mismatch_kl"] < MISMATCH_KL_MAX
    for x, y in zip(shared.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)


PACKED_REPLY_LENGTHS = ([7, 25, 8, 24, 1, 64, 8, 8], [48, 8, 30, 64, 23, 48, 14, 8],
                        [64, 22, 3, 27, 37, 64, 2, 20], [1, 5, 64, 2])
"""Replies of a default run's groups (bench/train_step.py MIXED_REPLY_TOKENS), with 1-token and
max-length (64) replies, and a smaller group."""


GRAD_REL_TOL = 1e-5
"""Packed vs per-sequence gradients, relative to each tensor's largest entry: the sums run in
another order (~4e-7 measured on tiny-random); a completion seeing another is off by O(1)."""


def mixed_samples(vocab: int, seed: int = 0) -> list[wire.TrainSample]:
    """Groups of PACKED_REPLY_LENGTHS with prompts of different lengths and random tokens."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for g, lengths in enumerate(PACKED_REPLY_LENGTHS):
        prompt = torch.randint(vocab, (9 + 4 * g,), generator=rng).tolist()
        for n in lengths:
            out.append(wire.TrainSample(prompt, torch.randint(vocab, (n,), generator=rng).tolist(),
                                        [-1.0] * n, [0] * n, 0.0, g))
    return out


def per_sequence_logp(model: Any, s: wire.TrainSample) -> torch.Tensor:
    """log pi(token) [C] of one sample run alone, the model's own causal forward and full logits."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]


@pytest.mark.parametrize(("attention", "fast"), [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_packed_forward_equals_the_per_sequence_forward(tmp_path, one_thread, attention, fast) -> None:
    """Log-probs and gradients of the packed micro-batches (several groups, several micro-batches,
    replies of 1 to 64 tokens) are those of each sample run alone, through the chunked head and the
    model's own; a mask that lets a completion see another one is caught."""
    trainer = make_trainer(tmp_path)
    trainer.model.set_attn_implementation(attention)
    assert trainer.share_prompts and trainer.model.config._attn_implementation == attention
    samples = mixed_samples(trainer.model.config.vocab_size)
    weight = torch.randn(sum(len(s.completion_ids) for s in samples),
                         generator=torch.Generator().manual_seed(1))  # a loss that touches every token

    trainer.model.zero_grad(set_to_none=True)
    ref = torch.cat([per_sequence_logp(trainer.model, s) for s in samples])
    (ref * weight).sum().backward()
    ref_grads = [p.grad.clone() for p in trainer.params]

    rows = [group_row_length(samples, g) for g in prompt_groups(samples, 0, len(samples))]
    trainer.cfg = dataclasses.replace(trainer.cfg, micro_tokens=2 * max(rows))  # room for two rows, not four
    mbs = trainer._micro_batches(samples, 0, len(samples), torch.zeros(len(samples)))
    assert len(mbs) > 1 and any(mb.input_ids.shape[0] > 1 for mb in mbs)
    assert all(mb.shared and mb.computed <= trainer.cfg.micro_tokens for mb in mbs)
    assert [i for mb in mbs for i in mb.index] == list(range(len(samples)))
    trainer.model.zero_grad(set_to_none=True)
    logps, lo = [], 0
    for mb in mbs:
        logp, _ = trainer._forward(trainer.model, mb, fast=fast)
        (logp * weight[lo:lo + mb.tokens]).sum().backward()
        logps.append(logp.detach())
        lo += mb.tokens
    torch.testing.assert_close(torch.cat(logps), ref.detach(), atol=1e-5, rtol=0)
    for p, g in zip(trainer.params, ref_grads, strict=True):
        # fp32 sums in another order: off by ~4e-7 of the tensor's largest entry
        assert float((p.grad - g).abs().max()) <= GRAD_REL_TOL * float(g.abs().max())

    # the same test on a mask where completions also see the completions before them fails
    mb = mbs[0]
    leaky = mb.attention_mask | (mb.attention_mask.any(dim=2, keepdim=True)
                                 & torch.ones_like(mb.attention_mask).tril())  # causal within rows
    with torch.no_grad():
        wrong, _ = trainer._forward(trainer.model, dataclasses.replace(mb, attention_mask=leaky))
    assert not torch.allclose(wrong, logps[0], atol=1e-3)


def test_prox_is_the_policy_before_the_update_in_every_mini_batch(tmp_path, batch, monkeypatch) -> None:
    """The first mini-batch reads pi_prox off its own forward, the second takes it from a
    pass before any step: both must equal a no-grad pass on the pre-update weights."""
    import areal_aio.workers.trainer.worker as trainer_module

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (behav, prox) per micro-batch
    real = trainer_module.losses.token_loss

    def spy(logp, behav, prox, *args, **kwargs):
        seen.append((behav.clone(), prox.clone()))
        return real(logp, behav, prox, *args, **kwargs)

    monkeypatch.setattr(trainer_module.losses, "token_loss", spy)
    trainer = make_trainer(tmp_path / "a", "trainer.minibatches=2", "trainer.lr=1e-3")
    before = make_trainer(tmp_path / "b")  # same seed: the same pre-update weights
    stats = trainer.train(wire.Train(step=0, version=0, samples=batch)).stats
    adv = torch.zeros(len(batch))
    refs = [(mb.behav, before.logprobs(mb)) for half in ((0, len(batch) // 2), (len(batch) // 2, len(batch)))
            for mb in before._micro_batches(batch, *half, adv)]
    assert len(seen) == len(refs) == 2
    for behav, prox in seen:
        ref = next(logp for b, logp in refs if torch.equal(b, behav))
        torch.testing.assert_close(prox, ref, atol=1e-6, rtol=0)
    assert stats["ratio_max"] > stats["ratio_min"]  # the second mini-batch ran on moved weights


@pytest.mark.parametrize("objective", ["pg", "ppo", "decoupled_ppo", "gspo", "cispo"])
def test_repeated_updates_raise_the_reward_weighted_logprob(tmp_path, batch, objective) -> None:
    trainer = make_trainer(tmp_path, f"trainer.objective={objective}", "trainer.lr=3e-3",
                           "trainer.minibatches=2")
    start = weighted_logp(trainer, batch)
    losses = []
    for step in range(3):
        losses.append(trainer.train(wire.Train(step=step, version=step, samples=batch)).stats["loss"])
    assert weighted_logp(trainer, batch) > start + 0.5
    if objective == "pg":  # same batch, same -A logp objective: its value must fall
        assert losses[-1] < losses[0]


def sft_samples(tok: Any) -> list[wire.TrainSample]:
    """Three pairs, two with one prompt (they share a packed row), as the sft command builds them."""
    pairs = [(PROMPTS[0], [5, 6, 7, 2]), (PROMPTS[1], [8, 9, 2]), (PROMPTS[0], [11, 2])]
    return [wire.TrainSample(encode_prompt(tok, p), c, [0.0] * len(c), [0] * len(c), 0.0, 0) for p, c in pairs]


@pytest.mark.parametrize("share", ["on", "off"])
def test_sft_loss_is_the_mean_completion_nll_at_temperature_one(tmp_path, one_thread, share) -> None:
    """The loss is worked out by hand from each sequence alone through the model: the log-softmax
    of its full logits at temperature 1 (the settings' rollout temperature is 0.7), prompt tokens
    left out, averaged over the completion tokens. Nothing is published."""
    from areal_aio.workers.trainer.worker import SFT_STATS

    trainer = make_trainer(tmp_path, "trainer.lr=1e-3", f"trainer.share_prompts={share}")
    samples = sft_samples(trainer.tokenizer)
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logp = torch.log_softmax(trainer.model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0], -1)
            for j, token in enumerate(s.completion_ids):  # position P - 1 + j predicts token j
                nll -= float(logp[len(s.prompt_ids) - 1 + j, token])
                n += 1
    reply = trainer.train(wire.Train(0, 0, samples, objective="sft", publish=False))
    assert reply.stats["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert set(reply.stats) == set(SFT_STATS) and reply.stats["tokens"] == n == 9
    assert reply.version == trainer.version == 1 and reply.path == ""
    assert not list(tmp_path.glob("*.safetensors"))
    again = trainer.train(wire.Train(1, 1, samples, objective="sft", publish=False))
    assert again.stats["loss"] < reply.stats["loss"]


def test_kl_against_a_frozen_reference_grows_from_zero(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path, "trainer.kl_coef=0.1", "trainer.kl_ref=ref", "trainer.lr=3e-3")
    first = trainer.train(wire.Train(step=0, version=0, samples=batch)).stats
    second = trainer.train(wire.Train(step=1, version=1, samples=batch)).stats
    assert first["kl"] < 1e-9 < second["kl"]


def test_bf16_autocast_step_is_finite(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path, "trainer.bf16=true", "rollout.dtype=bfloat16")
    st = trainer.train(wire.Train(step=0, version=0, samples=batch)).stats
    assert all(v == v for v in st.values() if isinstance(v, float))  # no NaN
    assert st["ratio_min"] == st["ratio_max"] == 1.0  # prox ran the same bf16 micro-batches
    assert st["mismatch_kl"] < 1e-2  # bf16 vs fp32 behaviour: small, not ~0
    from safetensors import safe_open
    with safe_open(str(tmp_path / "v1.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.float32  # fp32 master weights


# ---- subprocess ----------------------------------------------------------------------------------

class Worker:
    """Synchronous test client of `python -m areal_aio.workers.<role>`."""

    def __init__(self, role: str, tmp: Path, shm: Path, s: Any) -> None:
        self.log = tmp / f"{role}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", f"areal_aio.workers.{role}"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "wb"), env=dict(os.environ))
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.send(wire.Init(role=role, settings=s.to_dict(), shm_dir=str(shm)))
        self.ready = self.recv()
        assert isinstance(self.ready, wire.Ready), self.log.read_text()

    def _read(self) -> None:
        while (msg := wire.read_message(self.proc.stdout)) is not None:
            self.inbox.put(msg)
        self.inbox.put(None)

    def send(self, msg: Any) -> None:
        wire.write_message(self.proc.stdin, msg)

    def recv(self) -> Any:
        return self.inbox.get(timeout=REPLY_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def workers(tmp_path):
    started: list[Worker] = []

    def start(role: str, s: Any) -> Worker:
        shm = tmp_path / "shm"
        shm.mkdir(exist_ok=True)
        w = Worker(role, tmp_path, shm, s)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


@pytest.mark.slow
def test_trainer_process_trains_publishes_and_shuts_down(workers, batch) -> None:
    trainer = workers("trainer", settings())
    assert trainer.ready.role == "trainer" and trainer.ready.version == 0
    trainer.send(wire.Train(step=0, version=0, samples=batch))
    reply = trainer.recv()
    assert isinstance(reply, wire.Trained), reply
    assert reply.version == 1 and reply.stats["mismatch_kl"] < MISMATCH_KL_MAX
    v0, _ = load_model(TINY, seed=SEED)
    v1, _ = load_model(TINY, seed=SEED)
    load_weights(v1, reply.path)
    diff = max((a - b).abs().max().item() for a, b in zip(v0.parameters(), v1.parameters(), strict=True))
    assert diff > 0
    trainer.send(wire.Shutdown())
    assert trainer.proc.wait(timeout=REPLY_TIMEOUT_S) == 0


@pytest.mark.slow
def test_trainer_process_reports_a_wrong_version_as_error(workers, batch) -> None:
    trainer = workers("trainer", settings())
    trainer.send(wire.Train(step=0, version=5, samples=batch))
    reply = trainer.recv()
    assert isinstance(reply, wire.Error) and "version 5" in reply.message
    assert "Traceback" in reply.traceback
    assert trainer.proc.wait(timeout=REPLY_TIMEOUT_S) == 1


@pytest.mark.slow
def test_rollout_samples_train_with_zero_mismatch_and_v1_loads_back(workers) -> None:
    s = settings("rollout.dtype=float32", "rollout.quantize=off", "rollout.interrupt=false")
    rollout = workers("rollout", s)
    trainer = workers("trainer", s)
    for g, prompt in enumerate(PROMPTS):
        for k in range(GROUP):
            rollout.send(wire.Generate(request_id=f"{g}-{k}", prompt=prompt,
                                       max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE))
    samples = []
    while len(samples) < GROUP * len(PROMPTS):
        c = rollout.recv()
        assert isinstance(c, wire.Completion), c
        samples.append(wire.TrainSample(c.prompt_ids, c.completion_ids, c.logprobs, c.versions,
                                        reward_of(c.completion_ids), int(c.request_id[0])))
    trainer.send(wire.Train(step=0, version=0, samples=samples))
    reply = trainer.recv()
    assert isinstance(reply, wire.Trained), reply
    assert reply.stats["mismatch_kl"] < MISMATCH_KL_MAX
    assert reply.stats["tokens"] == sum(len(x.completion_ids) for x in samples)
    rollout.send(wire.UpdateWeights(version=reply.version, path=reply.path))
    loaded = rollout.recv()
    assert isinstance(loaded, wire.WeightsLoaded) and loaded.version == 1


def test_bf16_auto_follows_the_hardware() -> None:
    from areal_aio.workers.trainer.worker import bf16_autocast

    assert bf16_autocast("on", "cpu") and not bf16_autocast("off", "cpu")
    # auto on a CPU: exactly oneDNN's own answer to "are bf16 matmuls native here?"
    assert bf16_autocast("auto", "cpu") == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# ---- episodes: a loss mask over completion_ids ---------------------------------------------------

def episode_samples(batch: list[wire.TrainSample], tok: Any, nan: bool) -> list[wire.TrainSample]:
    """Each sample as an episode: its first 4 tokens a reply, then a tool turn (the chat
    template's own ids, mask 0, placeholder logprobs: NaN when `nan`), then the rest a reply."""
    from areal_aio.workers.models import encode_turns

    turn = encode_turns(tok, [{"role": "tool", "content": "7"}], closed=False)
    out = []
    for s in batch:
        ids = s.completion_ids[:4] + turn + s.completion_ids[4:]
        filler = float("nan") if nan else 0.0
        logprobs = s.logprobs[:4] + [filler] * len(turn) + s.logprobs[4:]
        versions = s.versions[:4] + [s.versions[3]] * len(turn) + s.versions[4:]
        mask = [1] * 4 + [0] * len(turn) + [1] * (len(s.completion_ids) - 4)
        out.append(dataclasses.replace(s, completion_ids=ids, logprobs=logprobs, versions=versions,
                                       loss_mask=mask))
    return out


@pytest.mark.parametrize("share", ["on", "off"])
def test_tool_turns_get_no_loss_and_no_gradient(tmp_path, batch, share) -> None:
    """The masked forward gives the trained tokens exactly the log-probs of the unmasked one
    (the tool turn is context), its gradient is the gradient of the trained tokens alone, and
    an update never reads a placeholder (NaN there would poison loss and weights)."""
    trainer = make_trainer(tmp_path / "a", f"trainer.share_prompts={share}")
    episodes = episode_samples(batch, trainer.tokenizer, nan=True)
    whole = [dataclasses.replace(s, loss_mask=None, logprobs=[0.0] * len(s.logprobs)) for s in episodes]
    adv = torch.ones(len(episodes))
    plan = dict(lo=0, hi=len(episodes), adv=adv)
    [masked] = trainer._micro_batches(episodes, **plan)
    [full] = trainer._micro_batches(whole, **plan)
    keep = torch.tensor([bool(m) for s in episodes for m in s.loss_mask])  # [T of full]
    assert masked.tokens == int(keep.sum()) == sum(len(s.completion_ids) for s in batch) < full.tokens
    assert torch.equal(masked.targets, full.targets[keep])

    def grads(mb):
        trainer.model.zero_grad(set_to_none=True)
        logp = trainer._forward(trainer.model, mb)[0]
        (logp[keep] if mb is full else logp).sum().backward()
        return logp.detach(), [p.grad.clone() for p in trainer.params]

    lp_masked, g_masked = grads(masked)
    lp_full, g_full = grads(full)
    assert torch.allclose(lp_masked, lp_full[keep], atol=1e-6)
    for a, b in zip(g_masked, g_full, strict=True):
        assert torch.allclose(a, b, atol=1e-6 * max(1.0, float(b.abs().max())))
    trainer.model.zero_grad(set_to_none=True)
    reply = trainer.train(wire.Train(step=0, version=0, samples=episodes))
    assert reply.stats["tokens"] == int(keep.sum())
    assert all(value is None or value == value for value in reply.stats.values())  # no NaN anywhere
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_loss_aggregation_is_each_kinds_reference_formula(tmp_path, batch) -> None:
    """trainer.loss_agg on ragged replies, pg (token loss -A logp): token = sum / tokens,
    sequence = mean over sequences of each one's token mean, constant = sum / (S x max_new_tokens);
    the same however the mini-batch is cut into micro-batches."""
    from areal_aio.workers.trainer.losses import advantages

    samples = ragged(batch)
    probe = make_trainer(tmp_path / "probe")
    adv = advantages(torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]))
    per_seq = []
    for i in range(len(samples)):
        mb = build_micro_batch(samples, [i], adv, probe.pad_id, "cpu")
        per_seq.append((-mb.adv * probe.logprobs(mb)).double().detach())
    n = sum(len(t) for t in per_seq)
    max_len = probe.max_new_tokens
    want = {"token": sum(float(t.sum()) for t in per_seq) / n,
            "sequence": sum(float(t.mean()) for t in per_seq) / len(per_seq),
            "constant": sum(float(t.sum()) for t in per_seq) / (len(per_seq) * max_len)}
    ordered = sorted(want.values())
    assert ordered[1] - ordered[0] > 0.01 * abs(ordered[1]) and ordered[2] - ordered[1] > 0.01 * abs(ordered[2])
    cases = [(agg, "on", 100000) for agg in want] + [("sequence", "off", 48), ("constant", "on", 48)]
    for agg, share, micro in cases:
        trainer = make_trainer(tmp_path / f"{agg}-{share}-{micro}", "trainer.objective=pg", f"trainer.loss_agg={agg}",
                               f"trainer.share_prompts={share}", f"trainer.micro_tokens={micro}")
        got = trainer.train(wire.Train(step=0, version=0, samples=samples)).stats["loss"]
        assert got == pytest.approx(want[agg], rel=1e-4), (agg, share, micro)  # fp32 sums in another order


def test_the_entropy_bonus_raises_the_policys_entropy(tmp_path, batch) -> None:
    """Equal rewards (advantage 0): the policy-gradient part is 0, so trainer.entropy_coef alone
    moves the weights, and the entropy the next steps measure rises; with the bonus off the
    weights stay as they were."""
    flat = [dataclasses.replace(s, reward=1.0) for s in batch]
    seen = {}
    for coef in (0.0, 0.5):
        trainer = make_trainer(tmp_path / str(coef), "trainer.objective=pg", "trainer.lr=3e-3",
                               f"trainer.entropy_coef={coef}")
        seen[coef] = [trainer.train(wire.Train(step=k, version=k, samples=flat)).stats["entropy"] for k in range(3)]
    assert seen[0.0][0] == pytest.approx(seen[0.0][-1], rel=1e-6)
    # tiny-random is close to uniform (entropy near log V = 10.8): the rise is small, and it is
    # a hundred times what the same steps without the bonus move it (nothing)
    assert seen[0.5][0] == pytest.approx(seen[0.0][0], rel=1e-6) and seen[0.5][-1] - seen[0.5][0] > 1e-3


@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_step_whose_loss_is_not_finite_is_skipped_and_leaves_the_weights(tmp_path, batch, minibatches) -> None:
    """A NaN reward (as 1e308 rewards overflowing the advantages made) gives a NaN loss and
    gradient: no AdamW step, the weights and the optimizer's state as they were, the step
    reported skipped; the version still advances with the weights it holds, all finite."""
    trainer = make_trainer(tmp_path, f"trainer.minibatches={minibatches}")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    poisoned = [dataclasses.replace(s, reward=float("nan")) for s in batch]
    reply = trainer.train(wire.Train(step=1, version=0, samples=poisoned))
    assert reply.version == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert reply.stats["skipped"] == minibatches
    assert not trainer.opt.state and all(p.grad is None for p in trainer.params)
    assert all(torch.isfinite(t).all() for t in load_file(reply.path).values())
    good = trainer.train(wire.Train(step=2, version=1, samples=batch))
    assert good.stats["skipped"] == 0 and trainer.opt.state
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_guided_members_written_tokens_take_pi_prox_as_their_behaviour(tmp_path, batch) -> None:
    """Tokens a guide wrote (TrainSample.written) have no sampler: their placeholder log-probs
    are never read, pi_prox stands in (weight 1, none capped), and the update is the one with
    their exact log-probs given; the same placeholders read as sampled ones are capped."""
    def placeholders(s: wire.TrainSample, written: int) -> wire.TrainSample:
        return dataclasses.replace(s, logprobs=[-50.0] * len(s.logprobs), written=written)

    exact = make_trainer(tmp_path / "exact")
    exact.train(wire.Train(step=0, version=0, samples=batch))
    guided = make_trainer(tmp_path / "guided")
    st = guided.train(wire.Train(step=0, version=0, samples=[*batch[:-1], placeholders(batch[-1], NEW_TOKENS)])).stats
    assert st["capped_frac"] == 0.0 and st["behav_w_max"] < 1.001
    for name, value in exact.model.state_dict().items():
        torch.testing.assert_close(guided.model.state_dict()[name], value, atol=1e-6, rtol=1e-4)
    read = make_trainer(tmp_path / "read").train(
        wire.Train(step=0, version=0, samples=[*batch[:-1], placeholders(batch[-1], 0)])).stats
    assert read["capped_frac"] > 0


def test_more_written_tokens_than_completion_tokens_are_refused(tmp_path, batch) -> None:
    bad = dataclasses.replace(batch[0], written=len(batch[0].completion_ids) + 1)
    with pytest.raises(ValueError, match="written tokens"):
        make_trainer(tmp_path).train(wire.Train(step=0, version=0, samples=[*batch, bad]))


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory) -> Path:
    """A tiny-random model folder of other weights than the policy's (seed SEED + 1), the
    policy's tokenizer beside them."""
    folder = tmp_path_factory.mktemp("teacher")
    model, tok = load_model(TINY, seed=SEED + 1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_teacher_that_is_the_policy_adds_nothing(tmp_path, batch) -> None:
    """teacher.model = the policy's own weights: the reverse KL is 0 at every token, so the
    update is the plain one, and the stats say so."""
    plain = make_trainer(tmp_path / "plain")
    plain.train(wire.Train(step=0, version=0, samples=batch))
    same = make_trainer(tmp_path / "same", f"teacher.model={TINY}")
    st = same.train(wire.Train(step=0, version=0, samples=batch)).stats
    assert abs(st["teacher_kl"]) < 1e-5 and st["teacher_logp"] < 0 and st["teacher_s"] > 0
    assert len(st["teacher_kl_seq"]) == len(batch) and max(map(abs, st["teacher_kl_seq"])) < 1e-5
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(same.model.state_dict()[name], value, atol=1e-6, rtol=1e-4)


def test_distillation_alone_moves_the_policy_toward_the_teacher(tmp_path, batch, other_teacher) -> None:
    """teacher.keep_reward = false with rewards all equal (no task advantage): the KL term alone
    trains, and the reverse KL to the teacher on the sampled tokens falls step after step; the
    per-sequence figures average to the step's."""
    flat = [dataclasses.replace(s, reward=1.0) for s in batch]
    trainer = make_trainer(tmp_path, f"teacher.model={other_teacher}", "teacher.keep_reward=false",
                           "trainer.lr=1e-3")
    kls = []
    for step in range(4):
        st = trainer.train(wire.Train(step=step, version=step, samples=flat)).stats
        kls.append(st["teacher_kl"])
        tokens = [len(s.completion_ids) for s in flat]
        assert st["teacher_kl"] == pytest.approx(
            sum(k * n for k, n in zip(st["teacher_kl_seq"], tokens, strict=True)) / sum(tokens), rel=1e-6)
    assert kls[0] > 0.05 and kls[-1] < 0.8 * kls[0] and all(b < a for a, b in zip(kls, kls[1:], strict=False))


def test_a_teacher_with_another_tokenizer_is_refused(batch) -> None:
    from areal_aio.workers.trainer.worker import load_teacher

    class Other:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="teacher.model: .* another tokenizer"):
        load_teacher(TINY, Other(), "cpu", SEED)
