"""What a person watching a run sees: the live line and, every few steps, a few completions.

    controller._train_step --(step row, trained samples)--> Progress.step
        terminal:      one rich progress bar, redrawn in place (reward, eval, loss, staleness, tok/s)
        not terminal:  one plain line per step (a log file or CI keeps every line readable)
        every run.log_completions_every steps: a table of prompts, replies, rewards and versions,
            printed (rich table / plain lines) and appended to <run folder>/completions.md
    controller._monitor --every PROGRESS_PERIOD_S--> Progress.refresh (the bar's clock)

Terminal handling is rich's; this module only chooses what to show.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
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
        self.console = Console(file=stream or sys.stderr, force_terminal=terminal, highlight=False,
                               soft_wrap=True)
        self._bar: Bar | None = None
        self._task = None
        self._last: dict[str, Any] | None = None

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
                self._draw()
            else:
                print(f"step {row['step']}/{self.max_steps} {self.stats(row)} | {row['wall_s']:.0f}s",
                      file=self.console.file, flush=True)
        if self.completions_every and row["step"] % self.completions_every == 0 and samples:
            self.completions(row, samples)

    def refresh(self) -> None:
        """Between steps: keep the terminal bar's clock and eval figures current."""
        if self.show and self.terminal:
            self._draw()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

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
            console.print(table)
        else:
            print(title, file=self.console.file)
            for r in shown:
                print(f"  [{r['reward']:.2f} v{r['versions']}] {_cut(r['prompt'])!r} -> "
                      f"{_cut(r['reply'])!r}", file=self.console.file)
            self.console.file.flush()


def pick(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """The best and the worst reply of the first COMPLETION_GROUPS groups, as plain rows."""
    groups: dict[int, list[Any]] = {}
    for s in samples:
        if s.completion is not None and s.score is not None:
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
