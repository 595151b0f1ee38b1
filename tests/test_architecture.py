"""Each layer of modelpar imports only from layers below it (docs/architecture.md names them)."""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "modelpar"

# docs/architecture.md's table: a package may import its own layer (without a cycle) or lower ones
LAYERS = {
    "_validate": 0, "_renamed": 0, "formulas": 0, "schedules": 0, "layer_split": 0, "_options": 0, "_outputs": 0,
    "simulate": 1, "costmodel": 1,
    "_compat": 2, "_tensor_meta": 2, "recompute": 2, "tensor_parallel": 2, "checkpoint": 2, "distributed": 2,
    "pipeline": 3, "text": 3, "corpus": 3,
    "model": 4, "bench": 4,
    "export": 5, "hf": 5, "generate": 5,
    "training": 6, "calibrate": 6,
    "commands": 7, "cli": 7, "__main__": 7,
}
PURE = {"_validate", "_renamed", "formulas", "schedules", "layer_split", "_options", "_outputs", "simulate", "costmodel"}


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Top-level modelpar package -> the other top-level packages it imports (lazily or not); parsed once."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        src = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if src == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                parts = name.split(".")
                if parts[0] == "modelpar" and len(parts) > 1 and parts[1] != src:
                    edges.setdefault(src, set()).add(parts[1])
                if parts[0] == "torch" and src in PURE:
                    edges.setdefault(src, set()).add("torch")
    return edges


def test_every_package_has_a_layer():
    found = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert found == set(LAYERS)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_go_down(package):
    up = {dst: LAYERS.get(dst) for dst in _imports().get(package, ()) if LAYERS.get(dst, 99) > LAYERS[package]}
    assert not up, f"{package} (layer {LAYERS[package]}) imports from above: {up}"


def test_no_cycle_within_a_layer():
    edges = _imports()
    for a, targets in edges.items():
        for b in targets:
            assert a not in edges.get(b, set()), f"{a} and {b} import each other"
