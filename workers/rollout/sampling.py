"""Sampling on the device: per-row uniforms, top-p and the inverse-CDF draw, as tensor ops.

    uniforms(seed [B], counter [B])  -> u [B]      areal_aio.seeds.uniform, bit for bit
    nucleus(logp [B, V], top_p [B])  -> logp [B, V]
    draw(logp [B, V], u [B])         -> token [B]
    sample(logits [B, V], mode, ..)  -> token [B], its log-prob [B]   (the three above, by mode)

The engine keeps each row's seed and counter in device tensors and calls these once per decode
step, so choosing a token never waits for the host. areal_aio.seeds is the reference (pure
Python, torch-free, so the controller can derive seeds); `uniforms` is the same splitmix64 in
int64 tensor ops: addition and multiplication wrap modulo 2**64 in torch's int64 exactly as
the reference masks its Python ints, and a right shift, arithmetic on int64, is made logical
by masking off the copies of the sign bit it shifts in. A uint64 word and the int64 with the
same bits are the same word here: seeds are below 2**63 anyway (seeds.SEED_BITS).
"""

from __future__ import annotations

import torch

from areal_aio.seeds import UNIFORM_BITS


def _int64(word: int) -> int:
    """The int64 with the bits of the uint64 `word`."""
    return word - (1 << 64) if word >= 1 << 63 else word


GOLDEN_GAMMA = _int64(0x9E3779B97F4A7C15)
MIX1 = _int64(0xBF58476D1CE4E5B9)
MIX2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift by 0 < n < 64 of int64 words: the top n bits come out 0."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """seeds.mix64 of every int64 word of `x` (same bits in, same bits out)."""
    x = x + GOLDEN_GAMMA
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def uniforms(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """float32 [B]: seeds.uniform(seed[i], counter[i]) for int64 tensors seed [B], counter [B]."""
    bits = _shr(mix64(seed ^ mix64(counter)), 64 - UNIFORM_BITS)  # < 2**24: exact in float32
    return bits.to(torch.float32) * 2.0 ** -UNIFORM_BITS


def draw(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logp) [B, V] by inverting the CDF at u [B] in [0, 1).

    ~10x cheaper on CPU than torch.multinomial or Gumbel-max over a 49k vocabulary (one cumsum
    instead of one random number per entry). `right=True` lands on the first index whose CDF
    exceeds u, so a token of probability 0 (cut by top-p) is never drawn.
    """
    cdf = logp.exp().cumsum(-1)
    x = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of tokens whose mass reaches top_p; renormalize (log space)."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()  # mass of the tokens ranked higher
    drop_sorted = before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logp, dim=-1)


def sample(logits: torch.Tensor, mode: str, scale: torch.Tensor, top_p: torch.Tensor,
           greedy: torch.Tensor, seed: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B]) from logits [B, V]: `mode` "greedy" (argmax, plain softmax),
    "sample" (softmax of logits / scale drawn with each row's uniform for `count`), "nucleus" (the
    same restricted to each row's top_p mass); greedy rows take the argmax in every mode.
    The Engine's dynamic path and its slots (rollout/slots.py) share it, so both pick the same tokens."""
    if mode == "greedy":
        logp = torch.log_softmax(logits, dim=-1)
        token = logp.argmax(-1)
        return token, logp.gather(1, token[:, None])[:, 0]
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    if mode == "nucleus":
        logp = nucleus(logp, top_p)
    token = torch.where(greedy, logp.argmax(-1), draw(logp, uniforms(seed, count)))
    return token, logp.gather(1, token[:, None])[:, 0]
