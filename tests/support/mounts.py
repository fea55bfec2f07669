"""Real file-system faults for the tests (they run as root): read-only bind mounts, small
tmpfs mounts and throttled loop devices, always undone afterwards, also when the test fails."""

from __future__ import annotations

import contextlib
import os
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


class SlowDisk:
    """A loop-mounted ext4 whose reads and writes a block-I/O cgroup limits, for the processes
    put in it: a real slow disk under a folder.

    Mounted `sync` while limited, so every write reaches the (limited) device before it
    returns (`lift` makes it an ordinary fast mount again); reads come
    from the page cache unless `forget_cached` drops a file's pages first (an archive written
    long ago). cgroup v2's `io.max` where the io controller is enabled, else v1's blkio
    throttle.
    """

    def __init__(self, mountpoint: Path, image: Path, device: str, cgroup: Path) -> None:
        self.mountpoint = mountpoint
        self.image = image
        self.device = device
        self.cgroup = cgroup
        major_minor = subprocess.run(
            ["lsblk", "-dno", "MAJ:MIN", device], check=True, capture_output=True, text=True
        )
        self.major_minor = major_minor.stdout.strip()

    @property
    def _v2(self) -> bool:
        return (self.cgroup / "io.max").exists()

    def add(self, pid: int) -> None:
        (self.cgroup / "cgroup.procs").write_text(str(pid))

    def limit(self, bytes_per_s: int) -> None:
        _mount("-o", "remount,sync", str(self.mountpoint))  # writes reach the limited device
        if self._v2:
            (self.cgroup / "io.max").write_text(
                f"{self.major_minor} rbps={bytes_per_s} wbps={bytes_per_s}"
            )
            return
        for name in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):
            (self.cgroup / name).write_text(f"{self.major_minor} {bytes_per_s}")

    def lift(self) -> None:
        """A fast disk again: no limit, and writes into the page cache (a `sync` loop device
        writes slower than a small model prefills on an idle machine)."""
        if self._v2:
            (self.cgroup / "io.max").write_text(f"{self.major_minor} rbps=max wbps=max")
        else:
            for name in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):
                (self.cgroup / name).write_text(f"{self.major_minor} 0")
        _mount("-o", "remount,async", str(self.mountpoint))

    def forget_cached(self) -> None:
        """Drop the cached pages of every file on it: the next read goes to the device."""
        for path in self.mountpoint.rglob("*"):
            if path.is_file():
                with contextlib.suppress(OSError):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def _io_cgroup_parent() -> Path:
    unified = Path("/sys/fs/cgroup")
    controllers = unified / "cgroup.controllers"
    if controllers.exists() and "io" in controllers.read_text().split():
        (unified / "cgroup.subtree_control").write_text("+io")
        return unified
    blkio = unified / "blkio"
    if (blkio / "blkio.throttle.write_bps_device").exists():
        return blkio
    raise RuntimeError("neither cgroup v2's io controller nor v1's blkio throttle is available")


@contextlib.contextmanager
def slow_disk(mountpoint: Path, size_mib: int = 128, sync: bool = True) -> Iterator[SlowDisk]:
    """An ext4 loop device mounted over `mountpoint`, throttled through a cgroup of its own;
    all undone afterwards, also when the test fails. `sync`: mounted synchronous, so writes are
    throttled too (without it they land in the page cache, and only reads of files whose pages
    `forget_cached` dropped come from the throttled device)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    image = mountpoint.parent / f".{mountpoint.name}.img"
    with open(image, "wb") as file:
        file.truncate(size_mib << 20)
    device = subprocess.run(
        ["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    cgroup = _io_cgroup_parent() / f"cacheproxy-slow-disk-{os.getpid()}-{mountpoint.name}"
    try:
        subprocess.run(["mkfs.ext4", "-q", device], check=True, capture_output=True)
        _mount(*(("-o", "sync") if sync else ()), device, str(mountpoint))
        cgroup.mkdir()
        disk = SlowDisk(mountpoint, image, device, cgroup)
        try:
            yield disk
        finally:
            with contextlib.suppress(OSError):
                disk.lift()
            _unmount(mountpoint)
            # its processes go back to the root group, or the group cannot be removed
            root = cgroup.parent / "cgroup.procs"
            for pid in (cgroup / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    root.write_text(pid)
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    finally:
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        image.unlink(missing_ok=True)
