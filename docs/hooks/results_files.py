"""Serves bench/results/ on the docs site, so a page can show a plot beside its table.

MkDocs serves only what lies under docs/, and the benches keep their results in
bench/results/<machine>/ (a JSON and, for most, a PNG plot). This hook (mkdocs.yml `hooks:`)
adds each of those files to the site as a generated file at results/<machine>/<name>, so a page
writes `![caption](results/epyc-2core/lora.png)` (relative to docs/; `../results/...` from a
page in a sub-folder) and links a results file the same way. The strict build then checks
these links like any other: a misspelled name is a link to a file the site does not have, and
`mkdocs build --strict` fails (tests/test_docs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
URL = "results"
"""Where the files appear on the site, relative to docs/: results/<machine>/<name>."""
SERVED = (".png", ".json")


def served(results: Path = RESULTS) -> dict[str, Path]:
    """The site path (relative to docs/) of every results file, mapped to the file itself."""
    return {f"{URL}/{path.relative_to(results).as_posix()}": path
            for path in sorted(results.rglob("*")) if path.is_file() and path.suffix in SERVED}


def on_files(files: Files, config: Any, **_: Any) -> Files:
    for uri, path in served().items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
