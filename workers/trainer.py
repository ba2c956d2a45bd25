"""The trainer worker: holds the trainable policy and its optimizer, takes one update per Train.

    Train(step, version, samples)                        (version must be ours)
      |  advantages per sequence (grpo | drgrpo | batch)            losses.advantages
      |  split into `minibatches`, each into token-budget micro-batches  packing
      |  prox logp: this version's weights, same micro-batches; the first
      |      mini-batch reads it off its own forward (the weights have not moved
      |      yet), the others take a no-grad pass before any step
      |      (and ref logp from a frozen copy of v0 when kl_ref = "ref")
      |  per mini-batch: forward micro-batches, token losses, sum / tokens,
      |      backward (grads accumulate), clip grad norm, AdamW step
      v  publish v<version+1> in the rollout dtype, version += 1
    Trained(step, version + 1, path, stats)

Run as `python -m workers.trainer` (workers.common.serve speaks the pipe), or
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
group share one prompt, often longer than their completions. Each group's prompt
runs through the model once and its KV is repeated for the group's rows, which
then run only their completions on it; the gradient of every completion flows
back through the repeated KV into the one prompt pass. The result equals the
unshared forward (a test checks log-probs and gradients); the trainer does
about (P + G*C) / (G*(P + C)) of the token work, ~1/3 for 50-token prompts,
groups of 8 and 15-token replies. Measured (bench/train_step.py, SmolLM2-135M, 32
samples in groups of 8, bf16): 2.75x faster on one CPU core; 1.35x slower on an
H100, where a 135M model is kernel-launch-bound and the second pass adds launches.

Stats (all plain floats/ints, token means unless named otherwise): loss,
entropy, clip_frac, ratio_min/mean/max, behav_w_min/mean/max (pi_prox /
pi_behav), capped_frac, grad_norm (mean pre-clip norm over mini-batches), kl
(k3, only when kl_coef > 0), tokens, seqs, seconds, prox_s (the no-grad pi_prox
pass of mini-batches after the first: 0 with one), publish_s,
mismatch_kl (k3 KL(behav || prox) over tokens sampled by exactly this version;
None when there are none), reward_mean, adv_abs_mean.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from areal_aio import wire
from areal_aio.weight_store import WeightStore
from workers import losses
from workers.common import EOF, Channel, configure_torch, serve
from workers.models import load_model
from workers.packing import group_micro_batches, micro_batches

HEAD_CHECK_ATOL = 1e-4
"""Chunked head vs the model's own logits at init: fp32 agreement well inside this means the
model's logits are exactly lm_head(last hidden) (no scaling we do not know about)."""


@dataclass(slots=True)
class MicroBatch:
    """Padded inputs of a few sequences and where their completion tokens sit.

    Unshared (each row is prompt + completion):
        input_ids, attention_mask, select: [n, L]; select marks the positions whose
        logits predict a completion token (position p-1+j predicts completion token j).
    Shared (share_prompts: each group's prompt runs once, its completions on that KV):
        prompt_ids, prompt_mask: [g, P] right-padded prompts; prompt_last [g]: the
        column of each prompt's last token; row_group [n]: the prompt of each row;
        input_ids [n, C] right-padded completions; attention_mask [n, P + C] (the row's
        prompt mask, then its completion mask); position_ids [n, C]; select [n, C]: the
        completion tokens, whose logits come from the previous position (the prompt's
        last token for j = 0).
    targets, behav, adv: [T] with T = select.sum(), in row-major order of select.
    """

    index: list[int]  # sample indices in the batch, one per row
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    select: torch.Tensor
    targets: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    prompt_last: torch.Tensor | None = None
    row_group: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def shared(self) -> bool:
        return self.prompt_ids is not None


