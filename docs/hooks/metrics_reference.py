"""The metrics page's reference: every field a run writes, generated from the descriptions kept
beside the code that writes each row (a `*_FIELDS` dict in that module), so the page cannot drift
from the rows.

An MkDocs hook (mkdocs.yml `hooks:`): on docs/metrics.md it replaces MARKER with one table per
kind of row. A field with a blank description, or a tracker name for a field no table lists,
stops the build (and tests/test_metrics_reference.py, which also checks the tables against the
rows of a run). A description that begins with "Only" says when the field is written; a field
whose description does not is in every row of its kind. A field named with `<...>` is a pattern
(`reward/<name>`: one field per reward).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType
from typing import Any, NamedTuple

from reference_tables import cell, fill

from areal_aio.app import trackers
from areal_aio.control import controller, evaluation, keeping, stats
from areal_aio.rewards import process
from areal_aio.workers.trainer import worker

PAGE = "metrics.md"
MARKER = "<!-- metrics-reference -->"
CONDITIONAL = "Only "
"""How the description of a field that some rows lack begins ("Only with process.mode on: ...")."""


class MissingDescription(ValueError):
    """A field without a description, or a tracker name for a field no table lists."""


class Source(NamedTuple):
    """Who writes some of a table's fields: its name on the page, the module and its dict."""

    writer: str
    module: ModuleType
    name: str  # the dict's name in `module`

    @property
    def fields(self) -> dict[str, str]:
        return getattr(self.module, self.name)

    @property
    def where(self) -> str:
        return f"{self.module.__name__}.{self.name}"


class Table(NamedTuple):
    """One kind of row: its anchor on the page, heading, what it is, and who writes its fields
    (in the order the row is built: a later writer's field replaces an earlier one's)."""

    anchor: str
    title: str
    about: str
    sources: tuple[Source, ...]
    level: int = 3

    @property
    def fields(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for source in self.sources:
            merged.update(source.fields)
        return merged


TABLES = (
    Table("steps", "`steps.jsonl`", "One row per committed step; the trainer's part comes from the trainer "
          "worker, the process reward's only with process.mode on.",
          (Source("controller", stats, "STEP_FIELDS"), Source("trainer", worker, "TRAIN_STATS"),
           Source("process reward", process, "STEP_FIELDS"))),
    Table("samples", "`samples.jsonl`: training rows", "One row per sequence trained (`dropped` null) and "
          "per sample dropped, written when its fate is known.",
          (Source("controller", stats, "SAMPLE_FIELDS"),)),
    Table("process-record", "A training row's `process`", "What the process reward records of a reply "
          "(process.mode on).",
          (Source("process reward", process, "RECORD_FIELDS"),), level=4),
    Table("eval-samples", "`samples.jsonl`: eval rows", "One row per held-out prompt of each eval.",
          (Source("evaluator", evaluation, "EVAL_SAMPLE_FIELDS"),)),
    Table("summary", "`summary.json`", "Written once, when the run ends (also after a failure).",
          (Source("controller", stats, "SUMMARY_FIELDS"), Source("controller", controller, "COLD_START_FIELDS"),
           Source("process reward", process, "COUNTER_FIELDS"))),
    Table("workers", "`rollout_workers_detail` entries", "One per rollout worker.",
          (Source("controller", stats, "WORKER_FIELDS"),), level=4),
    Table("resumes", "`resumes` entries", "One per resume.", (Source("keeper", keeping, "RESUME_FIELDS"),),
          level=4),
    Table("best-eval", "`best_eval`", "The best eval of a trained version.",
          (Source("keeper", keeping, "BEST_FIELDS"),), level=4),
    Table("evals", "Eval rows", "One per held-out eval: summary.json's `eval_curve`, the `eval` events of "
          "events.jsonl (with `event` and `t`) and the trackers' `eval/` names.",
          (Source("evaluator", evaluation, "EVAL_FIELDS"),)),
    Table("eval-json", "`eval.json`", "What `python -m areal_aio eval` writes.",
          (Source("evaluator", evaluation, "EVAL_FILE_FIELDS"),)),
)
TRACKED = (("steps", trackers.STEP_METRICS), ("evals", trackers.EVAL_METRICS))
"""The trackers' name tables (areal_aio/app/trackers.py), each with the table of the rows it maps."""


def table(anchor: str) -> Table:
    return next(t for t in TABLES if t.anchor == anchor)


def listed(fields: Iterable[str], key: str) -> bool:
    """Whether `key` is one of `fields` or matches one of their patterns (`reward/<name>`)."""
    for field in fields:
        if key == field or ("<" in field and re.fullmatch(_pattern(field), key)):
            return True
    return False


def _pattern(field: str) -> str:
    return "[^<>]+".join(re.escape(part) for part in re.split(r"<[^<>]+>", field))


def unlisted(anchor: str, keys: Iterable[str]) -> list[str]:
    """The keys written in a row of `anchor`'s kind that its table does not describe."""
    fields = table(anchor).fields
    return sorted({key for key in keys if not listed(fields, key)})


def conditional(description: str) -> bool:
    """A field some rows of its kind lack (its description says when it is written)."""
    return description.startswith(CONDITIONAL)


def undocumented() -> list[str]:
    """Fields (anchor: field) with a blank description, and tracker names' fields no table lists."""
    missing = [f"{t.anchor}: {key}" for t in TABLES for s in t.sources for key, doc in s.fields.items()
               if not str(doc or "").strip()]
    missing += [f"{anchor}: {key} (trackers)" for anchor, names in TRACKED for key in names
                if not listed(table(anchor).fields, key)]
    return missing


def reference() -> str:
    """Markdown: one heading and one table (field, written by, meaning) per kind of row, then the
    trackers' names."""
    if missing := undocumented():
        raise MissingDescription(f"fields without a description: {', '.join(missing)}")
    out = []
    for t in TABLES:
        where = ", ".join(f"`{s.where}`" for s in t.sources)
        out += [f"{'#' * t.level} {t.title} {{#{t.anchor}}}", "", f"{cell(t.about)} Described in {where}.", ""]
        several = len({s.writer for s in t.sources}) > 1
        out += ["| field | written by | meaning |", "| --- | --- | --- |"] if several else \
            ["| field | meaning |", "| --- | --- |"]
        for s in t.sources:
            for key, doc in s.fields.items():
                out.append(f"| `{key}` | {s.writer} | {cell(doc)} |" if several else f"| `{key}` | {cell(doc)} |")
        out.append("")
    out += ["### Tracker names {#trackers}", "",
            "What `run.report_to` sends, by the row field each name carries (`areal_aio.app.trackers`). Any "
            "other numeric field of a step row goes to `train/<field>`, of an eval row to `eval/<field>` "
            "(`reward/<name>` too: `train/reward/<name>`); a field whose name holds another `/` keeps it.", "",
            "| tracker name | field |", "| --- | --- |"]
    for anchor, names in TRACKED:
        out += [f"| `{name}` | [`{key}`](#{anchor}) |" for key, name in names.items()]
    out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return fill(markdown, page, PAGE, MARKER, "metrics", reference)
