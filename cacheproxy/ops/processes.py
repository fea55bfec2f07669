"""Whether a process still runs, from `/proc` (Linux): a pid together with the process's start
time names one process, so a pid reused by a later process does not pass for the one that
left. Which host a pid belongs to (`host_identity`): a pid means something only there.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path


def host_identity() -> str:
    """This host's name and boot: the pids of one boot of one kernel are one namespace (a
    container with a pid namespace of its own should set a hostname of its own)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def process_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot); None where unknown."""
    if pid == os.getpid():
        return _own_start_ticks(pid)
    return _start_ticks(pid)


def process_alive(pid: int, started: int | None) -> bool:
    """Whether process `pid` runs, and is the one that started at `started` (None: any).

    Assumes the pid is of this host's pid namespace (`host_identity`)."""
    if pid == os.getpid():
        # the asking process runs: its own pid is checked without reading /proc every time
        return started is None or started == _own_start_ticks(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    stat = _process_stat(pid)
    if stat is None:
        return True
    state, current_start = stat
    # a zombie has exited: only its parent has not collected its status yet
    return state not in ("Z", "X") and (started is None or current_start == started)


def _start_ticks(pid: int) -> int | None:
    stat = _process_stat(pid)
    return None if stat is None else stat[1]


# this process's start time, read once (by pid: a forked child reads its own)
_own_start_ticks = functools.cache(_start_ticks)


def _process_stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time (clock ticks since boot); None where unknown.

    The start time and the pid together name a process uniquely: pids are reused, in a container
    often at once (a restarted proxy may well get its predecessor's pid).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the fields after the command name (which may hold spaces) start after the last ')':
    # state is field 3 of the line, starttime field 22
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])
