"""Switching a SQLite file to write-ahead logging when several openers race for a new file."""

from __future__ import annotations

import sqlite3
import time

RETRY_S = 0.01


def enable_wal(connection: sqlite3.Connection, timeout_s: float) -> None:
    """Put the connection's file in WAL mode. The switch needs the file to itself, and while
    another connection opens or migrates it SQLite may refuse at once with "database is locked"
    without calling the busy handler, so the connection's busy timeout does not cover it:
    retried here for up to `timeout_s`, as that timeout would."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
            if mode != "wal":
                connection.execute("PRAGMA journal_mode = wal")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(RETRY_S)
