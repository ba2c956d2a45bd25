"""The trainer worker: holds the trainable policy and its optimizer, takes one update per Train.

    Train(step, version, samples)                        (version must be ours)
      |  advantages per sequence (grpo | drgrpo | batch)            losses.advantages
      |  split into `minibatches`, each into token-budget micro-batches  packing,
      |      laid out one row per sample or one packed row per group    microbatch
      |  prox logp: this version's weights, same micro-batches; the first
      |      mini-batch reads it off its own forward (the weights have not moved
      |      yet), the others take a no-grad pass before any step
      |      (and ref logp from a frozen copy of v0 when kl_ref = "ref")
      |  per mini-batch: forward micro-batches, token losses, sum / tokens,
      |      backward (grads accumulate), clip grad norm, AdamW step; a loss or
      |      norm that is not finite: no step, the grads dropped (`skipped`)
      v  publish v<version+1> in the rollout dtype, version += 1
    Trained(step, version + 1, path, stats)

With lora.rank > 0 (workers/lora.py) the base is frozen and peft's LoRA layers sit in the
model: the same passes, gradients and AdamW state on lora_A / lora_B only (the all-reduce of
several ranks too), and v<version+1> is the adapter alone.

With several ranks (trainer.devices; workers/trainer/data_parallel.py) every rank plans the whole
batch, forwards its share of each mini-batch's micro-batches, and the gradients are summed
before the clip; the stats are of the whole batch (summed, min and max over the ranks);
rank 0 publishes, the others answer Trained with path "".

Run as `python -m areal_aio.workers.trainer` (workers.common.serve speaks the pipe), or
use `Trainer` in-process (tests, benchmarks).

Log-probs are taken under the sampling distribution: logits / rollout
temperature, as the rollout worker reports them, so pi_prox and pi_behav of
the same weights agree (`mismatch_kl` ~ 0 in fp32). The model stays in eval
mode while training: dropout would make pi_theta differ from pi_prox at equal
weights and turn the PPO ratio into noise. Only the completion positions go
through the LM head, in chunks that never hold [T, V] logits
(losses.token_logprobs): prompt logits are never needed, and with a 49k
vocabulary the head's logits are the largest activation of a small model.

Prompt sharing (trainer.share_prompts; auto = on for CPU): the samples of a GRPO
group share one prompt, and their replies range from 2 to 64 tokens. Each group
is packed into one row: its prompt once, then its completions one after another,
each seeing only the prompt and its own past (a 4D mask, position ids restarting
after the prompt; workers/trainer/microbatch.py). The result equals the per-sequence
forward (a test checks log-probs and gradients), and the work is the real tokens,
P + sum(C_i - 1) per group, where rows padded to the longest reply cost
G * (P + C_max) unshared and P + G * (C_max - 1) with the prompt's KV shared
(docs/benchmarks/components.md has both measured on a run's replies). It needs an
attention that takes a custom mask (sdpa or eager). auto leaves it off on CUDA,
where a 135M model is kernel-launch-bound and this layout is not measured yet.

Stats: one plain number (or None) per TRAIN_STATS key, of the whole batch; a supervised update
(Train.objective "sft", what `python -m areal_aio sft` sends) reports SFT_STATS only. A
mini-batch whose loss or gradient norm is not finite takes no step (`skipped`: AdamW with a NaN
gradient would make every weight NaN); the update still publishes v<version+1>, the weights it
holds, so the clock goes on and the controller counts the step as skipped.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from areal_aio import wire
from areal_aio.settings import DECOUPLED, SFT, Settings, TrainerSettings
from areal_aio.store.weights import WeightStore
from areal_aio.workers import frozen_base, lora
from areal_aio.workers.common import EOF, Channel, configure_torch, serve
from areal_aio.workers.models import checkpoint_layers, load_model
from areal_aio.workers.trainer import checkpoint, losses
from areal_aio.workers.trainer.data_parallel import Ranks
from areal_aio.workers.trainer.microbatch import (
    PACKED_ATTENTION,
    MicroBatch,
    behav_from_prox,
    check_samples,
    plan_micro_batches,
    trained,
    trained_count,
)

HEAD_CHECK_ATOL = 1e-4
"""Chunked head vs the model's own logits at init: fp32 agreement well inside this means the
model's logits are exactly lm_head(last hidden) (no scaling we do not know about)."""


