"""Experiment trackers: step and eval rows sent to TensorBoard, Weights & Biases or trackio.

    Orchestrator.events() --step / eval rows--> follow() --metric names (table below)-->
        tensorboard: <run folder>/tensorboard/   (event files)
        wandb:       <run folder>/wandb/          (offline unless WANDB_MODE says otherwise)
        trackio:     trackio's own folder ($TRACKIO_DIR), project "areal_aio", run = folder name

A tracker is a consumer of the orchestrator's event stream, never a part of
the controller: the JSONL rows in the run folder stay the record, and a
tracker that is slow or fails cannot stall training (each backend call runs in
a thread, in order). Each backend is an optional extra (`pip install
'areal_aio[tensorboard]'`); naming one whose package is missing is a settings
error at `check` time, not a failure an hour into a run. The names follow what
TRL and prime-rl users read on their dashboards: `train/reward`,
`eval/pass_rate`, `perf/gen_tokens_per_s`, `staleness/max`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from areal_aio.control.progress import say

if TYPE_CHECKING:
    from areal_aio.control.controller import Orchestrator

PROJECT = "areal_aio"
"""wandb / trackio project every run is logged under (the run's name is its folder's)."""
CLOSE_TIMEOUT_S = 60.0
"""How long a finished run waits for its trackers to write their last rows (wandb syncs files)."""

STEP_METRICS = {
    "reward_mean": "train/reward",
    "pass_rate": "train/pass_rate",
    "strict_rate": "train/strict_rate",
    "loss": "train/loss",
    "entropy": "train/entropy",
    "kl": "train/kl",
    "grad_norm": "train/grad_norm",
    "skipped": "train/skipped",
    "clip_frac": "train/clip_frac",
    "groups": "train/groups",
    "spread_frac": "train/spread_frac",
    "solved_frac": "train/solved_frac",
    "unsolved_frac": "train/unsolved_frac",
    "guided": "train/guided",
    "teacher_kl": "train/teacher_kl",
    "teacher_logp": "train/teacher_logp",
    "teacher_s": "perf/teacher_s",
    "adv_abs_mean": "train/adv_abs_mean",
    "ratio_min": "train/ratio_min",
    "ratio_mean": "train/ratio_mean",
    "ratio_max": "train/ratio_max",
    "behav_w_min": "train/behav_w_min",
    "behav_w_mean": "train/behav_w_mean",
    "behav_w_max": "train/behav_w_max",
    "capped_frac": "train/capped_frac",
    "mismatch_kl": "train/mismatch_kl",
    "mismatch_k1": "train/mismatch_k1",
    "tokens": "train/tokens",
    "seqs": "train/seqs",
    "version": "train/version",
    "staleness_max": "staleness/max",
    "staleness_mean": "staleness/mean",
    "gen_tokens_per_s": "perf/gen_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "wall_s": "perf/wall_s",
    "train_s": "perf/train_s",
    "wait_s": "perf/wait_s",
    "seconds": "perf/trainer_step_s",
    "prox_s": "perf/prox_s",
    "publish_s": "perf/publish_s",
    "reduce_s": "perf/reduce_s",
    "replay_groups": "queue/replay_groups",
    "in_flight": "queue/in_flight",
    "process_mean": "process/score_mean",
    "gated_frac": "process/gated_frac",
    "format_valid_frac": "process/format_valid_frac",
    "cost_multiple": "process/cost_multiple",
    "continuation_tokens": "process/continuation_tokens",
    "continuation_requests": "process/continuation_requests",
    "continuation_s": "process/continuation_s",
    "process_replies": "process/replies",
    "process_gated": "process/gated",
    "continuation_reward_failures": "process/continuation_reward_failures",
    "gen_tokens": "perf/gen_tokens",
}
"""steps.jsonl field -> tracker name. A numeric field not listed goes to `train/<field>`, as does
each reward of a weighted set (`reward/<name>` -> `train/reward/<name>`); another that already
holds a `/` keeps its name, so a new column is never lost."""

EVAL_METRICS = {
    "pass_rate": "eval/pass_rate",
    "strict_rate": "eval/strict_rate",
    "reward_mean": "eval/reward",
    "version": "eval/version",
    "wall_s": "eval/wall_s",
    "done_s": "eval/done_s",
}
"""Eval row field -> tracker name; an unlisted numeric field goes to `eval/<field>` (so
`reward/<name>` -> `eval/reward/<name>`)."""


def metrics(row: dict[str, Any]) -> dict[str, float]:
    """A step or eval row's numeric fields under their tracker names (`step` is the x axis)."""
    table, prefix = (EVAL_METRICS, "eval/") if row.get("kind") == "eval" else (STEP_METRICS, "train/")
    out = {}
    for key, value in row.items():
        if key in ("kind", "step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        own = "/" in key and not key.startswith("reward/")
        out[table.get(key, key if own else prefix + key)] = float(value)
    return out


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int, kind: str) -> None: ...

    def close(self, summary: dict[str, Any]) -> None: ...


