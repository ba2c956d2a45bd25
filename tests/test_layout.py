"""The package's shape, read from its source: which room (subpackage) may import which (ROOMS,
the one copy of the table; docs/ shows it and is checked against it), no import circles, and
the controller's side never reaches torch.

Every import between the package's modules counts, at the top of a module or inside a function
(a lazy import still runs the imported module in the process that calls it). For the table,
`if TYPE_CHECKING:` imports count too (a type-only arrow is still an arrow between rooms); the
circle and torch checks leave them out (they never run). An outside package counts where it is
imported at a module's top; inside a function it counts unless the module is one of LAZY_HEAVY,
whose heavy imports sit in functions only the workers call. A last test imports the controller's
side in a fresh interpreter and looks for torch in sys.modules. The modules are those pyproject
ships, each read from the folder it maps (`workers/` as `areal_aio.workers`)."""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

ROOMS: dict[str, tuple[str, ...]] = {
    "areal_aio": ("agents", "app", "control", "rewards", "settings", "tasks"),
    "app": ("control", "agents", "fleet", "rewards", "tasks", "sandbox", "workers", "store", "settings", "wire",
            "seeds"),
    "control": ("agents", "fleet", "rewards", "tasks", "sandbox", "store", "settings", "wire", "seeds"),
    "agents": ("rewards", "tasks", "store", "settings", "wire", "seeds"),
    "fleet": ("store", "settings", "wire", "seeds"),
    "rewards": ("tasks", "sandbox", "store", "settings", "wire", "seeds"),
    "tasks": ("sandbox", "store", "settings", "wire", "seeds"),
    "workers": ("store", "settings", "wire", "seeds"),
    "store": ("settings", "wire", "seeds"),
    "sandbox": (),
    "settings": (),
    "wire": (),
    "seeds": (),
}
"""Room -> the rooms its modules may import (besides its own). A room is a subpackage of areal_aio
(`workers` for workers/) or a top-level module (settings, wire, seeds); `areal_aio` is the
package's own front doors (`__init__`'s lazy names, `__main__`). The arrows point one way:
commands over the loop; the loop over the agents (episodes, the endpoint: handed the loop's
counts, never importing it) and the workers' clients; the agents over the rewards and the tasks
(a reward reads a task, never the reverse); all of them over the store and the leaves. The
sandbox is a leaf: tasks make their tests with it, rewards judge with it, it imports nothing of
the package. The workers (torch) see only store, settings, wire and seeds."""
HEAVY = ("torch", "transformers", "safetensors", "accelerate", "gguf", "peft")
"""Packages that load torch (or are only used beside it)."""
LAZY_HEAVY = {
    "areal_aio.store.safetensors_io": "the tensor I/O of the weight store: publish (the trainer) "
                                      "and load (the rollout worker)",
}
"""Modules the controller imports whose torch imports are inside worker-only functions."""
REMOTE = ("areal_aio.fleet.ray_workers",)
"""Modules that run in a Ray actor's process besides the controller's (they may load what the
worker loads; the controller imports them only when ray.address is set)."""


def reach(room: str) -> set[str]:
    """The rooms `room` reaches through the table, itself included."""
    seen, stack = {room}, [room]
    while stack:
        for target in ROOMS[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


TORCH_FREE = tuple(f"areal_aio.{room}" for room in ROOMS if room != "areal_aio" and "workers" not in reach(room))
"""What the controller process imports (the rooms that cannot reach workers/): none of it may
reach HEAVY."""


def room(module: str) -> str:
    """`areal_aio.control.stats` -> control; the package itself and its __main__ -> areal_aio."""
    parts = module.split(".")
    return "areal_aio" if len(parts) == 1 or parts[1] == "__main__" else parts[1]


def packages() -> dict[str, Path]:
    """Each package pyproject ships, and the folder it is read from (its package-dir mapping)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setup.get("package-dir", {})
    out = {}
    for package in setup["packages"]:
        top = max((m for m in mapped if package == m or package.startswith(m + ".")), key=len, default="")
        rest = package.removeprefix(top).strip(".").split(".") if package != top else []
        out[package] = ROOT.joinpath(mapped[top] if top else "", *[p for p in rest if p])
    return out


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in packages().items():
        for path in folder.glob("*.py"):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(name: str, path: Path, known: dict[str, Path], type_only: bool = False) -> set[str]:
    """What `name` imports: modules of the package (resolved to the deepest known module) and
    the top-level names of outside packages; `type_only`: `if TYPE_CHECKING:` imports too."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def add(target: str, names: list[str], top: bool) -> None:
        if not target.startswith("areal_aio"):
            if top or name not in LAZY_HEAVY:
                out.add(target.split(".")[0])
            return
        for sub in names:
            if f"{target}.{sub}" in known:
                out.add(f"{target}.{sub}")
            elif target in known:
                out.add(target)

    def visit(node: ast.AST, top: bool) -> None:
        if _type_checking(node) and not type_only:
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("areal_aio"):
                    out.add(max((m for m in known if alias.name == m or alias.name.startswith(m + ".")),
                                key=len, default=alias.name))
                else:
                    add(alias.name, [""], top)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            add(base, [a.name for a in node.names], top)
        inside = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(path.read_text(), str(path)), True)
    out.discard(name)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


