"""Keeping the run: checkpoints, resume, the model/ and best/ exports.

    train loop, after a commit:  best eval pending? --> export_best --> <run>/best/
                                 every run.checkpoint_every steps --> checkpoint --> checkpoints/step-N
    at a stop (trainer alive):   link.settle (a step in flight is committed) --> model/ --> best/
                                 --> a final checkpoint; then the trainer is stopped and the
                                 temp folders of a write it cut short are removed
    resume:                      the checkpoint's best and resumes come back here; the
                                 controller is built from its part (RunState)

A checkpoint is the controller's state at one instant after a commit, then the trainer's part
of that same version (no Train is sent until it is saved: the train loop awaits each Save, a
stop reads its own replies through the link), then the atomic rename (areal_aio.store.checkpoint).
Exports are HF folders written beside the run and replaced whole. With run.keep_best, a new
best eval's version stays in the weight store (`retain`) until best/ holds it.

The Keeper is given what it reads, never the controller: the run folder, the settings, the
trainer link, the checkpoint resumed from, and two views of the controller's clock
(`position`: the last committed step and version; `controller_state`: its part of a
checkpoint); the run log and the weight store once they are open (`attach`). It sees every
eval row (`evaluated`), so it knows which row an export's version scored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from areal_aio.control.progress import say
from areal_aio.control.runlog import RunLog
from areal_aio.control.stats import Counts, Failure, worker_failure
from areal_aio.control.trainer_link import TrainerLink
from areal_aio.fleet.client import WorkerFailed
from areal_aio.settings import Settings
from areal_aio.store import checkpoint
from areal_aio.store.weights import WeightStore
from areal_aio.tasks.task import Task

STOP_SAVE_TIMEOUT_S = 600.0
"""At a stop the trainer may first finish a step in flight, then writes model/ and a checkpoint:
a few seconds for a 135M model, minutes at most for a large one on a slow disk."""
EXPORTS = ("model", "best")
"""The HF folders a run writes beside its rows (as .<name>.tmp first)."""


RESUME_FIELDS: dict[str, str] = {
    "step": "The step of the checkpoint the run resumed from.",
    "version": "The policy version of that checkpoint.",
    "checkpoint": "Its folder under checkpoints/ (step-<N>).",
    "lost_in_flight": "Samples of the groups admitted and not trained at the checkpoint, generated again first.",
    "wall_s": "Wall seconds the run had spent before this resume.",
}
"""An entry of summary.json's resumes (and the `resumed` event): `Keeper.resumed`."""
BEST_FIELDS: dict[str, str] = {
    "pass_rate": "Its held-out pass rate.",
    "version": "The policy version it scored (best/ holds it with run.keep_best).",
    "step": "The step of that eval.",
}
"""summary.json's best_eval: the best eval of a trained version (`Keeper.evaluated`)."""


@dataclass(frozen=True, slots=True)
class Position:
    """Where the run stands: the last committed step and the version it committed."""

    step: int
    version: int


