"""Reports: plots and a markdown summary of run folders, finished or still running.

    python -m areal_aio report RUN_DIR [RUN_DIR ...] [--out DIR]

    RUN_DIR/settings.toml, summary.json (only once finished), steps.jsonl, samples.jsonl,
    events.jsonl --read_run--> Run --figures--> {name: Figure} --write_report-->
        OUT/eval.png        held-out pass and strict rates against wall time and against steps
        OUT/training.png    training reward, entropy, loss and groups with reward spread per step
        OUT/staleness.png   staleness of the trained samples (share of each run's samples)
        OUT/timeline.png    each worker's busy / idle intervals (`busy` events)
        OUT/queues.png      queue depths (`queues` events) and version commits over time
        OUT/report.md       a table of the runs and the pictures above

Several runs are overlaid in every plot, labelled `folder (mode)`. A run still
in progress has no summary.json and may end in a half-written JSONL line: the
rows are read as far as they parse, so a report can be made at any time.
Times are seconds since both workers were ready, the clock of `wall_s` in the
step and eval rows (events carry their own clock, from the run folder's
creation; the last `worker_ready` event marks the start of the run's).
Figures are drawn on matplotlib's Agg canvas without pyplot: nothing global
changes in a process that imports this module.
"""

from __future__ import annotations

import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
from matplotlib.figure import Figure

from areal_aio.control.progress import say

TRAINING_PANELS = (("reward_mean", "reward (mean of the batch)"), ("entropy", "entropy (per token)"),
                   ("loss", "loss"), ("spread_frac", "groups with reward spread (share)"))
QUEUES = ("in_flight", "replay_groups", "pending_groups")
"""Fields of the `queues` event, drawn for each run."""
WORKERS = ("rollout", "trainer")
PANEL_INCHES = (5.0, 3.2)
"""Size of one panel: figures grow with the number of panels so labels stay readable."""


@dataclass(frozen=True, slots=True)
class Run:
    """What one run folder holds so far."""

    folder: Path
    settings: dict[str, Any]
    summary: dict[str, Any] | None
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    staleness: list[int]
    events: list[dict[str, Any]]
    unreadable: int
    """JSONL lines that did not parse (a run in progress may end in a half-written one)."""
    name: str = ""
    """How plots name the run: the folder's name, or parent/name where two runs share one."""

    @property
    def mode(self) -> str:
        return (self.summary or {}).get("mode") or self.settings.get("run", {}).get("mode", "?")

    @property
    def label(self) -> str:
        return f"{self.name or self.folder.name} ({self.mode})"

    @property
    def state(self) -> str:
        """How the run ended: its summary's `ended` (completed, threshold, max_wall, interrupted,
        failed: <cause>, ...), or "in progress" before it has a summary. A summary from before
        `ended` existed says it through `error` (CancelledError: interrupted)."""
        if self.summary is None:
            return "in progress"
        if self.summary.get("ended"):
            return self.summary["ended"]
        error = self.summary.get("error")
        if error in ("CancelledError", "KeyboardInterrupt", ""):
            return "interrupted"
        return f"failed: {error}" if error else "completed"

    @property
    def start_t(self) -> float:
        """The events clock's time of the run's start (both workers ready)."""
        ready = [e["t"] for e in self.events if e.get("event") == "worker_ready"]
        return max(ready) if ready else 0.0

    def event_times(self, name: str) -> list[tuple[float, dict[str, Any]]]:
        """(seconds since the run's start, row) of every event called `name`."""
        t0 = self.start_t
        return [(e["t"] - t0, e) for e in self.events if e.get("event") == name and "t" in e]

    def busy_intervals(self, worker: str) -> list[tuple[float, float]]:
        """(start, length) of each stretch the worker had work in hand.

        From `busy` events; a stretch still open is drawn to the last event seen. Runs without
        them (made before those events existed) show the trainer's steps from `train_s`."""
        changes = [(t, e["busy"]) for t, e in self.event_times("busy") if e.get("worker") == worker]
        if not changes and worker == "trainer":
            commits = {e["step"]: t for t, e in self.event_times("version_commit")}
            return [(commits[r["step"]] - r["train_s"], r["train_s"]) for r in self.steps
                    if r["step"] in commits and "train_s" in r]
        end = max((e["t"] - self.start_t for e in self.events if "t" in e), default=0.0)
        out, since = [], None
        for t, on in changes:
            if on and since is None:
                since = t
            elif not on and since is not None:
                out.append((since, t - since))
                since = None
        if since is not None:
            out.append((since, max(end - since, 0.0)))
        return out


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The rows that parse, and how many lines did not (a missing file has none of either)."""
    if not path.exists():
        return [], 0
    rows, bad = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            bad += 1
    return rows, bad


def read_run(folder: str | Path) -> Run:
    """Read a run folder as far as it has been written."""
    folder = Path(folder)
    if not (folder / "steps.jsonl").exists() and not (folder / "events.jsonl").exists():
        raise FileNotFoundError(f"{folder}: not a run folder (no steps.jsonl or events.jsonl)")
    settings: dict[str, Any] = {}
    if (folder / "settings.toml").exists():
        try:
            settings = tomllib.loads((folder / "settings.toml").read_text())
        except tomllib.TOMLDecodeError:
            pass
    summary = None
    if (folder / "summary.json").exists():
        try:
            summary = orjson.loads((folder / "summary.json").read_bytes())
        except orjson.JSONDecodeError:  # being written right now: the run counts as in progress
            pass
    steps, bad_steps = read_jsonl(folder / "steps.jsonl")
    samples, bad_samples = read_jsonl(folder / "samples.jsonl")
    events, bad_events = read_jsonl(folder / "events.jsonl")
    if summary is not None and summary.get("eval_curve"):
        evals = summary["eval_curve"]
    else:
        evals = [{k: v for k, v in e.items() if k not in ("event", "t")} for e in events
                 if e.get("event") == "eval"]
    staleness = [s["staleness"] for s in samples
                 if s.get("kind") == "train" and s.get("staleness") is not None]
    return Run(folder=folder, settings=settings, summary=summary, steps=steps,
               evals=sorted(evals, key=lambda r: r["step"]), staleness=staleness, events=events,
               unreadable=bad_steps + bad_samples + bad_events)


def read_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Read several run folders; runs whose folders share a name are told apart by their parent."""
    runs = [read_run(d) for d in run_dirs]
    names = Counter(run.folder.name for run in runs)
    return [replace(run, name=f"{run.folder.parent.name}/{run.folder.name}")
            if names[run.folder.name] > 1 else run for run in runs]


