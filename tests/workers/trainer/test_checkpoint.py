"""workers/trainer/checkpoint.py: the trainer's checkpoint part resumes exactly; exports load with transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_aio import wire
from areal_aio.store.weights import WeightStore
from areal_aio.workers.models import TINY, load_model
from areal_aio.workers.trainer import checkpoint
from areal_aio.workers.trainer.worker import Trainer
from tests.conftest import generate_samples
from tests.conftest import trainer_settings as settings


def trainer(tmp_path, name: str) -> Trainer:
    (tmp_path / name).mkdir()
    model, tok = load_model(TINY, seed=1)
    return Trainer(settings("trainer.lr=1e-2"), tmp_path / name, model=model, tokenizer=tok)


def test_a_resumed_trainer_takes_the_same_next_step_bit_for_bit(tmp_path):
    t = trainer(tmp_path, "a")
    samples = generate_samples(t.model, t.tokenizer)
    t.train(wire.Train(1, 0, samples))
    saved = t.save(wire.Save("checkpoint", str(tmp_path / "ckpt")))
    assert saved.version == 1 and saved.bytes > 0
    t.train(wire.Train(2, 1, samples))
    again = trainer(tmp_path, "b")
    path = again.resume(tmp_path / "ckpt")
    assert again.version == 1 and path.exists()  # published for the rollout worker
    again.train(wire.Train(2, 1, samples))
    for (name, p), q in zip(t.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_exports_load_with_transformers_alone(tmp_path):
    t = trainer(tmp_path, "a")
    old = WeightStore(tmp_path / "a").publish(t.model, 0)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.01)
    t.save(wire.Save("model", str(tmp_path / "live")))
    t.save(wire.Save("model", str(tmp_path / "older"), weights=str(old)))
    live = AutoModelForCausalLM.from_pretrained(tmp_path / "live")
    older = AutoModelForCausalLM.from_pretrained(tmp_path / "older")
    tok = AutoTokenizer.from_pretrained(tmp_path / "live")
    assert tok.chat_template and live.config.use_cache
    assert not t.model.config.use_cache  # the trainer's own setting is left as it was
    for (name, p), q, r in zip(t.model.state_dict().items(), live.state_dict().values(),
                               older.state_dict().values(), strict=True):
        assert torch.equal(p, q), name  # the live weights, exactly
        assert torch.allclose(p - 0.01, r, atol=1e-6), name  # the older version's file
    assert checkpoint.fsync_tree(tmp_path / "live") > 0


def test_weights_that_are_not_finite_are_never_written(tmp_path):
    t = trainer(tmp_path, "a")
    t.save(wire.Save("model", str(tmp_path / "model")))
    kept = (tmp_path / "model" / "model.safetensors").read_bytes()
    with torch.no_grad():
        next(t.model.parameters())[0].fill_(float("nan"))
    bad = WeightStore(tmp_path / "a").publish(t.model, 1)
    for kind, path, weights in (("model", "model", ""), ("checkpoint", "ckpt", ""),
                                ("model", "best", str(bad))):
        with pytest.raises(ValueError, match="is not finite"):
            t.save(wire.Save(kind, str(tmp_path / path), weights))
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == kept
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "best").exists()
