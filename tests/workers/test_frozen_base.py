"""workers/frozen_base.py: a LoRA trainer's frozen base in bfloat16 or int8 (lora.base_dtype), on
embedded:tiny-random: the adapter alone trains, the policy stays close to the fp32 base's, the
base's bytes halve / quarter, the backward keeps no wide weight, and the export is plain floats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from areal_aio import wire
from areal_aio.store.safetensors_io import load_weights
from areal_aio.workers import frozen_base, lora
from areal_aio.workers.models import TINY, load_model
from areal_aio.workers.trainer.microbatch import build_micro_batch
from areal_aio.workers.trainer.worker import Trainer
from tests.conftest import TRAINER_SEED as SEED
from tests.conftest import generate_samples
from tests.conftest import trainer_settings as settings

LORA = ("lora.rank=4", "lora.alpha=8.0")
LOGP_ATOL = {"bfloat16": 0.01, "int8": 0.02}
"""Largest |log-prob difference| from the fp32 base over the batch's tokens (measured: 0.0017 and
0.0033; tiny-random's logits are near-uniform over 49k tokens, a token's log-prob about -10.8)."""

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch() -> list[wire.TrainSample]:
    return generate_samples(*load_model(TINY, seed=SEED))


def make_trainer(folder: Path, base_dtype: str) -> Trainer:
    folder.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(TINY, seed=SEED)
    torch.manual_seed(SEED)  # lora_A's start
    return Trainer(settings(*LORA, f"lora.base_dtype={base_dtype}").to_dict(), folder, model=model, tokenizer=tok)


def block_linear_bytes(model) -> int:
    """Bytes of the blocks' frozen linear weights (and int8 scales): what lora.base_dtype narrows."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".layers." in name and not m.weight.requires_grad:
            scale = getattr(m, frozen_base.SCALE, None)
            total += m.weight.nbytes + (0 if scale is None else scale.nbytes)
    return total


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_a_narrow_base_trains_the_adapter_alone_close_to_the_fp32_base(tmp_path, batch, dtype) -> None:
    wide, narrow = make_trainer(tmp_path / "fp32", "float32"), make_trainer(tmp_path / dtype, dtype)
    assert block_linear_bytes(narrow.model) <= block_linear_bytes(wide.model) * (0.5 if dtype == "bfloat16" else 0.3)
    emb = narrow.model.get_input_embeddings().weight
    assert emb.dtype == torch.bfloat16 and narrow.model.get_output_embeddings().weight is emb  # tied, once
    assert {p.dtype for p in narrow.params} == {torch.float32} and narrow.params == list(narrow.opt.param_groups[0]["params"])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at 0: give it a value, the same in both, so A gets a gradient too
        for a, b in zip(lora.layers(wide.model).values(), lora.layers(narrow.model).values(), strict=True):
            a.lora_B[lora.ADAPTER].weight.normal_(0, 0.05, generator=gen)
            b.lora_B[lora.ADAPTER].weight.copy_(a.lora_B[lora.ADAPTER].weight)
    adv = torch.linspace(-1, 1, len(batch))
    mb = build_micro_batch(batch, list(range(len(batch))), adv, wide.pad_id, "cpu")
    logps = []
    for tr in (wide, narrow):
        logp, _ = tr._forward(tr.model, mb)
        (logp * mb.adv).sum().backward()
        logps.append(logp.detach())
    assert (logps[0] - logps[1]).abs().max() < LOGP_ATOL[dtype]
    trained = {id(p) for p in narrow.params}
    graded = [name for name, p in narrow.model.named_parameters() if p.grad is not None]
    assert graded and all(id(p) in trained for p in narrow.model.parameters() if p.grad is not None), graded
    for w, n in zip(wide.params, narrow.params, strict=True):  # the adapter's gradient, as over the fp32 base
        assert torch.nn.functional.cosine_similarity(w.grad.flatten(), n.grad.flatten(), dim=0) > 0.9
    st = narrow.train(wire.Train(step=0, version=0, samples=batch)).stats
    assert st["loss"] == st["loss"] and st["grad_norm"] > 0


