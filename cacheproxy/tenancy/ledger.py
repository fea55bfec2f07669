"""The usage ledger's SQLite file: usage per tenant and UTC hour, and the rate buckets' levels.

Blocking: the proxy calls it from worker threads only (the meter writes a batch every
`usage.flush_interval_s`); the CLI calls it directly. One connection, shared between threads
under a lock. Each batch is one transaction that adds to the hours' rows (an upsert), saves the
buckets' levels (so a restart does not refill them) and deletes hours past the retention.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlite_utils import Database, Migrations

from cacheproxy.sqlite_wal import enable_wal
from cacheproxy.tenancy.limits import TokenBucket
from cacheproxy.tenancy.usage import FIGURES, budget_tokens

BUSY_TIMEOUT_S = 5.0
HourKey = tuple[str, int]  # (tenant id, hour start in Unix seconds)
SavedBucket = tuple[str, str, TokenBucket]  # (tenant id, limit name, bucket)


class LedgerUnusable(Exception):
    """The ledger file cannot be opened or migrated; the message names it and the fix."""


MIGRATIONS = Migrations("cacheproxy.usage")


# Append-only, as the registry's: a released migration is never edited, only followed.
@MIGRATIONS()
def m001_usage_hours_and_rate_buckets(db: Database) -> None:
    columns = ",\n".join(f"{name} INTEGER NOT NULL DEFAULT 0" for name in FIGURES)
    db.executescript(
        f"""
        CREATE TABLE usage_hours (
            tenant_id TEXT NOT NULL,
            hour INTEGER NOT NULL,  -- the UTC hour's start, Unix seconds
            {columns},
            PRIMARY KEY (tenant_id, hour)
        ) STRICT, WITHOUT ROWID;
        CREATE INDEX usage_hours_by_hour ON usage_hours(hour);

        CREATE TABLE rate_buckets (
            tenant_id TEXT NOT NULL,
            name TEXT NOT NULL,  -- requests_per_minute, prompt_/generated_tokens_per_minute
            capacity REAL NOT NULL,
            level REAL NOT NULL,
            updated REAL NOT NULL,  -- wall-clock seconds of `level`
            PRIMARY KEY (tenant_id, name)
        ) STRICT, WITHOUT ROWID;
        """
    )


class LedgerStore:
    """The ledger at `path` (created and migrated on open)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        is_new = not self.path.exists()
        try:
            connection = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._unusable(exc) from exc
        if is_new:
            self.path.chmod(0o600)  # who used how much is nobody else's business
        self._db = Database(connection, execute_plugins=False)
        try:
            enable_wal(self._db, BUSY_TIMEOUT_S)
            if MIGRATIONS.pending(self._db):
                with self._transaction():
                    MIGRATIONS.apply(self._db)
        except sqlite3.DatabaseError as exc:
            connection.close()
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise
            raise self._unusable(exc) from exc

    def _unusable(self, exc: Exception) -> LedgerUnusable:
        return LedgerUnusable(
            f"usage ledger {self.path} cannot be used ({exc}): make its folder writable, restore"
            " it from a backup, or move it away to start a new ledger (usage.database)"
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.conn.rollback()
            raise
        self._db.conn.execute("COMMIT")

    # -- writes ------------------------------------------------------------------------------

    def write(
        self,
        hours: Mapping[HourKey, Counter[str]],
        buckets: list[SavedBucket],
        prune_before: int | None = None,
    ) -> None:
        """Add `hours` to the ledger, save `buckets`, delete hours before `prune_before`: all
        or nothing."""
        names = ", ".join(FIGURES)
        marks = ", ".join("?" for _ in FIGURES)
        added = ", ".join(f"{name} = {name} + excluded.{name}" for name in FIGURES)
        with self._lock, self._transaction():
            conn = self._db.conn
            conn.executemany(
                f"INSERT INTO usage_hours (tenant_id, hour, {names}) VALUES (?, ?, {marks})"
                f" ON CONFLICT (tenant_id, hour) DO UPDATE SET {added}",
                [
                    (tenant, hour, *(int(figures[name]) for name in FIGURES))
                    for (tenant, hour), figures in hours.items()
                ],
            )
            conn.executemany(
                "INSERT INTO rate_buckets (tenant_id, name, capacity, level, updated)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, name) DO UPDATE SET"
                " capacity = excluded.capacity, level = excluded.level,"
                " updated = excluded.updated",
                [
                    (tenant, name, bucket.capacity, bucket.level, bucket.updated)
                    for tenant, name, bucket in buckets
                ],
            )
            if prune_before is not None:
                conn.execute("DELETE FROM usage_hours WHERE hour < ?", [prune_before])

    # -- reads -------------------------------------------------------------------------------

    def rows(
        self, tenant: str | None = None, start: int | None = None, end: int | None = None
    ) -> list[dict[str, Any]]:
        """Hours in [start, end) (Unix seconds; None: unbounded), of one tenant or all."""
        clauses, params = ["1"], []
        if tenant is not None:
            clauses.append("tenant_id = ?")
            params.append(tenant)
        if start is not None:
            clauses.append("hour >= ?")
            params.append(start)
        if end is not None:
            clauses.append("hour < ?")
            params.append(end)
        with self._lock:
            cursor = self._db.conn.execute(
                f"SELECT tenant_id, hour, {', '.join(FIGURES)} FROM usage_hours"
                f" WHERE {' AND '.join(clauses)} ORDER BY hour, tenant_id",
                params,
            )
            columns = [column[0] for column in cursor.description]
            return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]

    def budget_totals(self, since: int) -> dict[str, dict[int, int]]:
        """Prompt + generated tokens per tenant and hour since `since` (for the budgets)."""
        totals: dict[str, dict[int, int]] = {}
        for row in self.rows(start=since):
            totals.setdefault(row["tenant_id"], {})[row["hour"]] = budget_tokens(row)
        return totals

    def buckets(self) -> dict[str, dict[str, TokenBucket]]:
        with self._lock:
            rows = self._db.conn.execute(
                "SELECT tenant_id, name, capacity, level, updated FROM rate_buckets"
            ).fetchall()
        saved: dict[str, dict[str, TokenBucket]] = {}
        for tenant, name, capacity, level, updated in rows:
            saved.setdefault(tenant, {})[name] = TokenBucket(capacity, level, updated)
        return saved
