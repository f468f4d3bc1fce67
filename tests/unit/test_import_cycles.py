"""No two runtime modules import each other, however indirectly.

Every import counts: at module level, inside a function (a lazy import) and under
``if TYPE_CHECKING`` alike, because each is coupling all the same. The runtime folders map to
the one ``ddnn`` package as pyproject's ``package-dir`` installs them (``device/`` is
``ddnn.device``, ...). An import of a package counts as an import of its ``__init__``;
``from package import module`` counts as an import of that module alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# folder in the repository -> the package it installs as (pyproject's package-dir)
PACKAGES = {"ddnn": "ddnn", "device": "ddnn.device", "edge": "ddnn.edge", "cloud": "ddnn.cloud"}


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name ``path`` installs as, and whether it is a package's ``__init__``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = PACKAGES[parts[0]].split(".")
    rest = list(parts[1:])
    is_init = rest[-1:] == ["__init__"]
    if is_init:
        rest = rest[:-1]
    return ".".join(package + rest), is_init


def imported_names(tree: ast.Module, name: str, is_init: bool) -> Iterator[str]:
    """Every name ``tree`` imports, wherever the import stands, relative ones resolved."""
    package = name if is_init else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from ddnn.plumbing import ota` names the module ddnn.plumbing.ota; an attribute
            # (`from ddnn.bundle import Bundle`) resolves to its module in import_graph
            yield from (module if a.name == "*" else f"{module}.{a.name}" for a in node.names)


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules (of ``sources``) it imports.

    ``sources`` maps a module's dotted name to its code and whether it is a package's
    ``__init__``. Names that are not modules here (third-party, or an attribute imported
    from a module) resolve to the nearest enclosing module that is.
    """
    graph: dict[str, set[str]] = {}
    for name, (code, is_init) in sources.items():
        edges = set()
        for imported in imported_names(ast.parse(code), name, is_init):
            target = imported
            while target and target not in sources:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # iterative, so a deep import chain cannot hit the recursion limit
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def runtime_sources() -> dict[str, tuple[str, bool]]:
    sources = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            name, is_init = module_name(path)
            sources[name] = (path.read_text(encoding="utf-8"), is_init)
    return sources


def test_no_runtime_modules_import_each_other():
    found = cycles(import_graph(runtime_sources()))
    assert not found, "import cycles (lazy and TYPE_CHECKING imports count):\n" + "\n".join(
        " <-> ".join(part) for part in found)


@pytest.mark.parametrize(("sources", "expected"), [
    # a plain pair, one side lazy
    ({"p.a": ("import p.b\n", False), "p.b": ("def f():\n    from p.a import X\n", False)},
     [["p.a", "p.b"]]),
    # under TYPE_CHECKING, through a relative import, three long
    ({"p.a": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
              False),
      "p.b": ("from p import c\n", False),
      "p.c": ("import p.a as a\n", False)},
     [["p.a", "p.b", "p.c"]]),
    # attributes resolve to their module; `from package import module` is that module alone
    ({"p": ("from p.a import A\n", True), "p.a": ("import numpy\nfrom p import b\n", False),
      "p.b": ("import os.path\nfrom p.a import A\n", False)},
     [["p.a", "p.b"]]),
    ({"p": ("from p.a import A\n", True), "p.a": ("from p import b\n", False),
      "p.b": ("import os.path\n", False)},
     []),
    # a module taking a name from its package's __init__, which imports the module back
    ({"p.q": ("from p.q.a import A\n", True), "p.q.a": ("from ..q import OTHER\n", False)},
     [["p.q", "p.q.a"]]),
])
def test_the_cycle_check_finds_cycles(sources, expected):
    assert cycles(import_graph(sources)) == expected


def test_module_names_follow_the_package_dir():
    assert module_name(ROOT / "device" / "gateway" / "service.py") == (
        "ddnn.device.gateway.service", False)
    assert module_name(ROOT / "edge" / "__init__.py") == ("ddnn.edge", True)
