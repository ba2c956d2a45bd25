"""The trainer's side of keeping a run: its checkpoint part, and the policy as a plain HF folder.

    <checkpoint>/trainer/               (written by `save_state`, read by `load_state`)
        v<N>.safetensors                fp32 policy, tied weights once (the weight-store writer:
                                        streamed from the parameters, no copy of the model);
                                        with LoRA the adapter alone
        optimizer.pt                    AdamW state_dict (moments, step counts: the adapter's
                                        alone with LoRA)
        rng.pt                          torch CPU (and CUDA) generator states
        state.json                      {"version": N}, with LoRA also "base": {path, sha256}
                                        (workers/lora.py base_identity), checked at resume

    <run>/model/ or best/               (written by `export_model`)
        config.json, generation_config.json, model.safetensors,
        tokenizer files with the chat template; with LoRA the merged weights
    <run>/adapter/                      with LoRA, beside model/ (`adapter_folder`): PEFT's
        adapter_config.json, adapter_model.safetensors, areal_aio_base.json, tokenizer files

Weights that are not finite are never written (`check_finite`): the trainer skips a step whose
loss or gradient is not finite, so its weights stay finite; should a NaN get in all the same, the
Save fails with one line naming the tensor, and model/, best/ and the checkpoints written before
stay as they were, instead of being replaced by a policy that is NaN everywhere.

Everything is fsynced before the reply, so the controller's rename of the checkpoint folder
publishes files that are on disk. The live model is exported in place (save_pretrained reads
the parameters; no second copy of the model is made); an older version is exported from its
weight-store file by rewriting the file's header and streaming the tensor bytes, so that needs
no memory either.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from areal_aio import wire
from areal_aio.store.checkpoint import replace_folder
from areal_aio.store.safetensors_io import copy_as_hf_weights, load_weights
from areal_aio.store.weights import WeightStore
from areal_aio.workers import lora
from areal_aio.workers.models import hf_folder


def fsync_tree(folder: Path) -> int:
    """fsync every file under `folder` and the folders themselves; returns the bytes in it."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            total += os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return total


