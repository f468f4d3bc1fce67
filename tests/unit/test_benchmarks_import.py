"""Every benchmark module imports: a benchmark broken by a change elsewhere fails here, in the
suite, not months later in `ddnn bench` (alignment once imported a helper that was gone)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import ddnn.benchmarks


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(
    ddnn.benchmarks.__path__)))
def test_benchmark_module_imports(name):
    importlib.import_module(f"ddnn.benchmarks.{name}")
