"""The losses: advantages, the three policy objectives and the k3 KL, as pure torch functions.

Everything here works on flat per-token tensors of one micro-batch (T = number of
completion tokens in it) or per-sequence tensors of one batch (B = sequences), so
it is testable by hand on tiny tensors and knows nothing about models or pipes.

    advantages(rewards[B], groups[B])                       -> adv[B]
    token_loss(logp[T], behav[T], prox[T], adv[T], ...)    -> loss[T], TokenStats
    k3_kl(logp[T], ref[T])                                  -> kl[T]
    token_logprobs(hidden[T, H], head[V, H], targets[T])   -> logp[T], entropy[T]

    sequence_weights(lengths[S], kind, max_len)             -> w[S]

Aggregation (trainer.loss_agg) is a weight per sequence: a mini-batch's loss is
sum_i w_i * sum_t loss_it over its sequences i and their trained tokens t
(sequence_weights); the caller (workers/trainer/worker.py) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from areal_aio.settings import ADVANTAGES, CAP_MODES, LOSS_AGGS, OBJECTIVES, SFT

ADV_EPS = 1e-6
"""Added to the std before dividing: a group whose rewards are all equal gets advantage 0, not NaN."""


def advantages(rewards: torch.Tensor, groups: torch.Tensor, kind: str = "grpo",
               eps: float = ADV_EPS) -> torch.Tensor:
    """Per-sequence advantages [B] from rewards [B] and group ids [B].

    grpo:   (r - group mean) / (group std + eps)   (Shao et al. 2024)
    drgrpo: r - group mean; no std division, which biases toward
            low-variance prompts (Liu et al. 2025, "Dr. GRPO")
    batch:  (r - batch mean) / (batch std + eps)   (groups ignored)

    The std is the population std (divide by n): a group of one sample has
    std 0 and advantage 0 instead of NaN.
    """
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage kind {kind!r}; choose one of {', '.join(ADVANTAGES)}")
    r = rewards.to(torch.float64)
    if kind == "batch":
        return ((r - r.mean()) / (r.std(unbiased=False) + eps)).to(torch.float32)
    _, inverse = torch.unique(groups, return_inverse=True)  # inverse[B]: dense group index
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, r) / count  # [G]
    centred = r - mean[inverse]  # [B]
    if kind == "drgrpo":
        return centred.to(torch.float32)
    var = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, inverse, centred * centred) / count
    return (centred / (var.sqrt()[inverse] + eps)).to(torch.float32)


def sequence_weights(lengths: list[int], kind: str, max_len: int) -> torch.Tensor:
    """Each sequence's weight on its token losses in a mini-batch's loss [S] (float64), from
    its trained-token counts `lengths`; S counts the sequences with a trained token.

    token:    1 / sum_i n_i     every token of the mini-batch alike (DAPO's token-level loss;
                                a long reply weighs in proportion to its length)
    sequence: 1 / (S * n_i)     each sequence's token mean, then the mean over sequences (GRPO
                                as published: a token of a short reply weighs more)
    constant: 1 / (S * max_len) a constant normaliser (Dr. GRPO; max_len: rollout.max_new_tokens)
    """
    if kind not in LOSS_AGGS:
        raise ValueError(f"loss aggregation {kind!r}; choose one of {', '.join(LOSS_AGGS)}")
    n = torch.tensor(lengths, dtype=torch.float64)
    seqs = int((n > 0).sum())
    if not seqs:
        return torch.zeros_like(n)
    if kind == "token":
        return torch.full_like(n, 1.0 / float(n.sum()))
    if kind == "constant":
        return torch.full_like(n, 1.0 / (seqs * max_len))
    return torch.where(n > 0, 1.0 / (seqs * n.clamp(min=1)), torch.zeros_like(n))


@dataclass(frozen=True, slots=True)
class TokenStats:
    """Per-token diagnostics of one micro-batch, all [T] and detached."""

    ratio: torch.Tensor  # the ratio the objective clips (vs behav for ppo/pg, vs prox for decoupled)
    clipped: torch.Tensor  # bool: the clip zeroed this token's gradient
    behav_w: torch.Tensor  # pi_prox / pi_behav before capping
    capped: torch.Tensor  # bool: behav_w > behav_cap (masked or clamped)


def token_loss(logp: torch.Tensor, behav: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, *,
               objective: str, clip_eps: float = 0.2, clip_eps_high: float | None = None,
               behav_cap: float = 5.0, cap_mode: str = "mask",
               seq: torch.Tensor | None = None) -> tuple[torch.Tensor, TokenStats]:
    """Per-token policy loss [T] (to be aggregated over the mini-batch: trainer.loss_agg).

    logp  [T]: log pi_theta(token), with grad (the policy being updated)
    behav [T]: log pi_behav(token), the sampler's log-probs (from the rollout worker)
    prox  [T]: log pi_prox(token), the trainer's weights before this step (recomputed, no grad)
    adv   [T]: the sequence's advantage repeated on each of its tokens
    seq   [T]: (gspo) each token's sequence, 0 .. S-1 (a sequence's tokens need not be adjacent)

    pg:            -A * logp
    ppo:           -min(r A, clip(r, 1-eps, 1+eps_high) A),  r = pi_theta / pi_behav
    decoupled_ppo: -w * min(r A, clip(r, ...) A),  r = pi_theta / pi_prox,
                   w = pi_prox / pi_behav (no grad), tokens with w > behav_cap
                   masked (w = 0) or clamped (w = behav_cap)  (Fu et al. 2025, AReaL)
    gspo:          -w_i * min(s A, clip(s, ...) A) on each token t of sequence i, where
                   s = sg(s_i) * pi_theta(t) / sg(pi_theta(t)): its value is the sequence's
                   ratio s_i = exp(mean_t log(pi_theta / pi_prox)), its gradient s_i * grad
                   log pi_theta(t) (GSPO-token, Zheng et al. 2025); w_i = exp(mean_t log(pi_prox /
                   pi_behav)), the behaviour correction at the sequence level, capped as above.
                   With trainer.loss_agg = sequence this is GSPO's sequence-mean objective.
    cispo:         -w * sg(clip(r, 1-eps, 1+eps_high)) * A * logp,  r = pi_theta / pi_prox, w as
                   decoupled_ppo's (MiniMax-M1's CISPO: the IS weight is clipped, never the
                   gradient, so every token keeps one; `clipped` counts the weights clipped)
    sft:           -logp (behav, prox and adv unused): summed and divided by the tokens, the
                   token-mean negative log-likelihood of the completions

    gspo and cispo take their ratio against pi_prox (the trainer's weights before this step)
    and correct for pi_behav with the capped weight w, which is decoupled PPO's composition:
    with one mini-batch pi_prox = pi_theta, so r = s = 1 and both are w-weighted policy
    gradients. Against pi_behav directly (as the papers, whose samplers are one version old)
    the same formulas hold with prox = behav: pass behav for both.
    """
    if objective not in (*OBJECTIVES, SFT):
        raise ValueError(f"objective {objective!r}; choose one of {', '.join((*OBJECTIVES, SFT))}")
    if cap_mode not in CAP_MODES:
        raise ValueError(f"cap_mode {cap_mode!r}; choose one of {', '.join(CAP_MODES)}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    behav_w = torch.exp(prox - behav).detach()
    capped = behav_w > behav_cap
    if objective == SFT:
        ones, no = torch.ones_like(behav_w), torch.zeros_like(capped)
        return -logp, TokenStats(ones, no, ones, no)
    if objective == "pg":
        ratio = torch.exp(logp.detach() - behav)
        no_clip = torch.zeros_like(capped)
        return -adv * logp, TokenStats(ratio, no_clip, behav_w, torch.zeros_like(capped))
    if objective == "cispo":
        ratio_d = torch.exp(logp.detach() - prox)
        is_w = torch.clamp(ratio_d, 1.0 - clip_eps, 1.0 + high)
        weight = _capped(behav_w, capped, behav_cap, cap_mode)
        return -weight * is_w * adv * logp, TokenStats(ratio_d, is_w != ratio_d, behav_w, capped)
    if objective == "gspo":
        if seq is None:
            raise ValueError("gspo needs seq: each token's sequence")
        log_s = _segment_mean(logp.detach() - prox, seq)  # [T]: the sequence's log s_i
        ratio = torch.exp(log_s + logp - logp.detach())
        seq_w = torch.exp(_segment_mean(prox - behav, seq))  # the sequence's behaviour weight
        capped = seq_w > behav_cap
        behav_w = seq_w
    else:
        anchor = behav if objective == "ppo" else prox
        ratio = torch.exp(logp - anchor)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv)
    ratio_d = ratio.detach()
    clipped = ((ratio_d < 1.0 - clip_eps) & (adv < 0)) | ((ratio_d > 1.0 + high) & (adv > 0))
    if objective == "ppo":
        return -surrogate, TokenStats(ratio_d, clipped, behav_w, torch.zeros_like(capped))
    weight = _capped(behav_w, capped, behav_cap, cap_mode)
    return -weight * surrogate, TokenStats(ratio_d, clipped, behav_w, capped)


def _capped(behav_w: torch.Tensor, capped: torch.Tensor, behav_cap: float, cap_mode: str) -> torch.Tensor:
    """The behaviour weight with `capped` entries masked (0) or clamped to behav_cap."""
    if cap_mode == "mask":
        return torch.where(capped, torch.zeros_like(behav_w), behav_w)
    return torch.clamp(behav_w, max=behav_cap)


def _segment_mean(x: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of x [T] (seq [T]: the sequence of each token), per token."""
    n = int(seq.max()) + 1 if seq.numel() else 0
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seq, x)
    counts = torch.bincount(seq, minlength=n).to(x.dtype)
    return (sums / counts)[seq]


