"""The folder big request bodies are spilled to (`bodies.spill_dir`, by default
`state_dir/bodies`, on disk).

Each running proxy writes in a subfolder of its own, holding an exclusive lock (flock) on a file
in it while it runs: the kernel lets go of the lock when the process ends, however it ends. At
start, every subfolder whose lock can be taken belonged to a proxy that is gone (a kill -9
leaves the bodies it was receiving) and is removed; a subfolder still locked is another running
proxy's, sharing the folder, and is left alone.

A spilled body's name is removed once it is parsed (the proxy keeps it open to forward it), so
the names left by a crash are those of bodies still arriving; the open ones go with the process.

Blocking (mkdir, flock, rmtree): `open` and `close` run off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

RUN_PREFIX = "run-"
LOCK_NAME = "lock"
BODY_PREFIX = "body-"
# a subfolder without its lock file yet may be a proxy's that is starting right now
FRESH_S = 60.0


class SpillFolder:
    """This proxy's subfolder of the spill folder, locked while it is open."""

    def __init__(self, root: Path, run: Path, lock: int) -> None:
        self.root = root
        self.run = run
        self._lock = lock

    @classmethod
    def open(cls, root: Path) -> SpillFolder:
        """Remove what stopped proxies left in `root`, and take a subfolder of it."""
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        removed = sweep(root)
        if removed:
            log.info("removed %d spilled request bodies left by a proxy that stopped", removed)
        run = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=root))
        lock = os.open(run / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cls(root, run, lock)

    @classmethod
    async def aopen(cls, root: Path) -> SpillFolder:
        """`open`, its sweep of a dead proxy's files and its folder work off the event loop."""
        return await asyncio.to_thread(cls.open, root)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def new_file(self) -> tuple[int, str]:
        """A new private file for a body: its descriptor (read and write) and its path."""
        return tempfile.mkstemp(prefix=BODY_PREFIX, dir=self.run)

    def close(self) -> None:
        """Remove this proxy's subfolder (what is still open in it lives on until closed)."""
        shutil.rmtree(self.run, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def sweep(root: Path) -> int:
    """Remove the subfolders of proxies no longer running; the number of bodies removed."""
    removed = 0
    for run in root.glob(f"{RUN_PREFIX}*"):
        if run.is_dir() and _owner_gone(run):
            removed += sum(1 for name in os.listdir(run) if name.startswith(BODY_PREFIX))
            shutil.rmtree(run, ignore_errors=True)
    return removed


def _owner_gone(run: Path) -> bool:
    try:
        lock = os.open(run / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return time.time() - run.stat().st_mtime > FRESH_S
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its proxy runs
    finally:
        os.close(lock)  # a lock taken here goes with it: nobody else wants it
    return True
