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
    folder_of,
    import_alone,
    import_graph,
    needs_engine_library,
    package_modules,
)

# The layer map: floors from the face down. A folder imports folders on the floors below its
# own; on its own floor, only what SIDEWAYS names, each arrow with its reason. Nothing imports
# a floor above it. `provision` (the test bed) sits just below the command line and the
# benchmarks, its only users besides the tests: the service gets what it builds handed in.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("__main__",),  # `python -m cacheproxy`
    ("cli",),  # the command line
    ("bench",),  # the benchmarks
    # the first-party plugins: the service finds them by name (entry points); only the
    # benchmarks that measure them import them
    ("cacheproxy_plugins",),
    ("provision",),  # the test bed: builds llama-server and the engine, writes test models
    ("http",),  # the app factory, routes, front door, admin API and dashboard
    ("slots",),  # the request path: mirror, placement, scheduler, stages, executor
    ("apis",),  # the answers' shapes: llama-server's read, Anthropic's and Responses' converted
    ("tenancy", "cluster", "embedded", "disk"),  # the services the request path uses
    ("upstreams",),  # the servers: pool, client, relay, what each of their slots holds
    ("ops",),  # metrics, logs, tracing, supervised background tasks
    ("db",),  # SQLite and PostgreSQL connections and migrations
    ("plugins",),  # finds plugins by name (entry points) and builds them
    # pure shared pieces: the error envelope, settings, the prompt-cache interface, token helpers
    ("errors", "settings", "prompt_cache", "tokens", "sqlite_wal"),
)
SIDEWAYS: dict[tuple[str, str], str] = {
    ("embedded", "disk"): "the engine reads and writes llama-server's slot-file format",
}


def allowed_imports() -> dict[str, set[str]]:
    """Which folders each folder may import, from FLOORS and SIDEWAYS."""
    allowed: dict[str, set[str]] = {}
    for height, floor in enumerate(FLOORS):
        below = {folder for lower in FLOORS[height + 1 :] for folder in lower}
        for folder in floor:
            allowed[folder] = below | {to for (frm, to) in SIDEWAYS if frm == folder}
    return allowed


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
        "cacheproxy.embedded.model",
        "cacheproxy.embedded.kv_ops",
        "cacheproxy.embedded.slot_files",
        "cacheproxy.embedded.server",
        "cacheproxy.embedded.http_api",
        "cacheproxy.embedded.api_json",
        "cacheproxy.embedded.kv_costs",
        "cacheproxy.bench.embedded_bench",
    }


def test_no_import_cycle_at_module_level() -> None:
    assert find_cycle(import_graph(module_level_only=True)) is None


def test_no_import_cycle_hidden_in_a_function_or_for_types() -> None:
    """An import inside a function, or one made only for type checkers, that closes a cycle is
    still a cycle: the two modules cannot be understood, or moved, apart."""
    cycle = find_cycle(import_graph(module_level_only=False, type_only=True))
    assert cycle is None, " -> ".join(cycle or [])


def test_every_folder_is_on_the_layer_map() -> None:
    on_map = {folder for floor in FLOORS for folder in floor}
    present = {folder_of(module) for module in package_modules()} - {"cacheproxy"}
    assert present - on_map == set(), "folders missing from FLOORS"
    assert on_map - present == set(), "FLOORS names folders that do not exist"


def test_imports_run_down_the_layer_map() -> None:
    """Every import (in a function or for type checkers too) goes to a floor below, or sideways
    where SIDEWAYS says why; an arrow upward is named with the line that makes it."""
    allowed = allowed_imports()
    upward = []
    for module, imported in sorted(import_graph(module_level_only=False, type_only=True).items()):
        source = folder_of(module)
        for name in sorted(imported):
            target = folder_of(name)
            if target not in (source, "cacheproxy") and target not in allowed[source]:
                upward.append(f"{source} -> {target} ({module} imports {name})")
    assert upward == [], "imports against the layer map:\n" + "\n".join(upward)


def test_no_two_folders_import_each_other() -> None:
    arrows = {
        (folder_of(module), folder_of(name))
        for module, imported in import_graph(module_level_only=False, type_only=True).items()
        for name in imported
    }
    both_ways = sorted({tuple(sorted(a)) for a in arrows if a[0] != a[1] and a[::-1] in arrows})
    assert both_ways == []


def test_the_layer_map_refuses_an_upward_arrow() -> None:
    allowed = allowed_imports()
    assert "slots" in allowed["http"] and "http" not in allowed["slots"]
    assert "disk" in allowed["embedded"] and "embedded" not in allowed["disk"]
    assert "provision" not in allowed["http"] and "provision" in allowed["cli"]


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
