"""Each layer of modelpar imports only from layers below it (docs/architecture.md names them)."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "modelpar"


def _layer_table() -> tuple[dict[str, int], set[str]]:
    """docs/architecture.md's layer table, the one place the layers are written: (package -> layer, the
    packages that must not import torch). A row is ``| n | `pkg`, `pkg` | no | job |``."""
    layers, pure = {}, set()
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        row = re.match(r"\| (\d+) \| ([^|]+) \| ([^|]+) \|", line)
        if row:
            for name in re.findall(r"`(\w+)`", row.group(2)):
                layers[name] = int(row.group(1))
                if row.group(3).strip() == "no":
                    pure.add(name)
    return layers, pure


LAYERS, PURE = _layer_table()  # a package may import its own layer (without a cycle) or lower ones


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


def _module_imports() -> dict[str, set[str]]:
    """Module -> the modelpar modules it imports at run time (lazily or not; ``if TYPE_CHECKING:`` blocks are
    annotations only and are skipped, as are imports of a package's ``__init__``, which only re-exports)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges[name] = {m for m in found if m in modules and m != name and modules[m].name != "__init__.py"}
    return edges


def test_no_import_cycle_between_modules():
    edges = _module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(edges[module]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [module, nxt])
            if nxt not in state:
                visit(nxt, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])


def test_the_training_loop_takes_its_schedule_and_never_asks_the_cost_model():
    """Issue 37: the schedule is resolved where the run starts and shipped to the ranks (modelpar.training.start);
    the loop imports nothing from the cost model, directly or through the run's prediction."""
    tree = ast.parse((ROOT / "modelpar" / "training" / "loop.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m.startswith(("modelpar.costmodel", "modelpar.training.prediction"))}


def test_the_training_step_is_short_and_each_dimension_is_one_function():
    """Issue 37: the step reads as its order (batch → runner → gradient sync → clip → agree → optimizer), at most 20
    lines, telemetry kept apart; the parts are applied by one function each (modelpar.training.parts)."""
    import inspect

    from modelpar.training import parts
    from modelpar.training.loop import _Run

    assert len(inspect.getsource(_Run.step).splitlines()) <= 20
    assert {"build_stages", "apply_float8", "apply_compile", "stage_loss", "apply_pipeline",
            "apply_data_parallel"} <= set(parts.__all__)
