"""The weight store: the one place that writes, publishes, finds and deletes weight versions.

    /dev/shm/areal_aio/<run>/            one folder per run, private to it
        owner.pid                        the controller's pid (dead owner -> swept at next start)
        v<N>.safetensors                 policy version N; written as .v<N>.tmp, then renamed,
                                         so a reader never sees half a file

The trainer publishes (`publish`), the rollout worker loads (`load_weights`),
the controller decides what to keep (`retain`) and removes the folder
(`close`). Tied weights (lm_head = embed_tokens) are written once and tied
again on load. torch and safetensors are imported only by the functions that
move tensors, so the controller stays free of them.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SHM_BASE = Path(os.environ.get("AREAL_AIO_SHM", "/dev/shm/areal_aio"))
VERSION_FILE = re.compile(r"^v(\d+)\.safetensors$")


class WeightStoreError(RuntimeError):
    """/dev/shm missing, full, or a version that is not there."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_runs(base: Path = SHM_BASE) -> list[Path]:
    """Remove run folders whose controller is gone (crashed without cleaning up)."""
    removed = []
    if not base.is_dir():
        return removed
    for run in base.iterdir():
        try:
            pid = int((run / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is None or not _pid_alive(pid):
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


class WeightStore:
    """Versioned safetensors of one run. Safe to use from the controller and both workers."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def create(cls, run_name: str, base: Path = SHM_BASE) -> WeightStore:
        """Make the run's folder (sweeping dead runs first); fails clearly without /dev/shm."""
        if not base.parent.is_dir():
            raise WeightStoreError(f"{base.parent} does not exist: the weight store needs a tmpfs "
                                   "there (set AREAL_AIO_SHM to another tmpfs folder)")
        sweep_dead_runs(base)
        root = base / f"{run_name}-{os.getpid()}"
        try:
            root.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise WeightStoreError(f"{root} exists already: another run of this name and process") from None
        (root / "owner.pid").write_text(str(os.getpid()))
        return cls(root)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}.safetensors"

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (VERSION_FILE.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def retain(self, keep: Iterable[int]) -> list[int]:
        """Delete every version not in `keep`; returns the deleted versions."""
        keep = set(keep)
        gone = [v for v in self.versions() if v not in keep]
        for v in gone:
            self.path(v).unlink(missing_ok=True)
        return gone

    def close(self) -> None:
        """Remove the run's folder and everything in it."""
        shutil.rmtree(self.root, ignore_errors=True)

    def publish(self, model: Any, version: int, dtype: Any = None) -> Path:
        """Write `model`'s weights as v<version>.safetensors atomically; returns the path."""
        from safetensors.torch import save_file

        state = _unique_state(model, dtype)
        need = sum(t.numel() * t.element_size() for t in state.values())
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise WeightStoreError(f"{self.root}: {need / 2**20:.0f} MiB needed for v{version}, "
                                   f"{free / 2**20:.0f} MiB free in /dev/shm")
        final = self.path(version)
        tmp = self.root / f".v{version}.tmp"
        try:
            save_file(state, str(tmp), metadata={"version": str(version)})
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise WeightStoreError(f"writing {final}: {exc}") from exc
        return final


def _unique_state(model: Any, dtype: Any) -> dict[str, Any]:
    """State dict with each shared storage once (tied lm_head dropped), contiguous, on CPU."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().cpu()
    return out


def load_weights(model: Any, path: str | Path) -> float:
    """Copy v<N>.safetensors into `model` in place (tied weights follow); returns seconds."""
    import torch
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    try:
        state = load_file(str(path), device=str(next(model.parameters()).device))
    except FileNotFoundError:
        raise WeightStoreError(f"{path}: no such weight version") from None
    params = model.state_dict()
    missing = [k for k in params if k not in state and not _is_tied(model, k)]
    if missing:
        raise WeightStoreError(f"{path}: missing tensors {missing[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return time.perf_counter() - t0


def _is_tied(model: Any, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name.startswith("lm_head.")
