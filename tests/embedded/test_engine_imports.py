"""The modules that need llama_cpp import on their own too, now that it is installed (see
tests/unit/test_imports.py for the rest)."""

from __future__ import annotations

import pytest

from tests.support.imports import import_alone, needs_engine_library, package_modules

WITH_ENGINE = [name for name in package_modules() if needs_engine_library(name)]


@pytest.mark.parametrize("module", WITH_ENGINE)
def test_engine_module_imports_alone(module: str) -> None:
    result = import_alone(module)
    assert result.returncode == 0, result.stderr
