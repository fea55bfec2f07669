"""A real CPU limit for the tests (they run as root): a process in a cgroup of its own whose
CPU time per period is capped, undone afterwards, also when the test fails."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PERIOD_US = 100_000


def _cpu_cgroup_parent() -> Path:
    unified = Path("/sys/fs/cgroup")
    controllers = unified / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        (unified / "cgroup.subtree_control").write_text("+cpu")
        return unified
    legacy = unified / "cpu"
    if (legacy / "cpu.cfs_quota_us").exists():
        return legacy
    raise RuntimeError("neither cgroup v2's cpu controller nor v1's CFS quota is available")


@contextlib.contextmanager
def cpu_capped(pid: int, cpus: float) -> Iterator[None]:
    """Process `pid` (every thread of it) gets at most `cpus` CPUs' worth of time."""
    cgroup = _cpu_cgroup_parent() / f"cacheproxy-cpu-cap-{os.getpid()}-{pid}"
    cgroup.mkdir()
    try:
        quota_us = max(int(cpus * PERIOD_US), 1000)
        if (cgroup / "cpu.max").exists():
            (cgroup / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        else:
            (cgroup / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (cgroup / "cpu.cfs_quota_us").write_text(str(quota_us))
        (cgroup / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        # its processes go back to the parent group, or the group cannot be removed
        parent = cgroup.parent / "cgroup.procs"
        for task in (cgroup / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                parent.write_text(task)
        with contextlib.suppress(OSError):
            cgroup.rmdir()
