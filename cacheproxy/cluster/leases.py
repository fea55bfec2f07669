"""The lease table: which proxy holds which upstream, and which proxies are alive.

Rows live in the registry database that every proxy of a cluster shares (SQLite in WAL mode on
one machine's file system, or the server database). The SQL is portable on purpose: upserts
with `ON CONFLICT ... DO UPDATE ... WHERE`, timestamps in Unix seconds given by the caller (no
database clock function), so the same statements run on PostgreSQL. One round of a proxy (its
heartbeat, reading every lease, its claims and releases) is one write transaction: two proxies
never both see a lease free and both take it.

The store owns its thread hop: the keeper hands a round's statements to `in_transaction`, which
runs them in one write transaction on a worker thread, as Datasette's `execute_write_fn` runs a
function on its write thread; the statements themselves are blocking and stay callable directly
inside `transaction()` where no event loop runs (tests).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from cacheproxy.db.connection import DatabaseTarget
from cacheproxy.db.migrations import Migrations, connect_migrated
from cacheproxy.db.off_loop import off_loop

BUSY_TIMEOUT_S = 5.0

MIGRATIONS = Migrations("cacheproxy.cluster")
# Timestamps are Unix seconds supplied by the caller ({float} is 8 bytes on both: PostgreSQL
# keeps sub-second precision). `IF NOT EXISTS`: a database migrated before this set existed got
# the same tables from the registry's own set (its step m005_cluster_leases).
MIGRATIONS.add(
    "m001_cluster_leases",
    """
    CREATE TABLE IF NOT EXISTS cluster_members (
        proxy_id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        expires_at {float} NOT NULL
    ) {strict};
    CREATE TABLE IF NOT EXISTS upstream_leases (
        upstream TEXT PRIMARY KEY,
        holder TEXT NOT NULL,
        holder_address TEXT NOT NULL,
        expires_at {float} NOT NULL
    ) {strict};
    """,
)

# the key hand-offs are signed with when `cluster.secret` is not set: made once, by whichever
# proxy comes first, and read by every other (only what may read this database may read it)
MIGRATIONS.add(
    "m002_cluster_secret",
    """
    CREATE TABLE IF NOT EXISTS cluster_secret (
        id {int} PRIMARY KEY CHECK (id = 1),
        secret TEXT NOT NULL
    ) {strict};
    """,
)
MAKE_SECRET_SQL = (
    "INSERT INTO cluster_secret (id, secret) VALUES (1, ?) ON CONFLICT (id) DO NOTHING"
)
SECRET_SQL = "SELECT secret FROM cluster_secret WHERE id = 1"

HEARTBEAT_SQL = (
    "INSERT INTO cluster_members (proxy_id, address, expires_at) VALUES (?, ?, ?)"
    " ON CONFLICT (proxy_id) DO UPDATE SET address = excluded.address,"
    " expires_at = excluded.expires_at"
)
# taken when free, expired, or already ours (a renewal); a live lease of another proxy is left
CLAIM_SQL = (
    "INSERT INTO upstream_leases (upstream, holder, holder_address, expires_at)"
    " VALUES (?, ?, ?, ?)"
    " ON CONFLICT (upstream) DO UPDATE SET holder = excluded.holder,"
    " holder_address = excluded.holder_address, expires_at = excluded.expires_at"
    " WHERE upstream_leases.holder = excluded.holder OR upstream_leases.expires_at < ?"
)
RELEASE_SQL = "DELETE FROM upstream_leases WHERE upstream = ? AND holder = ?"
LEAVE_SQL = "DELETE FROM cluster_members WHERE proxy_id = ?"
LIVE_MEMBERS_SQL = "SELECT proxy_id, address FROM cluster_members WHERE expires_at >= ?"
LEASES_SQL = "SELECT upstream, holder, holder_address, expires_at FROM upstream_leases"
# members gone for a day are forgotten (their rows only ever grow otherwise)
FORGET_SQL = "DELETE FROM cluster_members WHERE expires_at < ?"
FORGET_AFTER_S = 86400.0

Result = TypeVar("Result")


@dataclass(frozen=True)
class LeaseRow:
    upstream: str
    holder: str
    holder_address: str
    expires_at: float

    def live(self, now: float) -> bool:
        return self.expires_at >= now


class LeaseStore:
    """Leases and members in the registry's database at `target` (a SQLite file or a
    `postgresql://` URL; migrated on open).

    On an event loop: `aopen`, `in_transaction`, `aread_leases`, `aclose`; each waits for the
    store's lock and the database on a worker thread, one call at a time."""

    def __init__(self, target: DatabaseTarget) -> None:
        self._db = connect_migrated(
            target, MIGRATIONS, busy_timeout_s=BUSY_TIMEOUT_S, lock_name="cluster_leases"
        )
        self._lock = threading.Lock()

    @classmethod
    async def aopen(cls, target: DatabaseTarget) -> LeaseStore:
        """The store, opened (and migrated) on a worker thread."""
        return await asyncio.to_thread(cls, target)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    aclose = off_loop(close)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One write transaction, its lock taken up front (SQLite's BEGIN IMMEDIATE, a named
        advisory lock on PostgreSQL)."""
        with self._lock, self._db.write():
            yield

    async def in_transaction(self, statements: Callable[[], Result]) -> Result:
        """Run `statements` (calls of this store's statements below, and decisions between
        them) in one `transaction()` on a worker thread; what they return."""

        def run() -> Result:
            with self.transaction():
                return statements()

        return await asyncio.to_thread(run)

    def secret(self) -> bytes:
        """The cluster's hand-off key kept in the database (made by the first proxy to ask)."""
        with self.transaction():
            self._db.execute(MAKE_SECRET_SQL, [secrets.token_hex(32)])
            (secret,) = self._db.execute(SECRET_SQL).fetchone()
        return bytes.fromhex(secret)

    asecret = off_loop(secret)

    def read_leases(self) -> list[LeaseRow]:
        """Every lease, read outside any round (one statement: one state), for an observer."""
        with self._lock:
            return self.leases()

    aread_leases = off_loop(read_leases)

    # -- statements (inside `transaction()`) -------------------------------------------------

    def heartbeat(self, proxy_id: str, address: str, expires_at: float) -> None:
        self._db.execute(HEARTBEAT_SQL, [proxy_id, address, expires_at])
        self._db.execute(FORGET_SQL, [expires_at - FORGET_AFTER_S])

    def live_members(self, now: float) -> dict[str, str]:
        """proxy id -> address of every member whose heartbeat has not expired."""
        return dict(self._db.execute(LIVE_MEMBERS_SQL, [now]).fetchall())

    def leases(self) -> list[LeaseRow]:
        return [LeaseRow(*row) for row in self._db.execute(LEASES_SQL).fetchall()]

    def claim(
        self, upstream: str, proxy_id: str, address: str, now: float, expires_at: float
    ) -> bool:
        """Take or renew the lease on `upstream`; False when another proxy holds it live."""
        cursor = self._db.execute(CLAIM_SQL, [upstream, proxy_id, address, expires_at, now])
        return cursor.rowcount == 1

    def release(self, upstream: str, proxy_id: str) -> None:
        self._db.execute(RELEASE_SQL, [upstream, proxy_id])

    def leave(self, proxy_id: str) -> None:
        self._db.execute(LEAVE_SQL, [proxy_id])
