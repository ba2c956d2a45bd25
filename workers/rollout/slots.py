"""The engine's static-shape decode path: a fixed number of slots, a preallocated KV cache indexed
by slot, and on a GPU each decode step replayed from a captured CUDA graph.

    Slots(capacity)           rows live in slots 0..capacity-1; a new row takes the lowest free one
      cache                   per layer keys/values [capacity, kv_heads, columns, head_dim]: a slot's
                              tokens sit left-aligned in columns 0..pos-1, its pending token goes to
                              column pos at the next step (position id = column: no padding, no mask
                              to carry; a step attends to columns 0..pos)
      merge(fresh)            copy a prefilled _Batch (right-aligned, holes masked) into free slots
      keep(rows)              free every other slot (nothing moves)
      step()                  one decode step of slots 0..width-1 (width: the power of two, at most
                              capacity, past the highest slot in use), all in place

A step reads and writes only tensors whose addresses never change (inputs, KV, sampling state,
outputs), so on a GPU it is captured once per (width, sampling mode) and then replayed: one
launch instead of one per kernel, which is what a small model's decode step is made of. Rows
join and leave, weights change (loaded in place) and requests are interrupted between steps,
as on the dynamic path; the captured graphs are dropped when the cache grows (a longer row
than any before) or when a weight load put a parameter at a new address.

The sampling is the dynamic path's (`sampling.sample` modes: greedy, sampled, sampled with a
nucleus), so at temperature 0 both paths pick the same tokens; where two rows' float sums
differ in the last bits the batch shape is to blame, as between any two batchings.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from areal_aio.workers.rollout.sampling import sample

COLUMN_QUANTUM = 64
"""The cache's column count is a power of two of at least this: grown (and graphs recaptured)
only when a row's prompt + max_new_tokens passes it."""
WARMUP_STEPS = 2
"""Eager steps run on a side stream before a capture (cuBLAS/cuDNN pick their kernels, the
allocator warms up), as torch.cuda.graphs asks."""


def slots_problem(model: Any) -> str | None:
    """Why the static path cannot run `model` (None: it can): every layer full attention through
    sdpa or eager, the attention implementations that take the [B, 1, 1, T] mask as given."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        return f"attention {attention!r} (static decode takes sdpa or eager)"
    cache = DynamicCache(config=model.config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return "a layer that is not plain full attention (sliding window, state space)"
    return None


class _SlotLayer(DynamicLayer):
    """One layer's keys/values [S, H, C, D]; a decode step writes row i's new K/V at column at[i]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, at: list[torch.Tensor]) -> None:
        super().__init__()
        self.keys, self.values, self.at = keys, values, at  # at: [row index [W], column [W]], set per step
        self.is_initialized, self.dtype, self.device = True, keys.dtype, keys.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = self.at
        width = rows.shape[0]
        keys, values = self.keys[:width], self.values[:width]
        keys[rows, :, cols] = key_states[:, :, 0]
        values[rows, :, cols] = value_states[:, :, 0]
        return keys, values


