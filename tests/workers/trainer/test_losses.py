"""workers/trainer/losses.py against values worked out by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from areal_aio.workers.trainer import losses

EPS = losses.ADV_EPS


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- advantages ----------------------------------------------------------------------------

def test_grpo_normalizes_within_each_group() -> None:
    # group 0: rewards 1, 0 -> mean .5, std .5; group 1: 3, 1, 2 -> mean 2, std sqrt(2/3)
    adv = losses.advantages(t(1, 0, 3, 1, 2), torch.tensor([0, 0, 1, 1, 1]), "grpo")
    s1 = math.sqrt(2 / 3)
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 1 / (s1 + EPS), -1 / (s1 + EPS), 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_grpo_groups_need_not_be_contiguous() -> None:
    a = losses.advantages(t(1, 5, 0, 7), torch.tensor([3, 9, 3, 9]), "grpo")
    b = losses.advantages(t(1, 0, 5, 7), torch.tensor([3, 3, 9, 9]), "grpo")
    assert a[[0, 2, 1, 3]].tolist() == pytest.approx(b.tolist())
    assert a.tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)


def test_drgrpo_only_centres() -> None:
    adv = losses.advantages(t(1, 0, 3, 1, 2), torch.tensor([0, 0, 1, 1, 1]), "drgrpo")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 1, -1, 0])


def test_batch_normalizes_over_everything() -> None:
    r = [1.0, 0.0, 1.0, 1.0]
    adv = losses.advantages(t(*r), torch.tensor([0, 0, 1, 1]), "batch")
    std = math.sqrt(sum((x - 0.75) ** 2 for x in r) / 4)
    assert adv.tolist() == pytest.approx([(x - 0.75) / (std + EPS) for x in r], abs=1e-6)


@pytest.mark.parametrize("kind", losses.ADVANTAGES)
def test_zero_spread_gives_zero_advantage_not_nan(kind: str) -> None:
    adv = losses.advantages(t(0.7, 0.7, 0.7, 0.7), torch.tensor([0, 0, 1, 1]), kind)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    single = losses.advantages(t(0.3), torch.tensor([5]), kind)  # a group of one
    assert single.tolist() == [0.0]


def test_unknown_advantage_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="grpo"):
        losses.advantages(t(1, 0), torch.tensor([0, 0]), "gae")


# ---- objectives ------------------------------------------------------------------------------

def _grad(loss: torch.Tensor, logp: torch.Tensor) -> list[float]:
    loss.sum().backward()
    return logp.grad.tolist()


def test_pg_is_minus_advantage_times_logp() -> None:
    logp = t(-1.0, -2.0).requires_grad_()
    loss, st = losses.token_loss(logp, t(-1.0, -1.0), t(-1.0, -1.0), t(1.0, -2.0), objective="pg")
    assert loss.tolist() == pytest.approx([1.0, -4.0])
    assert st.ratio.tolist() == pytest.approx([1.0, math.exp(-1.0)])
    assert not st.clipped.any() and not st.capped.any()
    assert _grad(loss, logp) == pytest.approx([-1.0, 2.0])


def test_ppo_clips_against_behaviour() -> None:
    # ratios vs behav (= 0): in range, above 1+eps_high with A>0, below 1-eps with A<0,
    # in range with A<0, below 1-eps with A>0 (not clipped: min keeps r*A), above with A<0.
    r = [1.1, 1.5, 0.5, 0.9, 0.5, 1.5]
    a = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    logp = torch.log(t(*r)).requires_grad_()
    zeros = torch.zeros(6)
    loss, st = losses.token_loss(logp, zeros, zeros - 3.0, t(*a), objective="ppo",
                                 clip_eps=0.2, clip_eps_high=0.28)
    assert loss.tolist() == pytest.approx([-1.1, -1.28, 0.8, 0.9, -0.5, 1.5], abs=1e-6)
    assert st.clipped.tolist() == [False, True, True, False, False, False]
    assert st.ratio.tolist() == pytest.approx(r)
    # d loss / d logp = -r*A where unclipped, 0 where the clip is active
    assert _grad(loss, logp) == pytest.approx([-1.1, 0.0, 0.0, 0.9, -0.5, 1.5], abs=1e-6)


def test_ppo_symmetric_clip_without_eps_high() -> None:
    logp = torch.log(t(1.25)).requires_grad_()
    loss, st = losses.token_loss(logp, t(0.0), t(0.0), t(1.0), objective="ppo", clip_eps=0.2)
    assert loss.tolist() == pytest.approx([-1.2])
    assert st.clipped.tolist() == [True]


def _decoupled(cap_mode: str) -> tuple[torch.Tensor, losses.TokenStats, list[float]]:
    # behav = 0; prox: w = pi_prox/pi_behav = 1, 2, 6, 0.5; ratio vs prox = 1.1, 1.5, 1.0, 0.9
    prox = torch.log(t(1.0, 2.0, 6.0, 0.5))
    logp = (prox + torch.log(t(1.1, 1.5, 1.0, 0.9))).detach().requires_grad_()
    loss, st = losses.token_loss(logp, torch.zeros(4), prox, t(1.0, 1.0, 1.0, -1.0),
                                 objective="decoupled_ppo", clip_eps=0.2, clip_eps_high=0.28,
                                 behav_cap=5.0, cap_mode=cap_mode)
    return loss, st, _grad(loss, logp)


def test_decoupled_ppo_mask_drops_tokens_over_the_cap() -> None:
    loss, st, grad = _decoupled("mask")
    # token 0: -1 * 1.1; token 1: clipped at 1.28, weight 2; token 2: w 6 > 5 masked;
    # token 3: A<0, r .9 in range: -(0.5 * -0.9)
    assert loss.tolist() == pytest.approx([-1.1, -2.56, 0.0, 0.45], abs=1e-6)
    assert st.capped.tolist() == [False, False, True, False]
    assert st.clipped.tolist() == [False, True, False, False]
    assert st.ratio.tolist() == pytest.approx([1.1, 1.5, 1.0, 0.9], abs=1e-6)
    assert st.behav_w.tolist() == pytest.approx([1.0, 2.0, 6.0, 0.5], abs=1e-6)
    assert grad == pytest.approx([-1.1, 0.0, 0.0, 0.45], abs=1e-6)  # -w r A, w held constant


def test_decoupled_ppo_clamp_caps_the_weight() -> None:
    loss, st, grad = _decoupled("clamp")
    assert loss.tolist() == pytest.approx([-1.1, -2.56, -5.0, 0.45], abs=1e-6)
    assert st.capped.tolist() == [False, False, True, False]
    assert grad == pytest.approx([-1.1, 0.0, -5.0, 0.45], abs=1e-6)


def test_decoupled_equals_ppo_when_prox_is_behav() -> None:
    logp, behav, adv = t(-0.9, -2.0, -0.2), t(-1.0, -1.5, -0.1), t(1.0, -1.0, 0.5)
    dec, _ = losses.token_loss(logp, behav, behav, adv, objective="decoupled_ppo")
    ppo, _ = losses.token_loss(logp, behav, behav, adv, objective="ppo")
    assert dec.tolist() == pytest.approx(ppo.tolist())


def test_sft_is_the_negative_log_likelihood_whatever_the_rest() -> None:
    logp = t(-0.5, -2.0, -0.1).requires_grad_()
    loss, st = losses.token_loss(logp, t(-9.0, 3.0, 0.0), t(1.0, -4.0, 2.0), t(5.0, -5.0, 0.0), objective="sft")
    assert loss.tolist() == pytest.approx([0.5, 2.0, 0.1])
    # summed over tokens and divided by their count (the trainer's aggregation): the mean NLL
    assert float(loss.detach().sum() / 3) == pytest.approx((0.5 + 2.0 + 0.1) / 3)
    assert _grad(loss, logp) == [-1.0, -1.0, -1.0]
    assert st.clipped.tolist() == [False] * 3 and st.ratio.tolist() == [1.0] * 3


def test_unknown_objective_and_cap_mode_are_refused() -> None:
    x = t(0.0)
    with pytest.raises(ValueError, match="decoupled_ppo"):
        losses.token_loss(x, x, x, x, objective="grpo")
    with pytest.raises(ValueError, match="clamp"):
        losses.token_loss(x, x, x, x, objective="decoupled_ppo", cap_mode="drop")


# ---- k3 KL and entropy ------------------------------------------------------------------------

def test_k3_by_hand() -> None:
    # pi = .5, ref = 1: d = ln 2, k3 = 2 - ln 2 - 1;  pi = 1, ref = .5: d = -ln 2, k3 = .5 + ln 2 - 1
    kl = losses.k3_kl(torch.log(t(0.5, 1.0, 0.3)), torch.log(t(1.0, 0.5, 0.3)))
    assert kl.tolist() == pytest.approx([1 - math.log(2), math.log(2) - 0.5, 0.0], abs=1e-7)


def test_k3_is_never_negative_and_tiny_for_tiny_gaps() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert (losses.k3_kl(a, b) >= 0).all()
    d = torch.tensor([1e-6], dtype=torch.float64)
    assert losses.k3_kl(torch.zeros(1, dtype=torch.float64), d).item() == pytest.approx(5e-13, rel=1e-3)


def test_entropy_of_uniform_and_peaked_rows() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert losses.entropy_from_logits(logits).tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


# ---- the chunked LM head ---------------------------------------------------------------------

def _naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temp: float):
    z = (hidden @ weight.T) / temp
    logp = torch.log_softmax(z, -1).gather(1, targets[:, None])[:, 0]
    return logp, losses.entropy_from_logits(z.detach())


@pytest.mark.parametrize("chunk_elems", [7, 1 << 22])  # several chunks (one partial), one chunk
def test_token_logprobs_match_full_log_softmax(monkeypatch, chunk_elems: int) -> None:
    monkeypatch.setattr(losses, "HEAD_CHUNK_ELEMS", chunk_elems)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 3, generator=g, requires_grad=True)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 1, 1, 2])
    logp, ent = losses.token_logprobs(h, w, targets, temperature=0.7)
    ref_logp, ref_ent = _naive(h, w, targets, 0.7)
    assert logp.tolist() == pytest.approx(ref_logp.tolist(), abs=1e-6)
    assert ent.tolist() == pytest.approx(ref_ent.tolist(), abs=1e-6)
    assert not ent.requires_grad
    coef = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    gh, gw = torch.autograd.grad((logp * coef).sum(), (h, w))
    rh, rw = torch.autograd.grad((ref_logp * coef).sum(), (h, w))
    assert torch.allclose(gh, rh, atol=1e-6) and torch.allclose(gw, rw, atol=1e-6)


def test_token_logprobs_gradcheck(monkeypatch) -> None:
    monkeypatch.setattr(losses, "HEAD_CHUNK_ELEMS", 10)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([5, 0, 2, 2])
    assert torch.autograd.gradcheck(lambda a, b: losses.token_logprobs(a, b, targets, 0.5)[0], (h, w))


def test_token_logprobs_bf16_compute_is_close_and_grads_keep_their_dtype() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(10, 8, generator=g, requires_grad=True)
    targets = torch.arange(6)
    logp, _ = losses.token_logprobs(h, w, targets, 1.0, torch.bfloat16)
    ref, _ = _naive(h, w, targets, 1.0)
    assert logp.dtype == torch.float32 and torch.allclose(logp, ref, atol=0.1)
    logp.sum().backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_token_logprobs_of_a_frozen_head_give_the_same_hidden_gradient_and_none_for_it() -> None:
    """A LoRA run's head (the tied embedding) is frozen: no [V, H] gradient is computed for it."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    targets = torch.randint(11, (7,), generator=gen)
    grads = []
    for trainable in (True, False):
        hidden, head = h.clone().requires_grad_(), w.clone().requires_grad_(trainable)
        losses.token_logprobs(hidden, head, targets, 0.7)[0].sum().backward()
        grads.append((hidden.grad, head.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and grads[0][1] is not None and grads[1][1] is None


def test_sequence_weights_by_hand() -> None:
    """Token losses 1 everywhere on replies of 2, 0 and 4 trained tokens (S = 2 with a token)."""
    lengths = [2, 0, 4]
    w = {kind: losses.sequence_weights(lengths, kind, max_len=8).tolist() for kind in ("token", "sequence", "constant")}
    assert w["token"] == pytest.approx([1 / 6, 1 / 6, 1 / 6])  # sum 6 / 6 tokens = 1
    assert w["sequence"] == pytest.approx([1 / 4, 0.0, 1 / 8])  # (2/2 + 4/4) / 2 = 1
    assert w["constant"] == pytest.approx([1 / 16, 1 / 16, 1 / 16])  # 6 / (2 x 8)
    loss = {kind: sum(wi * n for wi, n in zip(ws, lengths, strict=True)) for kind, ws in w.items()}
    assert loss == pytest.approx({"token": 1.0, "sequence": 1.0, "constant": 6 / 16})
    assert losses.sequence_weights([0, 0], "sequence", 8).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="loss aggregation"):
        losses.sequence_weights([1], "mean", 8)


def test_gspo_is_the_sequence_ratio_clipped_per_sequence_by_hand() -> None:
    """Two sequences (tokens 0-1 and 2-4): s_i = exp(mean log(pi / pi_prox)), the clip on s_i,
    each token's gradient s_i * A_i * w_i (0 where the clip holds), w_i the sequence's capped
    behaviour weight exp(mean log(pi_prox / pi_behav))."""
    seq = torch.tensor([0, 0, 1, 1, 1])
    prox = torch.tensor([-1.0, -2.0, -1.0, -1.5, -0.5])
    logp = (prox + torch.tensor([0.1, 0.3, 0.5, 0.4, 0.6])).requires_grad_()  # mean log ratio 0.2, 0.5
    behav = prox - torch.tensor([0.2, 0.0, 0.1, 0.1, 0.1])  # mean log(prox / behav): 0.1, 0.1
    adv = torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0])
    loss, st = losses.token_loss(logp, behav, prox, adv, objective="gspo", clip_eps=0.1, clip_eps_high=0.3,
                                 seq=seq)
    s = [math.exp(0.2), math.exp(0.5)]  # 1.221 inside [0.9, 1.3]; 1.649 over it (A > 0: clipped)
    w = math.exp(0.1)
    want = [-w * s[0] * 1.0] * 2 + [-w * 1.3 * 2.0] * 3
    assert loss.tolist() == pytest.approx(want, rel=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-w * s[0] * 1.0] * 2 + [0.0] * 3, rel=1e-6)
    assert st.clipped.tolist() == [False, False, True, True, True]
    with pytest.raises(ValueError, match="gspo needs seq"):
        losses.token_loss(logp, behav, prox, adv, objective="gspo")


