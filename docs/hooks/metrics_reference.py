"""Fills docs/metrics.md with the reference of every field a run writes (placeholder)."""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return markdown
