"""Install the pinned llama-cpp-python (the `embedded` extra) from a wheel built once and cached.

Its sdist compiles llama.cpp (about 7 minutes on 2 cores), so the wheel is kept in the cache
folder; a later run, or another checkout, installs that wheel in seconds.
`cacheproxy testbed build-engine` prints the wheel's path.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from cacheproxy.provision.cache import cache_root, locked, say

LLAMA_CPP_PYTHON = "llama-cpp-python"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# Portable code (no -march=native), so a cached wheel runs on any x86-64 CI machine.
CMAKE_ARGS = "-DGGML_NATIVE=OFF"


def wheel_dir() -> Path:
    return cache_root() / "wheels"


def cached_wheel() -> Path | None:
    pattern = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-*.whl"
    return next(iter(sorted(wheel_dir().glob(pattern))), None)


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(LLAMA_CPP_PYTHON)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_engine() -> Path | None:
    """Install the pinned llama-cpp-python unless it already is; return the wheel used."""
    with locked("llama-cpp-python"):
        wheel = cached_wheel()
        if installed_version() == LLAMA_CPP_PYTHON_VERSION:
            return wheel
        if wheel is None:
            wheel = _build_wheel()
        say(f"installing {wheel.name}")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", str(wheel)], check=True)
    return wheel


def _build_wheel() -> Path:
    wheel_dir().mkdir(parents=True, exist_ok=True)
    say(
        f"building {LLAMA_CPP_PYTHON}=={LLAMA_CPP_PYTHON_VERSION} into {wheel_dir()}"
        " (about 7 minutes on 2 cores)"
    )
    environment = {
        **os.environ,
        "CMAKE_ARGS": CMAKE_ARGS,
        "CMAKE_BUILD_PARALLEL_LEVEL": str(min(os.cpu_count() or 2, 2)),
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--wheel-dir",
            str(wheel_dir()),
            f"{LLAMA_CPP_PYTHON}=={LLAMA_CPP_PYTHON_VERSION}",
        ],
        check=True,
        env=environment,
    )
    wheel = cached_wheel()
    if wheel is None:
        raise RuntimeError(f"pip wheel left no llama-cpp-python wheel in {wheel_dir()}")
    return wheel


def main() -> None:
    print(ensure_engine() or f"{LLAMA_CPP_PYTHON} {installed_version()} already installed")
