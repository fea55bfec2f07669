"""The import graph of the installed packages, read with `ast` (nothing is imported to build it).

Shared by tests/unit/test_imports.py (cycles; every module importable alone) and
tests/embedded/test_engine_imports.py (the modules that need llama_cpp).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

PACKAGES = ("cacheproxy", "cacheproxy_plugins")
ENGINE_LIBRARY = "llama_cpp"  # only in the optional `embedded` extra


@cache
def package_modules() -> dict[str, Path]:
    """Every module of our packages, by dotted name, with its file."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(
    tree: ast.AST, module_level_only: bool, type_only: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements; those in `if TYPE_CHECKING:` blocks (never run) only with
    `type_only`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            stack.extend(node.orelse)
            continue
        if module_level_only and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        ):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imported_names(module: str, module_level_only: bool, type_only: bool = False) -> set[str]:
    """What `module` imports: our modules by name, and other top-level packages by name;
    `type_only`: the imports made only for type checkers too."""
    path = package_modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    known = package_modules()
    found: set[str] = set()
    for node in _import_nodes(tree, module_level_only, type_only):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _absolute(module, path.name == "__init__.py", node)
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            found.add(target if target in known else target.split(".")[0])
    found.discard(module)
    return found


def import_graph(module_level_only: bool, type_only: bool = False) -> dict[str, set[str]]:
    """Edges between our modules only (`type_only`: those for type checkers too)."""
    known = package_modules()
    return {
        module: {
            name for name in imported_names(module, module_level_only, type_only) if name in known
        }
        for module in known
    }


def folder_of(module: str) -> str:
    """The folder (floor of the layer map) a module belongs to: `cacheproxy.slots.scheduler`
    -> `slots`, a top-level module such as `cacheproxy.errors` -> `errors`, the first-party
    plugins package -> `cacheproxy_plugins`."""
    parts = module.split(".")
    if parts[0] != "cacheproxy":
        return parts[0]
    return parts[1] if len(parts) > 1 else "cacheproxy"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


@cache
def needs_engine_library(module: str) -> bool:
    """Whether importing `module` imports llama_cpp (directly or through our modules)."""
    seen: set[str] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in imported_names(current, module_level_only=True):
            if name == ENGINE_LIBRARY:
                return True
            if name in package_modules():
                stack.append(name)
    return False


def import_alone(module: str) -> subprocess.CompletedProcess[str]:
    """`python -c "import module"` in a fresh interpreter: no other test's imports help it."""
    return subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
