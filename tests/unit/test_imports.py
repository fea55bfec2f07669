"""Every module imports on its own, and the modules import each other without a cycle.

As aiohttp's own suite does, each module is imported in a fresh interpreter, so a module that
only works because another was imported first fails here. The modules that need llama_cpp (the
optional engine) are imported in tests/embedded/test_engine_imports.py, where it is installed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.imports import (
    find_cycle,
    import_alone,
    import_graph,
    needs_engine_library,
    package_modules,
)

# `__main__` runs the command line when imported: it is run with --help below instead
WITHOUT_ENGINE = [
    name
    for name in package_modules()
    if not needs_engine_library(name) and not name.endswith(".__main__")
]


@pytest.mark.parametrize("module", WITHOUT_ENGINE)
def test_module_imports_alone(module: str) -> None:
    result = import_alone(module)
    assert result.returncode == 0, result.stderr


def test_python_m_cacheproxy_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cacheproxy", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_the_engine_modules_are_the_few_expected() -> None:
    """The split above is computed from the imports; this keeps it from silently growing."""
    with_engine = {name for name in package_modules() if needs_engine_library(name)}
    assert with_engine == {
        "cacheproxy.embedded.engine",
        "cacheproxy.embedded.server",
        "cacheproxy.embedded.http_api",
        "cacheproxy.embedded.api_json",
        "cacheproxy.embedded.kv_costs",
        "cacheproxy.bench.embedded_bench",
    }


def test_no_import_cycle_at_module_level() -> None:
    assert find_cycle(import_graph(module_level_only=True)) is None


def test_no_import_cycle_hidden_in_a_function() -> None:
    """An import inside a function that closes a cycle is still a cycle: the two modules cannot
    be understood, or moved, apart."""
    cycle = find_cycle(import_graph(module_level_only=False))
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
