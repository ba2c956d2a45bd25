"""Micro-batch tensors: the layout in which the trainer computes a few samples' completion tokens.

`workers/trainer/packing.py` decides which samples share a micro-batch (counting tokens);
this module builds their tensors. Two layouts, both giving every completion token
the log-prob of the plain per-sequence forward:

Unshared (trainer.share_prompts off): one row per sample, prompt + completion,
right-padded to the longest row; the model's own causal mask and a 2D padding mask.

    row 0   p p p p c c c . .        [n, L]; cost n x L
    row 1   p p p p c c c c c

Packed (share_prompts on): the samples of a GRPO group share one prompt. Each group
becomes one row: its prompt once, then every completion but its last token (the
last predicts nothing), one after another. Position ids restart after the prompt
for each completion, and a 4D mask lets each completion see the prompt and its own
past only, so every completion is computed exactly as if it ran alone after the
prompt, and the gradient of each flows back into the one prompt pass:

    row       P0 P1 P2 | a0 a1 a2 | b0 | c0 c1 c2 c3        (a: 4 tokens, b: 2, c: 5)
    position   0  1  2 |  3  4  5 |  3 |  3  4  5  6
    a1 sees   P0 P1 P2    a0 a1      (not b, not c)

    completion a's token 0 is predicted at P2, its token j at a_{j-1}

A group costs its real tokens, P + sum(len(c) - 1), where rows padded to the
group's longest reply cost P + G x (longest - 1) even with the prompt's KV shared:
1.6-3x more for a run's replies of 2 to 64 tokens. Rows are right-padded to the
longest group of the micro-batch; a pad position sees itself (a query that sees
nothing would make the softmax NaN, and NaN times a zero gradient is still NaN).

Why one group per row: the mask is dense, and on CPU attention with a mask pays
for every query-key pair of a row, quadratic in its length. Two groups per row
save the padding between groups and pay it back in attention
(docs/benchmarks/components.md gives the measurement); one is simpler.

Both layouts carry `gather` [T]: for each completion token, the flat position in
[n x L] whose hidden state predicts it, so the LM head runs on those T positions only.

A sample with a `loss_mask` (a multi-turn episode: replies, and tool turns between them) has
every completion token in its row (the context the later replies were sampled after), but only
the trained ones (mask 1) among the targets: a tool turn's tokens are never predicted, so they
get no loss and no gradient, and their placeholder logprobs and versions are never read. T
counts trained tokens only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from areal_aio import wire
from areal_aio.workers.trainer.packing import micro_batches, split

PACKED_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take a custom 4D mask as given (transformers returns a 4D
mask as-is); flash-attention kernels take no mask and would compute another function."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Padded inputs of a few samples and where their completion tokens are predicted.

    input_ids [n, L]: one row per sample (unshared) or per group (packed).
    attention_mask: [n, L] padding mask (unshared; the model adds causality), or
        [n, 1, L, L] bool, True where a query (dim 2) may see a key (dim 3) (packed).
    position_ids [n, L] (packed) or None (the model counts from 0).
    gather [T]: flat positions in [n * L] whose hidden state predicts each target.
    targets, behav, adv [T]: the completion tokens of samples[index], sample after sample.
    weight [T] (trainer.loss_agg other than token): each token's weight in its mini-batch's
        loss, its sequence's (losses.sequence_weights); None: the token mean of the mini-batch.
    """

    index: list[int]  # sample indices in the batch, in the order of the targets
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None
    gather: torch.Tensor
    targets: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    padded: bool = False  # unshared: some row is shorter than L (known here, on the host)
    weight: torch.Tensor | None = None  # [T] each token's weight in the mini-batch's loss; None: 1 / its tokens
    written: bool = False  # some sample holds tokens a guide wrote (their behav NaN: behav_from_prox)

    @property
    def tokens(self) -> int:
        """Completion tokens: what the loss is computed on."""
        return int(self.targets.numel())

    @property
    def computed(self) -> int:
        """Token positions the model runs on, padding included: what the micro-batch costs."""
        return int(self.input_ids.numel())

    @property
    def shared(self) -> bool:
        """True for the packed layout (each group's prompt computed once)."""
        return self.attention_mask.dim() == 4


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
        if s.loss_mask is not None and len(s.loss_mask) != len(s.completion_ids):
            raise ValueError(f"sample {i}: {len(s.completion_ids)} completion ids, "
                             f"{len(s.loss_mask)} loss mask entries")
        if not 0 <= s.written <= len(s.completion_ids):
            raise ValueError(f"sample {i}: {s.written} written tokens of {len(s.completion_ids)}")