def save_state(trainer: Any, folder: Path) -> None:
    """The trainer's checkpoint part: policy (fp32; with LoRA the adapter and its base's
    identity), optimizer, RNG, version."""
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"version": trainer.version}
    if trainer.lora is not None:
        WeightStore(folder).publish_state(lora.adapter_state(trainer.model), trainer.version,
                                          metadata=lora.metadata(trainer.lora))
        state["base"] = trainer.base_identity()
    else:
        WeightStore(folder).publish(trainer.model, trainer.version)  # dtype None: fp32 as trained
    torch.save(trainer.opt.state_dict(), folder / "optimizer.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.device(trainer.device).type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, folder / "rng.pt")
    (folder / "state.json").write_text(json.dumps(state))


def load_state(trainer: Any, folder: Path) -> None:
    """Continue from `save_state`'s folder: weights into the live model in place, optimizer, RNG.
    A LoRA adapter resumes only on the base it was trained on (one line names both)."""
    state = json.loads((folder / "state.json").read_text())
    version = int(state["version"])
    saved = state.get("base")
    if (saved is None) != (trainer.lora is None):
        held = "a LoRA adapter" if saved is not None else "full weights"
        raise ValueError(f"resume: {folder} holds {held}; this trainer has lora.rank = "
                         f"{trainer.lora.rank if trainer.lora is not None else 0}")
    if trainer.lora is not None:
        mine = trainer.base_identity()
        if saved != mine:
            raise ValueError(f"resume: the checkpoint's adapter was trained on the base {saved['path']} "
                             f"(weights sha256 {saved['sha256'][:12]}), this trainer loaded {mine['path']} "
                             f"(sha256 {mine['sha256'][:12]}); an adapter resumes only on its own base")
        lora.load_adapter(trainer.model, folder / f"v{version}.safetensors")
    else:
        load_weights(trainer.model, folder / f"v{version}.safetensors")
    opt_state = torch.load(folder / "optimizer.pt", map_location=trainer.device, weights_only=True)
    trainer.opt.load_state_dict(opt_state)
    rng = torch.load(folder / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():  # the GPUs this process sees now (a resume
        # inside a Ray actor sees one): as many of the saved states as there are GPUs
        for i, state in enumerate(rng["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
    trainer.version = version


def export_model(model: Any, tokenizer: Any, folder: Path, weights: str | Path = "") -> None:
    """`model` as a plain HF folder; with `weights`, that weight-store file's tensors instead."""
    folder.mkdir(parents=True, exist_ok=True)
    use_cache = model.config.use_cache
    model.config.use_cache = True  # the trainer turns the KV cache off; generation wants it
    try:
        if weights:
            model.config.save_pretrained(folder)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(folder)
            copy_as_hf_weights(Path(weights), folder / "model.safetensors")
        else:
            model.save_pretrained(folder, safe_serialization=True)
    finally:
        model.config.use_cache = use_cache
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)  # with its chat template


def adapter_folder(export: Path) -> Path | None:
    """Where a LoRA run's adapter goes beside an export: <dir>/adapter for the run's model/
    (which the controller writes as <dir>/.model.tmp and renames, and `sft` as <dir>/model);
    None for the other exports (best/ holds the merged weights alone)."""
    return export.parent / "adapter" if export.name in ("model", ".model.tmp") else None


def export_lora(trainer: Any, folder: Path, weights: str | Path = "") -> int:
    """A LoRA run's export: the merged weights as a plain HF folder at `folder` (base + the live
    adapter, or the adapter of the weight-store file `weights`) and, for model/, the adapter
    alone in PEFT's format at `adapter_folder`, replaced whole; returns the adapter's bytes."""
    model, tokenizer = trainer.model, trainer.tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    use_cache = model.config.use_cache
    model.config.use_cache = True  # the trainer turns the KV cache off; generation wants it
    try:
        model.config.save_pretrained(folder)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
    finally:
        model.config.use_cache = use_cache
    lora.write_merged(model, folder / "model.safetensors", weights or None)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    adapter = adapter_folder(folder)
    if adapter is None:
        return 0
    # hf_path: what PEFT's base_model_name_or_path names (a folder or hub id HF tools load)
    base = {**trainer.base_identity(), "seed": trainer.seed, "hf_path": hf_folder(trainer.spec)}
    tmp = adapter.parent / f".{adapter.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save_adapter(model, trainer.lora, tmp, base, weights or None)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    size = fsync_tree(tmp)
    replace_folder(tmp, adapter)
    return size


def check_finite(trainer: Any, kind: str, weights: str | Path = "") -> None:
    """ValueError naming the first tensor that is not finite (NaN, inf) of what a Save of `kind`
    would write: the live model's parameters, or the weight-store file `weights` (read a tensor
    at a time); nothing is written then. One host read for the live model."""
    if weights:
        with safe_open(str(weights), framework="pt") as f:
            bad = next((name for name in f.keys() if not torch.isfinite(f.get_tensor(name)).all()), None)
    else:
        named = list(trainer.model.named_parameters())
        finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).tolist()
        bad = next((name for (name, _), ok in zip(named, finite, strict=True) if not ok), None)
    if bad is not None:
        raise ValueError(f"trainer: refusing to write the {kind} of version {trainer.version}: weight "
                         f"{bad!r} is not finite (NaN or inf); what was written before stays")


def save(trainer: Any, msg: wire.Save) -> wire.Saved:
    """Answer one Save: check the weights are finite, write, fsync, report the size."""
    t0 = time.perf_counter()
    check_finite(trainer, msg.kind, msg.weights)
    folder = Path(msg.path)
    extra = 0
    if msg.kind == "checkpoint":
        save_state(trainer, folder)
    elif msg.kind == "model" and trainer.lora is not None:
        extra = export_lora(trainer, folder, msg.weights)
    elif msg.kind == "model":
        export_model(trainer.model, trainer.tokenizer, folder, msg.weights)
    else:
        raise wire.WireError(f"trainer: Save of unknown kind {msg.kind!r}")
    size = fsync_tree(folder) + extra
    return wire.Saved(kind=msg.kind, path=str(folder), version=trainer.version, bytes=size,
                      seconds=time.perf_counter() - t0)
