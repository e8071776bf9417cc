"""The package's shape, checked on its source: one-way layers, few function-local imports, short functions.

Layers, bottom to top (docs/architecture.md). A module may import its own package and any package
of a lower layer, never a higher one nor another package of its own layer:

    0 errors   1 yamlio   2 datasets, mace (the MACE file format)   3 runtime   4 calibrate
    5 quant    6 reports  7 app (pipeline, mixed precision, bias correction, CLIs)
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"errors": 0, "yamlio": 1, "datasets": 2, "mace": 2, "runtime": 3, "calibrate": 4, "quant": 5,
         "reports": 6, "app": 7}
#: function-local imports of maceq modules that are allowed: each loads an optional dependency
OPTIONAL_IMPORTS = {("maceq.runtime.model", "maceq.runtime.opencl.backend"),  # pyopencl
                    ("maceq.app.launch", "maceq.app.cli")}  # after the workers' forkserver has started
MAX_LOCAL_IMPORTS = 5
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if (rel.parts[0] in ("tests", "bench", "tools", "build") or rel.parts[0].endswith(".egg-info")
                or any(part.startswith(".") for part in rel.parts)):  # .ci, a .venv inside the checkout
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["maceq", *parts])] = p
    return out


MODULES = _modules()


def _targets(module: str, path: Path, node: ast.AST) -> list[str]:
    """The maceq modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("maceq")]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("maceq"):
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]


def _imports(module: str, path: Path):
    """(target, line, function-local?) of every maceq import in a module."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for t in _targets(module, path, node):
                yield t, node.lineno, id(node) in local


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_library_package_has_a_layer():
    packages = {_package(m) for m in MODULES} - {""}
    assert packages == set(LAYER), f"packages without a layer: {sorted(packages - set(LAYER))}"


def test_imports_go_one_way_down():
    bad = []
    for module, path in MODULES.items():
        here = _package(module)
        for target, line, _ in _imports(module, path):
            there = _package(target)
            if there and there != here and LAYER[there] >= LAYER[here]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here} (layer {LAYER[here]}) imports "
                           f"{target} (layer {LAYER[there]})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_import_cycle_between_packages():
    edges = {p: set() for p in LAYER}
    for module, path in MODULES.items():
        for target, _, _ in _imports(module, path):
            if _package(target) and _package(target) != _package(module):
                edges[_package(module)].add(_package(target))
    state: dict[str, int] = {}

    def visit(p, trail):
        state[p] = 1
        for q in edges[p]:
            assert state.get(q) != 1, "import cycle: " + " -> ".join(trail + [q])
            if q not in state:
                visit(q, trail + [q])
        state[p] = 2

    for p in edges:
        if p not in state:
            visit(p, [p])


def test_function_local_maceq_imports_only_for_optional_dependencies():
    local = sorted({(m, t, line) for m, path in MODULES.items() for t, line, is_local in _imports(m, path)
                    if is_local})
    assert len(local) <= MAX_LOCAL_IMPORTS, local
    assert {(m, t) for m, t, _ in local} <= OPTIONAL_IMPORTS, local


def test_no_library_function_is_longer_than_80_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_the_checks_see_a_violation():
    """The walk resolves relative and absolute imports to the modules it ranks."""
    path = MODULES["maceq.runtime.model"]
    targets = {t for t, _, _ in _imports("maceq.runtime.model", path)}
    assert "maceq.mace.format" in targets and "maceq.runtime.registry" in targets
    fake = ast.parse("from ..quant import build\nfrom maceq.app.cli import main\n")
    got = [t for node in fake.body for t in _targets("maceq.runtime.model", path, node)]
    assert got == ["maceq.quant.build", "maceq.app.cli"]
    assert LAYER[_package(got[0])] > LAYER["runtime"] and LAYER[_package(got[1])] > LAYER["runtime"]