@pytest.fixture(scope="module")
def arrows() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, type-only imports included."""
    known = modules()
    return {name: {t for t in imports(name, path, known, type_only=True) if t in known}
            for name, path in known.items()}


def test_every_package_folder_ships_and_none_is_a_link():
    """pyproject lists the packages (a mapped folder cannot be found by setuptools' find): a
    folder left out of the list would be missing from the wheel. No file has two paths."""
    listed = {folder.resolve() for folder in packages().values()}
    folders = {init.parent.resolve() for top in ("areal_aio", "workers") for init in (ROOT / top).rglob("__init__.py")}
    assert folders == listed, sorted(map(str, folders ^ listed))
    links = [str(p) for top in ("areal_aio", "workers") for p in (ROOT / top).rglob("*") if p.is_symlink()]
    assert not links, links


def test_the_walk_sees_the_package(graph):
    assert {"areal_aio.control.controller", "areal_aio.workers.rollout.engine",
            "areal_aio.workers.trainer.worker", "areal_aio.settings"} <= set(graph)
    assert "torch" in graph["areal_aio.workers.rollout.engine"]
    assert "areal_aio.wire" in graph["areal_aio.control.controller"]


def test_the_table_names_every_room_once_and_points_one_way(arrows):
    assert {room(m) for m in arrows} == set(ROOMS), "a room of the package is missing from ROOMS, or a row is stale"
    assert all(t in ROOMS and t != r for r, targets in ROOMS.items() for t in targets)
    circles = [r for r in ROOMS if any(r in reach(t) for t in ROOMS[r])]
    assert not circles, f"the table itself lets these rooms reach themselves: {circles}"


def test_every_import_follows_the_table(arrows):
    bad = [f"{name} -> {target}  ({room(name)} may not import {room(target)})"
           for name, targets in sorted(arrows.items()) for target in sorted(targets)
           if room(target) != room(name) and room(target) not in ROOMS[room(name)]]
    assert not bad, "\n".join(bad)


def test_the_table_catches_a_type_only_import(tmp_path):
    """The check reads `if TYPE_CHECKING:` blocks: an upward arrow there is still reported."""
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from areal_aio.agents.episodes import Model\n")
    known = {"areal_aio.tasks.mod": path, "areal_aio.agents.episodes": path}
    assert imports("areal_aio.tasks.mod", path, known, type_only=True) == {"typing", "areal_aio.agents.episodes"}
    assert imports("areal_aio.tasks.mod", path, known) == {"typing"}


def test_the_front_door_names_come_from_its_rooms():
    """`areal_aio.Orchestrator` and the other lazy names import their modules by name, out of the
    walk's sight: their rooms are read from `_HOME` instead."""
    tree = ast.parse((ROOT / "areal_aio" / "__init__.py").read_text())
    home = next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_HOME" for t in n.targets))
    known = modules()
    assert all(f"areal_aio.{module}" in known for module in home.values()), home
    assert {module.split(".")[0] for module in home.values()} <= set(ROOMS["areal_aio"])


def docs_tables() -> list[tuple[Path, dict[str, set[str]]]]:
    """Each markdown table under docs/ headed `| subpackage | may import |`: its page and its rows
    (the backticked rooms of a row's left cell -> the backticked rooms of its right cell)."""
    tables = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if [c.strip().lower() for c in line.strip().strip("|").split("|")] != ["subpackage", "may import"]:
                continue
            rows: dict[str, set[str]] = {}
            for row in itertools.takewhile(lambda x: x.startswith("|"), lines[i + 2:]):
                left, right = row.strip().strip("|").split("|")
                rows.update({name: set(re.findall(r"`([^`]+)`", right)) for name in re.findall(r"`([^`]+)`", left)})
            tables.append((page, rows))
    return tables


def test_the_docs_show_this_table():
    """The table a person reads is ROOMS, row for row: at least one page under docs/ shows it,
    and no table of arrows there says otherwise (a table whose rows name no arrow at all is a
    placeholder, not a copy)."""
    table = {name: set(targets) for name, targets in ROOMS.items()}
    tables = docs_tables()
    assert any(rows == table for _, rows in tables), "no table '| subpackage | may import |' under docs/ is ROOMS"
    stale = [str(page.relative_to(ROOT)) for page, rows in tables if any(rows.values()) and rows != table]
    assert not stale, f"these pages show other arrows than ROOMS: {stale}"


def test_no_import_circles(graph):
    internal = {name: {t for t in targets if t in graph} for name, targets in graph.items()}
    done: set[str] = set()
    circles = []

    def walk(name: str, path: list[str]) -> None:
        if name in path:
            circles.append(" -> ".join(path[path.index(name):] + [name]))
            return
        if name in done:
            return
        for target in sorted(internal[name]):
            walk(target, path + [name])
        done.add(name)

    for name in sorted(internal):
        walk(name, [])
    assert not circles, "\n".join(circles)


def test_the_controller_side_never_reaches_torch(graph):
    roots = [m for m in graph if m.startswith(TORCH_FREE) and m not in REMOTE]
    bad = []
    for root in roots:
        seen, stack, parent = {root}, [root], {root: None}
        while stack:
            name = stack.pop()
            for target in graph.get(name, ()):
                if target in HEAVY:
                    chain, at = [target], name
                    while at is not None:
                        chain.append(at)
                        at = parent[at]
                    bad.append(" <- ".join(chain))
                elif target in graph and target not in seen and target not in REMOTE:
                    seen.add(target)
                    parent[target] = name
                    stack.append(target)
    assert not bad, "\n".join(sorted(set(bad)))


def test_importing_the_controller_side_loads_no_torch(graph):
    names = sorted(m for m in graph if m.startswith(TORCH_FREE) and m not in REMOTE)
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(sorted(set(sys.modules) & set({HEAVY!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
