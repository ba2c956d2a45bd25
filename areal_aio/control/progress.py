"""What a person watching a run sees: the live line and, every few steps, a few completions.

    controller._train_step --(step row, trained samples)--> Progress.step
        terminal:      one rich progress bar, redrawn in place (reward, eval, loss, staleness, tok/s)
        not terminal:  one plain line per step (a log file or CI keeps every line readable)
        every run.log_completions_every steps: a table of prompts, replies, rewards and versions,
            printed (rich table / plain lines) and appended to <run folder>/completions.md
    controller._monitor --every PROGRESS_PERIOD_S--> Progress.refresh (the bar's clock)

Terminal handling is rich's; this module only chooses what to show. The console is never
needed: a run piped into `tee` or `less` whose reader is gone (the same Ctrl-C ended it) or a
closed stream is let go, and what would have been printed goes to <run folder>/console.log
(`say`): what a run keeps at a stop must not depend on its stdout or stderr.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar
from rich.table import Table

COMPLETION_GROUPS = 3
"""Prompts shown per completions table, each with its best and worst reply: the contrast a
group-relative advantage learns from, in a table short enough to read between steps."""
CONSOLE_CHARS = 70
"""Prompt and reply are cut to this many characters on the console (completions.md keeps all)."""
CONSOLE_LOG = "console.log"
"""In the run folder: the lines a console could not take."""
GONE = (OSError, ValueError)
"""What writing to a console that is gone raises: BrokenPipeError (its pipe's reader ended),
another OSError (a hung-up terminal: EIO), ValueError (a closed file)."""


def say(text: str, stream: TextIO | None = None, folder: Path | None = None) -> bool:
    """Print `text` to `stream` (stderr by default), flushed; True if it was. A console that is
    gone (GONE) is ignored, never raised: the line goes to <folder>/console.log instead when a
    folder is given. The stop path prints through here, so a run's keep never depends on it."""
    try:
        print(text, file=stream if stream is not None else sys.stderr, flush=True)
        return True
    except GONE:
        if folder is not None:
            keep_line(text, folder)
        return False


def keep_line(text: str, folder: Path) -> None:
    """Append `text` to <folder>/console.log (a folder that cannot take it either is let be)."""
    with contextlib.suppress(OSError):
        with open(folder / CONSOLE_LOG, "a") as fh:
            fh.write(text.rstrip("\n") + "\n")


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own points stdout at /dev/null and exits the process (SystemExit, whichever
        stream broke); a run lets its console go instead (Progress._on_console) and goes on."""
        raise BrokenPipeError(errno.EPIPE, "the console's reader is gone")


class Progress:
    """The live line and the completions log of one run (`run.progress`, `run.log_completions_every`).

    `evals` is the controller's list of eval rows, read (never written) when a line is drawn."""

    def __init__(self, max_steps: int, folder: Path, *, show: bool = True, completions_every: int = 0,
                 evals: Sequence[dict] = (), stream: TextIO | None = None,
                 terminal: bool | None = None) -> None:
        self.max_steps = max_steps
        self.folder = folder
        self.show = show
        self.completions_every = completions_every
        self._evals = evals
        self.console = _Console(file=stream or sys.stderr, force_terminal=terminal, highlight=False,
                               soft_wrap=True)
        self._bar: Bar | None = None
        self._task = None
        self._last: dict[str, Any] | None = None
        self.gone = False  # the console could not be written: lines go to console.log

    @property
    def terminal(self) -> bool:
        return self.console.is_terminal

    def stats(self, row: dict[str, Any] | None = None) -> str:
        """reward, eval pass/strict, loss, staleness (mean/max), generated and trained tokens/s."""
        row = row if row is not None else self._last
        ev = max(self._evals, key=lambda r: r["step"]) if self._evals else None
        parts = [f"v{row['version']}" if row else "v0"]
        if row:
            parts.append(f"reward {row['reward_mean']:.3f}")
        parts.append(f"eval {ev['pass_rate']:.2f}/{ev['strict_rate']:.2f}" if ev else "eval -")
        if row:
            if row.get("loss") is not None:
                parts.append(f"loss {row['loss']:.4f}")
            parts.append(f"stale {row['staleness_mean']:.1f}/{row['staleness_max']}")
            if "gen_tokens_per_s" in row:
                parts.append(f"gen {row['gen_tokens_per_s']:.0f} tok/s "
                             f"train {row['train_tokens_per_s']:.0f} tok/s")
        return " | ".join(parts)

    def step(self, row: dict[str, Any], samples: Sequence[Any] = ()) -> None:
        """A step was trained: redraw the bar or print its line; log completions when due."""
        self._last = row
        if self.show:
            if self.terminal:
                self._on_console(self._draw)
            else:
                self._line(f"step {row['step']}/{self.max_steps} {self.stats(row)} | {row['wall_s']:.0f}s")
        if self.completions_every and row["step"] % self.completions_every == 0 and samples:
            self.completions(row, samples)

    def refresh(self) -> None:
        """Between steps: keep the terminal bar's clock and eval figures current."""
        if self.show and self.terminal:
            self._on_console(self._draw)

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            self._on_console(bar.stop)

    def _line(self, text: str) -> None:
        """One plain line: to the console, or to console.log once the console is gone."""
        if self.gone:
            keep_line(text, self.folder)
        elif not say(text, self.console.file, self.folder):
            self.gone = True

    def _on_console(self, draw: Callable[[], None]) -> None:
        """Draw on the terminal; one that is gone is let go (the bar dropped, never raised)."""
        if self.gone:
            return
        try:
            draw()
        except GONE:
            self.gone, bar, self._bar = True, self._bar, None
            if bar is not None:
                with contextlib.suppress(*GONE):
                    bar.stop()  # gives sys.stdout and sys.stderr back

    def _draw(self) -> None:
        if self._bar is None:
            self._bar = Bar(TextColumn("step"), BarColumn(bar_width=12), MofNCompleteColumn(),
                            TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                            console=self.console, auto_refresh=False)
            self._task = self._bar.add_task("train", total=self.max_steps, stats="")
            self._bar.start()
        step = self._last["step"] if self._last else 0
        self._bar.update(self._task, completed=step, stats=self.stats())
        self._bar.refresh()

    # ------------------------------------------------------------------ completions

    def completions(self, row: dict[str, Any], samples: Sequence[Any]) -> list[dict[str, Any]]:
        """Show a few of this step's trained samples and append them to completions.md."""
        shown = pick(samples)
        if self.show:
            self._print(row, shown)
        with open(self.folder / "completions.md", "a") as fh:
            fh.write(markdown(row, shown))
        return shown

    def _print(self, row: dict[str, Any], shown: list[dict[str, Any]]) -> None:
        title = f"step {row['step']} (version {row['version']}): completions"
        if self.terminal:
            table = Table(title=title, show_lines=True)
            for name, justify in (("prompt", "left"), ("reply", "left"), ("reward", "right"),
                                  ("versions", "right")):
                table.add_column(name, justify=justify, overflow="fold")
            for r in shown:
                table.add_row(_cut(r["prompt"]), _cut(r["reply"]), f"{r['reward']:.2f}", r["versions"])
            console = self._bar.console if self._bar is not None else self.console
            self._on_console(lambda: console.print(table))
        else:
            self._line("\n".join([title, *(f"  [{r['reward']:.2f} v{r['versions']}] {_cut(r['prompt'])!r} -> "
                                            f"{_cut(r['reply'])!r}" for r in shown)]))


def pick(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """The best and the worst reply of the first COMPLETION_GROUPS groups, as plain rows: the
    policy's own (a guided member, task.guide, was written, not sampled)."""
    groups: dict[int, list[Any]] = {}
    for s in samples:
        if s.completion is not None and s.score is not None and not getattr(s, "written", 0):
            groups.setdefault(s.group_id, []).append(s)
    rows = []
    for members in list(groups.values())[:COMPLETION_GROUPS]:
        ranked = sorted(members, key=lambda s: s.score.reward, reverse=True)
        best, worst = ranked[0], ranked[-1]
        for s in (best, worst) if worst.score.reward != best.score.reward else (best,):
            c = s.completion
            span = f"{c.oldest_version}" if c.oldest_version == c.newest_version else \
                f"{c.oldest_version}-{c.newest_version}"
            rows.append({"group": s.group_id, "prompt": s.task.text, "answer": s.task.answer,
                         "reply": c.text, "reward": s.score.reward, "versions": span})
    return rows


def markdown(row: dict[str, Any], shown: list[dict[str, Any]]) -> str:
    """One step's completions as a markdown section (full prompts and replies)."""
    lines = [f"## step {row['step']} (version {row['version']}, reward mean {row['reward_mean']:.3f})",
             "", "| group | prompt | answer | reply | reward | versions |", "| --- | --- | --- | --- | --- | --- |"]
    for r in shown:
        lines.append(f"| {r['group']} | {_cell(r['prompt'])} | {_cell(str(r['answer']))} | "
                     f"{_cell(r['reply'])} | {r['reward']:.3f} | {r['versions']} |")
    return "\n".join(lines) + "\n\n"


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= CONSOLE_CHARS else text[:CONSOLE_CHARS - 1] + "…"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