def test_int8_widens_per_matmul_and_its_backward_keeps_no_wide_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    plain = torch.nn.Linear(64, 32, bias=True)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(32, 64, generator=gen))
    layer = frozen_base.FrozenLinear(plain, "int8")
    assert layer.weight.dtype == torch.int8 and getattr(layer, frozen_base.SCALE).shape == (32, 1)
    wide = frozen_base.widen(layer.weight, getattr(layer, frozen_base.SCALE), torch.float32)
    assert (wide - plain.weight).abs().max() <= getattr(layer, frozen_base.SCALE).max() / 2 + 1e-6  # rounding
    x = torch.randn(5, 64, generator=gen, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert torch.allclose(y, x @ wide.T + plain.bias, atol=1e-5)
    assert not any(t.dtype == torch.float32 and t.shape == (32, 64) for t in saved)  # only the int8 weight
    g = torch.randn(5, 32, generator=gen)
    y.backward(g)
    assert torch.allclose(x.grad, g @ wide, atol=1e-5)


def test_a_narrow_base_exports_plain_float_weights_of_the_policy_it_trains(tmp_path, batch) -> None:
    trainer = make_trainer(tmp_path / "t", "int8")
    trainer.train(wire.Train(step=0, version=0, samples=batch))
    lora.write_merged(trainer.model, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).is_floating_point() for k in keys)
    fresh, _ = load_model(TINY, seed=SEED)
    assert keys == set(lora.base_state(fresh))  # plain HF names: no base_layer, no scales
    load_weights(fresh, tmp_path / "model.safetensors")
    mb = build_micro_batch(batch, list(range(len(batch))), torch.zeros(len(batch)), trainer.pad_id, "cpu")
    assert torch.allclose(trainer.logprobs(mb), trainer.logprobs(mb, fresh), atol=1e-4)


def test_a_base_dtype_without_lora_is_a_settings_error() -> None:
    from areal_aio.settings import SettingsError

    with pytest.raises(SettingsError, match="lora.base_dtype: int8 stores the frozen base of a LoRA run"):
        settings("lora.base_dtype=int8")


def test_a_trainer_loads_a_narrow_base_in_bf16_and_computes_in_fp32(tmp_path, batch) -> None:
    """The trainer's own load (no model handed in): the base read in bf16 and stored so, never
    widened; the adapter, the norms and the buffers fp32; the policy the fp32 base's, closely."""
    torch.manual_seed(SEED)
    trainer = Trainer(settings(*LORA, "lora.base_dtype=bfloat16").to_dict(), tmp_path)
    dtypes = {name: p.dtype for name, p in trainer.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".base_layer." in n or "embed" in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if ".lora_" in n or "norm" in n} == {torch.float32}
    assert {b.dtype for b in trainer.model.buffers()} == {torch.float32}
    mb = build_micro_batch(batch, list(range(len(batch))), torch.zeros(len(batch)), trainer.pad_id, "cpu")
    wide = make_trainer(tmp_path / "fp32", "float32")
    assert (trainer.logprobs(mb) - wide.logprobs(mb)).abs().max() < LOGP_ATOL["bfloat16"]


def test_an_int8_base_keeps_no_view_of_the_loaded_weights() -> None:
    """A bf16-loaded base is views of its safetensors file's mapping: int8 keeps none of them (the
    mapping can go), bfloat16 keeps them as its storage (no copy)."""
    for dtype, shared in (("int8", False), ("bfloat16", True)):
        model, _ = load_model(TINY, seed=SEED, dtype="bfloat16")
        lora.attach(model, settings(*LORA).lora, TINY)
        base = [p for p in model.parameters() if not p.requires_grad]  # held: no address of theirs is reused
        loaded = {p.untyped_storage().data_ptr() for p in base}
        frozen_base.store(model, dtype)
        kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        assert bool(kept & loaded) is shared, dtype
