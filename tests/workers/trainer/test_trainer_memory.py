"""What keeps the trainer's memory in bounds, on embedded:tiny-random: activation checkpointing
(trainer.activation_checkpointing) gives the same gradients, recomputes each layer and saves fewer
activations; and no update path (RL with the reference KL and the entropy bonus, several
mini-batches, LoRA, SFT) ever holds logits for more than one chunk of tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areal_aio import wire
from areal_aio.workers.models import TINY, load_model
from areal_aio.workers.trainer import losses
from areal_aio.workers.trainer.microbatch import build_micro_batch
from areal_aio.workers.trainer.worker import SFT, Trainer
from tests.conftest import TRAINER_SEED as SEED
from tests.conftest import generate_samples
from tests.conftest import trainer_settings as settings

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK_ROWS = 4
"""Tokens per chunk of the head in the logits test: far fewer than a micro-batch's."""


@pytest.fixture(scope="module")
def batch() -> list[wire.TrainSample]:
    return generate_samples(*load_model(TINY, seed=SEED))


def make_trainer(folder: Path, *overrides: str) -> Trainer:
    folder.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(TINY, seed=SEED)
    torch.manual_seed(SEED)
    return Trainer(settings(*overrides).to_dict(), folder, model=model, tokenizer=tok)


def gradient_pass(trainer: Trainer, batch: list[wire.TrainSample]) -> tuple[dict[str, torch.Tensor], int, int]:
    """One forward and backward of the whole batch as one micro-batch: (each trained parameter's
    gradient, calls of layer 0's MLP, bytes of activations the forward saved for the backward
    outside any checkpointed layer). A pre-hook: the recompute stops early, once the last tensor the
    backward needs is back, before the MLP returns)."""
    adv = torch.linspace(-1, 1, len(batch))
    mb = build_micro_batch(batch, list(range(len(batch))), adv, trainer.pad_id, "cpu")
    calls = []
    hook = trainer.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes, the weights left out (saved, but not new memory)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = trainer._forward(trainer.model, mb)
        (logp * mb.adv).sum().backward()
    finally:
        hook.remove()
    grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    return grads, len(calls), sum(saved.values())


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_gradients(tmp_path, batch, lora) -> None:
    extra = ("lora.rank=4",) if lora else ()
    plain = make_trainer(tmp_path / "plain", *extra)
    ckpt = make_trainer(tmp_path / "ckpt", *extra, "trainer.activation_checkpointing=true")
    if lora:  # B starts at 0: give both the same B, so A's gradient is not 0
        for (name, p), q in zip(plain.model.named_parameters(), ckpt.model.parameters(), strict=True):
            if ".lora_B." in name:
                with torch.no_grad():
                    p.fill_(0.01)
                    q.fill_(0.01)
    g0, calls0, saved0 = gradient_pass(plain, batch)
    g1, calls1, saved1 = gradient_pass(ckpt, batch)
    assert (calls0, calls1) == (1, 2)  # checkpointed: the layer runs again in the backward
    assert saved1 < saved0 / 2, (saved0, saved1)  # what the forward keeps for the backward
    assert g0.keys() == g1.keys() and len(g0) == len(plain.params)  # the trained ones, all of them
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=1e-4), name
    assert not any(m.training for m in ckpt.model.modules() if isinstance(m, torch.nn.Dropout))


class _LogitsWatch(TorchDispatchMode):
    """The most rows of any new tensor an op returns whose last dimension is the vocabulary (a
    view of an input, such as the head's transpose [H, V], holds no new memory)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows, self.ops = vocab, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in given:
                self.rows = max(self.rows, t.numel() // self.vocab)
                self.ops.add((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("overrides", [
    ("trainer.kl_coef=0.1", "trainer.kl_ref=ref", "trainer.entropy_coef=0.01", "trainer.minibatches=2"),
    ("lora.rank=4", "trainer.kl_coef=0.1", "trainer.kl_ref=ref", "trainer.minibatches=2"),
    ("trainer.activation_checkpointing=true", "trainer.share_prompts=off"),
    (SFT,),
], ids=["rl-ref-entropy", "lora-ref", "checkpointed", "sft"])
def test_no_update_path_holds_logits_for_more_than_one_chunk(tmp_path, batch, monkeypatch, overrides) -> None:
    sft = overrides == (SFT,)
    trainer = make_trainer(tmp_path, *(() if sft else overrides))
    vocab = trainer.model.config.vocab_size
    assert sum(len(s.completion_ids) for s in batch) > 4 * CHUNK_ROWS
    monkeypatch.setattr(losses, "HEAD_CHUNK_ELEMS", CHUNK_ROWS * vocab)
    watch = _LogitsWatch(vocab)
    with watch:
        trainer.train(wire.Train(step=0, version=0, samples=batch, objective=SFT if sft else ""))
    assert 0 < watch.rows <= CHUNK_ROWS, watch.ops


def test_the_watch_sees_the_logits_of_the_model_s_own_head(tmp_path, batch, monkeypatch) -> None:
    """The control: the full-logits path (a head the chunked one cannot replace) shows [n x L, V]."""
    trainer = make_trainer(tmp_path)
    monkeypatch.setattr(losses, "HEAD_CHUNK_ELEMS", CHUNK_ROWS * trainer.model.config.vocab_size)
    trainer._fast_head = False
    watch = _LogitsWatch(trainer.model.config.vocab_size)
    with watch:
        trainer.train(wire.Train(step=0, version=0, samples=batch))
    assert watch.rows >= sum(len(s.completion_ids) for s in batch)
