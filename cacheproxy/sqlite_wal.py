"""Switching a SQLite file to write-ahead logging when several openers race for a new file."""

from __future__ import annotations

import sqlite3
import time

from sqlite_utils import Database

RETRY_S = 0.01


def enable_wal(db: Database, timeout_s: float) -> None:
    """Put `db` in WAL mode. The switch needs the file to itself, and while another connection
    opens or migrates it SQLite may refuse at once with "database is locked" without calling
    the busy handler, so the connection's busy timeout does not cover it: retried here for up
    to `timeout_s`, as that timeout would."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            db.enable_wal()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(RETRY_S)
