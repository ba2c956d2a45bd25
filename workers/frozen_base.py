"""A LoRA run's frozen base in fewer bytes: the trainer stores it in bfloat16 or int8 (lora.base_dtype).

    float32   as loaded: 4 bytes a weight
    bfloat16  every frozen Linear and Embedding in bf16: 2 bytes a weight
    int8      the blocks' frozen Linears weight-only int8, one fp32 scale per output channel
              (absmax / 127): 1 byte a weight; the embeddings and the output layer in bf16 (the
              chunked head reads the output layer's weight as it is: losses.token_logprobs)

    x [.., in] (fp32; bf16 under autocast) --FrozenLinear--> x @ widen(W)^T + b   [.., out]
        widen(W) = W.to(x.dtype), int8: W.to(x.dtype) * scale[out, 1]; made per matmul
        and dropped after it. The backward widens W again (`_Widened`): autograd would
        otherwise keep every layer's wide copy until the backward, the whole base in fp32.

Norms and biases stay as loaded (a few KiB a layer). `store` runs after peft has injected the
adapter (workers/lora.py attach), on every Linear and Embedding whose weight is frozen, so a
peft layer's base_layer is replaced and lora_A / lora_B (trainable, fp32) are left alone; tied
weights stay tied (the embedding and the output layer share one stored tensor).

Exports see plain float weights: `plain_weight` widens one module's weight at a time, which
the merged export (lora.write_merged) calls per tensor while it writes.
"""

from __future__ import annotations

from typing import Any

import torch

INT8_MAX = 127
"""Largest int8 magnitude of a stored weight (symmetric: -127..127, no -128)."""
SCALE = "weight_scale"
"""The per-output-channel scale buffer of an int8 FrozenLinear: in its state dict, not in an export's."""


class _Widened(torch.autograd.Function):
    """x @ widen(W)^T + b with only the stored (narrow) W saved for the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        return torch.nn.functional.linear(x, widen(weight, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight, scale = ctx.saved_tensors
        return grad @ widen(weight, scale, grad.dtype), None, None, None


def widen(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The stored weight in `dtype` (int8 times its channel scales)."""
    wide = weight.to(dtype)
    return wide if scale is None else wide.mul_(scale.to(dtype))


class FrozenLinear(torch.nn.Linear):
    """A frozen Linear whose weight is stored narrow (bf16, or int8 with `weight_scale` [out, 1]).

    An nn.Linear to every isinstance check (peft, transformers, linear_paths), with its
    in_features / out_features, but no fp32 weight is ever allocated for it."""

    def __init__(self, linear: torch.nn.Linear, dtype: str, weight: torch.nn.Parameter | None = None,
                 own: bool = False) -> None:
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate a wide weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = None
        if weight is None:
            weight, scale = narrow(linear.weight.detach(), dtype, own)
        self.weight = weight  # given: tied, the embedding's stored table
        self.register_buffer(SCALE, scale)
        bias = None if linear.bias is None else linear.bias.detach()
        self.bias = None if bias is None else torch.nn.Parameter(bias.clone() if own else bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(kind, enabled=False):  # the dtype is chosen here, once
            return _Widened.apply(x.to(dtype), self.weight, getattr(self, SCALE), bias)


class FrozenEmbedding(torch.nn.Embedding):
    """A frozen Embedding stored in bf16 whose rows come out in fp32, the dtype the trainer
    computes in (autocast narrows its matmuls itself), whatever dtype the base was loaded in."""

    def __init__(self, emb: torch.nn.Embedding, own: bool = False) -> None:
        torch.nn.Module.__init__(self)  # not Embedding's: it would allocate a wide table
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.max_norm = emb.padding_idx, emb.max_norm
        self.norm_type, self.scale_grad_by_freq, self.sparse = emb.norm_type, emb.scale_grad_by_freq, emb.sparse
        self.weight, _ = narrow(emb.weight.detach(), "bfloat16", own)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).float()


def narrow(weight: torch.Tensor, dtype: str, own: bool = False) -> tuple[torch.nn.Parameter, torch.Tensor | None]:
    """(the frozen weight stored as `dtype`, its per-row scale [out, 1] for int8 else None). A bf16
    weight already bf16 is kept as it is unless `own` (a copy: see `store`)."""
    if dtype == "bfloat16":
        return torch.nn.Parameter(weight.to(torch.bfloat16, copy=own), requires_grad=False), None
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp_(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(weight.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return torch.nn.Parameter(q, requires_grad=False), scale


def store(model: Any, dtype: str) -> None:
    """Store `model`'s frozen Linear and Embedding weights as `dtype` (module docstring), in place.
    float32 leaves the model as it is. Call after the adapter is attached.

    A base loaded in bf16 from safetensors is views of the file's mapping: bfloat16 keeps them
    (the mapping is the storage); int8 copies what it keeps in bf16 (embeddings, output layer,
    biases), so no view is left and the mapping, whose every page quantizing read, goes: 2.9 GiB
    of resident memory at the 1.5B shape (bench/memory.py's loaded_file)."""
    own = dtype == "int8"
    if dtype == "float32":
        return
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    swaps: dict[str, Any] = {}
    head_name = None
    for name, module in model.named_modules():
        if module is head:
            head_name = name
        elif type(module) in (torch.nn.Linear, torch.nn.Embedding) and not module.weight.requires_grad:
            swaps[name] = new = FrozenEmbedding(module, own) if module is emb else FrozenLinear(module, dtype, own=own)
            emb = new if module is emb else emb
    if head_name is not None and not head.weight.requires_grad:  # bf16 in every mode: the chunked head reads it
        swaps[head_name] = FrozenLinear(head, "bfloat16", weight=emb.weight if tied else None, own=own)
    for name, new in swaps.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    _widen_the_rest(model)


def _widen_the_rest(model: Any) -> None:
    """Every floating tensor outside the stored layers in fp32: the norms, the adapter (peft gave
    it the dtype of a bf16-loaded base) and the buffers. In place: the adapter's Parameters stay
    the objects the optimizer is given."""
    for module in model.modules():
        if isinstance(module, (FrozenLinear, FrozenEmbedding)):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.float()
        for key, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, key, b.float())


def stored_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers, each storage once (tied weights count once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def plain_weight(module: Any) -> torch.Tensor:
    """A stored weight as an export writes it: bf16 as stored, int8 widened to fp32."""
    scale = getattr(module, SCALE, None)
    return module.weight.detach() if scale is None else widen(module.weight.detach(), scale, torch.float32)
