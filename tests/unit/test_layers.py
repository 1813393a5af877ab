"""The package's imports run one way: no module imports itself back, no layer imports one above it.

Every import counts, also one inside a function or under ``TYPE_CHECKING``: each is a dependency a
reader must follow. The layers, lowest first, are ``LAYERS``; a package may import its own modules
and those of lower layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "strata"
LAYERS = (
    ("strata",),  # the package itself: its version
    ("strata.errors",),
    ("strata.schema",),
    ("strata.config",),
    ("strata.hooktypes",),
    ("strata.hooks",),
    ("strata.plugins",),
    ("strata.model",),
    ("strata.gpu",),
    ("strata.backend",),
    ("strata.engine",),
    ("strata.serve", "strata.bench", "strata.cli"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The strata modules ``path`` imports, each resolved to a module that exists."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def layer_of(module: str) -> int:
    best = (-1, 0)  # (length of the longest matching prefix, its layer)
    for rank, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best[0]:
                best = (len(package), rank)
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_no_layer_imports_one_above_it():
    upward = [f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
              if layer_of(target) > layer_of(module)]
    assert upward == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("strata.gpu.kernels.gemm") < layer_of("strata.backend.ops") < layer_of("strata.engine.runner")
    assert layer_of("strata.serve.app") == layer_of("strata.cli.check")


def test_plugins_import_only_the_contract():
    plugin_sources = sorted((REPO / "plugins").glob("*/*.py"))
    modules = {name for name in import_graph()} | {"strata.hooks", "strata.hooktypes"}
    outside = {f"{path.name} imports {target}" for path in plugin_sources
               for target in imports_of(path, modules) if target not in ("strata.hooks", "strata.hooktypes")}
    assert plugin_sources and outside == set()
