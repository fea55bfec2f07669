"""Real file-system faults for the tests (they run as root): read-only bind mounts and small
tmpfs mounts, always unmounted afterwards, also when the test fails."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _unmount(path: Path) -> None:
    # lazy: a llama-server holding a file open there must not keep the mount alive
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` read-only, even for root, until the block ends (a bind mount remounted ro)."""
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,ro,bind", str(path))
        yield path
    finally:
        _unmount(path)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "2m") mounted over `path`, so that it fills up."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield path
    finally:
        _unmount(path)


class Remountable:
    """A bind mount of `path` onto itself that a test switches between read-only and writable."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read_only(self) -> None:
        _mount("-o", "remount,ro,bind", str(self.path))

    def writable(self) -> None:
        _mount("-o", "remount,rw,bind", str(self.path))


@contextlib.contextmanager
def remountable(path: Path) -> Iterator[Remountable]:
    _mount("--bind", str(path), str(path))
    try:
        yield Remountable(path)
    finally:
        _unmount(path)