@dataclass(slots=True)
class RunState:
    """The controller's part of a checkpoint, at one instant after a commit (Keeper.state adds
    the best eval, the resumes, the row files' sizes and the settings); a fresh run starts from
    the defaults. A resumed controller is built from it: the clock, counters and eval curve
    come back, the groups admitted but not trained (`open_groups`) are dispatched again first
    (same group ids, tasks and sampling seeds: the samples they lost in flight are counted as
    lost_in_flight), then the task stream continues after the `consumed` tasks."""

    step: int = 0  # the last committed step
    version: int = 0  # the policy clock (staleness.Admission)
    trained: int = 0  # samples trained so far (staleness.Admission)
    consumed: int = 0  # tasks taken from the source (a resume skips them)
    next_group: int = 0  # the id the next admitted group gets
    wall_s: float = 0.0  # wall seconds of the run so far (the processes before this one)
    open_groups: dict[int, Task] = field(default_factory=dict)  # group id -> its task (groups.Groups)
    counts: Counts = field(default_factory=Counts)
    eval_curve: list[dict] = field(default_factory=list)  # the eval rows (evaluation.Evaluator)
    commit_wall: dict[int, float] = field(default_factory=lambda: {0: 0.0})  # version -> wall_s at its commit
    time_to_threshold: float | None = None
    max_trained_staleness: int = 0
    busy: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "trainer": 0.0})  # seconds busy
    process: dict[str, Any] | None = None  # the process reward's counters (rewards.process.StepCredit)

    def to_dict(self) -> dict[str, Any]:
        """As a checkpoint stores it (JSON: string keys, tasks as dicts)."""
        counts, hist = self.counts.state()
        return {
            "step": self.step, "version": self.version, "trained": self.trained, "consumed": self.consumed,
            "next_group": self.next_group, "wall_s": self.wall_s,
            "open_groups": [{"group": gid, "task": dataclasses.asdict(task)}
                            for gid, task in sorted(self.open_groups.items())],
            "counts": counts, "staleness_hist": hist,
            "eval_curve": self.eval_curve, "commit_wall": {str(k): v for k, v in self.commit_wall.items()},
            "time_to_threshold": self.time_to_threshold, "max_trained_staleness": self.max_trained_staleness,
            "busy": self.busy, "process": self.process}

    @classmethod
    def of(cls, ckpt: checkpoint.Checkpoint | None) -> RunState:
        """Where a run starts: the checkpoint's controller state, or a fresh run's."""
        if ckpt is None:
            return cls()
        state = ckpt.state
        return cls(
            step=state["step"], version=state.get("version", 0), trained=state.get("trained", 0),
            consumed=state["consumed"], next_group=state["next_group"], wall_s=state["wall_s"],
            open_groups={g["group"]: Task(**g["task"]) for g in state["open_groups"]},
            counts=Counts.from_state(state["counts"], state["staleness_hist"]),
            eval_curve=list(state["eval_curve"]),
            commit_wall={int(k): v for k, v in state["commit_wall"].items()},
            time_to_threshold=state["time_to_threshold"], max_trained_staleness=state["max_trained_staleness"],
            busy=dict(state["busy"]), process=state.get("process"))


def run_name(settings: Settings) -> str:
    """run.name, else <mode>-<time>-<pid>: the run folder's name under run.out_dir."""
    return settings.run.name or f"{settings.run.mode}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def resume_from(resume: str | Path | checkpoint.Checkpoint | None, settings: Settings) -> checkpoint.Checkpoint | None:
    """The checkpoint to resume from (the newest of a run folder), checked against `settings`."""
    if resume is None:
        return None
    ckpt = resume if isinstance(resume, checkpoint.Checkpoint) else checkpoint.latest(Path(resume))
    checkpoint.check_compatible(ckpt, settings)
    return ckpt


RESUME_REFUSED = "resume: "
"""How the trainer's refusal of a checkpoint reads, after its exception type
(workers/trainer/checkpoint.py load_state: an adapter on another base, LoRA against full weights)."""
WHOLE_BYTES = 1 << 20
"""FolderState keeps a file under this size whole (summary.json, settings.toml, .lock); a larger
one is only ever appended to before the workers are up (events.jsonl, the workers' logs)."""


def refused_resume(error: BaseException) -> str | None:
    """The trainer's refusal of the checkpoint it was to resume from, in one line, if that is what
    ended the run (an input error: the run never started)."""
    failure = worker_failure(error)
    if not isinstance(failure, WorkerFailed) or failure.role != "trainer":
        return None
    why = failure.message.strip().splitlines()[0].partition(": ")[2] if failure.message.strip() else ""
    return why.removeprefix(RESUME_REFUSED) if why.startswith(RESUME_REFUSED) else None


@dataclass(frozen=True, slots=True)
class FolderState:
    """The files at the top of a run folder as a resume found them, to put back when the trainer
    refuses the checkpoint: by then the run had started writing (its lock, settings, rows cut
    back to the checkpoint, events, workers' logs, a failed summary), and a refused resume must
    leave the run it refused byte for byte as it was. Sub-folders (checkpoints, model/) are not
    written before the workers are up. Each file is kept from an offset on: the rows the
    checkpoint counted (`keep`) and a large file's bytes so far stay where they are."""

    folder: Path
    tails: dict[str, tuple[int, bytes]]  # file name -> (offset, its bytes from there)

    @classmethod
    def at_resume(cls, ckpt: checkpoint.Checkpoint) -> FolderState:
        """`ckpt`'s run folder as the resume from it finds it: its row files kept from where the
        checkpoint counted them (what Keeper.claim cuts them back to)."""
        rows = {f"{name}.jsonl": size for name, size in ckpt.state["rows"].items()}
        return cls.of(ckpt.path.parent.parent, rows)

    @classmethod
    def of(cls, folder: Path, keep: dict[str, int]) -> FolderState:
        tails = {}
        for path in _own_files(folder):
            size = path.stat().st_size
            start = min(keep.get(path.name, 0 if size < WHOLE_BYTES else size), size)
            with open(path, "rb") as fh:
                fh.seek(start)
                tails[path.name] = (start, fh.read())
        return cls(folder, tails)

    def restore(self) -> None:
        """Every file as it was; a file the resume made is removed (a link is neither)."""
        for path in _own_files(self.folder):
            if path.name not in self.tails:
                path.unlink()
        for name, (start, data) in self.tails.items():
            path = self.folder / name
            with open(path, "r+b" if path.exists() else "wb") as fh:
                fh.seek(start)
                fh.write(data)
                fh.truncate()