TRAIN_STATS: dict[str, str] = {
    "loss": "The objective's loss, averaged over the step's mini-batches (each aggregated by "
            "trainer.loss_agg; the kl and entropy terms included where on); not finite on a skipped step.",
    "entropy": "Mean entropy of the policy per trained token, in nats, at the sampling temperature: near 0, "
               "the policy repeats itself and groups lose their spread.",
    "clip_frac": "Fraction of trained tokens the objective clipped (cispo: whose weight it clipped); 0 for pg.",
    "ratio_min": "Smallest ratio the objective clips, over trained tokens: pi_theta / pi_prox (decoupled "
                 "objectives: 1 with one mini-batch), pi_theta / pi_behav (ppo, pg).",
    "ratio_mean": "Mean of that ratio over trained tokens.",
    "ratio_max": "Largest of that ratio over trained tokens.",
    "behav_w_min": "Smallest behaviour weight pi_prox / pi_behav over trained tokens: how far the policy that "
                   "trains is from the one that sampled (staleness, int8 generation).",
    "behav_w_mean": "Mean behaviour weight over trained tokens.",
    "behav_w_max": "Largest behaviour weight over trained tokens.",
    "capped_frac": "Fraction of trained tokens whose behaviour weight passed trainer.behav_cap (masked or "
                   "clamped by trainer.cap_mode); 0 for ppo and pg.",
    "grad_norm": "Gradient norm before clipping, averaged over the mini-batches; not finite on a skipped step.",
    "kl": "Only with trainer.kl_coef > 0: mean k3 KL per trained token to the reference (trainer.kl_ref).",
    "tokens": "Tokens trained (an episode's added turns left out).",
    "computed_tokens": "Token positions the update's forward passes ran on, padding included.",
    "seqs": "Sequences trained.",
    "mismatch_kl": "k3 KL(pi_behav || pi_prox) over the tokens this very version sampled: the gap between "
                   "generation and training on the same weights (~0 in fp32; int8 or bf16 raise it); null "
                   "when no token is of this version.",
    "mismatch_k1": "The same tokens' k1 estimate of that KL (mean log pi_behav - log pi_prox): unbiased too, of "
                   "either sign, the figure some peers report (k3 is never negative and varies less).",
    "reward_mean": "Mean reward of the sequences trained; in steps.jsonl it replaces the controller's mean over "
                   "samples, which it equals unless an episode trained several sequences.",
    "adv_abs_mean": "Mean absolute advantage over the sequences: 0 when no group has spread (trainer.advantage "
                    "grpo or drgrpo).",
    "skipped": "Mini-batches whose optimizer step was not taken (loss or gradient norm not finite); 0 normally.",
    "seconds": "Wall seconds of the whole update in the trainer, publishing included.",
    "prox_s": "Seconds of the no-grad pi_prox passes of the mini-batches after the first (0 with one).",
    "publish_s": "Seconds publishing the new weights to the weight store.",
    "teacher_kl": "Only with a teacher (teacher.model): mean reverse KL per trained token, log pi_prox - log "
                  "pi_teacher at the tokens the policy sampled (k1: of either sign per token, its mean >= 0 "
                  "in expectation); what distillation drives down.",
    "teacher_logp": "Only with a teacher: mean log-prob per trained token under the teacher (at "
                    "rollout.temperature).",
    "teacher_s": "Only with a teacher: seconds of its no-grad passes over the step's micro-batches (each once).",
    "reduce_s": "Seconds in the gradient all-reduces of a data-parallel trainer, the wait for the slowest "
                "rank included (0 with one rank; on a GPU the reduction is queued, so mostly that wait).",
}
"""Trained.stats, each update's numbers (`_summary` and `train`): token means unless named
otherwise, of the whole batch (summed, min and max over the ranks); steps.jsonl rows carry them."""

SFT_STATS = ("loss", "entropy", "grad_norm", "tokens", "computed_tokens", "seqs", "seconds", "publish_s",
             "reduce_s", "skipped")
"""The stats of a supervised update (loss: the token-mean negative log-likelihood)."""


class _Stats:
    """Running sums over the tokens of one update, as 0-d float64 tensors on the trainer's
    device: adding a micro-batch reads nothing on the host (on a GPU a read waits for every
    queued kernel); `_summary` reads them all at once. float64 sums of the float32 partial
    sums are the same numbers as the Python floats they replace."""

    def __init__(self, device: str) -> None:
        self.tokens = 0  # from shapes, on the host
        self.skipped = 0  # mini-batches whose step was not taken (read on the host: see _descend)
        self.loss: list[torch.Tensor] = []  # per mini-batch
        self.grad_norm: list[torch.Tensor] = []
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.entropy = self.clipped = self.kl = self.ratio_sum = zero
        self.ratio_min, self.ratio_max = zero + math.inf, zero - math.inf

    def add(self, st: losses.TokenStats, entropy: torch.Tensor, kl: torch.Tensor | None) -> None:
        if st.ratio.numel() == 0:
            return
        self.tokens += st.ratio.numel()
        self.entropy = self.entropy + entropy.sum().double()
        self.clipped = self.clipped + st.clipped.sum().double()
        self.ratio_sum = self.ratio_sum + st.ratio.sum().double()
        # fmin / fmax skip a NaN as Python's min / max did
        self.ratio_min = torch.fmin(self.ratio_min, st.ratio.min().double())
        self.ratio_max = torch.fmax(self.ratio_max, st.ratio.max().double())
        if kl is not None:
            self.kl = self.kl + kl.detach().sum().double()