def _flat_targets(samples: list[wire.TrainSample], index: list[int], adv: torch.Tensor,
                  device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """targets, behav, per-token adv [T] of samples[index], row after row."""
    targets, behav, tok_adv = [], [], []
    for i in index:
        s = samples[i]
        targets.extend(s.completion_ids)
        behav.extend(s.logprobs)
        tok_adv.extend([float(adv[i])] * len(s.completion_ids))
    return (torch.tensor(targets, dtype=torch.long, device=device),
            torch.tensor(behav, dtype=torch.float32, device=device),
            torch.tensor(tok_adv, dtype=torch.float32, device=device))


def _right_padded(rows: list[list[int]], pad_id: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [len(rows), max(width, longest row)]: each row left-aligned, pad_id after."""
    width = max(width, *map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[r, :len(row)] = 1
    return ids, mask


def build_micro_batch(samples: list[wire.TrainSample], index: list[int], adv: torch.Tensor,
                      pad_id: int, device: str) -> MicroBatch:
    """Right-padded tensors of samples[index]; adv [B] is per sequence of the whole batch."""
    input_ids, attention_mask = _right_padded(
        [samples[i].prompt_ids + samples[i].completion_ids for i in index], pad_id)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, i in enumerate(index):
        p, c = len(samples[i].prompt_ids), len(samples[i].completion_ids)
        select[row, p - 1:p + c - 1] = True
    return MicroBatch(list(index), input_ids.to(device), attention_mask.to(device),
                      select.to(device), *_flat_targets(samples, index, adv, device))


def build_shared_micro_batch(samples: list[wire.TrainSample], groups: list[list[int]],
                             adv: torch.Tensor, pad_id: int, device: str) -> MicroBatch:
    """Tensors of `groups` (lists of sample indices with one prompt each) for the shared
    forward: prompts once, completions on their prompt's KV (see MicroBatch)."""
    prompts = [samples[g[0]].prompt_ids for g in groups]
    index = [i for g in groups for i in g]
    prompt_ids, prompt_mask = _right_padded(prompts, pad_id)
    row_group = torch.tensor([g for g, members in enumerate(groups) for _ in members], dtype=torch.long)
    input_ids, completion_mask = _right_padded([samples[i].completion_ids for i in index], pad_id, width=1)
    prompt_lengths = torch.tensor([len(samples[i].prompt_ids) for i in index])
    position_ids = prompt_lengths[:, None] + torch.arange(input_ids.shape[1])  # [n, C]
    attention_mask = torch.cat([prompt_mask.index_select(0, row_group), completion_mask], dim=1)
    return MicroBatch(
        index, input_ids.to(device), attention_mask.to(device),
        completion_mask.bool().to(device), *_flat_targets(samples, index, adv, device),
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
        prompt_last=torch.tensor([len(p) - 1 for p in prompts], device=device),
        row_group=row_group.to(device), position_ids=position_ids.to(device))


def prompt_groups(samples: list[wire.TrainSample], lo: int, hi: int) -> list[list[int]]:
    """Indices lo..hi-1 grouped by (group id, prompt), in order of first appearance."""
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in range(lo, hi):
        groups.setdefault((samples[i].group, tuple(samples[i].prompt_ids)), []).append(i)
    return list(groups.values())


def check_samples(samples: list[wire.TrainSample]) -> None:
    """Reject malformed samples before any weight changes (a clear error, not a shape error)."""
    if not samples:
        raise ValueError("Train with no samples")
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {i}: empty prompt (the first completion token needs a context)")
        if not (len(s.completion_ids) == len(s.logprobs) == len(s.versions)):
            raise ValueError(f"sample {i}: {len(s.completion_ids)} completion ids, "
                             f"{len(s.logprobs)} logprobs, {len(s.versions)} versions")


class _Stats:
    """Running sums over the tokens of one update."""

    def __init__(self) -> None:
        self.tokens = 0
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.entropy = self.clipped = self.kl = self.ratio_sum = 0.0
        self.ratio_min, self.ratio_max = math.inf, -math.inf

    def add(self, st: losses.TokenStats, entropy: torch.Tensor, kl: torch.Tensor | None) -> None:
        if st.ratio.numel() == 0:
            return
        self.tokens += st.ratio.numel()
        self.entropy += float(entropy.sum())
        self.clipped += float(st.clipped.sum())
        self.ratio_sum += float(st.ratio.sum())
        self.ratio_min = min(self.ratio_min, float(st.ratio.min()))
        self.ratio_max = max(self.ratio_max, float(st.ratio.max()))
        if kl is not None:
            self.kl += float(kl.detach().sum())


def _adamw(params: list[torch.Tensor], **kw: float) -> torch.optim.AdamW:
    """AdamW, fused where this torch build has it for the parameters' device: one kernel over
    all parameters instead of a loop over tensors."""
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, **kw)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


class Trainer:
    """The trainable policy, its optimizer and the weight store; one `train` call per update."""

    def __init__(self, settings: dict[str, Any], shm_dir: str | Path,
                 model: Any = None, tokenizer: Any = None) -> None:
        """`settings` is Settings.to_dict(); pass `model`/`tokenizer` to skip loading (tests)."""
        if hasattr(settings, "to_dict"):
            settings = settings.to_dict()
        self.cfg = dict(settings["trainer"])
        self.device = self.cfg["device"]
        self.temperature = float(settings["rollout"]["temperature"])
        self.publish_dtype = getattr(torch, settings["rollout"]["dtype"])
        if model is None:
            model, tokenizer = load_model(settings["model"]["path"], seed=settings["run"]["seed"],
                                          dtype="float32", device=self.device)
        self.model = model.float().to(self.device)
        self.model.eval()  # see module docstring: no dropout in an RL update
        self.model.config.use_cache = False
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = _adamw(self.params, lr=self.cfg["lr"], weight_decay=self.cfg["weight_decay"])
        self.ref = None
        if self.cfg["kl_coef"] > 0 and self.cfg["kl_ref"] == "ref":
            self.ref = copy.deepcopy(self.model).requires_grad_(False)  # frozen v0
        if not Path(shm_dir).is_dir():
            raise FileNotFoundError(f"trainer: weight store folder {shm_dir} does not exist "
                                    "(the controller creates it before Init)")
        self.store = WeightStore(shm_dir)
        self.version = 0
        self._fast_head = self._check_head()
        # the shared path takes logits from lm_head(hidden), so it needs the fast head
        share = self.cfg.get("share_prompts", "auto")
        on_cpu = torch.device(self.device).type == "cpu"
        self.share_prompts = self._fast_head and (share == "on" or (share == "auto" and on_cpu))

    # ---- forward -------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if not self.cfg["bf16"]:
            return nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16)

    def _forward(self, model: Any, mb: MicroBatch, fast: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log pi(token) [T] with grad, entropy [T]) at `mb`'s completion tokens, under
        logits / temperature; call inside `_autocast()`."""
        fast = self._fast_head if fast is None else fast
        if fast:
            hidden = self._shared_hidden(model, mb) if mb.shared else model.base_model(
                input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                use_cache=False).last_hidden_state  # [n, L, H]
            head = model.get_output_embeddings().weight  # [V, H]
            on = torch.is_autocast_enabled(torch.device(self.device).type)
            dtype = torch.bfloat16 if on else None  # autocast does not reach a Function's backward
            return losses.token_logprobs(hidden[mb.select], head, mb.targets,  # [T, H] -> [T]
                                         self.temperature, dtype)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       use_cache=False).logits[mb.select]  # [n, L, V] -> [T, V]
        logits = logits.float() / self.temperature
        logp = logits.gather(1, mb.targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        with torch.no_grad():
            return logp, losses.entropy_from_logits(logits)

    @staticmethod
    def _shared_hidden(model: Any, mb: MicroBatch) -> torch.Tensor:
        """Hidden states [n, C, H] whose position j predicts completion token j: the prompts
        run once ([g, P]), their KV is repeated for each row of the group (the gradient of
        every completion flows back into its prompt), the completions run on it."""
        cache = DynamicCache(config=model.config)
        prompt_hidden = model.base_model(input_ids=mb.prompt_ids, attention_mask=mb.prompt_mask,
                                         past_key_values=cache, use_cache=True).last_hidden_state
        for layer in cache.layers:  # [g, kv_heads, P, D] -> [n, kv_heads, P, D]
            layer.keys = layer.keys.index_select(0, mb.row_group)
            layer.values = layer.values.index_select(0, mb.row_group)
        last = prompt_hidden[torch.arange(len(mb.prompt_last), device=mb.prompt_last.device),
                             mb.prompt_last]  # [g, H]
        first = last.index_select(0, mb.row_group)[:, None]  # [n, 1, H]: predicts token 0
        if mb.input_ids.shape[1] == 1:
            return first
        hidden = model.base_model(input_ids=mb.input_ids[:, :-1], attention_mask=mb.attention_mask[:, :-1],
                                  position_ids=mb.position_ids[:, :-1], past_key_values=cache,
                                  use_cache=True).last_hidden_state  # [n, C-1, H]
        return torch.cat([first, hidden], dim=1)

    def _check_head(self) -> bool:
        """True when the logits are exactly lm_head(last hidden) (no bias, softcap or scaling),
        so the chunked head (losses.token_logprobs) may replace the model's own."""
        head = self.model.get_output_embeddings()
        if getattr(head, "bias", None) is not None or getattr(head, "weight", None) is None:
            return False
        ids = torch.tensor([[1, 2, 3, 4]], device=self.device)
        mb = MicroBatch([0], ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool),
                        ids[0], ids[0].float(), ids[0].float())
        with torch.no_grad():
            fast, _ = self._forward(self.model, mb, fast=True)
            full, _ = self._forward(self.model, mb, fast=False)
        return bool(torch.allclose(fast, full, atol=HEAD_CHECK_ATOL))

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch, model: Any = None) -> torch.Tensor:
        """log pi(token) [T] of `mb`'s completion tokens under `model` (default: the policy)."""
        with self._autocast():
            logp, _ = self._forward(self.model if model is None else model, mb)
        return logp.float()

    # ---- one update ----------------------------------------------------------------------

    def _micro_batches(self, samples: list[wire.TrainSample], lo: int, hi: int,
                       adv: torch.Tensor) -> list[MicroBatch]:
        """samples[lo:hi] in token-budget micro-batches: groups whole when prompts are shared."""
        if self.share_prompts:
            groups = prompt_groups(samples, lo, hi)
            packs = group_micro_batches(
                [len(samples[g[0]].prompt_ids) for g in groups],
                [[len(samples[i].completion_ids) for i in g] for g in groups], self.cfg["micro_tokens"])
            return [build_shared_micro_batch(samples, [groups[k] for k in pack], adv, self.pad_id,
                                             self.device) for pack in packs]
        lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in range(lo, hi)]
        return [build_micro_batch(samples, [lo + j for j in mb], adv, self.pad_id, self.device)
                for mb in micro_batches(lengths, self.cfg["micro_tokens"])]


    def train(self, msg: wire.Train) -> wire.Trained:
        """One PPO-family update on msg.samples, then publish v<version+1> and return Trained."""
        t0 = time.perf_counter()
        if msg.version != self.version:
            raise ValueError(f"Train step {msg.step}: controller says version {msg.version}, "
                             f"the trainer holds version {self.version}")
        samples = msg.samples
        check_samples(samples)
        cfg = self.cfg
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        adv = losses.advantages(rewards, groups, cfg["advantage"])  # [B]

        # Mini-batches are consecutive slices (groups stay together when B divides evenly);
        # prox uses the very micro-batches the update uses, so at equal weights the
        # decoupled ratio is exactly 1, even under bf16.
        n_mini = min(cfg["minibatches"], len(samples))
        bounds = [round(k * len(samples) / n_mini) for k in range(n_mini + 1)]
        plan: list[list[MicroBatch]] = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            plan.append(self._micro_batches(samples, lo, hi, adv))

        # pi_prox is this version's policy. The first mini-batch trains on exactly these
        # weights, so its own forward is pi_prox (detached: ratio 1; skipping the second
        # pass made a one-core update 1.22x faster); later mini-batches need theirs before
        # any step.
        t_prox = time.perf_counter()
        prox: dict[int, torch.Tensor] = {}  # id(micro-batch) -> [T]
        ref: dict[int, torch.Tensor] = {}
        for k, mini in enumerate(plan):
            for mb in mini:
                if k > 0:
                    prox[id(mb)] = self.logprobs(mb)
                if self.ref is not None:
                    ref[id(mb)] = self.logprobs(mb, self.ref)
        prox_s = time.perf_counter() - t_prox

        stats = _Stats()
        for k, mini in enumerate(plan):
            total = sum(mb.tokens for mb in mini)
            if total == 0:
                continue
            self.opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for mb in mini:
                if mb.tokens == 0:
                    continue
                with self._autocast():
                    logp, entropy = self._forward(self.model, mb)  # [T], [T]
                if k == 0:  # no step taken yet: this forward is pi_prox
                    prox[id(mb)] = logp.detach().float()
                tok_loss, st = losses.token_loss(
                    logp, mb.behav, prox[id(mb)], mb.adv, objective=cfg["objective"],
                    clip_eps=cfg["clip_eps"], clip_eps_high=cfg["clip_eps_high"],
                    behav_cap=cfg["behav_cap"], cap_mode=cfg["cap_mode"])
                kl = None
                if cfg["kl_coef"] > 0:
                    anchor = ref[id(mb)] if self.ref is not None else mb.behav
                    kl = losses.k3_kl(logp, anchor)
                    tok_loss = tok_loss + cfg["kl_coef"] * kl
                loss = tok_loss.sum() / total  # token-level aggregation over the mini-batch
                loss.backward()
                loss_sum += float(loss.detach())
                stats.add(st, entropy, kl)
                del logp, entropy, tok_loss, loss
            max_norm = cfg["grad_clip"] if cfg["grad_clip"] > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            self.opt.step()
            stats.loss.append(loss_sum)
            stats.grad_norm.append(float(norm))
        self.opt.zero_grad(set_to_none=True)

        t_pub = time.perf_counter()
        path = self.store.publish(self.model, self.version + 1, dtype=self.publish_dtype)
        publish_s = time.perf_counter() - t_pub
        self.version += 1

        out = self._summary(samples, plan, prox, stats, adv, rewards)
        out.update(seconds=time.perf_counter() - t0, prox_s=prox_s, publish_s=publish_s)
        if cfg["kl_coef"] <= 0:
            out.pop("kl")
        return wire.Trained(step=msg.step, version=self.version, path=str(path), stats=out)

    def _summary(self, samples: list[wire.TrainSample], plan: list[list[MicroBatch]],
                 prox: dict[int, torch.Tensor], stats: _Stats, adv: torch.Tensor,
                 rewards: torch.Tensor) -> dict[str, Any]:
        """Plain-number stats of one update (orjson-ready)."""
        cfg = self.cfg
        mbs = [mb for mini in plan for mb in mini if mb.tokens]
        if mbs:
            behav = torch.cat([mb.behav for mb in mbs]).double()
            prox_all = torch.cat([prox[id(mb)] for mb in mbs]).double()
            # version of each token, in the same order as behav/prox
            versions = torch.tensor([v for mb in mbs for i in mb.index for v in samples[i].versions])
        else:
            behav = prox_all = torch.zeros(0, dtype=torch.float64)
            versions = torch.zeros(0, dtype=torch.long)
        w = torch.exp(prox_all - behav)
        capped = (w > cfg["behav_cap"]) if cfg["objective"] == "decoupled_ppo" else torch.zeros_like(w, dtype=torch.bool)
        own = versions == self.version - 1  # tokens sampled by the weights prox was computed with
        r = (prox_all - behav)[own]
        n = stats.tokens
        return {
            "loss": _mean(stats.loss),
            "entropy": stats.entropy / n if n else 0.0,
            "clip_frac": stats.clipped / n if n else 0.0,
            "ratio_min": stats.ratio_min if n else 1.0,
            "ratio_mean": stats.ratio_sum / n if n else 1.0,
            "ratio_max": stats.ratio_max if n else 1.0,
            "behav_w_min": float(w.min()) if w.numel() else 1.0,
            "behav_w_mean": float(w.mean()) if w.numel() else 1.0,
            "behav_w_max": float(w.max()) if w.numel() else 1.0,
            "capped_frac": float(capped.double().mean()) if w.numel() else 0.0,
            "grad_norm": _mean(stats.grad_norm),
            "kl": stats.kl / n if n else 0.0,
            "tokens": int(n),
            "seqs": len(samples),
            "mismatch_kl": float((torch.expm1(r) - r).mean()) if r.numel() else None,
            "reward_mean": float(rewards.mean()),
            "adv_abs_mean": float(adv.abs().mean()),
        }

    # ---- process loop --------------------------------------------------------------------

    def run(self, channel: Channel) -> None:
        """Serve Train messages until Shutdown or the end of the pipe."""
        while True:
            msg = channel.recv()
            match msg:
                case wire.Train():
                    channel.send(self.train(msg))
                case wire.Shutdown():
                    return
                case _ if msg is EOF:
                    return
                case _:
                    raise wire.WireError(f"trainer: unexpected {type(msg).__name__}")


def build(init: wire.Init) -> Trainer:
    """serve()'s factory: give the process its cores/device, then load the policy."""
    t = init.settings["trainer"]
    configure_torch(t["device"], t["threads"])
    torch.manual_seed(init.settings["run"]["seed"])
    return Trainer(init.settings, init.shm_dir)


def main() -> int:
    return serve("trainer", build)


if __name__ == "__main__":
    raise SystemExit(main())