# ---------------------------------------------------------------------------------- figures


def _figure(rows: int, cols: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def eval_figure(runs: list[Run]) -> Figure:
    """Held-out pass and strict rates against wall time (top) and against steps (bottom)."""
    fig, axes = _figure(2, 2)
    panels = (("wall_s", "pass_rate"), ("wall_s", "strict_rate"), ("step", "pass_rate"),
              ("step", "strict_rate"))
    for ax, (x, y) in zip(axes, panels, strict=True):
        for run in runs:
            rows = [r for r in run.evals if x in r and y in r]
            ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o", markersize=3, label=run.label)
        ax.set_xlabel("wall seconds (workers ready = 0)" if x == "wall_s" else "step")
        ax.set_ylabel(f"held-out {y.replace('_', ' ')}")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("held-out eval (greedy)")
    return fig


def training_figure(runs: list[Run]) -> Figure:
    """Training reward, entropy, loss and the share of groups with reward spread per step (a run
    from before steps.jsonl logged `spread_frac` leaves that panel empty)."""
    fig, axes = _figure(1, len(TRAINING_PANELS))
    for ax, (key, title) in zip(axes, TRAINING_PANELS, strict=True):
        for run in runs:
            rows = [r for r in run.steps if r.get(key) is not None]
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=run.label)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("training batches")
    return fig


def staleness_figure(runs: list[Run]) -> Figure:
    """Share of each run's trained samples at each staleness, runs side by side."""
    fig, axes = _figure(1, 1)
    ax = axes[0]
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        counts = Counter(run.staleness)
        total = sum(counts.values()) or 1
        xs = sorted(counts)
        ax.bar([x + (i - (len(runs) - 1) / 2) * width for x in xs], [counts[x] / total for x in xs],
               width=width, label=f"{run.label}, {sum(counts.values())} samples")
    ax.set_xlabel("staleness (versions behind the trainer)")
    ax.set_ylabel("share of trained samples")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize="small")
    ax.set_title("staleness at training time")
    return fig


def timeline_figure(runs: list[Run]) -> Figure:
    """One panel per run: when each worker had work in hand (bars) and when it sat idle (gaps)."""
    fig, axes = _figure(len(runs), 1)
    fig.set_figwidth(2 * PANEL_INCHES[0])
    for ax, run in zip(axes, runs, strict=True):
        for row, worker in enumerate(WORKERS):
            ax.broken_barh(run.busy_intervals(worker), (row - 0.35, 0.7), label=worker,
                           color=f"C{row}", edgecolor="white", linewidth=0.5)  # steps back to back
        ax.set_yticks(range(len(WORKERS)), WORKERS)
        ax.set_xlabel("wall seconds (workers ready = 0)")
        ax.set_title(f"{run.label}: busy (bars) and idle (gaps)")
        ax.set_xlim(left=0)
        ax.grid(axis="x", alpha=0.3)
    return fig