def _own_files(folder: Path) -> list[Path]:
    """The plain files at the top of `folder`: what FolderState keeps and puts back. A symbolic
    link is the user's, never a run's, and is left as it is."""
    return [path for path in folder.iterdir() if path.is_file() and not path.is_symlink()]


class Keeper:
    """Writes what outlives the run's processes; owns the best eval and the resumes so far.

    `position()` and `controller_state()` read the controller at the moment of a write;
    trainer requests go through `link` (areal_aio.control.trainer_link)."""

    def __init__(self, folder: Path, settings: Settings, link: TrainerLink, ckpt: checkpoint.Checkpoint | None,
                 *, position: Callable[[], Position], controller_state: Callable[[], dict[str, Any]]) -> None:
        self.folder = folder
        self.settings = settings
        self.link = link
        self.ckpt = ckpt  # the checkpoint this run resumed from, if any
        self._position = position
        self._controller_state = controller_state
        self.log: RunLog | None = None  # set by attach, once the run has opened them
        self.store: WeightStore | None = None
        self.best: dict[str, Any] = {"pass_rate": -1.0, "version": None, "step": None}
        self.best_pending: int | None = None  # a new best version not yet exported
        self.eval_starts: dict[int, int] = {}  # eval step -> version it started on (keep_best pins)
        self.resumes: list[dict] = []
        self._eval_of: dict[int, dict[str, Any]] = {}  # version -> its newest eval row
        if ckpt is not None:
            self.best = dict(ckpt.state["best"])  # best_pending stays None: that version's file is gone
            self.resumes = list(ckpt.state["resumes"])
            for row in ckpt.state["eval_curve"]:
                self._eval_of[row["version"]] = row

    def attach(self, log: RunLog, store: WeightStore) -> None:
        """The run's log and weight store, once open (before any write or commit)."""
        self.log, self.store = log, store

    # ------------------------------------------------------------------ state

    def claim(self) -> IO[str]:
        """The run folder, locked for this run (checkpoint.claim); resuming, its row files are
        cut back to what the checkpoint counted."""
        lock = checkpoint.claim(self.folder, resume=self.ckpt is not None)
        if self.ckpt is not None:
            checkpoint.truncate_rows(self.folder, self.ckpt.state["rows"])
        return lock

    def state(self) -> dict[str, Any]:
        """Everything resuming needs, at one instant after a commit (the row files' sizes, counting
        rows not yet written, mark where a resume cuts them back to)."""
        return {**self._controller_state(), "best": self.best, "best_pending": self.best_pending,
                "rows": self.log.sizes(), "resumes": self.resumes, "settings": self.settings.to_dict()}

    def resumed(self, lost: int, spent: float) -> None:
        """Record this resume: `lost` samples were in flight at the checkpoint, `spent` wall
        seconds ran before it."""
        at = self._position()
        entry = {"step": at.step, "version": at.version, "checkpoint": self.ckpt.path.name,
                 "lost_in_flight": lost, "wall_s": round(spent, 3)}
        self.resumes.append(entry)
        self.log.events.info("resumed", **entry)

    # ------------------------------------------------------------------ best eval

    def evaluated(self, row: dict[str, Any]) -> None:
        """An eval row is in: a better pass rate of a trained version is the new best."""
        self._eval_of[row["version"]] = row
        if row["version"] >= 1 and row["pass_rate"] > self.best["pass_rate"]:
            self.best = {"pass_rate": row["pass_rate"], "version": row["version"], "step": row["step"]}
            if self.settings.run.keep_best:
                self.best_pending = row["version"]  # exported by the train loop (or at the stop)

    def retain(self) -> None:
        """Keep in the store what someone may still load: the newest and the one before (the
        rollout worker may be mid-load); with keep_best also every version an eval in flight
        may be stamped with, and a best not yet exported."""
        version = self._position().version
        keep = {version, version - 1}
        if self.settings.run.keep_best:
            floors = [*self.eval_starts.values(), *([self.best_pending] if self.best_pending else [])]
            if floors:
                keep |= set(range(min(floors), version + 1))
        self.store.retain(keep)

    # ------------------------------------------------------------------ writing

    async def checkpoint(self, request: Callable[..., Any] | None = None) -> None:
        """Controller state now, trainer part next (the trainer holds this version: no Train is
        sent until it is saved), then the atomic rename (areal_aio.store.checkpoint)."""
        t0 = time.perf_counter()
        at = self._position()
        state = self.state()
        tmp = checkpoint.begin(self.folder, at.step)
        saved = await (request or self.link.save)("checkpoint", tmp / "trainer")
        if saved.version != at.version:
            raise WorkerFailed("trainer", f"saved version {saved.version} for a checkpoint of {at.version}")
        await self.log.settle()  # the rows the checkpoint counts are on disk before it exists
        path, size = await asyncio.to_thread(checkpoint.commit, self.folder, tmp, state,
                                             self.settings.run.keep_checkpoints)
        self.log.events.info("checkpoint", step=at.step, version=at.version, path=str(path),
                             bytes=size, seconds=round(time.perf_counter() - t0, 3),
                             trainer_s=round(saved.seconds, 3))

    async def export(self, name: str, version: int, request: Callable[..., Any] | None = None,
                     weights: str = "") -> None:
        """The policy of `version` as an HF folder at <run>/<name>, replaced whole."""
        t0 = time.perf_counter()
        tmp = self.folder / f".{name}.tmp"
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        saved = await (request or self.link.save)("model", tmp, weights)
        if not weights and saved.version != version:
            raise WorkerFailed("trainer", f"exported version {saved.version}, expected {version}")
        info = {"version": version, "step": self._position().step if name == "model" else self.best["step"],
                "eval": self._eval_of.get(version), "settings": self.settings.to_dict()}
        (tmp / "areal_aio.json").write_bytes(orjson.dumps(info, option=orjson.OPT_INDENT_2))
        await asyncio.to_thread(checkpoint.replace_folder, tmp, self.folder / name)
        self.log.events.info("exported", folder=name, version=version, bytes=saved.bytes,
                             seconds=round(time.perf_counter() - t0, 3))

    async def export_best(self, request: Callable[..., Any] | None = None) -> None:
        """best/ from the pending best version."""
        version = self.best_pending
        # the live weights when they are that version, else its (pinned) weight-store file
        weights = "" if version == self._position().version else str(self.store.path(version))
        await self.export("best", version, request, weights)
        if self.best_pending == version:
            self.best_pending = None
        self.retain()

    # ------------------------------------------------------------------ at a stop

    async def keep_and_stop_trainer(self, failure: Failure | None,
                                    workers_up: bool) -> None:
        """At a stop: a trainer that is alive keeps the run (finishes a step in flight, writes
        model/, best/, a checkpoint), then is stopped; a write it did not finish leaves no
        temp folder (model/ and best/ stay whole or as they were, the checkpoints before it whole).
        Nothing here needs the console: a line it cannot take goes to the run folder (say)."""
        try:
            if workers_up and getattr(failure, "role", None) != "trainer":  # a broken reward pool has no role
                await asyncio.wait_for(self.keep_at_stop(), STOP_SAVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - keeping must never hide why the run stopped
            if self.log is not None:
                self.log.events.info("keep_failed", error=f"{type(exc).__name__}: {exc}")
            say(f"areal_aio: could not write model/ or the final checkpoint: {exc}", folder=self.folder)
        finally:
            try:
                await self.link.trainer.stop()
            finally:  # the trainer is gone: nothing writes into a temp folder any more
                await asyncio.to_thread(self.remove_temp_folders)

    def remove_temp_folders(self) -> None:
        """The temp folders of exports and checkpoints this run did not finish."""
        leftovers = [self.folder / f".{name}.tmp" for name in EXPORTS]
        base = self.folder / checkpoint.FOLDER
        if base.is_dir():
            leftovers += [p for p in base.iterdir() if p.name.startswith(".step-") and p.name.endswith(".tmp")]
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)

    async def keep_at_stop(self) -> None:
        await self.link.settle()  # replies to what was sent before the stop come first
        version = self._position().version
        if version < 1:
            return
        await self.export("model", version, self.link.save_at_stop)
        if self.best_pending is not None:
            await self.export_best(self.link.save_at_stop)
        if self.settings.run.checkpoint_every:
            await self.checkpoint(self.link.save_at_stop)
