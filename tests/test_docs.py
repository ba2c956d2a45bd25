"""The docs site builds with `mkdocs build --strict` (a broken link, a missing anchor or a page
left out of the nav fails it), the configuration reference covers every settings key with a
description, and the files the docs name outside docs/ exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from areal_aio.settings import SECTIONS
from tests.conftest import ROOT

HOOK = ROOT / "docs" / "hooks" / "settings_reference.py"
PAGES = sorted((ROOT / "docs").glob("*.md"))
REPO_PATH = re.compile(r"(?<![\w/.-])(?!bench/out/)((?:bench|tests|areal_aio|workers)/[\w./-]*\w\.(?:py|sh|json|png))\b")
"""A file of the repository named in the docs or the README (bench/results/..., a bench script,
a test, a module; not bench/out/, where a bench writes): mkdocs does not check these, since
they lie outside docs/."""


def reference_module():
    spec = importlib.util.spec_from_file_location("settings_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_strict_build_renders_every_page(site):
    for path in PAGES:
        name = "" if path.stem == "index" else path.stem + "/"
        assert (site / name / "index.html").exists(), path.name


def test_every_settings_key_has_a_description():
    assert reference_module().undocumented() == []


def test_a_key_without_a_description_stops_the_reference(monkeypatch):
    module = reference_module()
    blank = dataclasses.make_dataclass("Blank", [("key", int, dataclasses.field(default=0, metadata={"doc": " "}))])
    monkeypatch.setitem(module.SECTIONS, "blank", blank)
    assert module.undocumented() == ["blank.key"]
    with pytest.raises(module.MissingDescription, match="blank.key"):
        module.reference()


def test_configuration_page_lists_every_key_with_its_default(site):
    html = (site / "configuration" / "index.html").read_text()
    assert reference_module().MARKER not in html
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"<code>{name}.{f.name}</code>" in html, f"{name}.{f.name}"


def test_readme_links_reach_pages_and_anchors_of_the_site(site):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)\s]+)\)", readme)
    assert len(links) >= 15
    for link in links:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), link
        if path.endswith(".md") and anchor:
            stem = path.removeprefix("docs/").removesuffix(".md")
            html = (site / ("" if stem == "index" else stem + "/") / "index.html").read_text()
            assert f'id="{anchor}"' in html, link
    for link in re.findall(r"\]\(#([^)\s]+)\)", readme):  # the README's own sections
        heading = link.replace("-", " ")
        assert re.search(rf"^#+ {heading}$", readme, re.MULTILINE | re.IGNORECASE), link


def test_files_named_outside_docs_exist():
    for path in [ROOT / "README.md", *PAGES]:
        for name in REPO_PATH.findall(path.read_text()):
            assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"


def test_every_page_is_reachable_from_the_index_and_the_readme():
    """mkdocs' nav lists a page without a reader finding it: each page is linked from the home
    page's table and from the README's docs list (the pages a newcomer reads first)."""
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    docs_list = readme[readme.index("## Documentation"):]
    for page in PAGES:
        if page.name == "index.md":
            continue
        assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
        assert f"](docs/{page.name})" in docs_list, f"README's Documentation list does not link {page.name}"