class Slots:
    """The running rows in fixed slots, their KV cache and sampling state (module docstring).

    Device tensors, one entry per slot: pos (tokens cached = column of the pending token),
    pending, seed, count, scale, top_p, greedy (a free slot: greedy at column 0, harmless);
    token/logprob: what the last step drew. Host: seqs (slot -> _Seq or None), drawn (the
    (token, logprob) of each step since the host looked, cut to the slots in use)."""

    def __init__(self, model: Any, capacity: int, cache_kw: str, use_graphs: bool) -> None:
        self.model, self.capacity, self.cache_kw = model, capacity, cache_kw
        self.device = next(model.parameters()).device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.slot_seqs: list[Any] = [None] * capacity
        self.cache: DynamicCache | None = None
        self.columns = 0
        self.drawn: list[tuple[torch.Tensor, torch.Tensor]] = []
        d = self.device
        self.pos = torch.zeros(capacity, dtype=torch.long, device=d)
        self.pending = torch.zeros(capacity, dtype=torch.long, device=d)
        self.seed = torch.zeros(capacity, dtype=torch.long, device=d)
        self.count = torch.zeros(capacity, dtype=torch.long, device=d)
        self.scale = torch.ones(capacity, dtype=torch.float32, device=d)
        self.top_p = torch.ones(capacity, dtype=torch.float32, device=d)
        self.greedy = torch.ones(capacity, dtype=torch.bool, device=d)
        self.token = torch.zeros(capacity, dtype=torch.long, device=d)
        self.logprob = torch.zeros(capacity, dtype=torch.float32, device=d)
        self.arange = torch.arange(capacity, device=d)
        self.graphs: dict[tuple[int, str], Any] = {}
        self.param_ptrs: tuple[int, ...] = ()
        self.graph_error: str | None = None  # why capture failed once (then eager steps)

    # ------------------------------------------------------------------ the _Batch interface

    @property
    def seqs(self) -> list[Any]:
        """The running rows' _Seqs, in slot order."""
        return [s for s in self.slot_seqs if s is not None]

    def __len__(self) -> int:
        return sum(s is not None for s in self.slot_seqs)

    def used(self) -> list[int]:
        """The slots in use, in order (row i of `seqs` is in slot used()[i])."""
        return [i for i, s in enumerate(self.slot_seqs) if s is not None]

    def keep(self, rows: list[int]) -> None:
        """Keep rows `rows` of `seqs` (indices into it); free the others' slots, which go back to
        column 0 (a free slot inside a step's width decodes too, its results unread)."""
        used = self.used()
        kept = {used[r] for r in rows}
        freed = [slot for slot in used if slot not in kept]
        for slot in freed:
            self.slot_seqs[slot] = None
        if freed:
            self.pos.index_fill_(0, torch.tensor(freed, device=self.device), 0)

    def merge(self, fresh: Any) -> None:
        """Put the rows of a prefilled _Batch into free slots: each row's real columns (mask True)
        left-aligned, its sampling state alongside."""
        if not fresh.seqs:
            return
        free = [i for i, s in enumerate(self.slot_seqs) if s is None][:len(fresh.seqs)]
        need = max(len(s.req.prompt_ids) + s.req.max_new_tokens for s in fresh.seqs)
        self._fit(fresh.cache, need)
        index = torch.tensor(free, dtype=torch.long, device=self.device)
        for name in fresh.ROWS:  # _Batch.ROWS: the per-row tensors both layouts keep
            getattr(self, name).index_copy_(0, index, getattr(fresh, name).to(getattr(self, name).dtype))
        # each row's real columns first, in order (a stable sort of "is padding"); a shorter row
        # copies some padding past its length too, where no step looks before writing
        width = max(len(s.ids) - 1 for s in fresh.seqs)  # the pending token is not cached yet
        src = torch.sort((~fresh.mask).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        for mine, theirs in zip(self.cache.layers, fresh.cache.layers, strict=True):
            for buffer, part in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                at = src[:, None, :, None].expand(-1, part.shape[1], -1, part.shape[3])
                buffer[:, :, :width].index_copy_(0, index, part.gather(2, at))
        for slot, seq in zip(free, fresh.seqs, strict=True):
            self.slot_seqs[slot] = seq

    def _fit(self, like: DynamicCache, need: int) -> None:
        """Allocate (or grow) the cache to hold `need` columns per slot, in `like`'s layout."""
        columns = max(COLUMN_QUANTUM, 1 << (need - 1).bit_length())
        if columns <= self.columns:
            return
        at = [self.arange, self.pos]
        layers = []
        for i, layer in enumerate(like.layers):
            _, h, _, dk = layer.keys.shape
            keys = layer.keys.new_zeros(self.capacity, h, columns, dk)
            values = layer.values.new_zeros(self.capacity, h, columns, layer.values.shape[-1])
            if self.cache is not None:  # grow: keep what the running rows cached
                keys[:, :, :self.columns] = self.cache.layers[i].keys
                values[:, :, :self.columns] = self.cache.layers[i].values
            layers.append(_SlotLayer(keys, values, at))
        self.cache = DynamicCache(config=self.model.config)
        self.cache.layers = layers
        self.columns = columns
        self.at = at
        self.graphs.clear()  # they read the old buffers

    # ------------------------------------------------------------------ decoding

    def step(self, mode: str) -> None:
        """One decode step of every slot up to the highest in use (`mode`: Engine._sample's)."""
        width = self._width()
        if self.use_graphs and self.graph_error is None:
            graph = self._graph(width, mode)
            if graph is not None:
                graph.replay()
                self._record(width)
                return
        self._step(width, mode)
        self._record(width)

    def _width(self) -> int:
        """Slots a step computes: a power of two past the highest slot in use (a few shapes only)."""
        top = max(self.used()) + 1
        return min(self.capacity, 1 << (top - 1).bit_length())

    def _record(self, width: int) -> None:
        self.drawn.append((self.token[:width].clone(), self.logprob[:width].clone()))

    def _step(self, width: int, mode: str) -> None:
        """The decode step proper, in place on the slot tensors (what a graph captures)."""
        pos = self.pos[:width].clamp(max=self.columns - 1)  # a free slot's count may run past the end
        self.at[0], self.at[1] = self.arange[:width], pos
        cols = torch.arange(self.columns, device=self.device)
        mask = (cols[None, :] <= pos[:, None])[:, None, None, :]
        if getattr(self.model.config, "_attn_implementation", None) == "eager":
            dtype = self.model.dtype
            mask = torch.where(mask, torch.zeros((), dtype=dtype, device=self.device), torch.finfo(dtype).min)
        out = self.model(input_ids=self.pending[:width, None], attention_mask=mask,
                         position_ids=pos[:, None], **{self.cache_kw: self.cache}, use_cache=True,
                         logits_to_keep=1)
        token, logprob = sample(out.logits[:, -1].float(), mode, self.scale[:width],
                                self.top_p[:width], self.greedy[:width], self.seed[:width], self.count[:width])
        self.token[:width].copy_(token)
        self.logprob[:width].copy_(logprob)
        self.pending[:width].copy_(token)
        self.pos[:width].add_(1)
        self.count[:width].add_(1)

    def _graph(self, width: int, mode: str) -> Any:
        """The captured step for (width, mode), capturing it the first time; None if capture fails
        (graph_error says why; the steps then run eagerly)."""
        if not self.graphs:
            self.param_ptrs = self._param_ptrs()
        key = (width, mode)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(width, mode)
            except Exception as exc:  # noqa: BLE001 - a model whose forward syncs with the host
                self.graph_error = f"{type(exc).__name__}: {exc}"
                return None
        return self.graphs[key]

    def _capture(self, width: int, mode: str) -> Any:
        """Warm up on a side stream, then capture one step. The warm-up steps run for real, so the
        row state they advance (pos, pending, count) is put back; the KV they write sits at the
        column the next step overwrites with the same values."""
        saved = [t.clone() for t in (self.pos, self.pending, self.count, self.token, self.logprob)]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self._step(width, mode)
                self._restore(saved)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(width, mode)
        return graph

    def reloaded(self) -> None:
        """After a weight load: drop the graphs if it put a parameter at a new address (a graph
        reads the addresses it was captured with; a load that copies in place keeps them)."""
        if self.graphs and self._param_ptrs() != self.param_ptrs:
            self.graphs.clear()

    def _param_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for target, value in zip((self.pos, self.pending, self.count, self.token, self.logprob), saved,
                                 strict=True):
            target.copy_(value)
