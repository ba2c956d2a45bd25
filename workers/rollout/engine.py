"""The rollout engine: interruptible continuous-batching generation on a plain transformers model.

No pipe code here: `workers/rollout/worker.py` feeds it messages; tests drive it directly.

    add(request) -> waiting (FIFO) --admit when a slot frees--> running rows (<= max_batch)
    advance(n): admit: KV of each distinct new prompt (prefix cache, else one forward pass),
                    repeated for every row that shares it; sample each row's first token;
                    merge the rows into the batch
                decode, 1 to n times: feed every row's pending token, sample the next one
                look: read the sampled tokens on the host, retire finished rows (EOS, a stop string,
                    the length limit)
    update_weights(version, path): load, drop every KV (batch and prefix cache), recompute it
                    for the running rows: distinct prompts once, then the completions so far
                    in passes of similar lengths; later tokens carry `version`
                    (keep_kv: drop the prefix cache only; the running rows go on over the
                    KV the old weights computed, as PipelineRL does)

The host never waits for a decode step: the pending tokens, positions, mask, seeds and
counters of the rows are device tensors, and the tokens drawn wait on the device for the next
look (once per `advance`; on a CPU, and while requests wait for a slot, after every step).

One KV cache holds the whole batch, [B, kv_heads, T, head_dim] per layer, with an attention mask
[B, T]: a row is [pad | prompt | pad | completion], the pads masked out and position ids counting
real tokens only, so one decode step appends one column for every row. Invariant between steps:
the cache holds each row's prompt and every token it drew except the last (the "pending" token,
on the device in `pending`), which the next decode step feeds. Between `advance` calls the host
has looked: each row's completion ends with its pending token.
"""

from __future__ import annotations

import inspect
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from areal_aio.seeds import derive
from areal_aio.store.safetensors_io import load_weights
from areal_aio.wire import Completion, WeightsLoaded
from areal_aio.workers.rollout.sampling import sample
from areal_aio.workers.rollout.slots import Slots, slots_problem

GREEDY_BELOW = 1e-5
"""A temperature under this is greedy decoding (the wire says 0; floats may arrive as 1e-9)."""
PREFIX_CACHE_PROMPTS = 16
"""Prompts whose prefill (KV + next-token logits) is kept for the current weights: the
controller keeps a few GRPO groups in flight, and a group admitted a few slots at a time then
pays one prefill instead of one per admission. About 2 MB each for SmolLM2-135M."""
FORWARD_OVERHEAD_TOKENS = 16
"""The fixed cost of one more forward pass (reading every weight once) in tokens of work: on
CPU a 1-token step of SmolLM2-135M costs about as much as 16 tokens of a long pass."""
STOP_SPARE_TOKENS = 4
"""Tokens read past a stop string's length when looking for it (stop_in_tail)."""
HEADROOM_TOKENS = 32
"""Spare KV columns allocated past a cache's length: decode steps write into them in place
instead of copying the whole cache (DynamicLayer's torch.cat) every step. The batch is copied
anyway whenever rows join or leave, which reallocates the headroom."""