def trained(s: wire.TrainSample) -> list[int]:
    """Positions in s.completion_ids that the loss takes (loss_mask 1; all without a mask)."""
    if s.loss_mask is None:
        return list(range(len(s.completion_ids)))
    return [j for j, m in enumerate(s.loss_mask) if m]


def trained_count(s: wire.TrainSample) -> int:
    return len(s.completion_ids) if s.loss_mask is None else sum(1 for m in s.loss_mask if m)


def prompt_groups(samples: list[wire.TrainSample], lo: int, hi: int) -> list[list[int]]:
    """Indices lo..hi-1 grouped by (group id, prompt), in order of first appearance."""
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in range(lo, hi):
        groups.setdefault((samples[i].group, tuple(samples[i].prompt_ids)), []).append(i)
    return list(groups.values())


def group_row_length(samples: list[wire.TrainSample], group: list[int]) -> int:
    """Positions a group takes in the packed layout: its prompt once, each completion but its last token."""
    return len(samples[group[0]].prompt_ids) + sum(
        max(len(samples[i].completion_ids) - 1, 0) for i in group)


def _flat_targets(samples: list[wire.TrainSample], index: list[int], adv: torch.Tensor,
                  device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """targets, behav, per-token adv [T] of samples[index]'s trained tokens, sample after sample;
    a written token's behav is NaN (no sampler drew it): `behav_from_prox` fills it in."""
    targets, behav, tok_adv = [], [], []
    for i in index:
        s = samples[i]
        keep = trained(s)
        targets.extend(s.completion_ids[j] for j in keep)
        first_written = len(s.completion_ids) - s.written
        behav.extend(s.logprobs[j] if j < first_written else math.nan for j in keep)
        tok_adv.extend([float(adv[i])] * len(keep))
    return (torch.tensor(targets, dtype=torch.long, device=device),
            torch.tensor(behav, dtype=torch.float32, device=device),
            torch.tensor(tok_adv, dtype=torch.float32, device=device))


def behav_from_prox(mb: MicroBatch, prox: torch.Tensor) -> None:
    """A guided member's written tokens (behav NaN) take pi_prox as their behaviour log-prob, in
    place: importance weight 1, so decoupled PPO trains them as the policy's own. Only in a
    micro-batch that holds some (`mb.written`, known when it was built)."""
    if mb.written:  # known on the host: no device read per micro-batch
        mb.behav.copy_(torch.where(torch.isnan(mb.behav), prox.to(mb.behav.dtype), mb.behav))


def _right_padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """[len(rows), longest row (at least 1)]: each row left-aligned, `fill` after."""
    out = torch.full((len(rows), max(1, *map(len, rows))), fill, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def build_micro_batch(samples: list[wire.TrainSample], index: list[int], adv: torch.Tensor,
                      pad_id: int, device: str) -> MicroBatch:
    """Unshared layout of samples[index]; adv [B] is per sequence of the whole batch."""
    rows = [samples[i].prompt_ids + samples[i].completion_ids for i in index]
    input_ids = _right_padded(rows, pad_id)
    width = input_ids.shape[1]
    attention_mask = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()
    gather = []
    for row, i in enumerate(index):  # position p-1+j predicts completion token j
        p = len(samples[i].prompt_ids)
        gather.extend(row * width + p - 1 + j for j in trained(samples[i]))
    return MicroBatch(list(index), input_ids.to(device), attention_mask.to(device), None,
                      torch.tensor(gather, dtype=torch.long, device=device),
                      *_flat_targets(samples, index, adv, device),
                      padded=any(len(r) < width for r in rows), written=any(samples[i].written for i in index))


def build_packed_micro_batch(samples: list[wire.TrainSample], groups: list[list[int]],
                             adv: torch.Tensor, pad_id: int, device: str) -> MicroBatch:
    """Packed layout (module docstring) of `groups` (lists of sample indices with one prompt
    each): one row per group, its prompt and then its completions but their last tokens."""
    ids, pos, branch = [], [], []  # per row: token, position id, 0 (prompt) | k (completion k)
    gather: list[tuple[int, int]] = []  # (row, column) predicting each target, in target order
    index: list[int] = []
    for r, group in enumerate(groups):
        prompt = samples[group[0]].prompt_ids
        r_ids, r_pos, r_branch = list(prompt), list(range(len(prompt))), [0] * len(prompt)
        for k, i in enumerate(group, start=1):
            body = samples[i].completion_ids[:-1]  # the last token predicts nothing
            # token 0 from the prompt's last, token j from body[j-1]; trained tokens only
            at = [len(prompt) - 1, *(len(r_ids) + j for j in range(len(body)))]
            gather += [(r, at[j]) for j in trained(samples[i])]
            index.append(i)
            r_ids += body
            r_pos += range(len(prompt), len(prompt) + len(body))
            r_branch += [k] * len(body)
        ids.append(r_ids)
        pos.append(r_pos)
        branch.append(r_branch)
    input_ids = _right_padded(ids, pad_id)  # [n, L]
    width = input_ids.shape[1]
    col = torch.arange(width)
    real = col < torch.tensor([len(r) for r in ids])[:, None]  # [n, L]
    branch_t = _right_padded(branch, 0)
    q_br, k_br = branch_t[:, :, None], branch_t[:, None, :]  # [n, L, 1] queries, [n, 1, L] keys
    sees = (real[:, :, None] & real[:, None, :]  # [n, L, L]: query row, key column
            & (col[None, :] <= col[:, None]) & ((k_br == 0) | (k_br == q_br)))
    sees |= torch.eye(width, dtype=torch.bool)  # a pad position sees itself (no empty softmax)
    flat = torch.tensor([r * width + c for r, c in gather], dtype=torch.long)
    return MicroBatch(index, input_ids.to(device), sees[:, None].to(device),
                      _right_padded(pos, 0).to(device), flat.to(device),
                      *_flat_targets(samples, index, adv, device), written=any(samples[i].written for i in index))


def plan_micro_batches(samples: list[wire.TrainSample], lo: int, hi: int, adv: torch.Tensor, *,
                       packed: bool, max_tokens: int, pad_id: int, device: str,
                       part: int = 0, parts: int = 1, weight: torch.Tensor | None = None) -> list[MicroBatch]:
    """samples[lo:hi] in micro-batches of at most `max_tokens` computed positions (padding
    included; one row over the budget travels alone). Packed: one group per row, groups whole.

    `parts` > 1 (a data-parallel trainer's ranks): the rows are first dealt out by the positions
    they compute (packing.split, the same on every rank), and only part `part`'s rows are
    planned, so each rank builds and computes its own share, however few micro-batches the
    budget makes of the whole. `weight` [B]: each sample's weight per token (MicroBatch.weight)."""
    if packed:
        rows = prompt_groups(samples, lo, hi)
        lengths = [group_row_length(samples, g) for g in rows]
    else:
        rows = [[i] for i in range(lo, hi)]
        lengths = [len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in range(lo, hi)]
    if parts > 1:
        mine = split(lengths, parts)[part]
        rows, lengths = [rows[k] for k in mine], [lengths[k] for k in mine]
    if packed:
        built = [build_packed_micro_batch(samples, [rows[k] for k in mb], adv, pad_id, device)
                 for mb in micro_batches(lengths, max_tokens)]
    else:
        built = [build_micro_batch(samples, [rows[k][0] for k in mb], adv, pad_id, device)
                 for mb in micro_batches(lengths, max_tokens)]
    if weight is None:
        return built
    return [dataclasses.replace(mb, weight=torch.repeat_interleave(
        weight[mb.index].to(torch.float32), torch.tensor([len(trained(samples[i])) for i in mb.index])).to(device))
        for mb in built]
