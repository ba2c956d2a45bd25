"""The configuration page's reference: every key of settings.toml, generated from the settings
dataclasses (areal_aio/settings.py), so the page cannot drift from the code.

An MkDocs hook (mkdocs.yml `hooks:`): on docs/configuration.md it replaces MARKER with one table
per section. A key whose field carries no description stops the build (and tests/test_docs.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from reference_tables import cell, fill

from areal_aio.settings import SECTIONS, bounds, toml_value

PAGE = "configuration.md"
MARKER = "<!-- settings-reference -->"


class MissingDescription(ValueError):
    """A settings key whose field metadata has no `doc`."""


def undocumented() -> list[str]:
    """Keys (section.key) whose field has no description."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if not str(f.metadata.get("doc") or "").strip()]


def reference() -> str:
    """Markdown: one heading and one table (key, type, default, allowed, meaning) per section."""
    if missing := undocumented():
        raise MissingDescription(f"settings keys without a description: {', '.join(missing)}")
    out = []
    for name, cls in SECTIONS.items():
        out += [f"### `[{name}]`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):  # not the generated one
            out += [cell(" ".join(cls.__doc__.split())), ""]
        out += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"| `{name}.{f.name}` | {_type(hints[f.name])} | `{toml_value(default)}` "
                       f"| {_allowed(f.metadata, hints[f.name])} | {cell(f.metadata['doc'])} |")
        out.append("")
    return "\n".join(out)


def _type(kind: Any) -> str:
    return " or ".join(getattr(k, "__name__", str(k)) for k in getattr(kind, "__args__", (kind,)))


def _allowed(meta: Any, kind: Any) -> str:
    if kind is bool:
        return "`true`, `false`"
    if meta.get("choices"):
        return ", ".join(f"`{c}`" for c in meta["choices"])
    if limits := bounds(meta):
        return cell(", ".join(limits))
    parse = meta.get("parse")
    if parse is not None and ": " in (first := " ".join((parse.__doc__ or "").split()).split(". ")[0]):
        return cell(first.split(": ", 1)[1].rstrip("."))  # "key: what it takes. How it is checked."
    if kind is float:
        return "any finite number"
    return "see meaning"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return fill(markdown, page, PAGE, MARKER, "settings", reference)
