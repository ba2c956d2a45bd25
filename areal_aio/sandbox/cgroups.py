"""A cgroup per sandbox run: its memory and its processes bounded as a whole (sandbox/sandbox.py).

    find()   once per process: where this process may make cgroups
               v2: the unified hierarchy, memory and pids enabled for this process's cgroup's
                   children (cgroup.subtree_control), as a delegated or a root-owned tree has them
               v1: the memory hierarchy (and the pids one, where mounted) at this process's path
             a trial cgroup is made and removed; None and why where none can be
    RunGroup(where, memory_bytes, pids)   one run's cgroup, made before the run and removed after
      .procs   the cgroup.procs files the ns's init writes "0" into first (it and every process it
               forks are then inside: a child is born in its parent's cgroup)
      .peak    the most memory the run's processes held at once (read before removal)

The kernel then refuses the run's processes more memory than `memory_bytes` all together (its
OOM killer picks among them alone, never the caller) and more than `pids` processes; swap is
not theirs to use (memsw / swap.max). Without a cgroup the sandbox falls back to per-process
limits (RLIMIT_AS x RLIMIT_NPROC kept within a share of RAM by arithmetic).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "areal_aio-sbx-"
"""The name every run's cgroup begins with (then this process's pid and a random token)."""
REMOVE_WAIT_S = 2.0
"""After the run's processes are killed, how long removing its cgroup may wait for the kernel to
let go of them (an rmdir answers EBUSY until the last one is reaped)."""


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Where this process makes the runs' cgroups: `memory` (v2: the one folder for both
    controllers) and, under v1, `pids` where the pids controller is mounted."""

    version: int
    memory: Path
    pids: Path | None = None
    swap: bool = False  # the runs' swap is bounded too (memsw / swap.max could be written)

    def describe(self) -> str:
        return f"cgroup v{self.version} (memory{' and pids' if self.version == 2 or self.pids else ''})"


def mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Controller ("memory", "pids"; "" for the v2 hierarchy) -> (mount point, mount root), from
    /proc/self/mountinfo's text."""
    found: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            found.setdefault("", (point, root))
        elif fstype == "cgroup":
            for controller in ("memory", "pids"):
                if controller in options:
                    found.setdefault(controller, (point, root))
    return found


def own_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller ("memory", "pids"; "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths[""] = path
        for controller in controllers.split(","):
            if controller in ("memory", "pids"):
                paths[controller] = path
    return paths


def folder(mount: tuple[str, str], path: str) -> Path:
    """The folder of cgroup `path` in a hierarchy mounted at mount[0] whose root is mount[1]."""
    point, root = mount
    relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return Path(point) / ("" if relative == "." else relative)


def find() -> tuple[Hierarchy | None, str]:
    """Where runs' cgroups can be made by this process (a trial one made, limited and removed),
    v2 first; (None, why) where they cannot. Never raises."""
    try:
        found = mounts(Path("/proc/self/mountinfo").read_text())
        paths = own_paths(Path("/proc/self/cgroup").read_text())
    except OSError as exc:
        return None, f"cannot read this process's cgroups: {exc}"
    tried = []
    candidates = []
    if "" in found and "" in paths:
        candidates.append(Hierarchy(2, folder(found[""], paths[""])))
    if "memory" in found and "memory" in paths:
        pids = folder(found["pids"], paths["pids"]) if "pids" in found and "pids" in paths else None
        candidates.append(Hierarchy(1, folder(found["memory"], paths["memory"]), pids))
    for where in candidates:
        if where.version == 2 and not {"memory", "pids"} <= _enabled(where.memory):
            tried.append(f"v2: memory and pids are not enabled for the children of {where.memory}")
            continue
        trial = RunGroup(where, 64 << 20, 8)
        try:
            with trial:
                pass
        except OSError as exc:
            tried.append(f"v{where.version}: {exc.strerror or exc} ({getattr(exc, 'filename', '') or where.memory})")
            continue
        return dataclasses.replace(where, swap=trial.swap), ""
    return None, "; ".join(tried) or "no cgroup hierarchy with a memory controller is mounted"


def _enabled(path: Path) -> set[str]:
    try:
        return set((path / "cgroup.subtree_control").read_text().split())
    except OSError:
        return set()


class RunGroup:
    """One run's cgroup (module docstring); made on entry, removed on exit."""

    def __init__(self, where: Hierarchy, memory_bytes: int, pids: int) -> None:
        self.where, self.memory_bytes, self.pids_max = where, memory_bytes, pids
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.folders: list[Path] = []
        self.peak: int | None = None
        self.swap = False  # its swap limit was written (the kernel has one)

    @property
    def procs(self) -> list[str]:
        """The cgroup.procs files a process writes "0" into to join (each hierarchy's)."""
        return [str(f / "cgroup.procs") for f in self.folders]

    def __enter__(self) -> RunGroup:
        self.make()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def make(self) -> None:
        """Make the folders and write the limits; OSError (nothing left behind) where it cannot."""
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        w, memory = self.where, str(self.memory_bytes)
        main = w.memory / self.name
        main.mkdir()
        self.folders.append(main)
        if w.version == 2:
            _write(main / "memory.max", memory)
            self.swap = _write(main / "memory.swap.max", "0", optional=True)
            _write(main / "pids.max", str(self.pids_max))
            return
        _write(main / "memory.limit_in_bytes", memory)
        self.swap = _write(main / "memory.memsw.limit_in_bytes", memory, optional=True)  # no swap beyond it
        if w.pids is not None:
            pids = w.pids / self.name
            pids.mkdir()
            self.folders.append(pids)
            _write(pids / "pids.max", str(self.pids_max))

    def remove(self) -> None:
        """Read the peak, then remove each folder, waiting while the kernel still holds a process."""
        if self.folders and self.peak is None:
            name = "memory.peak" if self.where.version == 2 else "memory.max_usage_in_bytes"
            with contextlib.suppress(OSError, ValueError):
                self.peak = int((self.folders[0] / name).read_text())
        deadline = time.monotonic() + REMOVE_WAIT_S
        for path in reversed(self.folders):
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break  # left behind: named PREFIX, it holds no process worth keeping
                    time.sleep(0.01)
        self.folders = []


def _write(path: Path, value: str, optional: bool = False) -> bool:
    """Write one control file; an `optional` one this kernel lacks (or refuses) is left as it is
    (False)."""
    try:
        with open(path, "w") as fh:
            fh.write(value)
    except OSError:
        if not optional:
            raise
        return False
    return True