def test_cispo_clips_the_weight_and_never_the_gradient_by_hand() -> None:
    prox = torch.tensor([-1.0, -1.0, -1.0])
    logp = (prox + torch.tensor([0.0, 0.5, -0.5])).requires_grad_()  # r = 1, 1.65, 0.61
    behav = prox.clone()  # w = 1
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, st = losses.token_loss(logp, behav, prox, adv, objective="cispo", clip_eps=0.2, clip_eps_high=0.28)
    is_w = [1.0, 1.28, 0.8]
    assert loss.tolist() == pytest.approx([-is_w[i] * float(adv[i]) * float(logp.detach()[i]) for i in range(3)], rel=1e-6)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-is_w[i] * float(adv[i]) for i in range(3)], rel=1e-6)  # none zeroed
    assert st.clipped.tolist() == [False, True, True]


@pytest.mark.parametrize("objective", ["gspo", "cispo", "decoupled_ppo"])
def test_on_policy_with_prox_equal_behav_every_decoupled_objective_is_pg(objective) -> None:
    """pi_theta = pi_prox = pi_behav (one mini-batch, fresh samples): ratio 1, weight 1, so the
    gradient is policy gradient's -A on every token."""
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.1]).requires_grad_()
    fixed = logp.detach().clone()
    adv = torch.tensor([0.5, 0.5, -1.5, -1.5])
    loss, _ = losses.token_loss(logp, fixed, fixed, adv, objective=objective, seq=torch.tensor([0, 0, 1, 1]))
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx((-adv).tolist())


