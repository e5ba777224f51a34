"""The package's layering: the control plane imports no torch, no module imports from a layer above its own, and
within a layer no package or module imports one that imports it back (no circle, however long)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rayrunner"
# Lowest first: a module may import from its own layer and the ones before it (docs/architecture.md draws them).
LAYERS = [
    {"errors", "runtime"},
    {"protocol", "unsupported_fields", "models", "quantization"},
    {"openai"},
    {"engines"},
    {"replica", "deployments"},
    {"registry"},
    {"router"},
    {"client", "cli", "__init__"},
]


def layer_of(module: str) -> int:
    top = top_of(module)
    return next(index for index, names in enumerate(LAYERS) if top in names)


def imports_of(path: Path) -> set[str]:
    """The rayrunner modules `path` imports at module level or in a function (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayrunner"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("rayrunner"))
    return found


def top_of(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        for imported in imports_of(path):
            if imported != "rayrunner" and layer_of(imported) > layer_of(name):
                upward.append(f"{name} -> {imported}")
    assert upward == []


def import_graph() -> dict[str, set[str]]:
    """Each rayrunner module and the rayrunner modules it imports (a package's import counts as its `__init__`)."""
    return {module_name(path): imports_of(path) - {"rayrunner"} for path in sorted(PACKAGE.rglob("*.py"))}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm): each holds a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, set()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_between_modules() -> None:
    assert circles(import_graph()) == []


def test_no_circle_between_packages_of_a_layer() -> None:
    """`models` and `quantization` share a layer: one may import the other, not both ways."""
    packages: dict[str, set[str]] = {}
    for module, imported in import_graph().items():
        packages.setdefault(top_of(module), set()).update(top_of(name) for name in imported)
    for top, imported in packages.items():
        imported.discard(top)
    assert circles(packages) == []


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", ["rayrunner.router.app", "rayrunner.registry.actor", "rayrunner.client"])
def test_the_control_plane_loads_no_torch(module: str) -> None:
    """The router replicas, the registry actor and a driver import neither torch nor transformers (only a model's
    replica does), checked in a fresh interpreter."""
    code = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""