def bf16_autocast(setting: str, device: str) -> bool:
    """Whether `trainer.bf16` (on | off | auto) runs bf16 autocast on `device`. auto: only where
    bf16 matmuls are native: on an AVX2-only CPU oneDNN emulates them, many times slower
    than fp32."""
    if setting != "auto":
        return setting == "on"
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if dev.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def _adamw(params: list[torch.Tensor], **kw: float) -> torch.optim.AdamW:
    """AdamW, fused where this torch build has it for the parameters' device: one kernel over
    all parameters instead of a loop over tensors."""
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def load_teacher(spec: str, tokenizer: Any, device: str, seed: int) -> Any:
    """teacher.model, frozen in eval mode on `device`; ValueError (naming teacher.model) when its
    tokenizer is not the policy's: its log-probs would score other tokens."""
    teacher, its_tokenizer = load_model(spec, seed=seed, device=device)
    if tokenizer is not None and its_tokenizer is not None and its_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"teacher.model: {spec!r} has another tokenizer than model.path's "
                         f"({len(its_tokenizer.get_vocab())} against {len(tokenizer.get_vocab())} tokens, or "
                         f"other ids); distillation needs the policy's own")
    teacher.eval().requires_grad_(False)
    teacher.config.use_cache = False
    return teacher


def _teacher_sums(samples: list[wire.TrainSample], mbs: list[MicroBatch], prox: dict[int, torch.Tensor],
                  teacher: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's sums of the teacher's figures: its log-probs, the reverse KL, and each
    sample's KL sum (`teacher_kl<i>`, summed over the ranks with the rest)."""
    zero = torch.zeros((), dtype=torch.float64, device=next(iter(teacher.values())).device)
    out = {"teacher_logp": zero.clone(), "teacher_kl": zero.clone(),
           **{f"teacher_kl{i}": zero.clone() for i in range(len(samples))}}
    for mb in mbs:
        kl = (prox[id(mb)] - teacher[id(mb)]).double()
        out["teacher_logp"] += teacher[id(mb)].double().sum()
        out["teacher_kl"] += kl.sum()
        for i, part in zip(mb.index, torch.split(kl, [trained_count(samples[i]) for i in mb.index]), strict=True):
            out[f"teacher_kl{i}"] += part.sum()
    return out


def _teacher_stats(samples: list[wire.TrainSample], got: dict[str, float], tokens: int) -> dict[str, Any]:
    per_seq = [got[f"teacher_kl{i}"] / max(trained_count(s), 1) for i, s in enumerate(samples)]
    return {"teacher_kl": got["teacher_kl"] / tokens if tokens else 0.0,
            "teacher_logp": got["teacher_logp"] / tokens if tokens else 0.0,
            "teacher_kl_seq": per_seq}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Trainer:
    """The trainable policy, its optimizer and the weight store; one `train` call per update."""

    def __init__(self, settings: Settings | dict[str, Any], shm_dir: str | Path,
                 model: Any = None, tokenizer: Any = None, ranks: Ranks | None = None) -> None:
        """`settings`: the run's Settings (or its to_dict(), as Init carries it); pass
        `model`/`tokenizer` to skip loading (tests); `ranks`: this process's place among
        the trainer's ranks (default: the only one)."""
        if isinstance(settings, dict):
            settings = Settings.from_dict(settings)
        self.cfg: TrainerSettings = settings.trainer
        self.device = self.cfg.device
        self.temperature = settings.rollout.temperature
        self.max_new_tokens = settings.rollout.max_new_tokens  # trainer.loss_agg = constant's normaliser
        self.publish_dtype = getattr(torch, settings.rollout.dtype)
        # lora.base_dtype other than float32: the frozen base never exists in fp32 here: loaded in
        # bf16, then stored narrow (workers/frozen_base.py), its small tensors and the adapter fp32
        base_dtype = settings.lora.base_dtype if settings.lora.rank else "float32"
        if model is None:
            model, tokenizer = load_model(settings.model.path, seed=settings.run.seed, device=self.device,
                                          dtype="float32" if base_dtype == "float32" else "bfloat16")
        self.model = (model.float() if base_dtype == "float32" else model).to(self.device)
        self.tokenizer = tokenizer  # written next to the exported model (workers.checkpoint)
        self.model.eval()  # see module docstring: no dropout in an RL update
        self.model.config.use_cache = False
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else 0
        self.spec, self.seed = settings.model.path, settings.run.seed
        # LoRA (workers/lora.py): the base frozen, peft's layers injected in place; the adapter
        # alone gets gradients, AdamW state, the ranks' all-reduce, and is what is published
        self.lora = settings.lora if settings.lora.rank else None
        self._base_identity: dict[str, str] | None = None
        if self.lora is not None:
            self.params = lora.attach(self.model, self.lora, self.spec)
            frozen_base.store(self.model, base_dtype)
        else:
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.ranks = ranks or Ranks()
        self.ranks.broadcast(self.params)  # one set of weights, whatever each rank loaded
        self.opt = _adamw(self.params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        # kl_ref = "ref": a frozen copy of v0; with LoRA v0 is the base itself (B starts at 0),
        # so the reference pass turns the adapter off instead of copying the model
        self.use_ref = self.cfg.kl_coef > 0 and self.cfg.kl_ref == "ref"
        self.ref = None
        if self.use_ref and self.lora is None:
            self.ref = copy.deepcopy(self.model).requires_grad_(False)  # frozen v0
        if self.cfg.activation_checkpointing:  # after the ref copy: a no-grad model needs none
            checkpoint_layers(self.model)
        # lora.dropout: on in the gradient passes only, so pi_prox needs a no-grad pass of its own
        self.dropout = self.lora is not None and self.lora.dropout > 0
        if not Path(shm_dir).is_dir():
            raise FileNotFoundError(f"trainer: weight store folder {shm_dir} does not exist "
                                    "(the controller creates it before Init)")
        self.store = WeightStore(shm_dir)
        self.version = 0
        self._fast_head = self._check_head(self.model)
        # teacher.model: a frozen model scoring the sampled tokens (on-policy distillation)
        self.distill = settings.teacher
        self.teacher = self.teacher_fast = None
        if settings.teacher.model:
            self.teacher = load_teacher(settings.teacher.model, tokenizer, self.device, self.seed)
            self.teacher_fast = self._check_head(self.teacher)
        share = self.cfg.share_prompts
        on_cpu = torch.device(self.device).type == "cpu"
        attention = getattr(self.model.config, "_attn_implementation", None)
        if share == "on" and attention not in PACKED_ATTENTION:
            raise ValueError(f"trainer.share_prompts = on needs {' or '.join(PACKED_ATTENTION)} "
                             f"attention (a custom 4D mask); this model uses {attention}")
        self.bf16 = bf16_autocast(self.cfg.bf16, self.device)
        self.share_prompts = attention in PACKED_ATTENTION and (
            share == "on" or (share == "auto" and on_cpu))

    # ---- forward -------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if not self.bf16:
            return nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16)

    def _forward(self, model: Any, mb: MicroBatch, fast: bool | None = None,
                 temperature: float | None = None, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(token) [T] with grad, entropy [T], with grad only when `entropy_grad`) at
        `mb`'s completion tokens, under logits / temperature (default: the rollout's); call
        inside `_autocast()`."""
        fast = self._fast_head if fast is None else fast
        temperature = self.temperature if temperature is None else temperature
        inputs = dict(input_ids=mb.input_ids, attention_mask=self._attention_mask(model, mb),
                      position_ids=mb.position_ids, use_cache=False)
        if fast:
            hidden = model.base_model(**inputs).last_hidden_state  # [n, L, H]
            hidden = hidden.flatten(0, 1).index_select(0, mb.gather)  # [T, H]
            head = model.get_output_embeddings().weight  # [V, H]
            on = torch.is_autocast_enabled(torch.device(self.device).type)
            dtype = torch.bfloat16 if on else None  # autocast does not reach a Function's backward
            return losses.token_logprobs(hidden, head, mb.targets, temperature, dtype, entropy_grad)
        logits = model(**inputs).logits.flatten(0, 1).index_select(0, mb.gather)  # [T, V]
        logits = logits.float() / temperature
        logp = logits.gather(1, mb.targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, losses.entropy_from_logits(logits)

    @staticmethod
    def _attention_mask(model: Any, mb: MicroBatch) -> torch.Tensor:
        """mb's mask as the model's attention takes it: sdpa takes a 4D bool mask (True = may
        see), eager adds it to the scores, so it gets 0 / the dtype's minimum.

        Unshared rows with padding get the causal-and-padding mask transformers would build
        from the [n, L] one, built here: transformers first asks the device whether the mask
        holds any padding, a host read (on a GPU, a wait) per forward. Rows without padding
        keep [n, L]: sdpa then runs its causal kernel, as before (transformers still reads)."""
        mask = mb.attention_mask
        attention = model.config._attn_implementation
        if not mb.shared:
            if not (mb.padded and attention in PACKED_ATTENTION):
                return mask
            width = mask.shape[1]
            causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril_()
            mask = causal[None, None] & mask.bool()[:, None, None, :]  # [n, 1, L, L]
        if attention != "eager":
            return mask
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min)

    def _check_head(self, model: Any) -> bool:
        """True when `model`'s logits are exactly lm_head(last hidden) (no bias, softcap or
        scaling), so the chunked head (losses.token_logprobs) may replace the model's own."""
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None or getattr(head, "weight", None) is None:
            return False
        ids = torch.tensor([[1, 2, 3, 4]], device=self.device)
        mb = MicroBatch([0], ids, torch.ones_like(ids), None, torch.arange(4, device=self.device),
                        ids[0], ids[0].float(), ids[0].float())
        with torch.no_grad():
            fast, _ = self._forward(model, mb, fast=True)
            full, _ = self._forward(model, mb, fast=False)
        return bool(torch.allclose(fast, full, atol=HEAD_CHECK_ATOL))

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch, model: Any = None) -> torch.Tensor:
        """log pi(token) [T] of `mb`'s completion tokens under `model` (default: the policy)."""
        with self._autocast():
            logp, _ = self._forward(self.model if model is None else model, mb)
        return logp.float()

    @torch.no_grad()
    def teacher_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """log pi_teacher(token) [T] of `mb`'s completion tokens, at the rollout's temperature."""
        with self._autocast():
            logp, _ = self._forward(self.teacher, mb, fast=self.teacher_fast)
        return logp.float()

    def _distill(self, mb: MicroBatch, prox: torch.Tensor, teacher: torch.Tensor) -> None:
        """On-policy distillation: each token's advantage gains coef x (log pi_teacher - log
        pi_prox), the negative per-token reverse KL at the token the policy sampled (in place,
        once per micro-batch); teacher.keep_reward = false drops the task's advantage."""
        signal = self.distill.coef * (teacher - prox).to(mb.adv.dtype)
        if self.distill.keep_reward:
            mb.adv.add_(signal)
        else:
            mb.adv.copy_(signal)

    def ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """log pi_ref(token) [T]: the frozen v0 (with LoRA: the base, the adapter turned off)."""
        if self.lora is None:
            return self.logprobs(mb, self.ref)
        with lora.adapters_off(self.model):
            return self.logprobs(mb)

    def base_identity(self) -> dict[str, str]:
        """A LoRA run's base: model.path and the sha256 of its weights (computed once: frozen)."""
        if self._base_identity is None:
            self._base_identity = lora.base_identity(self.model, self.spec)
        return self._base_identity

    def publish(self, version: int) -> Path:
        """This policy as v<version> in the weight store: the whole model in the rollout dtype,
        or with LoRA the adapter alone (fp32: the rollout merges in fp32, workers/lora.py)."""
        if self.lora is not None:
            return self.store.publish_state(lora.adapter_state(self.model), version,
                                            metadata=lora.metadata(self.lora))
        return self.store.publish(self.model, version, dtype=self.publish_dtype)

    # ---- one update ----------------------------------------------------------------------

    def _micro_batches(self, samples: list[wire.TrainSample], lo: int, hi: int,
                       adv: torch.Tensor, weight: torch.Tensor | None = None) -> list[MicroBatch]:
        """samples[lo:hi] in token-budget micro-batches, packed when prompts are shared: this
        rank's share of them (all, with one rank). `weight` [B]: MicroBatch.weight's per sample."""
        return plan_micro_batches(samples, lo, hi, adv, packed=self.share_prompts,
                                  max_tokens=self.cfg.micro_tokens, pad_id=self.pad_id,
                                  device=self.device, part=self.ranks.rank, parts=self.ranks.world,
                                  weight=weight)

    def train(self, msg: wire.Train) -> wire.Trained:
        """One update on msg.samples (the RL update, or the supervised step when msg.objective
        is "sft"), then publish v<version+1> and return Trained."""
        t0 = time.perf_counter()
        if msg.version != self.version:
            raise ValueError(f"Train step {msg.step}: controller says version {msg.version}, "
                             f"the trainer holds version {self.version}")
        check_samples(msg.samples)
        objective = msg.objective or self.cfg.objective
        if objective == SFT:
            out = self._supervised_step(msg.samples)
        else:
            out = self._rl_update(msg.samples, objective)

        t_pub = time.perf_counter()
        publish = msg.publish and self.ranks.rank == 0
        path = self.publish(self.version + 1) if publish else ""
        self.version += 1
        out.update(seconds=time.perf_counter() - t0, publish_s=time.perf_counter() - t_pub)
        if objective == SFT:  # ratios, weights and rewards mean nothing here
            out = {key: out[key] for key in SFT_STATS}
        return wire.Trained(step=msg.step, version=self.version, path=str(path), stats=out)

    def _rl_update(self, samples: list[wire.TrainSample], objective: str) -> dict[str, Any]:
        """A PPO-family update: group advantages, pi_prox, one optimizer step per mini-batch;
        its stats (without the timings of publishing)."""
        cfg = self.cfg
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        adv = losses.advantages(rewards, groups, cfg.advantage)  # [B]
        mine, totals = self._mini_batches(samples, adv, cfg.loss_agg)

        # pi_prox is this version's policy. The first mini-batch trains on exactly these
        # weights, so its own forward is pi_prox (detached: ratio 1, and no second pass);
        # later mini-batches need theirs before any step.
        t_prox = time.perf_counter()
        prox: dict[int, torch.Tensor] = {}  # id(micro-batch) -> [T]
        ref: dict[int, torch.Tensor] = {}
        for k, mini in enumerate(mine):
            for mb in mini:
                if k > 0 or self.dropout:
                    prox[id(mb)] = self.logprobs(mb)
                if self.use_ref:
                    ref[id(mb)] = self.ref_logprobs(mb)
        prox_s = time.perf_counter() - t_prox
        t_teacher = time.perf_counter()
        teacher = {id(mb): self.teacher_logprobs(mb) for mini in mine for mb in mini
                   if self.teacher is not None and mb.tokens}  # once each, before any step
        teacher_s = time.perf_counter() - t_teacher

        def token_loss(k: int, mb: MicroBatch, logp: torch.Tensor) -> tuple:
            if k == 0 and not self.dropout:  # no step taken yet: this forward is pi_prox
                prox[id(mb)] = logp.detach().float()
            behav_from_prox(mb, prox[id(mb)])  # a guided member's written tokens
            if teacher:
                self._distill(mb, prox[id(mb)], teacher[id(mb)])
            seq = None
            if objective == "gspo":  # each token's sequence: samples[mb.index] in target order
                counts = torch.tensor([trained_count(samples[i]) for i in mb.index], device=logp.device)
                seq = torch.repeat_interleave(torch.arange(len(mb.index), device=logp.device), counts)
            tok_loss, st = losses.token_loss(
                logp, mb.behav, prox[id(mb)], mb.adv, objective=objective,
                clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                behav_cap=cfg.behav_cap, cap_mode=cfg.cap_mode, seq=seq)
            kl = None
            if cfg.kl_coef > 0:
                kl = losses.k3_kl(logp, ref[id(mb)] if self.use_ref else mb.behav)
                tok_loss = tok_loss + cfg.kl_coef * kl
            return tok_loss, st, kl

        stats, reduce_s = self._descend(mine, totals, self.temperature, token_loss, cfg.entropy_coef)
        out = self._summary(samples, mine, prox, stats, adv, rewards, objective, teacher)
        out.update(prox_s=prox_s, reduce_s=reduce_s, **({"teacher_s": teacher_s} if teacher else {}))
        if cfg.kl_coef <= 0:
            out.pop("kl")
        return out

    def _supervised_step(self, samples: list[wire.TrainSample]) -> dict[str, Any]:
        """The completions' token-mean negative log-likelihood under the model itself
        (temperature 1; behaviour log-probs, rewards and the proximal pass play no part), the
        step as in RL (mini-batches, clip, AdamW)."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        adv = torch.zeros(len(samples), dtype=torch.float64)
        mine, totals = self._mini_batches(samples, adv)  # SFT: the token mean
        prox: dict[int, torch.Tensor] = {}  # only for _summary's shapes: no ratio here

        def token_loss(k: int, mb: MicroBatch, logp: torch.Tensor) -> tuple:
            prox[id(mb)] = logp.detach().float()
            tok_loss, st = losses.token_loss(logp, mb.behav, prox[id(mb)], mb.adv, objective=SFT)
            return tok_loss, st, None

        stats, reduce_s = self._descend(mine, totals, 1.0, token_loss)
        out = self._summary(samples, mine, prox, stats, adv, rewards, SFT)
        out.update(reduce_s=reduce_s)
        return out

    def _mini_batches(self, samples: list[wire.TrainSample], adv: torch.Tensor,
                      agg: str = "token") -> tuple[list[list[MicroBatch]], list[int]]:
        """Per mini-batch: this rank's micro-batches, and the completion tokens of all ranks.

        Mini-batches are consecutive slices (groups stay together when B divides evenly); pi_prox
        uses the very micro-batches the update uses, so at equal weights the decoupled ratio is
        exactly 1, even under bf16. `agg` (trainer.loss_agg) other than token weighs each
        sequence's tokens (losses.sequence_weights over its mini-batch, the same on every rank)."""
        n_mini = min(self.cfg.minibatches, len(samples))
        bounds = [round(k * len(samples) / n_mini) for k in range(n_mini + 1)]
        slices = list(zip(bounds[:-1], bounds[1:], strict=True))
        weight = None
        if agg != "token":
            weight = torch.zeros(len(samples), dtype=torch.float64)
            for lo, hi in slices:
                weight[lo:hi] = losses.sequence_weights([trained_count(samples[i]) for i in range(lo, hi)],
                                                        agg, self.max_new_tokens)
        mine = [self._micro_batches(samples, lo, hi, adv, weight) for lo, hi in slices]
        totals = [sum(trained_count(samples[i]) for i in range(lo, hi)) for lo, hi in slices]
        return mine, totals

    def _descend(self, mine: list[list[MicroBatch]], totals: list[int], temperature: float,
                 token_loss: Any, entropy_coef: float = 0.0) -> tuple[_Stats, float]:
        """One optimizer step per mini-batch: forward each of this rank's micro-batches at
        `temperature`, `token_loss(k, mb, logp) -> (loss [T], TokenStats, kl [T] | None)`,
        minus entropy_coef x each token's entropy (trainer.entropy_coef: a bonus for keeping
        the policy spread), backward, the ranks' all-reduce, clip, AdamW. Returns the stats
        and the all-reduce time.

        A mini-batch whose loss or gradient norm is not finite takes no step (`_apply`)."""
        cfg = self.cfg
        stats = _Stats(self.device)
        reduce_s = 0.0
        for k, (own, total) in enumerate(zip(mine, totals, strict=True)):
            # total: of all ranks, the normalisation of one rank
            if total == 0:
                continue
            self.opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for mb in own:
                if mb.tokens == 0:
                    continue
                with self._autocast(), lora.dropout_on(self.model, self.dropout):
                    logp, entropy = self._forward(self.model, mb, temperature=temperature,
                                                  entropy_grad=entropy_coef > 0)  # [T], [T]
                tok_loss, st, kl = token_loss(k, mb, logp)
                if entropy_coef > 0:
                    tok_loss = tok_loss - entropy_coef * entropy
                    entropy = entropy.detach()
                # trainer.loss_agg: the token mean of the mini-batch, or each token its sequence's weight
                loss = tok_loss.sum() / total if mb.weight is None else (tok_loss * mb.weight).sum()
                loss.backward()
                loss_sum = loss_sum + loss.detach().double()
                stats.add(st, entropy, kl)
                del logp, entropy, tok_loss, loss
            self._poison(loss_sum)
            t_reduce = time.perf_counter()
            self.ranks.all_reduce_grads(self.params)  # summed, not averaged: see data_parallel
            reduce_s += time.perf_counter() - t_reduce
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            stats.skipped += not self._apply(norm)
            stats.loss.append(loss_sum)
            stats.grad_norm.append(norm.detach().double())
        self.opt.zero_grad(set_to_none=True)
        return stats, reduce_s

    def _poison(self, loss_sum: torch.Tensor) -> None:
        """A loss that is not finite makes one element of the gradient NaN before the ranks sum
        it, so the gradient norm every rank computes from the sum says it: the ranks skip the
        same steps and their weights stay the same. (loss * 0 is 0 for a finite loss.)"""
        grad = next((p.grad for p in self.params if p.grad is not None), None)
        if grad is not None:
            grad[(0,) * grad.dim()] += (loss_sum * 0).to(grad.dtype)

    def _apply(self, norm: torch.Tensor) -> bool:
        """AdamW's step when the gradient norm (of the summed gradients, after `_poison`) is
        finite; else no step: the gradients are dropped and AdamW's moments and step count stay
        as they were (one host read per mini-batch: whether to step cannot wait for the stats).
        Returns whether the step was taken."""
        if bool(torch.isfinite(norm)):
            self.opt.step()
            return True
        self.opt.zero_grad(set_to_none=True)
        return False

    def _summary(self, samples: list[wire.TrainSample], mine: list[list[MicroBatch]],
                 prox: dict[int, torch.Tensor], stats: _Stats, adv: torch.Tensor,
                 rewards: torch.Tensor, objective: str,
                 teacher: dict[int, torch.Tensor] | None = None) -> dict[str, Any]:
        """Plain-number stats of one update (orjson-ready): this rank's sums, minima and maxima
        (`mine`: its micro-batches), totalled over the ranks and read off the device in one go;
        with a teacher also `teacher_kl_seq`, each sample's mean reverse KL (a list, which the
        controller moves into samples.jsonl)."""
        cfg = self.cfg
        mbs = [mb for mini in mine for mb in mini if mb.tokens]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        if mbs:
            behav = torch.cat([mb.behav for mb in mbs]).double()
            prox_all = torch.cat([prox[id(mb)] for mb in mbs]).double()
        else:
            behav = prox_all = zero.new_zeros(0)
        # tokens sampled by the weights prox was computed with (this version, not yet
        # advanced), in the order of behav / prox; a guided member's written ones were not sampled
        versions = [samples[i].versions[j] if j < len(samples[i].completion_ids) - samples[i].written else None
                    for mb in mbs for i in mb.index for j in trained(samples[i])]
        own = [k for k, v in enumerate(versions) if v == self.version]
        w = torch.exp(prox_all - behav)
        capped = (w > cfg.behav_cap) if objective in DECOUPLED else torch.zeros_like(w, dtype=torch.bool)
        r = (prox_all - behav).index_select(0, torch.tensor(own, dtype=torch.long, device=behav.device))
        empty = not w.numel()
        sums = {"tokens": zero + stats.tokens, "computed": zero + sum(mb.computed for mb in mbs),
                "entropy": stats.entropy, "clipped": stats.clipped, "ratio_sum": stats.ratio_sum,
                "kl": stats.kl, "w_n": zero + w.numel(), "w_sum": w.sum(), "capped": capped.double().sum(),
                "r_n": zero + r.numel(), "mismatch": (torch.expm1(r) - r).sum(), "mismatch_k1": -r.sum(),
                **{f"loss{k}": v for k, v in enumerate(stats.loss)},
                **(_teacher_sums(samples, mbs, prox, teacher) if teacher else {})}
        mins = {"ratio_min": stats.ratio_min, "w_min": zero + math.inf if empty else w.min()}
        maxs = {"ratio_max": stats.ratio_max, "w_max": zero - math.inf if empty else w.max(),
                # the same on every rank (the norm of the summed gradients): max keeps it
                **{f"grad_norm{k}": v for k, v in enumerate(stats.grad_norm)}}
        got = self.ranks.totals(sums, mins, maxs)
        n, w_n = int(got["tokens"]), got["w_n"]
        return {
            "loss": _mean([got[f"loss{k}"] for k in range(len(stats.loss))]),
            "entropy": got["entropy"] / n if n else 0.0,
            "clip_frac": got["clipped"] / n if n else 0.0,
            "ratio_min": got["ratio_min"] if n else 1.0,
            "ratio_mean": got["ratio_sum"] / n if n else 1.0,
            "ratio_max": got["ratio_max"] if n else 1.0,
            "behav_w_min": got["w_min"] if w_n else 1.0,
            "behav_w_mean": got["w_sum"] / w_n if w_n else 1.0,
            "behav_w_max": got["w_max"] if w_n else 1.0,
            "capped_frac": got["capped"] / w_n if w_n else 0.0,
            "grad_norm": _mean([got[f"grad_norm{k}"] for k in range(len(stats.grad_norm))]),
            "kl": got["kl"] / n if n else 0.0,
            "tokens": n,
            "computed_tokens": int(got["computed"]),
            "seqs": len(samples),
            "mismatch_kl": got["mismatch"] / got["r_n"] if got["r_n"] else None,
            "mismatch_k1": got["mismatch_k1"] / got["r_n"] if got["r_n"] else None,
            "reward_mean": float(rewards.mean()),
            "adv_abs_mean": float(adv.abs().mean()),
            "skipped": stats.skipped,
            **(_teacher_stats(samples, got, n) if teacher else {}),
        }

    # ---- keeping the run (workers/trainer/checkpoint.py) -----------------------------------------

    def save(self, msg: wire.Save) -> wire.Saved:
        """Export the policy or write the checkpoint part, between two updates."""
        return checkpoint.save(self, msg)

    def resume(self, folder: str | Path) -> Path | None:
        """Continue from a checkpoint's trainer part (every rank); rank 0 publishes its weights
        for the rollout worker (the path; None on the other ranks)."""
        checkpoint.load_state(self, Path(folder))
        if self.ranks.rank != 0:
            return None
        return self.publish(self.version)

    # ---- process loop --------------------------------------------------------------------

    def run(self, channel: Channel) -> None:
        """Serve Train messages until Shutdown or the end of the pipe."""
        while True:
            msg = channel.recv()
            match msg:
                case wire.Train():
                    channel.send(self.train(msg))
                case wire.Save():
                    channel.send(self.save(msg))
                case wire.Shutdown():
                    self.ranks.close()
                    return
                case _ if msg is EOF:
                    return
                case _:
                    raise wire.WireError(f"trainer: unexpected {type(msg).__name__}")


def build(init: wire.Init) -> Trainer:
    """serve()'s factory: give the process its cores/device, then load the policy."""
    settings = Settings.from_dict(init.settings)
    configure_torch(settings.trainer.device, settings.trainer.threads)
    torch.manual_seed(settings.run.seed)
    trainer = Trainer(settings, init.shm_dir, ranks=Ranks.join(init, settings.trainer.device))
    if init.resume:
        trainer.resume(init.resume)
    return trainer


def main() -> int:
    return serve("trainer", build)


if __name__ == "__main__":
    raise SystemExit(main())
