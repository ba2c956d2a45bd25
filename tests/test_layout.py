"""The package's shape, read from its source: no import circles, and the controller's side never
reaches torch.

Every import between the package's modules counts, at the top of a module or inside a function
(a lazy import still runs the imported module in the process that calls it); only
`if TYPE_CHECKING:` blocks are left out. An outside package counts where it is imported at a
module's top; inside a function it counts unless the module is one of LAZY_HEAVY, whose heavy
imports sit in functions only the workers call. A last test imports the controller's side in a
fresh interpreter and looks for torch in sys.modules. The modules are those pyproject ships, each
read from the folder it maps (`workers/` as `areal_aio.workers`)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

HEAVY = ("torch", "transformers", "safetensors", "accelerate", "gguf", "peft")
"""Packages that load torch (or are only used beside it)."""
TORCH_FREE = ("areal_aio.settings", "areal_aio.wire", "areal_aio.seeds", "areal_aio.control",
              "areal_aio.fleet", "areal_aio.tasks", "areal_aio.rewards", "areal_aio.store")
"""What the controller process imports: none of it may reach HEAVY."""
LAZY_HEAVY = {
    "areal_aio.store.safetensors_io": "the tensor I/O of the weight store: publish (the trainer) "
                                      "and load (the rollout worker)",
}
"""Modules the controller imports whose torch imports are inside worker-only functions."""
REMOTE = ("areal_aio.fleet.ray_workers",)
"""Modules that run in a Ray actor's process besides the controller's (they may load what the
worker loads; the controller imports them only when ray.address is set)."""


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


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What `name` imports: modules of the package (resolved to the deepest known module) and
    the top-level names of outside packages."""
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
        if _type_checking(node):
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
