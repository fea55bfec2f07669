"""Block files whose payloads matched their checksums, so that a restore does not read them all
again (`RestoreBlocks.check`).

A block is read and checked once; the file's status then (inode, size, modification and change
times) is kept, and a later check that finds the same status does not read it. Any write to the
file, through any descriptor, mapping or process, moves its change time, which no process can set
back (only the clock can): a block changed on disk since its check is read and checked again.
What a status cannot show, a disk handing back other bytes than were written with no write at
all, a whole-file archive does not detect either (its file has no checksum); a new process checks
every block once more.

A status is kept only when its change time is older than the moment it was read by `settle_ns`:
file times move in coarse ticks (milliseconds; seconds on some file systems), and a write within
the tick the status was read in would leave it unchanged.

Blocks are never shared between tenants, so whether a tenant's restore reads a block depends on
that tenant's own restores alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

SETTLE_NS = 2_000_000_000
# statuses kept, the least recently used dropped first: a block of 64 cells holds megabytes of
# KV on a real model, so this many cover more than a disk budget holds
KEPT_STATUSES = 1 << 16


@dataclass(frozen=True)
class FileStatus:
    """What any write to a file changes, and when it was read (`read_ns`, wall clock)."""

    inode: int
    size: int
    modified_ns: int
    changed_ns: int
    read_ns: int

    @classmethod
    def of(cls, descriptor: int) -> FileStatus:
        read_ns = time.time_ns()  # before the status: a write after it moves the change time
        status = os.fstat(descriptor)
        return cls(status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns, read_ns)

    @property
    def file(self) -> tuple[int, int, int, int]:
        return (self.inode, self.size, self.modified_ns, self.changed_ns)


class CheckedBlocks:
    """The status of each block file when its payload last matched its checksum; safe to use
    from several threads (restores are put together and checked on threads of their own)."""

    def __init__(self, settle_ns: int = SETTLE_NS, kept: int = KEPT_STATUSES) -> None:
        self._settle_ns = settle_ns
        self._kept = kept
        self._statuses: OrderedDict[str, tuple[int, int, int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def unchanged(self, file_name: str, status: FileStatus) -> bool:
        """Whether the block was checked when its file was as `status` finds it."""
        with self._lock:
            known = self._statuses.get(file_name)
            if known != status.file:
                return False
            self._statuses.move_to_end(file_name)
            return True

    def checked(self, file_name: str, status: FileStatus) -> None:
        """The block's payload, read after `status`, matched its checksum."""
        if status.changed_ns > status.read_ns - self._settle_ns:
            return  # changed too recently: a write in the same tick would not show
        with self._lock:
            self._statuses[file_name] = status.file
            self._statuses.move_to_end(file_name)
            while len(self._statuses) > self._kept:
                self._statuses.popitem(last=False)