class TensorBoardTracker:
    """Scalars through tensorboard's own framework-free writer (no torch in the controller)."""

    def __init__(self, folder: Path, name: str, config: dict[str, Any]) -> None:
        from tensorboard.summary import Writer

        self._writer = Writer(str(folder / "tensorboard"))

    def log(self, values: dict[str, float], step: int, kind: str) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self, summary: dict[str, Any]) -> None:
        self._writer.close()


class WandbTracker:
    """Offline unless WANDB_MODE says otherwise (`wandb sync <run folder>/wandb/offline-run-*`).

    Eval rows arrive out of step order (an eval of step 4 may finish after step 5 trained) and
    wandb drops a row whose step goes backwards, so each namespace gets its own x axis
    (`train/step`, `eval/step`) instead of wandb's global step."""

    def __init__(self, folder: Path, name: str, config: dict[str, Any]) -> None:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") else "offline"
        self._run = wandb.init(project=PROJECT, name=name, dir=str(folder), config=config, mode=mode,
                               reinit="create_new")
        self._run.define_metric("train/step")
        self._run.define_metric("eval/step")
        for namespace in sorted({tag.split("/")[0] for tag in STEP_METRICS.values()}):
            self._run.define_metric(f"{namespace}/*", step_metric="train/step")
        self._run.define_metric("eval/*", step_metric="eval/step")

    def log(self, values: dict[str, float], step: int, kind: str) -> None:
        self._run.log({**values, f"{'eval' if kind == 'eval' else 'train'}/step": step})

    def close(self, summary: dict[str, Any]) -> None:
        self._run.summary.update({k: v for k, v in summary.items()
                                  if isinstance(v, int | float) and not isinstance(v, bool)})
        self._run.finish()


class TrackioTracker:
    """trackio keeps its runs in its own folder ($TRACKIO_DIR, else the Hugging Face cache)."""

    def __init__(self, folder: Path, name: str, config: dict[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        self._run = trackio.init(project=PROJECT, name=name, config=config, embed=False)

    def log(self, values: dict[str, float], step: int, kind: str) -> None:
        self._run.log(values, step=step)

    def close(self, summary: dict[str, Any]) -> None:
        self._run.finish()


BACKENDS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                             "trackio": TrackioTracker}


def open_trackers(names: Iterable[str], folder: Path, name: str,
                  config: dict[str, Any]) -> list[Tracker]:
    """One tracker per name, writing for the run in `folder` (blocking: wandb starts a process)."""
    return [BACKENDS[n](folder, name, config) for n in names]


async def follow(orchestrator: Orchestrator, names: Iterable[str]) -> None:
    """Send every step and eval row of `orchestrator` to the named trackers until the run ends.

    Start it before `orchestrator.run()` (a task created first subscribes first), or use
    `run_tracked`. Backends open at the first row, when the run folder exists."""
    names = list(names)
    trackers: list[Tracker] = []
    try:
        async for item in orchestrator.events():
            if item.get("kind") not in ("step", "eval"):
                continue
            if not trackers:
                config = {f"{section}.{key}": value
                          for section, values in orchestrator.settings.to_dict().items()
                          for key, value in values.items()}
                trackers = await asyncio.to_thread(open_trackers, names, orchestrator.folder,
                                                   orchestrator.folder.name, config)
            values = metrics(item)
            for tracker in trackers:
                await asyncio.to_thread(tracker.log, values, int(item["step"]), item["kind"])
    finally:
        for tracker in trackers:
            await asyncio.to_thread(tracker.close, orchestrator.summary)


async def run_tracked(orchestrator: Orchestrator, names: Iterable[str] | None = None) -> dict:
    """`orchestrator.run()` with its rows also sent to `names` (default: `run.report_to`)."""
    names = list(orchestrator.settings.run.report_to if names is None else names)
    if not names:
        return await orchestrator.run()
    follower = asyncio.create_task(follow(orchestrator, names), name="trackers")
    await asyncio.sleep(0)  # the follower subscribes before the run emits anything
    try:
        return await orchestrator.run()
    finally:
        # the stream ends when the run does; the trackers then write their last rows
        done, _ = await asyncio.wait({follower}, timeout=CLOSE_TIMEOUT_S)
        if not done:
            follower.cancel()
            say(f"warning: trackers still writing after {CLOSE_TIMEOUT_S:.0f} s, stopped; "
                f"the run folder's rows are complete", folder=orchestrator.folder)
        elif not follower.cancelled() and follower.exception() is not None:
            say(f"warning: trackers stopped, the run folder's rows are complete: "
                f"{follower.exception()!r}", folder=orchestrator.folder)