@pytest.mark.parametrize("chunk_elems", [7, 1 << 22])
def test_the_entropy_gradient_matches_autograd_through_full_logits(monkeypatch, chunk_elems: int) -> None:
    """entropy_grad: d/d(h, W) of sum(a * logp + b * entropy) equals autograd's through the full
    [T, V] logits (trainer.entropy_coef's path); gradcheck in float64 too."""
    monkeypatch.setattr(losses, "HEAD_CHUNK_ELEMS", chunk_elems)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, 3, generator=g, requires_grad=True)
    w = torch.randn(4, 3, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 1, 1, 2])
    logp, ent = losses.token_logprobs(h, w, targets, temperature=0.7, entropy_grad=True)
    assert ent.requires_grad
    z = (h @ w.T) / 0.7
    ref_logp = torch.log_softmax(z, dim=-1).gather(1, targets[:, None])[:, 0]
    ref_ent = losses.entropy_from_logits(z)
    a, b = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0]), torch.tensor([0.3, 1.0, -0.7, 0.0, 2.0])
    got = torch.autograd.grad((a * logp + b * ent).sum(), (h, w))
    want = torch.autograd.grad((a * ref_logp + b * ref_ent).sum(), (h, w))
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(got, want, strict=True))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x, y: losses.token_logprobs(x, y, targets, 0.7, entropy_grad=True)[1], (h64, w64))
