"""Checkpoints: the folder format, atomic writes, validation, and what a resume may change.

    <run>/checkpoints/
        step-000020/                 one complete checkpoint (the newest run.keep_checkpoints kept)
            manifest.json            {"format", "step", "version", "files": {relative path: bytes}}
            controller.json          the controller's state (see keeping.Keeper.state)
            trainer/                 the trainer's part (workers/trainer/checkpoint.py): fp32 policy,
                                     optimizer, torch RNG, version
        .step-000040.tmp/            being written; never read

A checkpoint is written into the temp folder (the trainer writes trainer/, the controller
controller.json, then manifest.json last), every file and folder fsynced, then renamed into
place: a reader finds a complete checkpoint or none. Both parts belong to one version: the
controller takes a checkpoint right after committing a version and sends no Train until the
trainer has saved. Sampling needs no RNG state: every draw is a function of its request's seed
(areal_aio.seeds), and the controller draws no random numbers.

No torch here; the controller imports this module.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson

from areal_aio.settings import (
    Settings,
    SettingsError,
    devices_value,
    mode_presets,
    parse_value,
    resolved_settings,
)

FORMAT = 1
"""Checkpoint format version: bump it when the layout or controller.json changes meaning."""
FOLDER = "checkpoints"
STEP_DIR = re.compile(r"^step-(\d+)$")
RESUMABLE = ("run.max_steps", "run.max_wall_s", "run.threshold", "run.progress",
             "run.checkpoint_every", "run.keep_checkpoints", "run.keep_best", "task.eval_every",
             "rollout.device", "rollout.devices", "rollout.threads", "rollout.max_batch", "trainer.device",
             "trainer.devices",
             "trainer.threads", "controller.reward_procs", "ray.address", "ray.ship_weights")
"""Keys a resume may change: when and where to stop, save, report and evaluate, and on which
devices, cores and machines (a run may resume on a Ray cluster, or off it). Every other key
changes what is trained (data, model, objective, rollouts)."""
RUN_FILES = ("settings.toml", "summary.json", "steps.jsonl", "samples.jsonl")
"""A folder holding any of these holds a run."""
LOCK = ".lock"


class CheckpointError(RuntimeError):
    """A run folder or checkpoint that cannot be used; the message is one line naming why."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A validated checkpoint folder."""

    path: Path
    step: int
    version: int
    state: dict  # controller.json

    @property
    def trainer(self) -> Path:
        return self.path / "trainer"


# ---------------------------------------------------------------- the run folder


def claim(folder: Path, *, resume: bool) -> IO[str]:
    """Lock `folder` for this run (held until the returned file is closed, or the process ends).

    Without `resume` a folder that already holds a run is refused: a new run never writes over
    an old one. A second run on the same folder, at the same time, is refused either way."""
    if not resume and folder.is_dir():
        found = [name for name in RUN_FILES if (folder / name).exists()]
        if found:
            raise CheckpointError(f"{folder} already holds a run ({found[0]}); resume it with "
                                  "`run --resume` or choose another folder")
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / LOCK, "w")  # noqa: SIM115 - held for the whole run
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise CheckpointError(f"{folder} is in use by another run") from None
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def replace_folder(tmp: Path, final: Path) -> None:
    """Put the complete folder `tmp` at `final` (an older one there is removed after)."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def truncate_rows(folder: Path, sizes: dict[str, int]) -> None:
    """Cut each JSONL file back to its size at the checkpoint: rows written after it are redone."""
    for name, size in sizes.items():
        path = folder / f"{name}.jsonl"
        if path.exists() and path.stat().st_size > size:
            with open(path, "r+b") as fh:
                fh.truncate(size)


# ---------------------------------------------------------------- writing


def begin(run: Path, step: int) -> Path:
    """A fresh temp folder for the checkpoint of `step`."""
    tmp = run / FOLDER / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(run: Path, tmp: Path, state: dict, keep: int) -> tuple[Path, int]:
    """Write controller.json and the manifest into `tmp`, fsync, rename into place, keep the
    newest `keep`; returns (the checkpoint's folder, its bytes)."""
    (tmp / "controller.json").write_bytes(orjson.dumps(state))
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"format": FORMAT, "step": state["step"], "version": state["version"],
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    (tmp / "manifest.json").write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    for name in ("controller.json", "manifest.json"):
        _fsync_file(tmp / name)
    _fsync_dir(tmp)
    final = run / FOLDER / f"step-{state['step']:06d}"
    if final.exists():  # the stop checkpoint of a step that had its periodic one already
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)
    for old in _complete_steps(run)[:-keep] if keep > 0 else []:
        shutil.rmtree(run / FOLDER / f"step-{old:06d}", ignore_errors=True)
    return final, sum(files.values())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)


