"""What the generated reference pages share (settings_reference.py, metrics_reference.py):
a table cell made safe, and the page's marker line replaced by its reference. MkDocs puts
this folder on sys.path while it loads a hook (tests/conftest.load_hook does the same)."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any


def cell(text: str) -> str:
    """Text safe inside a table cell: no raw HTML (`<answer>` stays visible), no column breaks."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def fill(markdown: str, page: Any, uri: str, marker: str, what: str, reference: Callable[[], str]) -> str:
    """Page `uri`'s markdown with its `marker` line replaced by `reference()`; other pages as they are."""
    if page.file.src_uri != uri:
        return markdown
    if marker not in markdown:
        raise ValueError(f"{uri} lost its {marker} line: the {what} reference goes there")
    return markdown.replace(marker, reference())
