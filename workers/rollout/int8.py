"""int8 generation on a CPU: each linear layer multiplies int8 by int8 (rollout.quantize = int8).

    x [M, K] --rotate--> x R --per-row scale--> int8 [M, K] --_int_mm--> int32 [M, N]
        --x row scale x weight channel scale--> float32 [M, N] (+ bias)

A CPU core multiplies int8 several times faster than fp32 (torch._int_mm, exact int32
sums), and a decode step on a CPU is made of such products. Weights take 8 bits where the
CPU sums int8 products exactly, 7 where it would saturate (`weight_qmax`). Only generation
is quantized: the trainer keeps fp32, the fp32 weights stay the layers' parameters
(versions load into them as before, tied weights stay tied), and `refresh` rebuilds the
int8 copy after each load. Decoupled PPO takes the difference as what it is, a behaviour
policy other than the trained one; the trainer's `mismatch_kl` reports it per step.

Why the rotation: activations of a small LLM carry a few channels hundreds of times larger
than the rest, and one int8 scale per row then rounds the rest away. Multiplying x by a
fixed orthogonal matrix R, and the weight rows by the same R, leaves x W^T unchanged and
spreads each outlier over a block of channels. R is block-diagonal, each block
diag(random signs) x the Walsh-Hadamard matrix of BLOCK channels. What this buys, in
tokens per second and in drift from fp32, is measured in docs/rollout.md and
docs/benchmarks/components.md.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 64
"""Channels mixed by one Hadamard block; a layer whose input width it does not divide takes
the largest power of two that does (1: no rotation)."""
SIGN_SEED = 0
"""Seed of the random signs of each block (fixed: the same R for every version)."""
QMAX = 127
"""Largest int8 magnitude of an input row (weights: `weight_qmax`)."""
TINY = torch.finfo(torch.float32).tiny


@functools.cache
def weight_qmax() -> int:
    """The largest int8 weight magnitude torch._int_mm sums exactly on this CPU: 127 where its
    kernel multiplies int8 pairs into int32 (AVX-512 VNNI, AMX); 63 where it pairs u8 x s8
    products in int16 (AVX2, AVX-512 without VNNI), which saturates past 7-bit weights and
    would get most sums wrong. Probed once, on the worst case and on random values."""
    gen = torch.Generator().manual_seed(0)
    probes = [(torch.full((32, 64), 127, dtype=torch.int8), torch.full((64, 32), 127, dtype=torch.int8)),
              (torch.randint(-127, 128, (32, 256), generator=gen, dtype=torch.int8),
               torch.randint(-127, 128, (256, 32), generator=gen, dtype=torch.int8))]
    exact = all(torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()) for a, b in probes)
    return 127 if exact else 63


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal n x n Walsh-Hadamard matrix (n a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of x [M, K] (amax and amin: several times faster than abs().amax()
    or an inf-norm on a large weight)."""
    return torch.maximum(x.amax(1), x.amin(1).neg())


def _block(width: int) -> int:
    return math.gcd(width, BLOCK)  # BLOCK is a power of two, so is the gcd


class Int8Linear(torch.nn.Linear):
    """A Linear layer that multiplies in int8; its `weight` and `bias` are the fp32 parameters
    of the layer it replaces (the same tensors), and `refresh` requantizes them."""

    def __init__(self, linear: torch.nn.Linear, rotation: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("rotation", rotation.to(linear.weight.device), persistent=False)
        self.last_input: list | None = None  # [x, int8 of x, row scales], shared by `quantize`
        self.refresh()

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x R, R block-diagonal with `rotation` [b, b] on the diagonal."""
        b = self.rotation.shape[0]
        if b == 1:
            return x
        shape = x.shape
        return (x.reshape(*shape[:-1], shape[-1] // b, b) @ self.rotation).reshape(shape)

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the int8 weight (a [K, N] view of [N, K]) and its channel scales [N]."""
        w = self.rotate(self.weight.detach())
        self.scale = (_absmax(w) / weight_qmax()).clamp_(min=TINY)
        self.packed = torch.round(w / self.scale[:, None]).to(torch.int8).t()  # w may be the weight

    def quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [M, K] of x rotated, row scales [M, 1]); the last input's, when x is it: q, k
        and v read one input, as do gate and up, and layers of one width share R."""
        last = self.last_input
        if last is not None and last[0] is x:
            return last[1], last[2]
        rotated = self.rotate(x.reshape(-1, x.shape[-1]))
        row = (_absmax(rotated)[:, None] / QMAX).clamp_(min=TINY)
        xq = torch.round(rotated / row).to(torch.int8)  # rotated may be x itself (no rotation)
        if last is not None:
            last[:] = (x, xq, row)
        return xq, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, row = self.quantized_input(x)
        y = torch._int_mm(xq, self.packed).float()
        y = y.mul(row).mul_(self.scale)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features)


def rotation(block: int, seed: int = SIGN_SEED) -> torch.Tensor:
    """diag(random signs) @ H: an orthonormal block x block matrix (block a power of two)."""
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs.float()[:, None] * _hadamard(block)


def quantize(model: torch.nn.Module) -> list[Int8Linear]:
    """Replace every nn.Linear of `model` (output layer included) by an Int8Linear, in place."""
    layers = []
    last_input: dict[int, list] = {}  # one per input width: layers of a width share R
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                layer = Int8Linear(child, rotation(_block(child.in_features)))
                layer.last_input = last_input.setdefault(child.in_features, [None, None, None])
                setattr(parent, name, layer)
                layers.append(layer)
    return layers


def refreshing(load: Callable[[Any, str], float], layers: list[Int8Linear]) -> Callable[[Any, str], float]:
    """A version loader that loads as `load` does, then requantizes `layers`; seconds of both."""

    def load_and_refresh(model: Any, path: str) -> float:
        t0 = time.perf_counter()
        load(model, path)
        for layer in layers:
            layer.refresh()
        return time.perf_counter() - t0

    return load_and_refresh

