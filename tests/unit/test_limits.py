"""The house rules that keep the code readable, checked on every run so they stay true.

In ``ddnn/`` (plumbing and tools included), ``device/``, ``edge/`` and ``cloud/``: no module
over 450 lines, no function over 60, no class over 20 methods, no constructor over 12
parameters. In ``tests/``: no test module imports another (what they share is in
``tests/support``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ("ddnn", "device", "edge", "cloud")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_METHODS = 20
MAX_INIT_PARAMETERS = 12


def modules(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters besides ``self`` (``*args`` and ``**kwargs`` one each)."""
    a = f.args
    return (len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
            + (a.vararg is not None) + (a.kwarg is not None))


def test_the_runtime_code_keeps_to_the_size_limits():
    found = []
    for path in modules(*RUNTIME):
        name = path.relative_to(ROOT)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
        tree = parsed(path)
        for f in functions(tree):
            length = f.end_lineno - f.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{f.lineno} {f.name}: {length} lines "
                             f"(at most {MAX_FUNCTION_LINES})")
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = [f for f in c.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
            if len(methods) > MAX_METHODS:
                found.append(f"{name}:{c.lineno} {c.name}: {len(methods)} methods "
                             f"(at most {MAX_METHODS})")
            for f in methods:
                if f.name == "__init__" and parameters(f) > MAX_INIT_PARAMETERS:
                    found.append(f"{name}:{f.lineno} {c.name}.__init__: {parameters(f)} "
                                 f"parameters (at most {MAX_INIT_PARAMETERS})")
    assert not found, "\n".join(found)


def imported_test_modules(tree: ast.Module) -> Iterator[str]:
    """The modules of ``tests`` (outside ``tests.support``) that ``tree`` imports."""
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names]
                                     if node.module == "tests" else [])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests" and len(parts) > 1 and parts[1] != "support":
                yield name


def test_no_test_module_imports_another():
    found = [f"{path.relative_to(ROOT)} imports {name}"
             for path in modules("tests") if "support" not in path.relative_to(ROOT).parts
             for name in imported_test_modules(parsed(path))]
    assert not found, "\n".join(found) + "\n(shared helpers belong in tests/support)"


@pytest.mark.parametrize(("code", "imports"), [
    ("from tests.integration.conftest import wait_for", ["tests.integration.conftest"]),
    ("import tests.unit.test_x", ["tests.unit.test_x"]),
    ("def f():\n    from tests.e2e import test_ota", ["tests.e2e"]),
    ("from tests import conftest", ["tests.conftest"]),
    ("from tests.support.polling import wait_for", []),
])
def test_the_import_check_finds_test_modules(code, imports):
    assert list(imported_test_modules(ast.parse(code))) == imports


def test_test_modules_have_unique_names():
    # pytest imports test modules by their basename (rootdir-relative
    # packages are not used here), so two files of one name break collection.
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen[path.name] = path
    assert not clashes, "test modules share a name: " + "; ".join(clashes)
