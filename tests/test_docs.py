"""The docs site builds with `mkdocs build --strict` (a broken link, a missing anchor, a
misspelled image path or a page left out of the nav fails it), the configuration reference covers
every settings key with a description, the files the docs name outside docs/ exist, and every
plot under bench/results/ is shown on a page."""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_aio.settings import SECTIONS
from tests.conftest import ROOT, load_hook

DOCS = ROOT / "docs"
HOOK = DOCS / "hooks" / "settings_reference.py"
RESULTS_HOOK = DOCS / "hooks" / "results_files.py"
PAGES = sorted(DOCS.rglob("*.md"))
"""Every page of the site, the benchmark topics in docs/benchmarks/ included."""
TOP_PAGES = sorted(DOCS.glob("*.md"))
"""The pages the home page and the README list; a sub-folder's pages are listed by its page."""
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"^ *```.*?^ *```|`[^`\n]*`", re.MULTILINE | re.DOTALL)
NOT_SHOWN: dict[str, str] = {}
"""Plots under bench/results/ (as results/<machine>/<name>.png) that no page shows, each with the
reason; empty while every plot is shown."""
REPO_PATH = re.compile(r"(?<![\w/.-])(?!bench/out/)((?:bench|tests|areal_aio|workers)/[\w./-]*\w\.(?:py|sh|json|png))\b")
"""A file of the repository named in the docs or the README (bench/results/..., a bench script,
a test, a module; not bench/out/, where a bench writes): mkdocs does not check these, since
they lie outside docs/."""


def reference_module():
    return load_hook(HOOK)


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def site_page(path: Path) -> Path:
    """A page's HTML file, relative to the site: docs/benchmarks/components.md is
    benchmarks/components/index.html, docs/index.md index.html."""
    stem = path.relative_to(DOCS).with_suffix("")
    return (stem.parent if stem.name == "index" else stem) / "index.html"


def images(text: str) -> list[str]:
    """The targets of the Markdown images in `text`, code blocks and spans left out."""
    return IMAGE.findall(CODE.sub("", text))


def image_target(page: Path, target: str, served: dict[str, Path]) -> Path | None:
    """The file an image of `page` shows, or None when it resolves to nothing. On a docs page
    the path is relative to the page's folder in docs/, and results/<machine>/<name> is a file
    of bench/results/ (docs/hooks/results_files.py); in the README it is relative to the root."""
    if page.parent == ROOT:
        found = ROOT / target
        return found if found.is_file() else None
    uri = posixpath.normpath(posixpath.join(page.parent.relative_to(DOCS).as_posix(), target))
    if uri in served:
        return served[uri]
    found = DOCS / uri
    return found if not uri.startswith("../") and found.is_file() else None


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_strict_build_renders_every_page(site):
    for path in PAGES:
        assert (site / site_page(path)).exists(), path.relative_to(DOCS)


def test_the_site_serves_every_plot_and_results_file(site):
    served = load_hook(RESULTS_HOOK).served()
    assert {path.relative_to(ROOT / "bench") for path in (ROOT / "bench" / "results").rglob("*.png")} \
        <= {Path(uri) for uri in served}
    for uri, path in served.items():
        assert (site / uri).read_bytes() == path.read_bytes(), uri


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
            assert (ROOT / name).exists(), f"{path.relative_to(ROOT)} names {name}, which does not exist"


def test_every_image_on_the_pages_exists():
    """mkdocs checks the docs' images in the strict build; this says which one is missing without
    a build, and checks the README's, which mkdocs does not see."""
    served = load_hook(RESULTS_HOOK).served()
    for page in [ROOT / "README.md", *PAGES]:
        for target in images(page.read_text()):
            assert image_target(page, target, served), \
                f"{page.relative_to(ROOT)} shows {target}, which does not exist"


