"""The weight store: the one place that writes, publishes, finds and deletes weight versions.

    /dev/shm/areal_aio/<run>/            one folder per run, private to it
        owner.pid                        the controller's pid (dead owner -> swept at next start)
        v<N>.safetensors                 policy version N (the whole policy, or a LoRA run's
                                         adapter alone); written as .v<N>.tmp, then renamed,
                                         so a reader never sees half a file

The trainer publishes (`publish`), a Ray rollout actor on another node stores the bytes it was
shipped (`put`, areal_aio/fleet/ray_workers.py), the rollout worker loads
(`areal_aio.store.safetensors_io.load_weights`),
the controller decides what to keep (`retain`) and removes the folder
(`close`). Tied weights (lm_head = embed_tokens) are written once and tied
again on load. The bytes themselves are written and read by
`areal_aio.store.safetensors_io`, imported only by `publish`, so the controller stays free of torch.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_aio.store.safetensors_io import WeightStoreError

SHM_BASE = Path(os.environ.get("AREAL_AIO_SHM", "/dev/shm/areal_aio"))
VERSION_FILE = re.compile(r"^v(\d+)\.safetensors$")
OWNERLESS_GRACE_S = 60.0
"""A run folder without owner.pid is swept only once this old (it may be mid-`create`)."""


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts; another user's too)."""
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
        if not run.is_dir():
            continue
        try:
            pid = int((run / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            pid = None
        if pid is None:
            # `create` makes the folder, then writes owner.pid: a folder without one may be a
            # run being created right now, so only an old one counts as abandoned.
            try:
                if time.time() - run.stat().st_mtime < OWNERLESS_GRACE_S:
                    continue
            except FileNotFoundError:
                continue
        elif pid_alive(pid):
            continue
        _remove(run)
        removed.append(run)
    return removed


def _remove(folder: Path, attempts: int = 3) -> None:
    """rmtree, again if a worker of the dead run (finishing its step before it sees that its
    controller is gone) wrote a file into the folder while it was being removed."""
    for _ in range(attempts):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
        time.sleep(0.05)


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
        """Write `model`'s weights as v<version>.safetensors atomically; returns the path.

        `dtype` (a torch dtype) casts floating tensors on the way out, in small pieces
        through one scratch buffer, so a bf16 copy of the whole model is never allocated.
        """
        from areal_aio.store.safetensors_io import unique_state

        return self.publish_state(unique_state(model), version, dtype)

    def publish_state(self, state: dict[str, Any], version: int, dtype: Any = None,
                      metadata: dict[str, str] | None = None) -> Path:
        """Write the tensors of `state` (name -> tensor) as v<version>.safetensors atomically, as
        `publish` does for a whole model (a LoRA version is its adapter alone: workers/lora.py);
        `metadata` joins {"version": ...} in the file's header."""
        from areal_aio.store.safetensors_io import HEADER_ROOM, out_dtype, write_safetensors

        need = HEADER_ROOM + sum(t.numel() * out_dtype(t, dtype).itemsize for t in state.values())
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise WeightStoreError(f"{self.root}: {need / 2**20:.0f} MiB needed for v{version}, "
                                   f"{free / 2**20:.0f} MiB free in /dev/shm")
        final = self.path(version)
        tmp = self.root / f".v{version}.tmp"
        try:
            write_safetensors(tmp, state, dtype, {**(metadata or {}), "version": str(version)})
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise WeightStoreError(f"writing {final}: {exc}") from exc
            raise
        return final

    def put(self, version: int, data: bytes | memoryview | Any) -> Path:
        """Store a published file's bytes (shipped from the trainer's node) as v<version>,
        atomically like `publish`; returns the path."""
        final, tmp = self.path(version), self.root / f".v{version}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise WeightStoreError(f"writing {final}: {exc}") from exc
        return final
