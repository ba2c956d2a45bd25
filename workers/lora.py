"""LoRA on both workers, built on peft: the base stays frozen, a version is the adapter alone.

    trainer   base (frozen; fp32, or bf16 / int8 by lora.base_dtype: workers/frozen_base.py)
              + peft's LoRA layers injected in place (`attach`): the model
              stays its transformers class, so every trainer path (packed rows, the chunked
              head, micro-batches, bf16 autocast) runs unchanged; only lora_A / lora_B have
              requires_grad, so they alone get gradients, AdamW state and the all-reduce
    publish   v<N>.safetensors = `adapter_state`: {module}.lora_A.weight [r, in] and
              {module}.lora_B.weight [out, r] of every adapted Linear, fp32, header metadata
              {"format": "lora", "scaling": alpha / r}
    rollout   `MergedAdapter` (lora.merge = true): W = W_base + scaling * B @ A written into
              each adapted weight, from a pristine copy of W_base kept at the first version, so
              no error accumulates across versions; decoding costs what the plain model costs
              `UnmergedAdapter` (lora.merge = false): peft's LoRA layers in the engine, the
              file read into them; no copy of the base, the adapter's matmuls every step.
              Merged is the default: a merge per version costs less than what unmerged
              decoding loses in one trainer step (docs/lora.md: bench/lora.py's figures)
    keeping   model/ = `write_merged` (a plain HF folder, loadable without peft), adapter/ =
              `save_adapter` (PEFT's format: adapter_config.json, adapter_model.safetensors),
              checkpoints = the adapter + its AdamW state + `base_identity` (checked at resume)

`merge_into` (workers/models.py, which also loads an adapter folder merged for `eval`) is the
one merge: the rollout's merge, the merged export and an adapter folder's load use it, so they
are the same bits. `base_identity` hashes the base weights (names, dtypes, shapes, bytes; sha256):
a resumed adapter on another base is one clear error.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from areal_aio.settings import LORA_ALL, LoraSettings
from areal_aio.store.safetensors_io import (
    WeightStoreError,
    as_bytes,
    read_tensors,
    unique_state,
    write_safetensors,
)
from areal_aio.workers import frozen_base, models
from areal_aio.workers.models import BASE_FILE, PEFT_PREFIX, linear_paths, merge_into

ADAPTER = "default"
"""peft's name of the one adapter."""
FORMAT = "lora"
"""The `format` in a published adapter's header: what tells it from a whole policy."""


# ---- which layers -------------------------------------------------------------------------------


def target_problem(model: Any, targets: str | list, spec: str) -> str | None:
    """The one-line error for a lora.targets entry the model has no Linear layer for, else None
    (models.target_problem, on this model's layers)."""
    return models.target_problem(linear_paths(model), targets, spec)


def peft_config(cfg: LoraSettings, targets: Any = None, base: str | None = None) -> Any:
    from peft import LoraConfig

    targets = targets if targets is not None else cfg.targets
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                      target_modules=targets if targets == LORA_ALL else list(targets),
                      base_model_name_or_path=base, task_type="CAUSAL_LM")


def attach(model: Any, cfg: LoraSettings, spec: str) -> list[torch.Tensor]:
    """Inject peft's LoRA layers into `model` in place (B = 0: the model's function is unchanged)
    and freeze everything else; returns the adapter's parameters in module order. lora_A's
    random start draws from torch's global generator (seeded by the trainer's start)."""
    from peft import inject_adapter_in_model

    if (problem := target_problem(model, cfg.targets, spec)) is not None:
        raise ValueError(problem)
    inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
        if p.requires_grad:
            params.append(p)
    return params


def layers(model: Any) -> dict[str, Any]:
    """Module path -> peft LoRA layer, for every adapted Linear of `model`."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter as published: {module}.lora_A.weight [r, in], {module}.lora_B.weight [out, r]."""
    out = {}
    for name, m in layers(model).items():
        out[f"{name}.lora_A.weight"] = m.lora_A[ADAPTER].weight.detach()
        out[f"{name}.lora_B.weight"] = m.lora_B[ADAPTER].weight.detach()
    return out