def stop_in_tail(tokenizer: Any, completion: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the last token completed one of the `stop` strings: one is in the text of the last
    few tokens. Every token is checked as it is appended, so an occurrence that ended before the
    last token would have ended the row there: one decode per token. The window holds as many
    tokens as the longest string has UTF-8 bytes (a token is at least one byte), plus a spare.
    The text is decoded without special tokens: a special token's own text never matches."""
    window = max(len(s.encode()) for s in stop) + STOP_SPARE_TOKENS
    tail = tokenizer.decode(completion[-window:], skip_special_tokens=True)
    return any(s in tail for s in stop)


@dataclass(slots=True)
class Request:
    """One sequence to generate; prompt already tokenized (chat template applied)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # sampling seed (areal_aio.seeds); None: the engine assigns one
    stop: tuple[str, ...] = ()  # strings whose completion ends the sequence (finish "stop"; kept)


@dataclass(slots=True)
class _Seq:
    """A request's generation state; `completion[-1]` is the pending token while running."""

    req: Request
    t0: float
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interrupts: int = 0

    @property
    def ids(self) -> list[int]:
        return self.req.prompt_ids + self.completion


class _SlackLayer(DynamicLayer):
    """A DynamicLayer whose keys/values [B, H, T, D] are views into buffers with spare columns."""

    def set(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold copies of keys/values [B, H, T, D] with HEADROOM_TOKENS free columns after T."""
        b, h, t, d = keys.shape
        self._k = keys.new_empty(b, h, t + HEADROOM_TOKENS, d)
        self._v = values.new_empty(b, h, t + HEADROOM_TOKENS, values.shape[-1])
        self._k[:, :, :t] = keys
        self._v[:, :, :t] = values
        self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.set(key_states, value_states)
            return self.keys, self.values
        t = self.keys.shape[-2]
        n = t + key_states.shape[-2]
        if n > self._k.shape[-2]:
            self.set(torch.cat([self.keys, key_states], dim=-2),
                     torch.cat([self.values, value_states], dim=-2))
            return self.keys, self.values
        self._k[:, :, t:n] = key_states
        self._v[:, :, t:n] = value_states
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
        return self.keys, self.values


def _new_cache(config: Any) -> DynamicCache:
    """A DynamicCache for `config`; its plain full-attention layers become _SlackLayers."""
    cache = DynamicCache(config=config)
    cache.layers = [_SlackLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _set_kv(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    if isinstance(layer, _SlackLayer):
        layer.set(keys, values)
    else:
        layer.keys, layer.values = keys, values


@dataclass(slots=True)
class _Prefix:
    """The KV of one token list after a forward pass, and the logits of its next token."""

    keys: list[torch.Tensor]  # per layer [1, kv_heads, len, head_dim]
    values: list[torch.Tensor]
    logits: torch.Tensor  # [1, vocab]

    def detached(self) -> _Prefix:
        """Own copies (not views into a whole batch's cache), to keep in the prefix cache."""
        return _Prefix([k.clone() for k in self.keys], [v.clone() for v in self.values],
                       self.logits.clone())


def _stack_right(parts: list[torch.Tensor], length: int) -> torch.Tensor:
    """[1, H, len_i, D] pieces -> [n, H, length, D], each right-aligned (zeros on the left)."""
    if len(parts) == 1 and parts[0].shape[2] == length:
        return parts[0]
    first = parts[0]
    out = first.new_zeros(len(parts), first.shape[1], length, first.shape[3])
    for i, part in enumerate(parts):
        out[i, :, length - part.shape[2]:] = part[0]
    return out


class _Batch:
    """The running rows, their shared right-aligned KV cache and their sampling state.

    On the model's device, one row each: cache layers keys/values [B, kv_heads, T, head_dim];
    mask [B, T] bool (True = real token); pos [B] = real tokens cached per row = position id of
    the row's pending token; pending [B] = that token; seed, count [B] int64 = the row's seed and
    completion length (the counter of its next uniform); scale, top_p [B] float32 and greedy [B]
    bool = its temperature (1 when greedy), nucleus mass and whether it decodes greedily.
    On the host: seqs, full (no False in mask: the model then needs no mask), and `drawn`,
    the (token [B], logprob [B]) of each decode step since the host last looked (Engine._look).
    """

    ROWS = ("pos", "pending", "seed", "count", "scale", "top_p", "greedy")
    """The per-row tensors: selected by keep, concatenated by merge."""

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.bool)
        self.full = True
        self.drawn: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name in self.ROWS:
            setattr(self, name, torch.zeros(0))

    def __len__(self) -> int:
        return len(self.seqs)

    def used(self) -> range:
        """Row i of `seqs` is row i of what was drawn (Slots: the slot it sits in)."""
        return range(len(self.seqs))

    def reloaded(self) -> None:
        """After a weight load: nothing holds the old addresses (Slots drops its graphs)."""

    def set_rows(self, seqs: list[_Seq], device: torch.device) -> None:
        """The sampling state of `seqs` (all but pending, which the first draw sets)."""
        greedy = [s.req.temperature < GREEDY_BELOW for s in seqs]
        self.seed = torch.tensor([s.req.seed for s in seqs], dtype=torch.long, device=device)
        self.count = torch.tensor([len(s.completion) for s in seqs], dtype=torch.long, device=device)
        self.scale = torch.tensor([1.0 if g else s.req.temperature for g, s in zip(greedy, seqs, strict=True)],
                                  dtype=torch.float32, device=device)
        self.top_p = torch.tensor([1.0 if g else s.req.top_p for g, s in zip(greedy, seqs, strict=True)],
                                  dtype=torch.float32, device=device)
        self.greedy = torch.tensor(greedy, dtype=torch.bool, device=device)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in order), then drop leading columns no row uses any more."""
        if len(rows) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.cache, self.mask, self.full = None, self.mask[:0, :0], True
            for name in self.ROWS:
                setattr(self, name, getattr(self, name)[:0])
            return
        index = torch.tensor(rows, dtype=torch.long).to(self.mask.device)
        self.mask = self.mask.index_select(0, index)
        for name in self.ROWS:
            setattr(self, name, getattr(self, name).index_select(0, index))
        # one read: the first column some row still uses, and the mask's False count
        first, holes = torch.stack([self.mask.any(0).int().argmax(), (~self.mask).sum()]).tolist()
        self.mask = self.mask[:, first:]
        self.full = holes == len(rows) * first  # every False was in the dropped columns
        for layer in self.cache.layers:
            _set_kv(layer, layer.keys[:, :, first:].index_select(0, index),
                    layer.values[:, :, first:].index_select(0, index))

    def merge(self, other: _Batch) -> None:
        """Append `other`'s rows; the shorter side is left-padded so columns stay right-aligned."""
        if not other.seqs:  # every row of a prefill finished on its first token: nothing cached
            return
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.full = other.seqs, other.cache, other.mask, other.full
            for name in self.ROWS:
                setattr(self, name, getattr(other, name))
            return
        t = max(self.mask.shape[1], other.mask.shape[1])
        self.full = self.full and other.full and self.mask.shape[1] == other.mask.shape[1]
        self.mask = torch.cat([_pad_left(self.mask, t), _pad_left(other.mask, t)])
        for name in self.ROWS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            _set_kv(mine, torch.cat([_pad_left(mine.keys, t, dim=2), _pad_left(theirs.keys, t, dim=2)]),
                    torch.cat([_pad_left(mine.values, t, dim=2), _pad_left(theirs.values, t, dim=2)]))
        self.seqs = self.seqs + other.seqs


def _pad_left(x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    short = length - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class Engine:
    """Continuous batching with per-token logprobs and versions, and weight swaps mid-sequence."""

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 32, version: int = 0,
                 seed: int = 0, look_every_step: bool | None = None,
                 load: Callable[[Any, str], float] = load_weights, keep_kv: bool = False,
                 static: bool = False, graphs: bool = True, waiting_steps: int = 1) -> None:
        """`look_every_step`: read the sampled tokens after every decode step, so finished rows
        leave the batch at once (default: on a CPU, where the read is free and a finished row's
        compute is not); else only when a waiting request may take a freed slot, at a row's
        length limit and at the end of `advance` (see there). `load(model, path) -> seconds`
        puts a published version into the model: the whole weights (default), or a LoRA run's
        adapter (workers/lora.py handoff). `keep_kv`: a weight update keeps the running rows' KV
        (rollout.kv_on_update = keep; see update_weights). `static`: decode in fixed slots over a
        preallocated KV cache (workers/rollout/slots.py; rollout.static_decode), each step
        replayed from a captured CUDA graph on a GPU unless `graphs` is False. `waiting_steps`:
        decode steps between looks while requests wait for a slot (1: a slot freed by an EOS is
        refilled at the next step; more: fewer waits for the device, a freed slot idle longer)."""
        self.model = model
        self.keep_kv = keep_kv
        self.cache_kw = _cache_keyword(model)
        self.load = load
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.version = version
        self.device = next(model.parameters()).device
        self.look_every_step = self.device.type == "cpu" if look_every_step is None else look_every_step
        self.waiting_steps = waiting_steps
        self.admitting = True  # False while draining for a non-interrupting weight update
        self.waiting: deque[_Seq] = deque()
        if static and (why := slots_problem(model)):
            raise ValueError(f"rollout.static_decode: this model cannot decode in slots: {why}")
        self.batch: _Batch | Slots = (Slots(model, max_batch, self.cache_kw, graphs) if static
                                      else _Batch())
        self.seed = seed
        self._added = 0  # requests added: the default seed of a request that brings none
        self.eos = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.prefixes: OrderedDict[tuple[int, ...], _Prefix] = OrderedDict()  # prompt -> prefill

    # ------------------------------------------------------------------ queue

    @property
    def running(self) -> int:
        return len(self.batch)

    @property
    def busy(self) -> bool:
        """True while a step would do work (rows to decode or requests it may admit)."""
        return bool(self.batch.seqs) or (self.admitting and bool(self.waiting))

    def add(self, req: Request) -> None:
        """Queue a request; it gets a slot at the next step with one free.

        A request without a seed gets one from (engine seed, how many were added before it):
        reproducible for one engine fed in one order; the controller sends its own seeds so
        that draws do not depend on the order either."""
        if req.seed is None:
            req.seed = derive(self.seed, self._added)
        self._added += 1
        self.waiting.append(_Seq(req, time.perf_counter()))

    def abort(self, request_id: str) -> Completion | None:
        """Drop a queued or running request: its Completion (finish 'abort'), None if unknown."""
        for seq in self.waiting:
            if seq.req.request_id == request_id:
                self.waiting.remove(seq)
                return self._completion(seq, "abort")
        for row, seq in enumerate(self.batch.seqs):
            if seq.req.request_id == request_id:
                self.batch.keep([i for i in range(len(self.batch)) if i != row])
                return self._completion(seq, "abort")
        return None

    # ------------------------------------------------------------------ generation

    def step(self) -> list[Completion]:
        """Admit into free slots, then one decode step for every running row."""
        return self.advance(1)[1]

    @torch.inference_mode()
    def advance(self, max_steps: int) -> tuple[int, list[Completion]]:
        """Admit into free slots, then 1 to `max_steps` decode steps, the host looking at what
        they sampled only after the last: (steps taken, sequences finished).

        The steps run back to back on the device (tokens, uniforms and counters stay there), so
        on a GPU the host queues step k+1 while step k runs. A row that samples EOS early
        decodes on until the look, which drops what it sampled after EOS; no other row reads
        its values, but like any batch mate it shapes the batch, which moves other rows' floats
        in the last bits (a float64 model gives bit-identical sequences either way). It stops
        after `waiting_steps` (default one) when a request waits for a slot (a finished row's slot
        is then refilled at the next step, as with a look every step), after one step with `look_every_step`, and at the
        step where the first row reaches max_new_tokens, so no row runs past its limit and
        requests are admitted at the same steps either way.
        """
        done = self._admit()
        b = self.batch
        if not b.seqs:
            return 1, done
        steps = 1
        if not self.look_every_step:
            cap = self.waiting_steps if self.admitting and self.waiting else max_steps
            steps = min(max_steps, cap, min(s.req.max_new_tokens - len(s.completion) for s in b.seqs))
        for _ in range(steps):
            self._decode(b)
        done.extend(self._look(b))
        return steps, done

    def _decode(self, b: _Batch | Slots) -> None:
        """One decode step of every row, all on the device: feed the pending tokens, draw the next."""
        if isinstance(b, Slots):
            b.step(_mode(b.seqs))
            return
        b.mask = torch.cat([b.mask, b.mask.new_ones(len(b), 1)], dim=1)
        out = self.model(input_ids=b.pending[:, None], attention_mask=self._decode_mask(b),
                         position_ids=b.pos[:, None], **{self.cache_kw: b.cache}, use_cache=True,
                         logits_to_keep=1)
        b.pos = b.pos + 1
        self._draw(b, out.logits[:, -1])

    def _decode_mask(self, b: _Batch) -> torch.Tensor | None:
        """The attention mask of a decode step, in the form that needs no look at its values.

        Given [B, T], transformers asks whether it holds any False (a host read every step) to
        skip the mask; the 4D mask it would build is passed instead: [B, 1, 1, T], bool for
        sdpa, 0 / dtype min for eager. None when the host knows there is no padding (what
        transformers would have found). Other attention kinds get the [B, T] mask.
        """
        if b.full:
            return None
        attention = getattr(self.model.config, "_attn_implementation", None)
        mask = b.mask[:, None, None, :]
        if attention == "sdpa":
            return mask
        if attention == "eager":
            dtype = self.model.dtype
            return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)
        return b.mask

    def _admit(self) -> list[Completion]:
        free = self.max_batch - len(self.batch)
        if not (self.admitting and free > 0 and self.waiting):
            return []
        seqs = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        fresh, done = self._prefill(seqs)
        self.batch.merge(fresh)
        return done

    def _prefill(self, seqs: list[_Seq]) -> tuple[_Batch, list[Completion]]:
        """Compute the KV of prompt + completion of `seqs` from scratch; sample one token each.

        Two passes, so that what rows share is computed once:
          prompts: each distinct prompt once (a GRPO group shares one), or taken from the
                   prefix cache when prefilled before under the same weights
          tails:   the completion tokens so far (only after a weight update), all rows in one
                   pass over the shared prompt KV; a row's layout is then
                   [pad | prompt | pad | completion] with the holes masked out
        """
        prompts: dict[tuple[int, ...], int] = {}
        which = [prompts.setdefault(tuple(s.req.prompt_ids), len(prompts)) for s in seqs]
        entries = self._prompt_entries(list(prompts))
        length = max(map(len, prompts))
        index = torch.tensor(which, dtype=torch.long)
        on_device = index.to(self.device)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            mask[i, length - len(prompt):] = 1
        mask = mask.index_select(0, index)
        cache = _new_cache(self.model.config)
        for layer_idx, layer in enumerate(cache.layers):
            keys = _stack_right([e.keys[layer_idx] for e in entries], length)
            values = _stack_right([e.values[layer_idx] for e in entries], length)
            _set_kv(layer, keys.index_select(0, on_device), values.index_select(0, on_device))
        logits = torch.cat([e.logits for e in entries]).index_select(0, on_device)
        tails = [s.completion for s in seqs]
        width = max(map(len, tails))
        if width:
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            tail_mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, tail in enumerate(tails):
                if tail:
                    ids[i, width - len(tail):] = torch.tensor(tail, dtype=torch.long)
                    tail_mask[i, width - len(tail):] = 1
            mask = torch.cat([mask, tail_mask], dim=1)
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -width:]
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), **{self.cache_kw: cache},
                             use_cache=True, logits_to_keep=1)
            has_tail = torch.tensor([bool(t) for t in tails], device=self.device)
            logits = torch.where(has_tail[:, None], out.logits[:, -1], logits)
        fresh = _Batch()
        fresh.seqs, fresh.cache, fresh.full = seqs, cache, bool(mask.all())
        fresh.mask = mask.to(self.device, torch.bool)
        fresh.pos = mask.sum(1).to(self.device)
        fresh.set_rows(seqs, self.device)
        self._draw(fresh, logits)
        return fresh, self._look(fresh)

    def _prompt_entries(self, prompts: list[tuple[int, ...]]) -> list[_Prefix]:
        """Each prompt's KV and next-token logits: from the prefix cache, else one forward pass."""
        entries = [self.prefixes.get(prompt) for prompt in prompts]
        todo = [i for i, entry in enumerate(entries) if entry is None]
        if todo:
            for i, entry in zip(todo, self._forward([prompts[i] for i in todo]), strict=True):
                entries[i] = entry
                self.prefixes[prompts[i]] = entry.detached()
        for prompt in prompts:
            self.prefixes.move_to_end(prompt)
        while len(self.prefixes) > PREFIX_CACHE_PROMPTS:
            self.prefixes.popitem(last=False)
        return entries

    def _forward(self, rows: list[tuple[int, ...]]) -> list[_Prefix]:
        """One left-padded forward pass over `rows`; each row's KV [1, H, len, D] and last logits."""
        length = max(map(len, rows))
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, length - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, length - len(row):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), **{self.cache_kw: cache},
                         use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        return [_Prefix(keys=[layer.keys[i:i + 1, :, length - len(row):] for layer in cache.layers],
                        values=[layer.values[i:i + 1, :, length - len(row):] for layer in cache.layers],
                        logits=logits[i:i + 1])
                for i, row in enumerate(rows)]

    def _draw(self, b: _Batch, logits: torch.Tensor) -> None:
        """Sample each row's next token from logits [B, V] on the device; it becomes pending.

        What is drawn waits in `b.drawn` for the host's next look (`_look`)."""
        token, logprob = self._sample(logits.float(), b)
        b.pending = token
        b.count = b.count + 1
        b.drawn.append((token, logprob))

    def _look(self, b: _Batch) -> list[Completion]:
        """Read what `b` drew since the last look, append it, remove and return finished rows.

        Tokens and logprobs [B, steps] come over together (one wait for the device). A row ends
        at its first EOS or at its length limit; anything it drew after that is dropped. Weights
        change only between `advance` calls, after a look, so every token drawn since the last
        one is of `self.version`.
        """
        tokens = torch.stack([t for t, _ in b.drawn], dim=1).tolist()
        logprobs = torch.stack([lp for _, lp in b.drawn], dim=1).tolist()
        b.drawn = []
        keep, done = [], []
        rows = b.used()  # each row's row in what was drawn
        for i, (seq, row) in enumerate(zip(b.seqs, rows, strict=True)):
            finish = self._append(seq, tokens[row], logprobs[row])
            if finish:
                done.append(self._completion(seq, finish))
            else:
                keep.append(i)
        b.keep(keep)
        return done

    def _append(self, seq: _Seq, tokens: list[int], logprobs: list[float]) -> str | None:
        """Append what `seq` drew up to where it ends; its finish ("stop": an EOS or a stop
        string, kept; "length": its limit) or None. A row without EOS among its tokens and
        without stop strings takes them in one piece (most rows at most looks: the host's time
        per look then grows with the rows, not with rows x steps)."""
        room = seq.req.max_new_tokens - len(seq.completion)
        if not seq.req.stop and self.eos.isdisjoint(tokens[:room]):
            take = min(len(tokens), room)
            seq.completion.extend(tokens[:take])
            seq.logprobs.extend(logprobs[:take])
            seq.versions.extend([self.version] * take)
            return "length" if take == room else None
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.completion.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            if token in self.eos or (seq.req.stop and stop_in_tail(self.tokenizer, seq.completion,
                                                                   seq.req.stop)):
                return "stop"
            if len(seq.completion) >= seq.req.max_new_tokens:
                return "length"
        return None

    def _sample(self, logits: torch.Tensor, b: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [B], its log-prob [B] under the distribution it was drawn from).

        Greedy rows: argmax, log-prob under the plain softmax. Sampled rows: softmax of
        logits / temperature, restricted to the top-p nucleus and renormalized, drawn with the
        row's own uniform for this token (seeds.uniform(seed, completion length), computed on
        the device from b.seed and b.count): the same token whatever other rows share the step.
        Which branches run is read off the requests (host, `_mode`), never off the tensors.
        """
        return sample(logits, _mode(b.seqs), b.scale, b.top_p, b.greedy, b.seed, b.count)

    # ------------------------------------------------------------------ weights

    @torch.inference_mode()
    def update_weights(self, version: int, path: str) -> tuple[WeightsLoaded, list[Completion]]:
        """Load `path` now and rebuild the KV cache of every running row under it.

        Returns the WeightsLoaded reply and any rows that finished on the token sampled right
        after the rebuild. Queued requests need nothing: they start on the new weights.

        With `keep_kv` nothing is rebuilt: the running rows decode on over the keys and values
        the old weights computed, their pending token (drawn under the old weights) fed next.
        The tokens they draw from then on carry `version` and their log-probs are those of the
        mixed state that drew them, which is what decoupled PPO's behaviour policy is. The
        trainer recomputes them under one version; mismatch_kl reports the difference (on the
        default run it did not rise: docs/rollout.md).
        """
        load_s = self.load(self.model, path)
        self.batch.reloaded()
        self.version = version
        self.prefixes.clear()  # computed with the old weights
        seqs = self.batch.seqs
        for seq in seqs:
            seq.interrupts += 1
        if self.keep_kv:
            return WeightsLoaded(version=version, load_s=load_s, rebuilt=0), []
        self.batch.keep([])
        done: list[Completion] = []
        # The pending token is part of the completion: the rebuild caches it too and samples the
        # next token under the new weights, restoring the invariant with a new pending token.
        for group in _tail_buckets(sorted(seqs, key=lambda s: len(s.completion))):
            fresh, finished = self._prefill(group)
            self.batch.merge(fresh)
            done.extend(finished)
        return WeightsLoaded(version=version, load_s=load_s, rebuilt=len(seqs)), done

    # ------------------------------------------------------------------ results

    def _completion(self, seq: _Seq, finish: str) -> Completion:
        return Completion(
            request_id=seq.req.request_id, prompt_ids=list(seq.req.prompt_ids),
            completion_ids=list(seq.completion), logprobs=list(seq.logprobs),
            versions=list(seq.versions),
            text=self.tokenizer.decode(seq.completion, skip_special_tokens=True),
            finish=finish, interrupts=seq.interrupts, gen_s=time.perf_counter() - seq.t0)


def _tail_buckets(seqs: list[_Seq]) -> list[list[_Seq]]:
    """Split rows sorted by completion length into rebuild passes of least padded work.

    One pass pads every completion to the longest; rows admitted at different times differ a
    lot, so a few passes of similar lengths cost less. Exact partition by dynamic programming:
    cost(pass) = rows x longest completion + FORWARD_OVERHEAD_TOKENS.
    """
    n = len(seqs)
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest split of seqs[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * len(seqs[j - 1].completion) + FORWARD_OVERHEAD_TOKENS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(seqs[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _mode(seqs: list[_Seq]) -> str:
    """How a step samples (sampling.sample): "greedy" when every row is, "nucleus" when a sampled
    row has top_p < 1, else "sample"."""
    greedy = [s.req.temperature < GREEDY_BELOW for s in seqs]
    if all(greedy):
        return "greedy"
    nucleus = any(s.req.top_p < 1.0 and not g for s, g in zip(seqs, greedy, strict=True))
    return "nucleus" if nucleus else "sample"


def _cache_keyword(model: Any) -> str:
    """The forward argument that takes the KV cache: `cache` in transformers releases that
    renamed it (5.24 warns that `past_key_values` goes in 5.40), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return ids
