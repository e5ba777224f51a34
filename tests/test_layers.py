"""The package's layering: the control plane imports no torch, and no module imports from a layer above its own."""

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
    {"deployments"},
    {"registry"},
    {"router"},
    {"client", "cli", "__init__"},
]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
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


@pytest.mark.parametrize("module", ["rayrunner.router.app", "rayrunner.registry.actor", "rayrunner.client"])
def test_the_control_plane_loads_no_torch(module: str) -> None:
    """The router replicas, the registry actor and a driver import neither torch nor transformers (only a model's
    replica does), checked in a fresh interpreter."""
    code = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""