def k3_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token [T]: exp(ref - logp) - (ref - logp) - 1.

    Unbiased for samples of pi_theta and never negative (Schulman 2020); the
    gradient flows through logp only.
    """
    d = ref - logp
    return torch.expm1(d) - d  # expm1: no cancellation when d is tiny (the usual case)


HEAD_CHUNK_ELEMS = 1 << 22
"""Logit elements per chunk of `token_logprobs` (16 MiB in fp32): a [T, V] logits tensor of a
small model's vocabulary is hundreds of MiB, and a chunk this size is reused from the allocator
instead of being faulted in fresh from the kernel on every call."""


class _TokenLogprobs(torch.autograd.Function):
    """log-softmax(h W^T / temperature)[target] and the entropy, chunked over tokens.

    Saves only hidden, weight and the per-token logsumexp; backward recomputes each
    chunk's logits (one more head matmul) instead of keeping [T, V] alive.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                temperature: float, compute_dtype: torch.dtype | None, entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        dt = compute_dtype or hidden.dtype
        h, w = hidden.to(dt), weight.to(dt)
        n = hidden.shape[0]
        chunk = max(1, HEAD_CHUNK_ELEMS // max(weight.shape[0], 1))
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = (h[lo:hi] @ w.T).to(acc).div_(temperature)  # [c, V]
            top = z.amax(dim=-1, keepdim=True)  # [c, 1]
            e = (z - top).exp_()  # [c, V]: the one exp of the chunk serves lse and entropy
            total = e.sum(dim=-1)  # [c]
            lse[lo:hi] = top[:, 0] + total.log()
            logp[lo:hi] = z.gather(1, targets[lo:hi, None])[:, 0] - lse[lo:hi]
            ent[lo:hi] = lse[lo:hi] - e.mul_(z).sum(dim=-1) / total
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.compute_dtype, ctx.chunk = temperature, dt, chunk
        ctx.entropy_grad = entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor, g_ent: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        dt, t, chunk = ctx.compute_dtype, ctx.temperature, ctx.chunk
        acc = lse.dtype
        h, w = hidden.to(dt), weight.to(dt)
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device)
        # a frozen head (LoRA) needs no [V, H] gradient: half the backward's head work
        want_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        g_logp = g_logp.to(acc)
        g_ent = g_ent.to(acc) if ctx.entropy_grad and g_ent is not None else None
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(hidden.shape[0], lo + chunk)
            g = g_logp[lo:hi]  # [c]
            z = (h[lo:hi] @ w.T).to(acc).div_(t)  # [c, V]
            # d logp / d z = onehot(target) - softmax(z); then d z / d (h W^T) = 1 / t
            if g_ent is None:
                gz = (z - lse[lo:hi, None]).exp_().mul_(-g[:, None])
            else:  # d entropy / d z_k = -p_k (log p_k + entropy)
                log_p = z.sub_(lse[lo:hi, None])
                p = log_p.exp()
                gz = p * (-g[:, None] - g_ent[lo:hi, None] * (log_p + ent[lo:hi, None]))
            gz.scatter_add_(1, targets[lo:hi, None], g[:, None])
            gz.div_(t)
            grad_h[lo:hi] = (gz.to(dt) @ w).to(acc)  # [c, H]
            if want_w:
                grad_w += (gz.T.to(dt) @ h[lo:hi]).to(acc)  # [V, H]
        return (grad_h.to(hidden.dtype), grad_w.to(weight.dtype) if want_w else None,
                None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, compute_dtype: torch.dtype | None = None,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(target) [T], entropy [T]) of logits = hidden [T, H] @ weight [V, H]^T / temperature.

    The same numbers as log_softmax over full logits, without a [T, V] tensor for the
    whole micro-batch; the matmuls run in `compute_dtype` (bf16 under autocast), the
    softmax in fp32. Gradients flow to hidden and, unless it is frozen, weight; through the
    entropy too when `entropy_grad` (trainer.entropy_coef), else it is a constant.
    """
    return _TokenLogprobs.apply(hidden, weight, targets, float(temperature), compute_dtype, entropy_grad)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [T] of each row of logits [T, V] (already temperature-scaled), in nats."""
    logz = torch.logsumexp(logits, dim=-1)  # [T]
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