def scaling(cfg: LoraSettings) -> float:
    return cfg.alpha / cfg.rank


def metadata(cfg: LoraSettings) -> dict[str, str]:
    """A published adapter's header metadata."""
    return {"format": FORMAT, "scaling": repr(scaling(cfg)), "rank": str(cfg.rank)}


def read_adapter(path: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """A published adapter: ({module path: (A [r, in], B [out, r])}, scaling)."""
    tensors, meta = read_tensors(path)
    if meta.get("format") != FORMAT:
        raise WeightStoreError(f"{path}: not a LoRA adapter (lora.rank > 0 expects one; was it "
                               f"written by a trainer with lora.rank = 0?)")
    pairs = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            if f"{module}.lora_B.weight" not in tensors:
                raise WeightStoreError(f"{path}: {module} has lora_A and no lora_B")
            pairs[module] = (tensors[key], tensors[f"{module}.lora_B.weight"])
    if 2 * len(pairs) != len(tensors):
        raise WeightStoreError(f"{path}: tensors other than lora_A / lora_B pairs")
    return pairs, float(meta["scaling"])


def load_adapter(model: Any, path: str | Path) -> None:
    """Read a published adapter into `model`'s LoRA layers (same modules, same shapes)."""
    pairs, _ = read_adapter(path)
    mine = layers(model)
    if set(pairs) != set(mine):
        raise WeightStoreError(f"{path}: adapts {sorted(set(pairs) ^ set(mine))[:3]} ..., not the "
                               f"layers this model adapts")
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            mine[name].lora_A[ADAPTER].weight.copy_(a)
            mine[name].lora_B[ADAPTER].weight.copy_(b)


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The base alone (a LoRA run's frozen reference: v0 is the base, B starting at 0)."""
    mods = list(layers(model).values())
    for m in mods:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in mods:
            m.enable_adapters(True)


@contextmanager
def dropout_on(model: Any, on: bool) -> Iterator[None]:
    """lora.dropout in force (its modules in train mode) inside; the model stays in eval mode."""
    drops = [m.lora_dropout[ADAPTER] for m in layers(model).values()] if on else []
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


# ---- the merge -----------------------------------------------------------------------------------


def base_state(model: Any) -> dict[str, torch.Tensor]:
    """The base's tensors under their plain names (a peft layer's base_layer.weight is its
    Linear's weight), tied ones once, the adapter left out."""
    return {name.replace(".base_layer.", "."): t for name, t in unique_state(model).items()
            if ".lora_A." not in name and ".lora_B." not in name}


def write_merged(model: Any, path: Path, adapter: str | Path | None = None) -> None:
    """The merged weights (base + adapter, the live adapter unless a published file is given) as
    an HF model.safetensors, each merged tensor computed as it is written."""
    if adapter is not None:
        pairs, scale = read_adapter(adapter)
    else:
        live = layers(model)
        pairs = {n: (m.lora_A[ADAPTER].weight.detach(), m.lora_B[ADAPTER].weight.detach()) for n, m in live.items()}
        scale = next(iter(live.values())).scaling[ADAPTER] if live else 1.0
    weights = {f"{module}.weight": pair for module, pair in pairs.items()}
    state, narrow = _plain_base(model)

    def merged(name: str, t: torch.Tensor) -> torch.Tensor:
        if name in narrow:  # an int8 base weight, widened as it is written
            t = frozen_base.plain_weight(narrow[name])
        if name not in weights:
            return t.detach()
        out = torch.empty_like(t)
        with torch.no_grad():
            merge_into(out, t.detach(), *weights[name], scale)
        return out

    write_safetensors(path, state, None, {"format": "pt"}, transform=merged)


def _plain_base(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """base_state as an HF folder holds it: an int8 base weight (lora.base_dtype) stands as an
    fp32 placeholder on the meta device (no bytes), its scale left out; and those weights'
    modules by name, for the writer to widen one at a time."""
    narrow = {f"{name}.weight".replace(".base_layer.", "."): m for name, m in model.named_modules()
              if getattr(m, frozen_base.SCALE, None) is not None}
    state = {}
    for name, t in base_state(model).items():
        if name.endswith("." + frozen_base.SCALE):
            continue
        state[name] = torch.empty(t.shape, dtype=torch.float32, device="meta") if name in narrow else t
    return state, narrow


def save_adapter(model: Any, cfg: LoraSettings, folder: Path, base: dict[str, Any],
                 adapter: str | Path | None = None) -> None:
    """The adapter in PEFT's format (adapter_config.json, adapter_model.safetensors: what
    PeftModel.from_pretrained(base, folder) loads), and BASE_FILE (`base`: path, seed, sha256)."""
    if adapter is not None:
        pairs, _ = read_adapter(adapter)
        state = {f"{m}.lora_{x}.weight": t for m, (a, b) in pairs.items() for x, t in (("A", a), ("B", b))}
    else:
        state = adapter_state(model)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({key.split(".lora_")[0].rpartition(".")[2] for key in state})
    peft_config(cfg, targets, base.get("hf_path") or base["path"]).save_pretrained(str(folder))
    write_safetensors(folder / "adapter_model.safetensors",
                      {PEFT_PREFIX + key: t for key, t in state.items()}, None, {"format": "pt"})
    (folder / BASE_FILE).write_text(json.dumps(base, indent=2))


def base_identity(model: Any, spec: str) -> dict[str, str]:
    """The base a LoRA adapter belongs to: model.path and a sha256 of the base weights (names,
    dtypes, shapes and bytes, in name order; the trainer's fp32 copy)."""
    digest = hashlib.sha256()
    for name, t in sorted(base_state(model).items()):
        digest.update(f"{name}:{str(t.dtype)}:{list(t.shape)};".encode())
        digest.update(as_bytes(t.detach().contiguous().cpu()))
    return {"path": spec, "sha256": digest.hexdigest()}


# ---- the rollout worker's hand-off --------------------------------------------------------------


class MergedAdapter:
    """lora.merge = true: each version rewrites every adapted weight as W_base + scaling * B @ A.

    W_base is copied once, at the first version (the weights are still the base then), in the
    model's dtype: the cost is one copy of the adapted weights, the gain a decode step that
    costs what the plain model's does."""

    def __init__(self) -> None:
        self.pristine: dict[str, torch.Tensor] = {}  # module path -> W_base

    def __call__(self, model: Any, path: str | Path) -> float:
        t0 = time.perf_counter()
        pairs, scale = read_adapter(path)
        modules = dict(model.named_modules())
        if self.pristine and set(pairs) != set(self.pristine):
            raise WeightStoreError(f"{path}: adapts other layers than the versions before it")
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                lin = modules.get(name)
                if not isinstance(lin, torch.nn.Linear) or list(lin.weight.shape) != [b.shape[0], a.shape[1]]:
                    raise WeightStoreError(f"{path}: {name} is no Linear layer of this model's shape")
                if name not in self.pristine:
                    self.pristine[name] = lin.weight.detach().clone()
                merge_into(lin.weight, self.pristine[name], a, b, scale)
        return time.perf_counter() - t0


class UnmergedAdapter:
    """lora.merge = false: peft's LoRA layers in the rollout model (injected at the first
    version), each version read into them; the base is never written."""

    def __init__(self, cfg: LoraSettings, spec: str) -> None:
        self.cfg, self.spec = cfg, spec
        self.attached = False

    def __call__(self, model: Any, path: str | Path) -> float:
        t0 = time.perf_counter()
        if not self.attached:
            state = torch.random.get_rng_state()  # lora_A's start draws; sampling never does
            try:
                attach(model, self.cfg, self.spec)
            finally:
                torch.random.set_rng_state(state)
            model.requires_grad_(False)
            self.attached = True
        load_adapter(model, path)
        return time.perf_counter() - t0


def handoff(cfg: LoraSettings, spec: str) -> Any:
    """The rollout worker's (model, path) -> seconds for a LoRA run's published versions."""
    return MergedAdapter() if cfg.merge else UnmergedAdapter(cfg, spec)
