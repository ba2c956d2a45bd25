"""The run folder: resolved settings, per-sample / per-step / event rows, and the summary.

    <out_dir>/<name>/
        settings.toml      resolved settings (mode presets and overrides applied)
        summary.json       written at the end, also after a failure (with "error")
        steps.jsonl        one row per trainer step
        samples.jsonl      one row per sample once its fate is known (trained / dropped / eval)
        events.jsonl       version commits, weight loads, interrupts, queue depths,
                           checkpoints, resumes (structlog)
        rollout.log        the workers' stderr
        trainer.log
        model/             the policy of the last committed version, a plain HF folder
                           (written at every stop that committed an update)
        best/              run.keep_best: the trained version with the best eval pass rate
        checkpoints/       step-<N>/ folders that `run --resume` continues (areal_aio.store.checkpoint)
        eval.json          written by `python -m areal_aio eval RUN_FOLDER`
        .lock              held by the run using the folder

Rows are buffered in memory and appended by `flush` through aiofiles, so the
event loop never waits on a disk. One write is in flight at a time and it is
shielded: a flush cancelled at the end of a run loses no rows, and `settle`
waits for it. `sizes` counts every row made so far (written or not), so a
checkpoint can record where its rows end without writing them first; it
settles before it commits. A resumed run appends (`append=True`) after the
controller cut steps/samples back to their size at the checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiofiles
import orjson
import structlog

STREAMS = ("steps", "samples", "events")
DUMPS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
"""orjson's options for every row: numpy values as numbers (a user's reward may return them), and
the line's newline written by orjson itself (no copy of the row to append it)."""


class RunLog:
    def __init__(self, folder: Path, settings_toml: str, *, append: bool = False) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "settings.toml").write_text(settings_toml)
        self._rows: dict[str, list[bytes]] = {name: [] for name in STREAMS}
        self._writing: asyncio.Future | None = None
        for name in STREAMS:
            path = folder / f"{name}.jsonl"
            if not append or not path.exists():
                path.write_bytes(b"")
        self._size = {name: (folder / f"{name}.jsonl").stat().st_size for name in STREAMS}
        self.t0 = time.perf_counter()
        # A private structlog logger (no global configuration): events become rows here. Bound
        # once, so no call resolves structlog's configuration again (a lazy proxy does, each call).
        self.events = structlog.wrap_logger(
            _Sink(self), processors=[self._stamp, lambda _logger, _name, event: {"row": event}]).bind()

    def _stamp(self, _logger: Any, _name: str, event: dict) -> dict:
        event["t"] = round(time.perf_counter() - self.t0, 4)
        return event

    def row(self, stream: str, row: dict) -> None:
        self._add(stream, orjson.dumps(row, option=DUMPS))

    def rows(self, stream: str, rows: Iterable[dict]) -> None:
        """Several rows as one buffered piece (a step's samples). Each row's bytes are freed as
        soon as they are joined, so the heap reuses them; held one by one until the flush, each
        row took fresh memory."""
        if data := b"".join([orjson.dumps(row, option=DUMPS) for row in rows]):
            self._add(stream, data)

    def _add(self, stream: str, data: bytes) -> None:
        self._rows[stream].append(data)
        self._size[stream] += len(data)

    def _take(self) -> dict[str, bytes]:
        taken = {name: b"".join(rows) for name, rows in self._rows.items() if rows}
        self._rows = {name: [] for name in STREAMS}
        return taken

    async def _write(self, taken: dict[str, bytes]) -> None:
        for name, data in taken.items():
            async with aiofiles.open(self.folder / f"{name}.jsonl", "ab") as fh:
                await fh.write(data)

    async def flush(self) -> None:
        """Append the buffered rows; if a write is already in flight, wait for that one instead."""
        if self._writing is None or self._writing.done():
            self._writing = asyncio.ensure_future(self._write(self._take()))
        await asyncio.shield(self._writing)

    async def settle(self) -> None:
        """Every row made so far is on disk when this returns."""
        while (self._writing is not None and not self._writing.done()) or any(self._rows.values()):
            await self.flush()

    def sizes(self) -> dict[str, int]:
        """Bytes of each row file once every row made so far is written: where a resume cuts
        them back to."""
        return {name: self._size[name] for name in ("steps", "samples")}

    def write_summary(self, summary: dict) -> None:
        (self.folder / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))


class _Sink:
    """The logger structlog wraps: every level writes an events row."""

    def __init__(self, log: RunLog) -> None:
        self._log = log

    def msg(self, row: dict) -> None:
        self._log.row("events", row)

    info = debug = warning = error = msg
