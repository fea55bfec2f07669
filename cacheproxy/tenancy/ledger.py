"""The usage ledger: usage per tenant and UTC hour, and the rate buckets' levels, in a SQLite
file or PostgreSQL (`cacheproxy.db`).

The store owns its thread hop: the proxy opens it with `aopen()` and calls the async twins
(`awrite`, `arows`, ...), each on a worker thread (the meter writes a batch every
`usage.flush_interval_s`); the CLI calls the blocking methods directly. One connection, shared
between threads under a lock. Each batch is one transaction that adds to the hours' rows (an
upsert), saves the buckets' levels (so a restart does not refill them) and deletes hours past
the retention.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cacheproxy.db.connection import (
    DATABASE_ERRORS,
    DatabaseTarget,
    connect,
    is_database_url,
    is_lock_timeout,
    shown_target,
)
from cacheproxy.db.migrations import Migrations
from cacheproxy.db.off_loop import off_loop
from cacheproxy.tenancy.limits import TokenBucket
from cacheproxy.tenancy.usage import FIGURES, budget_tokens

BUSY_TIMEOUT_S = 5.0
HourKey = tuple[str, int]  # (tenant id, hour start in Unix seconds)
ModelHourKey = tuple[str, str, int]  # (tenant id, model, hour start)
SavedBucket = tuple[str, str, TokenBucket]  # (tenant id, limit name, bucket)


class LedgerUnusable(Exception):
    """The ledger file cannot be opened or migrated; the message names it and the fix."""


MIGRATIONS = Migrations("cacheproxy.usage")

# Append-only, as the registry's: a released migration is never edited, only followed.
_COLUMNS = ",\n".join(f"{name} {{int}} NOT NULL DEFAULT 0" for name in FIGURES)
MIGRATIONS.add(
    "m001_usage_hours_and_rate_buckets",
    sqlite=f"""
        CREATE TABLE usage_hours (
            tenant_id TEXT NOT NULL,
            hour INTEGER NOT NULL,  -- the UTC hour's start, Unix seconds
            {_COLUMNS.format(int="INTEGER")},
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
    """,
    postgresql=f"""
        CREATE TABLE usage_hours (
            tenant_id TEXT NOT NULL,
            hour BIGINT NOT NULL,
            {_COLUMNS.format(int="BIGINT")},
            PRIMARY KEY (tenant_id, hour)
        );
        CREATE INDEX usage_hours_by_hour ON usage_hours(hour);

        CREATE TABLE rate_buckets (
            tenant_id TEXT NOT NULL,
            name TEXT NOT NULL,
            capacity DOUBLE PRECISION NOT NULL,
            level DOUBLE PRECISION NOT NULL,
            updated DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (tenant_id, name)
        );
    """,
)


# The same figures per model too (several models: tools/server router mode, plain servers of
# different models): what each tenant's tasks used of each model, by the name the upstream
# gives it (a bounded set, never a client's string).
MIGRATIONS.add(
    "m002_usage_by_model",
    f"""
    CREATE TABLE usage_model_hours (
        tenant_id TEXT NOT NULL,
        model TEXT NOT NULL,
        hour {{int}} NOT NULL,
        {_COLUMNS},
        PRIMARY KEY (tenant_id, model, hour)
    ) {{strict}};
    CREATE INDEX usage_model_hours_by_hour ON usage_model_hours(hour);
    """,
)


class LedgerStore:
    """The ledger at `database`: a SQLite file or a `postgresql://` URL (created and migrated
    on open)."""

    def __init__(self, database: DatabaseTarget) -> None:
        self.shown = shown_target(database)
        self._lock = threading.Lock()
        path = None if is_database_url(database) else Path(database)
        is_new = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            is_new = not path.exists()
        try:
            self._db = connect(database, busy_timeout_s=BUSY_TIMEOUT_S, lock_name="usage")
        except DATABASE_ERRORS as exc:
            raise self._unusable(exc) from exc
        if is_new and path is not None:
            path.chmod(0o600)  # who used how much is nobody else's business
        try:
            MIGRATIONS.migrate(self._db)
        except DATABASE_ERRORS as exc:
            self._db.close()
            if is_lock_timeout(exc):
                raise
            raise self._unusable(exc) from exc

    @classmethod
    async def aopen(cls, database: DatabaseTarget) -> LedgerStore:
        """The ledger, opened (and migrated) on a worker thread."""
        return await asyncio.to_thread(cls, database)

    def _unusable(self, exc: Exception) -> LedgerUnusable:
        return LedgerUnusable(
            f"usage ledger {self.shown} cannot be used ({exc}): make its folder writable, restore"
            " it from a backup, or move it away to start a new ledger (usage.database; for"
            " database_url: check that the PostgreSQL server runs and the user may create tables)"
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    aclose = off_loop(close)

    def __enter__(self) -> LedgerStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- writes ------------------------------------------------------------------------------

    def write(
        self,
        hours: Mapping[HourKey, Counter[str]],
        buckets: list[SavedBucket],
        prune_before: int | None = None,
        model_hours: Mapping[ModelHourKey, Counter[str]] | None = None,
    ) -> None:
        """Add `hours` (and `model_hours`, the same by model) to the ledger, save `buckets`,
        delete hours before `prune_before`: all or nothing."""
        names = ", ".join(FIGURES)
        marks = ", ".join("?" for _ in FIGURES)
        added = ", ".join(f"{name} = usage_hours.{name} + excluded.{name}" for name in FIGURES)
        by_model = added.replace("usage_hours.", "usage_model_hours.")
        with self._lock, self._db.write():
            conn = self._db
            conn.executemany(
                f"INSERT INTO usage_hours (tenant_id, hour, {names}) VALUES (?, ?, {marks})"
                f" ON CONFLICT (tenant_id, hour) DO UPDATE SET {added}",
                [
                    (tenant, hour, *(int(figures[name]) for name in FIGURES))
                    for (tenant, hour), figures in hours.items()
                ],
            )
            conn.executemany(
                f"INSERT INTO usage_model_hours (tenant_id, model, hour, {names})"
                f" VALUES (?, ?, ?, {marks})"
                f" ON CONFLICT (tenant_id, model, hour) DO UPDATE SET {by_model}",
                [
                    (tenant, model, hour, *(int(figures[name]) for name in FIGURES))
                    for (tenant, model, hour), figures in (model_hours or {}).items()
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
                conn.execute("DELETE FROM usage_model_hours WHERE hour < ?", [prune_before])

    awrite = off_loop(write)

    # -- reads -------------------------------------------------------------------------------

    def rows(
        self,
        tenant: str | None = None,
        start: int | None = None,
        end: int | None = None,
        by_model: bool = False,
    ) -> list[dict[str, Any]]:
        """Hours in [start, end) (Unix seconds; None: unbounded), of one tenant or all;
        `by_model`: per model as well (each row with its `model`)."""
        table, model = ("usage_model_hours", "model, ") if by_model else ("usage_hours", "")
        clauses, params = ["1 = 1"], []
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
            return self._db.rows(
                f"SELECT tenant_id, {model}hour, {', '.join(FIGURES)} FROM {table}"
                f" WHERE {' AND '.join(clauses)} ORDER BY hour, tenant_id",
                params,
            )

    arows = off_loop(rows)

    def budget_totals(self, since: int) -> dict[str, dict[int, int]]:
        """Prompt + generated tokens per tenant and hour since `since` (for the budgets)."""
        totals: dict[str, dict[int, int]] = {}
        for row in self.rows(start=since):
            totals.setdefault(row["tenant_id"], {})[row["hour"]] = budget_tokens(row)
        return totals

    abudget_totals = off_loop(budget_totals)

    def buckets(self) -> dict[str, dict[str, TokenBucket]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT tenant_id, name, capacity, level, updated FROM rate_buckets"
            ).fetchall()
        saved: dict[str, dict[str, TokenBucket]] = {}
        for tenant, name, capacity, level, updated in rows:
            saved.setdefault(tenant, {})[name] = TokenBucket(capacity, level, updated)
        return saved

    abuckets = off_loop(buckets)
