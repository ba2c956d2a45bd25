"""int8 generation (rollout.quantize = int8): the layer against fp32, the rotation, the refresh
after a load, and the engine on a quantized tiny-random."""

from __future__ import annotations

import copy

import pytest
import torch

from areal_aio.settings import SettingsError, build_settings
from areal_aio.store.safetensors_io import load_weights
from areal_aio.store.weights import WeightStore
from areal_aio.workers.models import TINY, encode_prompt, load_model
from areal_aio.workers.rollout import int8
from areal_aio.workers.rollout.engine import Engine, Request

pytestmark = pytest.mark.usefixtures("one_thread")


def _linear(k: int, n: int, seed: int = 0, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=bias)


def _outlier_input(m: int, k: int) -> torch.Tensor:
    """Activations as a small LLM's look: most channels ~1, two channels ~200."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 200
    x[:, k // 2] *= -150
    return x


def _layer(lin: torch.nn.Linear) -> int8.Int8Linear:
    return int8.Int8Linear(copy.deepcopy(lin), int8.rotation(int8._block(lin.in_features)))


def test_the_rotation_is_orthogonal_so_the_product_is_unchanged():
    lin = _linear(192, 40)
    layer = _layer(lin)
    assert layer.rotation.shape == (64, 64)
    x = torch.randn(5, 192)
    exact = x @ lin.weight.T
    rotated = layer.rotate(x) @ layer.rotate(lin.weight.detach()).T
    torch.testing.assert_close(rotated, exact, atol=1e-4, rtol=1e-4)
    h = layer.rotate(torch.eye(192))  # the rows of R: an orthonormal basis
    torch.testing.assert_close(h @ h.T, torch.eye(192), atol=1e-5, rtol=0)


def test_a_width_that_64_does_not_divide_takes_the_largest_power_of_two_that_does():
    assert _layer(_linear(96, 8)).rotation.shape == (32, 32)
    assert _layer(_linear(45, 8)).rotation.shape == (1, 1)  # odd: no rotation


@pytest.mark.parametrize("k", [576, 45])
def test_the_int8_layer_is_close_to_fp32_with_outlier_channels(k):
    lin = _linear(k, 300, bias=True)
    layer = _layer(lin)
    x = torch.randn(7, k) if k == 45 else _outlier_input(7, k)
    with torch.no_grad():
        exact, got = lin(x), layer(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    error = (got - exact).norm() / exact.norm()
    assert error < 0.02, error


def test_the_rotation_is_what_saves_the_outlier_channels():
    """Without it one int8 scale per row rounds the ordinary channels of an outlier row away."""
    lin = _linear(576, 300)
    x = _outlier_input(7, 576)
    rotated = _layer(lin)
    plain = int8.Int8Linear(copy.deepcopy(lin), torch.ones(1, 1))
    with torch.no_grad():
        exact = lin(x)
        errors = [((layer(x) - exact).norm() / exact.norm()).item() for layer in (rotated, plain)]
    assert errors[0] < errors[1] / 3, errors


def test_rows_are_quantized_alone_so_a_batch_mate_changes_nothing():
    layer = _layer(_linear(576, 64))
    x = _outlier_input(6, 576)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, seed=0)


def test_quantize_replaces_every_linear_and_keeps_names_and_ties(tiny):
    model = copy.deepcopy(tiny[0])
    names = list(model.state_dict())
    layers = int8.quantize(model)
    assert layers and not any(type(m) is torch.nn.Linear for m in model.modules())
    assert len(layers) == sum(type(m) is torch.nn.Linear for m in tiny[0].modules())
    assert list(model.state_dict()) == names  # versions load by the same names
    if tiny[0].config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def _logp(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_a_quantized_model_stays_near_fp32_and_follows_a_loaded_version(tiny, tmp_path):
    model, tok = tiny
    ids = encode_prompt(tok, "Calculate 3 + 4.")
    quantized = copy.deepcopy(model)
    layers = int8.quantize(quantized)
    assert _kl(_logp(model, ids), _logp(quantized, ids)) < 0.01
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = WeightStore(tmp_path).publish(other, 1)
    stale = copy.deepcopy(quantized)
    load_weights(stale, path)  # the fp32 parameters change, the int8 copy does not
    seconds = int8.refreshing(load_weights, layers)(quantized, str(path))
    assert seconds > 0
    new = _logp(other, ids)
    assert _kl(new, _logp(quantized, ids)) < 0.01
    assert _kl(new, _logp(stale, ids)) > 10 * _kl(new, _logp(quantized, ids))


def test_the_engine_on_a_quantized_model_reports_that_models_logprobs(tiny):
    model, tok = tiny
    quantized = copy.deepcopy(model)
    int8.quantize(quantized)
    engine = Engine(quantized, tok, max_batch=4, seed=0)
    for i in range(6):
        engine.add(Request(f"r{i}", encode_prompt(tok, f"Calculate {i} + 2."), 12, 0.0 if i % 2 else 1.0))
    done = []
    while engine.busy:
        done.extend(engine.advance(4)[1])
    assert len(done) == 6
    for c in done:
        logp = _logp(quantized, c.prompt_ids + c.completion_ids)[len(c.prompt_ids) - 1:-1]
        ref = logp.gather(1, torch.tensor(c.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize(("overrides", "needle"), [
    (("rollout.device=cuda",), "CPU rollout workers only"),
    (("rollout.devices=[\"cuda:0\"]",), "CPU rollout workers only"),
    (("rollout.dtype=bfloat16",), "rollout.dtype = float32"),
    (("lora.rank=8", "lora.merge=false"), "lora.merge = true"),
])
def test_settings_refuse_int8_where_it_cannot_run(overrides, needle):
    with pytest.raises(SettingsError, match=needle):
        build_settings({}, ("rollout.quantize=int8", *overrides))


def test_settings_take_int8_on_cpu():
    assert build_settings({}, ("rollout.quantize=int8", "lora.rank=8")).rollout.quantize == "int8"


@pytest.mark.parametrize(("overrides", "resolved"), [
    ((), "int8"),  # the default: one rollout worker on the CPU, float32
    (("rollout.devices=2",), "int8"),
    (("lora.rank=8",), "int8"),  # merged by default: each version is merged, then requantized
    (("rollout.device=cuda",), "off"),
    (("rollout.devices=[\"cpu\", \"cuda:0\"]",), "off"),
    (("rollout.dtype=bfloat16",), "off"),
    (("lora.rank=8", "lora.merge=false"), "off"),
    (("rollout.quantize=off",), "off"),
    (("rollout.quantize=int8",), "int8"),
])
def test_auto_quantizes_where_int8_can_run_and_never_refuses(overrides, resolved, monkeypatch):
    from areal_aio import settings

    monkeypatch.setattr(settings, "int8_fast_cpu", lambda: True)
    assert build_settings({}, overrides).rollout_quantize == resolved
    monkeypatch.setattr(settings, "int8_fast_cpu", lambda: False)  # no int8 dot-product unit: float32
    assert build_settings({}, overrides).rollout_quantize == ("int8" if "rollout.quantize=int8" in overrides else "off")


def test_an_int8_dot_product_unit_is_read_from_the_cpu_flags():
    from pathlib import Path

    from areal_aio import settings

    words = set(Path("/proc/cpuinfo").read_text().split())
    assert settings.int8_fast_cpu() == any(flag in words for flag in settings.INT8_DOT_FLAGS)


def test_layers_reading_one_input_quantize_it_once_and_compute_the_same(tiny, monkeypatch):
    """q, k and v read one input, as do gate and up: it is rotated and rounded once for them."""
    model, tok = tiny
    shared = copy.deepcopy(model)
    layers = int8.quantize(shared)
    alone = copy.deepcopy(shared)
    for layer in alone.modules():
        if isinstance(layer, int8.Int8Linear):
            layer.last_input = None
    ids = torch.tensor([encode_prompt(tok, "Calculate 3 + 4.")])
    rotations = []
    rotate = int8.Int8Linear.rotate
    monkeypatch.setattr(int8.Int8Linear, "rotate", lambda self, x: rotations.append(x.shape) or rotate(self, x))
    with torch.no_grad():
        got = shared(ids).logits
        shared_count = len(rotations)
        want = alone(ids).logits
    blocks = model.config.num_hidden_layers
    assert len(layers) == 7 * blocks + 1
    assert shared_count == 4 * blocks + 1  # qkv, o, gate-up, down in each block; the output layer
    assert len(rotations) - shared_count == len(layers)
    assert torch.equal(got, want)


EXACT_SUMS = """
import torch
from areal_aio.workers.rollout import int8
torch.manual_seed(0)
layer = int8.Int8Linear(torch.nn.Linear(576, 300, bias=False), int8.rotation(64))
x = torch.randn(7, 576) * torch.linspace(0.1, 50, 576)
xq, _ = layer.quantized_input(x)
exact = torch.equal(torch._int_mm(xq, layer.packed).long(), xq.long() @ layer.packed.long())
full = torch.full((32, 64), 127, dtype=torch.int8)
saturates = not torch.equal(torch._int_mm(full, full.T.contiguous()).long(), full.long() @ full.T.long())
print(int8.weight_qmax(), int(layer.packed.abs().max()), exact, saturates)
"""


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_weights_take_the_bits_this_cpu_sums_exactly(isa):
    """An AVX2 int8 kernel pairs products in int16 and saturates past 7-bit weights: the probe
    sees it (the CPU's kernel limited to AVX2 by oneDNN's own switch) and the sums stay exact."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"} if isa == "avx2" else {})}
    out = subprocess.run([sys.executable, "-c", EXACT_SUMS], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    qmax, largest, exact, saturates = int(out[0]), int(out[1]), out[2], out[3]
    assert exact == "True" and largest == qmax
    # a kernel that pairs products in int16 saturates on 127 x 127 (an AVX-512 CPU limited to AVX2
    # takes it); a CPU whose AVX2 path sums exactly (no such pairing) keeps 7-bit-and-more weights
    assert qmax == (63 if saturates == "True" else 127)


def test_a_layer_without_rotation_leaves_its_weight_and_its_input_alone():
    """Width 45 takes no rotation, so rotate returns its argument: quantizing must not write it."""
    lin = _linear(45, 20)
    weight = lin.weight.detach().clone()
    layer = int8.Int8Linear(lin, int8.rotation(int8._block(45)))
    x = torch.randn(3, 45)
    seen = x.clone()
    with torch.no_grad():
        layer(x)
    assert torch.equal(layer.weight, weight) and torch.equal(x, seen)