def _complete_steps(run: Path) -> list[int]:
    base = run / FOLDER
    if not base.is_dir():
        return []
    return sorted(int(m.group(1)) for p in base.iterdir() if (m := STEP_DIR.match(p.name)))


# ---------------------------------------------------------------- reading


def latest(run: Path) -> Checkpoint:
    """The newest checkpoint of run folder `run` (or `run` itself when it is a checkpoint)."""
    if not run.is_dir():
        raise CheckpointError(f"{run}: no such run folder")
    if STEP_DIR.match(run.name) and run.parent.name == FOLDER:
        return load(run)
    steps = _complete_steps(run)
    if not steps:
        raise CheckpointError(f"{run}: no checkpoint to resume from (run.checkpoint_every was 0, "
                              "or the run stopped before its first one)")
    return load(run / FOLDER / f"step-{steps[-1]:06d}")


def load(path: Path) -> Checkpoint:
    """Validate one checkpoint folder: its manifest, its format and every file it lists."""
    try:
        manifest = orjson.loads((path / "manifest.json").read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: partial checkpoint (no manifest.json); remove it to "
                              "resume from an older one") from None
    except orjson.JSONDecodeError:
        raise CheckpointError(f"{path}: partial checkpoint (manifest.json is not JSON)") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, this version "
                              f"of areal_aio reads format {FORMAT}")
    for name, size in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"{path}: partial checkpoint ({name} is missing or truncated)")
    if not (path / "trainer" / "state.json").is_file():
        raise CheckpointError(f"{path}: partial checkpoint (no trainer part)")
    state = orjson.loads((path / "controller.json").read_bytes())
    return Checkpoint(path, int(manifest["step"]), int(manifest["version"]), state)


def resume_settings(ckpt: Checkpoint, overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """The checkpoint's settings with `overrides`, each of which must be resumable."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key not in RESUMABLE:
            raise CheckpointError(f"--set {key}: cannot change on resume (it changes what is "
                                  f"trained); resumable keys: {', '.join(RESUMABLE)}")
    try:
        return resolved_settings(ckpt.state["settings"], [*sync_threads(ckpt, overrides), *overrides])
    except SettingsError as exc:
        raise CheckpointError(f"settings error: {exc}") from None


def sync_threads(ckpt: Checkpoint, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """A sync run resumed with other devices: each role's threads preset again for its new
    workers (settings.mode_presets), unless `overrides` give them; the checkpoint's were for
    its own. Other modes keep their threads (no preset there)."""
    saved = ckpt.state["settings"]
    if saved["run"]["mode"] != "sync":
        return []
    given = {item.partition("=")[0].strip(): parse_value(item.partition("=")[2].strip()) for item in overrides}
    keys = ("rollout.device", "rollout.devices", "trainer.device", "trainer.devices")
    if not any(key in given for key in keys):
        return []
    devices = {key: given.get(key, saved[key.partition(".")[0]][key.partition(".")[2]]) for key in keys}
    devices = {key: devices_value(key, v) if key.endswith("devices") else v for key, v in devices.items()}
    return [f"{key}={value}" for key, value in mode_presets("sync", devices).items()
            if key.endswith(".threads") and key not in given]


def check_compatible(ckpt: Checkpoint, settings: Settings) -> None:
    """Settings may differ from the checkpoint's only in RESUMABLE keys."""
    # a key or section newer than the checkpoint (lora, task.episode) was trained with its default
    saved = resolved_settings(ckpt.state["settings"]).to_dict()
    for section, values in settings.to_dict().items():
        if section == "sft":
            continue  # read by the sft command only, never by a run
        for key, value in values.items():
            name = f"{section}.{key}"
            old = saved[section][key]
            if name not in RESUMABLE and old != value and name not in ("run.name", "run.out_dir"):
                raise CheckpointError(f"{name} is {value!r}, the checkpoint was trained with {old!r}; "
                                      "only resumable keys may change")
