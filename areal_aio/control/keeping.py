"""Keeping the run: checkpoints, resume, the model/ and best/ exports.

    train loop, after a commit:  best eval pending? --> export_best --> <run>/best/
                                 every run.checkpoint_every steps --> checkpoint --> checkpoints/step-N
    at a stop (trainer alive):   link.settle (a step in flight is committed) --> model/ --> best/
                                 --> a final checkpoint; then the trainer is stopped
    resume:                      the checkpoint's best and resumes come back here, the rest
                                 in the controller (Orchestrator.run_state is its part)

A checkpoint is the controller's state at one instant after a commit, then the trainer's part
of that same version (no Train is sent until it is saved: the train loop awaits each Save, a
stop reads its own replies through the link), then the atomic rename (areal_aio.store.checkpoint).
Exports are HF folders written beside the run and replaced whole. With run.keep_best, a new
best eval's version stays in the weight store (`retain`) until best/ holds it.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from areal_aio.fleet.client import WorkerFailed
from areal_aio.rewards.pool import RewardPoolBroken
from areal_aio.settings import Settings
from areal_aio.store import checkpoint

if TYPE_CHECKING:
    from areal_aio.control.controller import Orchestrator

STOP_SAVE_TIMEOUT_S = 600.0
"""At a stop the trainer may first finish a step in flight, then writes model/ and a checkpoint:
a few seconds for a 135M model, minutes at most for a large one on a slow disk."""


def resume_from(resume: str | Path | checkpoint.Checkpoint | None, settings: Settings) -> checkpoint.Checkpoint | None:
    """The checkpoint to resume from (the newest of a run folder), checked against `settings`."""
    if resume is None:
        return None
    ckpt = resume if isinstance(resume, checkpoint.Checkpoint) else checkpoint.latest(Path(resume))
    checkpoint.check_compatible(ckpt, settings)
    return ckpt


class Keeper:
    """Writes what outlives the run's processes; owns the best eval and the resumes so far.

    `run` gives the folder, log, weight store, clock, eval curve and its part of a checkpoint
    (all public); trainer requests go through `run.link` (areal_aio.control.trainer_link)."""

    def __init__(self, run: Orchestrator, ckpt: checkpoint.Checkpoint | None) -> None:
        self.run = run
        self.ckpt = ckpt  # the checkpoint this run resumed from, if any
        self.best: dict[str, Any] = {"pass_rate": -1.0, "version": None, "step": None}
        self.best_pending: int | None = None  # a new best version not yet exported
        self.eval_starts: dict[int, int] = {}  # eval step -> version it started on (keep_best pins)
        self.resumes: list[dict] = []
        if ckpt is not None:
            self.best = dict(ckpt.state["best"])  # best_pending stays None: that version's file is gone
            self.resumes = list(ckpt.state["resumes"])

    # ------------------------------------------------------------------ state

    def claim(self) -> IO[str]:
        """The run folder, locked for this run (checkpoint.claim); resuming, its row files are
        cut back to what the checkpoint counted."""
        lock = checkpoint.claim(self.run.folder, resume=self.ckpt is not None)
        if self.ckpt is not None:
            checkpoint.truncate_rows(self.run.folder, self.ckpt.state["rows"])
        return lock

    def state(self) -> dict[str, Any]:
        """Everything resuming needs, at one instant after a commit (the row files' sizes, counting
        rows not yet written, mark where a resume cuts them back to)."""
        run = self.run
        return {**run.run_state(), "best": self.best, "best_pending": self.best_pending,
                "rows": run.log.sizes(), "resumes": self.resumes, "settings": run.settings.to_dict()}

    def resumed(self, lost: int, spent: float) -> None:
        """Record this resume: `lost` samples were in flight at the checkpoint, `spent` wall
        seconds ran before it."""
        run = self.run
        entry = {"step": run.step, "version": run.version, "checkpoint": self.ckpt.path.name,
                 "lost_in_flight": lost, "wall_s": round(spent, 3)}
        self.resumes.append(entry)
        run.log.events.info("resumed", **entry)

    # ------------------------------------------------------------------ best eval

    def evaluated(self, row: dict[str, Any]) -> None:
        """An eval row is in: a better pass rate of a trained version is the new best."""
        if row["version"] >= 1 and row["pass_rate"] > self.best["pass_rate"]:
            self.best = {"pass_rate": row["pass_rate"], "version": row["version"], "step": row["step"]}
            if self.run.settings.run.keep_best:
                self.best_pending = row["version"]  # exported by the train loop (or at the stop)

    def retain(self) -> None:
        """Keep in the store what someone may still load: the newest and the one before (the
        rollout worker may be mid-load); with keep_best also every version an eval in flight
        may be stamped with, and a best not yet exported."""
        version = self.run.version
        keep = {version, version - 1}
        if self.run.settings.run.keep_best:
            floors = [*self.eval_starts.values(), *([self.best_pending] if self.best_pending else [])]
            if floors:
                keep |= set(range(min(floors), version + 1))
        self.run.store.retain(keep)

    # ------------------------------------------------------------------ writing

    async def checkpoint(self, request: Callable[..., Any] | None = None) -> None:
        """Controller state now, trainer part next (the trainer holds this version: no Train is
        sent until it is saved), then the atomic rename (areal_aio.store.checkpoint)."""
        run = self.run
        t0 = time.perf_counter()
        state = self.state()
        tmp = checkpoint.begin(run.folder, run.step)
        saved = await (request or run.link.save)("checkpoint", tmp / "trainer")
        if saved.version != run.version:
            raise WorkerFailed("trainer", f"saved version {saved.version} for a checkpoint of {run.version}")
        await run.log.settle()  # the rows the checkpoint counts are on disk before it exists
        path, size = await asyncio.to_thread(checkpoint.commit, run.folder, tmp, state,
                                             run.settings.run.keep_checkpoints)
        run.log.events.info("checkpoint", step=run.step, version=run.version, path=str(path),
                            bytes=size, seconds=round(time.perf_counter() - t0, 3),
                            trainer_s=round(saved.seconds, 3))

    async def export(self, name: str, version: int, request: Callable[..., Any] | None = None,
                     weights: str = "") -> None:
        """The policy of `version` as an HF folder at <run>/<name>, replaced whole."""
        run = self.run
        t0 = time.perf_counter()
        tmp = run.folder / f".{name}.tmp"
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        saved = await (request or run.link.save)("model", tmp, weights)
        if not weights and saved.version != version:
            raise WorkerFailed("trainer", f"exported version {saved.version}, expected {version}")
        info = {"version": version, "step": run.step if name == "model" else self.best["step"],
                "eval": next((r for r in reversed(run.eval_curve) if r["version"] == version), None),
                "settings": run.settings.to_dict()}
        (tmp / "areal_aio.json").write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
        await asyncio.to_thread(checkpoint.replace_folder, tmp, run.folder / name)
        run.log.events.info("exported", folder=name, version=version, bytes=saved.bytes,
                            seconds=round(time.perf_counter() - t0, 3))

    async def export_best(self, request: Callable[..., Any] | None = None) -> None:
        """best/ from the pending best version."""
        version = self.best_pending
        # the live weights when they are that version, else its (pinned) weight-store file
        weights = "" if version == self.run.version else str(self.run.store.path(version))
        await self.export("best", version, request, weights)
        if self.best_pending == version:
            self.best_pending = None
        self.retain()

    # ------------------------------------------------------------------ at a stop

    async def keep_and_stop_trainer(self, failure: WorkerFailed | RewardPoolBroken | None,
                                    workers_up: bool) -> None:
        """At a stop: a trainer that is alive keeps the run (finishes a step in flight, writes
        model/, best/, a checkpoint), then is stopped."""
        run = self.run
        try:
            if workers_up and getattr(failure, "role", None) != "trainer":  # a broken reward pool has no role
                await asyncio.wait_for(self.keep_at_stop(), STOP_SAVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - keeping must never hide why the run stopped
            if run.log is not None:
                run.log.events.info("keep_failed", error=f"{type(exc).__name__}: {exc}")
            print(f"areal_aio: could not write model/ or the final checkpoint: {exc}", file=sys.stderr)
        finally:
            await run.link.trainer.stop()

    async def keep_at_stop(self) -> None:
        run = self.run
        await run.link.settle()  # replies to what was sent before the stop come first
        if run.version < 1:
            return
        await self.export("model", run.version, run.link.save_at_stop)
        if self.best_pending is not None:
            await self.export_best(run.link.save_at_stop)
        if run.settings.run.checkpoint_every:
            await self.checkpoint(run.link.save_at_stop)

