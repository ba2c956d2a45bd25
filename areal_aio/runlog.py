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
        checkpoints/       step-<N>/ folders that `run --resume` continues (areal_aio.checkpoint)
        eval.json          written by `python -m areal_aio eval RUN_FOLDER`
        .lock              held by the run using the folder

Rows are buffered in memory and appended by `flush` through aiofiles, so the
event loop never waits on a disk. A resumed run appends (`append=True`) after
the controller cut steps/samples back to their size at the checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiofiles
import orjson
import structlog

STREAMS = ("steps", "samples", "events")


class RunLog:
    def __init__(self, folder: Path, settings_toml: str, *, append: bool = False) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "settings.toml").write_text(settings_toml)
        self._rows: dict[str, list[bytes]] = {name: [] for name in STREAMS}
        for name in STREAMS:
            path = folder / f"{name}.jsonl"
            if not append or not path.exists():
                path.write_bytes(b"")
        self.t0 = time.perf_counter()
        # A private structlog logger (no global configuration): events become rows here.
        self.events = structlog.wrap_logger(
            _Sink(self), processors=[self._stamp, lambda _logger, _name, event: {"row": event}])

    def _stamp(self, _logger: Any, _name: str, event: dict) -> dict:
        event["t"] = round(time.perf_counter() - self.t0, 4)
        return event

    def row(self, stream: str, row: dict) -> None:
        self._rows[stream].append(orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    async def flush(self) -> None:
        for name in STREAMS:
            rows, self._rows[name] = self._rows[name], []
            if rows:
                async with aiofiles.open(self.folder / f"{name}.jsonl", "ab") as fh:
                    await fh.write(b"".join(rows))

    def flush_now(self) -> None:
        """Blocking flush, for the last rows after the loop is done or cancelled."""
        for name in STREAMS:
            rows, self._rows[name] = self._rows[name], []
            if rows:
                with open(self.folder / f"{name}.jsonl", "ab") as fh:
                    fh.write(b"".join(rows))

    def sizes(self) -> dict[str, int]:
        """Bytes in each row file (call after `flush_now`): where a resume cuts them back to."""
        return {name: (self.folder / f"{name}.jsonl").stat().st_size for name in ("steps", "samples")}

    def write_summary(self, summary: dict) -> None:
        (self.folder / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))


class _Sink:
    """The logger structlog wraps: every level writes an events row."""

    def __init__(self, log: RunLog) -> None:
        self._log = log

    def msg(self, row: dict) -> None:
        self._log.row("events", row)

    info = debug = warning = error = msg