def queues_figure(runs: list[Run]) -> Figure:
    """One panel per run with its queue depths, then every run's version commits."""
    fig, axes = _figure(len(runs) + 1, 1)
    fig.set_figwidth(2 * PANEL_INCHES[0])
    for ax, run in zip(axes, runs, strict=False):
        samples = run.event_times("queues")
        if not samples:
            ax.text(0.5, 0.5, "no queue depths yet (written every 2 s)", ha="center",
                    transform=ax.transAxes)
        for key in QUEUES:
            rows = [(t, e[key]) for t, e in samples if key in e]
            ax.step([t for t, _ in rows], [v for _, v in rows], where="post", label=key)
        ax.set_xlabel("wall seconds (workers ready = 0)")
        ax.set_ylabel("depth")
        ax.set_title(f"{run.label}: rollouts in flight, groups waiting in the replay buffer, "
                     "groups being scored", fontsize="medium")
        if samples:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for run in runs:
        commits = [(0.0, 0)] + [(t, e["version"]) for t, e in run.event_times("version_commit")]
        ax.step([t for t, _ in commits], [v for _, v in commits], where="post", label=run.label)
    ax.set_xlabel("wall seconds (workers ready = 0)")
    ax.set_ylabel("policy version")
    ax.set_title("version commits")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def figures(runs: list[Run]) -> dict[str, Figure]:
    """Every figure of the report, by name (the PNG's name without `.png`)."""
    return {"eval": eval_figure(runs), "training": training_figure(runs),
            "staleness": staleness_figure(runs), "timeline": timeline_figure(runs),
            "queues": queues_figure(runs)}


# ---------------------------------------------------------------------------------- markdown

CAPTIONS = {
    "eval": "Held-out pass and strict rates against wall time and against steps",
    "training": "Training reward, entropy, loss and groups with reward spread per step",
    "staleness": "Staleness of the trained samples",
    "timeline": "Each worker's busy and idle time",
    "queues": "Queue depths and version commits over time",
}


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(runs: list[Run], names: list[str]) -> str:
    """The report page: one row per run, then the pictures."""
    lines = ["# Run report", "",
             "| run | state | eta | steps | version | wall s | last eval pass / strict | best pass "
             "| time to threshold s | rollout idle | trainer idle |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        s = run.summary or {}
        last = run.steps[-1] if run.steps else {}
        ev = run.evals[-1] if run.evals else None
        eta = s.get("max_staleness", run.settings.get("controller", {}).get("max_staleness"))
        if run.mode == "sync":
            eta = 0
        elif run.mode == "one_step":
            eta = 1
        lines.append(" | ".join([
            f"| {run.label}", run.state, _fmt(eta), _fmt(s.get("steps", last.get("step", 0))),
            _fmt(s.get("final_version", last.get("version", 0))),
            _fmt(s.get("wall_s", last.get("wall_s")), 1),
            f"{_fmt(ev['pass_rate'])} / {_fmt(ev['strict_rate'])}" if ev else "-",
            _fmt(max((r["pass_rate"] for r in run.evals), default=None)),
            _fmt(s.get("time_to_threshold_s"), 1), _fmt(s.get("rollout_idle_frac"), 2),
            _fmt(s.get("trainer_idle_frac"), 2)]) + " |")
    lines.append("")
    folders = ", ".join(f"`{run.folder}`" for run in runs)
    lines.append(f"Runs: {folders}. A run in progress has no summary yet: its row shows the last "
                 "step written, and its idle fractions are left out.")
    unreadable = sum(run.unreadable for run in runs)
    if unreadable:
        lines.append(f"{unreadable} JSONL line(s) could not be read (a run still writing its last "
                     "line) and were skipped.")
    for name in names:
        lines += ["", f"## {CAPTIONS[name]}", "", f"![{CAPTIONS[name]}]({name}.png)"]
    return "\n".join(lines) + "\n"


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Read the runs, write every figure as a PNG and report.md into `out`; returns report.md."""
    runs = read_runs(run_dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = figures(runs)
    for name, fig in figs.items():
        fig.savefig(out / f"{name}.png", dpi=100)
    path = out / "report.md"
    path.write_text(markdown(runs, list(figs)))
    return path


def default_out(run_dirs: list[str | Path]) -> Path:
    """RUN_DIR/report for one run; report-<time> beside the first run for several."""
    first = Path(run_dirs[0])
    if len(run_dirs) == 1:
        return first / "report"
    return first.parent / f"report-{time.strftime('%Y%m%d-%H%M%S')}"


def main(run_dirs: list[str], out: str | None = None) -> int:
    """The `report` command: 0 when written, 2 when a folder is not a run folder."""
    try:
        path = write_report(run_dirs, out if out is not None else default_out(run_dirs))
    except FileNotFoundError as exc:
        say(f"report: {exc}")
        return 2
    say(f"report: {path}", sys.stdout)
    return 0