def test_a_misspelled_image_path_is_caught(tmp_path):
    """The check above and the strict build both refuse a plot whose name is misspelled, and both
    accept the plot's real name (served by the results hook, from outside docs/)."""
    served = load_hook(RESULTS_HOOK).served()
    page = DOCS / "benchmarks" / "components.md"
    assert image_target(page, "../results/epyc-2core/lora.png", served)
    assert image_target(page, "../results/epyc-2core/lroa.png", served) is None
    assert image_target(page, "../../bench/results/epyc-2core/lora.png", served) is None
    assert images("![a](results/x.png) `![b](results/y.png)`\n```\n![c](z.png)\n```\n") == ["results/x.png"]

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(
        "# Plots\n\n![right](results/epyc-2core/lora.png)\n\n![wrong](results/epyc-2core/lroa.png)\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump({
        "site_name": "plots", "docs_dir": "docs", "hooks": [str(RESULTS_HOOK)],
        "validation": {"links": {"not_found": "warn"}}}))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "'results/epyc-2core/lroa.png'" in done.stderr
    assert "'results/epyc-2core/lora.png'" not in done.stderr


def test_every_plot_is_shown_on_a_page_with_its_results_file():
    """Each plot under bench/results/ appears on a page (or in NOT_SHOWN, with a reason), and the
    caption below it names the JSON that holds its numbers."""
    served = load_hook(RESULTS_HOOK).served()
    shown = set()
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            for target in images(line):
                found = image_target(page, target, served)
                if found is None or not found.is_relative_to(ROOT / "bench" / "results"):
                    continue
                shown.add(found)
                caption = next((rest for rest in lines[i + 1:] if rest.strip()), "")
                data = found.with_suffix(".json")
                if data.exists():
                    assert str(data.relative_to(ROOT)) in caption, \
                        f"{page.relative_to(ROOT)}: the caption of {target} does not name {data.name}"
    plots = {f"results/{path.relative_to(ROOT / 'bench' / 'results').as_posix()}": path
             for path in (ROOT / "bench" / "results").rglob("*.png")}
    assert set(NOT_SHOWN) <= set(plots), "NOT_SHOWN names a plot that no longer exists"
    missing = sorted(uri for uri, path in plots.items() if path not in shown and uri not in NOT_SHOWN)
    assert missing == [], f"plots no page shows: {missing}"


def test_every_page_is_in_the_nav():
    """A page left out of mkdocs.yml's nav is built but no menu leads to it: the strict build
    fails on it only while validation.nav.omitted_files stays at warn, so check both."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    listed = nav_pages(config["nav"])
    assert len(listed) == len(set(listed)), "a page is in the nav twice"
    pages = {path.relative_to(DOCS).as_posix() for path in PAGES}
    assert set(listed) == pages, f"not in the nav: {sorted(pages - set(listed))}; " \
                                 f"in the nav, not in docs/: {sorted(set(listed) - pages)}"


def test_every_page_of_a_sub_folder_is_linked_from_its_page():
    """docs/benchmarks/*.md are listed by docs/benchmarks.md, the page the index and README link."""
    for page in PAGES:
        folder = page.parent.relative_to(DOCS)
        if folder == Path("."):
            continue
        parent = DOCS / folder.with_suffix(".md")
        assert parent.exists(), f"{folder}/ has no page {parent.name} to list it"
        assert f"]({folder.as_posix()}/{page.name})" in parent.read_text(), \
            f"docs/{parent.name} does not link {folder}/{page.name}"


def test_every_page_is_reachable_from_the_index_and_the_readme():
    """mkdocs' nav lists a page without a reader finding it: each page is linked from the home
    page's table and from the README's docs list (the pages a newcomer reads first)."""
    index = (ROOT / "docs" / "index.md").read_text()
    readme = (ROOT / "README.md").read_text()
    docs_list = readme[readme.index("## Documentation"):]
    for page in TOP_PAGES:
        if page.name == "index.md":
            continue
        assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
        assert f"](docs/{page.name})" in docs_list, f"README's Documentation list does not link {page.name}"
