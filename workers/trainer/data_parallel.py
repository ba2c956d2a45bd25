"""Data parallelism for the trainer: the ranks, the split of a step's micro-batches, the reductions.

With `trainer.devices` the trainer runs as N processes, torch.distributed ranks (gloo on the
CPU, NCCL on GPUs), each started by the controller like a single trainer (areal_aio.fleet.trainer_ranks):

    every rank: the whole Train -> advantages (of the whole batch), mini-batches
      |  each mini-batch's rows (a packed group, or a sample) dealt out by the positions
      |      they compute (packing.split, the same on every rank); each rank plans and
      |      computes micro-batches of its own rows only (microbatch.plan_micro_batches)
      |  loss = sum / GLOBAL token count of the mini-batch
      |  `all_reduce_grads`: one flat SUM per optimizer step (a rank with nothing adds zeros)
      |  clip, AdamW: the same numbers on every rank, so the weights stay the same
      v  `totals`: the stats' sums, minima and maxima over all ranks; rank 0 publishes

Summing gradients of losses that are each divided by the mini-batch's global token count
gives exactly one rank's gradient (the token-level normalisation is unchanged); averaging
them would divide it by N.

Replicated weights (DDP semantics), not sharded ones (FSDP2 `fully_shard`): the models this
trains fit on one device, the optimizer step is a small share of a step, and on gloo a
sharded step adds a gather of the weights before every forward to the one reduction.
Not measured: a sharded trainer would matter for models that do not fit, which this
project does not train.
"""

from __future__ import annotations

import datetime

import torch

from areal_aio import wire

DIST_TIMEOUT_S = 600.0
"""How long the start's rendezvous (or a collective) waits for the other ranks: as long as the
controller waits for a worker to be ready (client.READY_TIMEOUT_S), since a rank may start
that much later than rank 0 (a Ray actor waiting for resources). A rank that dies ends its
pipe at once and the controller stops the rest, so this only bounds a hang nobody else sees."""


class Ranks:
    """This process's place among the trainer's ranks; with world 1 every method is a no-op."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world

    @classmethod
    def join(cls, init: wire.Init, device: str) -> Ranks:
        """Join the process group of Init.dist_addr (when Init.world > 1)."""
        if init.world > 1:
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
            torch.distributed.init_process_group(
                backend, init_method=init.dist_addr, rank=init.rank, world_size=init.world,
                timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
        return cls(init.rank, init.world)

    def broadcast(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's `params` (the start: one set of weights)."""
        if self.world == 1:
            return
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        torch.distributed.broadcast(flat, src=0)
        for p, chunk in zip(params, _views(flat, params), strict=True):
            p.data.copy_(chunk)

    def all_reduce_grads(self, params: list[torch.Tensor]) -> None:
        """Sum the ranks' gradients in one flat reduction. A parameter keeps no gradient (None,
        which AdamW skips) only when it has none on every rank, as with one rank."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        has = torch.tensor([p.grad is not None for p in params], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [has])
        torch.distributed.all_reduce(flat)
        held = flat[-len(params):].tolist()
        for p, chunk, h in zip(params, _views(flat, params), held, strict=True):
            p.grad = chunk if h > 0 else None

    def totals(self, sums: dict[str, torch.Tensor], mins: dict[str, torch.Tensor],
               maxs: dict[str, torch.Tensor]) -> dict[str, float]:
        """0-d tensors summed, minimised and maximised over the ranks, read in one go."""
        device = next(iter(sums.values())).device
        summed = torch.stack([t.to(device, torch.float64) for t in sums.values()])
        top = torch.stack([t.to(device, torch.float64) for t in maxs.values()]
                          + [-t.to(device, torch.float64) for t in mins.values()])
        if self.world > 1:
            torch.distributed.all_reduce(summed)
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
        values = torch.cat([summed, top]).tolist()
        n, m = len(sums), len(maxs)
        out = dict(zip(sums, values[:n], strict=True))
        out.update(zip(maxs, values[n:n + m], strict=True))
        out.update((key, -v) for key, v in zip(mins, values[n + m:], strict=True))
        return out

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's [p.shape] view of `flat` (the parameters one after another)."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views
