"""`cacheproxy testbed build-engine`: the pinned llama-cpp-python, from a wheel cached once."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheproxy.provision import build_engine


def test_the_pinned_engine_is_installed_and_its_cached_wheel_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert build_engine.installed_version() == build_engine.LLAMA_CPP_PYTHON_VERSION
    monkeypatch.setenv("CACHEPROXY_CACHE_DIR", str(tmp_path))
    assert build_engine.cached_wheel() is None
    wheel = tmp_path / "wheels" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    (tmp_path / "wheels" / "llama_cpp_python-0.3.35-py3-none-linux_x86_64.whl").write_bytes(b"")
    assert build_engine.cached_wheel() == wheel
    # installed already: nothing is built or installed, the cached wheel is reported
    assert build_engine.ensure_engine() == wheel
