"""Whose text each slot of each upstream holds, as the proxy holding the upstream records it, so
that the next one to hold it (a survivor of a proxy's death, a proxy started again in front of a
server that kept running) knows.

One row a slot: its tenant (NULL: nobody's), and a hint of its ids, their hashes only (never the
ids, never text; see slots/slot_hints.py). The rows live in the registry database, shared by
the proxies of a cluster as the leases are. A claim that a slot holds a tenant's text is kept
true by its writer: a slot about to take another tenant's text is disowned here first, before
anything is sent to it (`disown`); a tenant's claim is written afterwards (`claim`), in a
cluster only while the writer holds the upstream's lease, so a proxy that lost it can never
overwrite what the next holder wrote. Every write bumps the row's generation.

The store owns its thread hop, as the lease store does: `a`-prefixed async twins run the
blocking calls on a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cacheproxy.db.connection import DatabaseTarget, connect, is_database_url
from cacheproxy.db.migrations import Migrations
from cacheproxy.db.off_loop import off_loop

BUSY_TIMEOUT_S = 5.0

MIGRATIONS = Migrations("cacheproxy.slot_claims")
MIGRATIONS.add(
    "m001_slot_claims",
    """
    CREATE TABLE slot_claims (
        upstream TEXT NOT NULL,
        slot_id {int} NOT NULL,
        tenant TEXT,
        hint_tokens {int} NOT NULL,
        hint {blob} NOT NULL,
        generation {int} NOT NULL,
        holder TEXT NOT NULL,
        written_at {float} NOT NULL,
        PRIMARY KEY (upstream, slot_id)
    ) {strict};
    """,
)

UPSERT = (
    "INSERT INTO slot_claims"
    " (upstream, slot_id, tenant, hint_tokens, hint, generation, holder, written_at)"
    " SELECT ?, ?, ?, ?, ?, 1, ?, ? WHERE {condition}"
    " ON CONFLICT (upstream, slot_id) DO UPDATE SET tenant = excluded.tenant,"
    " hint_tokens = excluded.hint_tokens, hint = excluded.hint,"
    " generation = slot_claims.generation + 1, holder = excluded.holder,"
    " written_at = excluded.written_at"
)
# a disowning is always written: it claims nothing
DISOWN_SQL = UPSERT.format(condition="1 = 1")
CLAIM_SQL = DISOWN_SQL
# in a cluster, a claim only from the upstream's live lease holder (its lease row, same database)
LEASED_CLAIM_SQL = UPSERT.format(
    condition="EXISTS (SELECT 1 FROM upstream_leases WHERE upstream = ? AND holder = ?"
    " AND expires_at >= ?)"
)
READ_SQL = (
    "SELECT slot_id, tenant, hint_tokens, hint, generation FROM slot_claims WHERE upstream = ?"
)


@dataclass(frozen=True)
class SlotClaim:
    """One slot's row: whose text it holds (None: nobody's, or nothing), and the hashes of its
    first `hint_tokens` ids (0: none)."""

    slot_id: int
    tenant: str | None
    hint_tokens: int = 0
    hint: bytes = b""
    generation: int = 0


class SlotClaimStore:
    """The claims in the database at `target` (a SQLite file or a `postgresql://` URL, migrated
    on open). `holder` names the writer in its rows; `leased`: claims need the writer's live
    lease on the upstream (a cluster)."""

    def __init__(self, target: DatabaseTarget, holder: str, leased: bool) -> None:
        if not is_database_url(target):
            Path(target).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.holder = holder
        self.leased = leased
        self._db = connect(target, busy_timeout_s=BUSY_TIMEOUT_S, lock_name="slot_claims")
        self._lock = threading.Lock()
        try:
            MIGRATIONS.migrate(self._db)
            if not self._db.is_postgresql:
                # most writes are claims that need not wait for the disk (`claim`); the others
                # ask for it (`_synced`)
                self._db.execute("PRAGMA synchronous = NORMAL")
        except BaseException:
            self._db.close()
            raise

    @classmethod
    async def aopen(cls, target: DatabaseTarget, holder: str, leased: bool) -> SlotClaimStore:
        """The store, opened (and migrated) on a worker thread."""
        return await asyncio.to_thread(cls, target, holder, leased)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    aclose = off_loop(close)

    def read(self, upstream: str) -> dict[int, SlotClaim]:
        """Every slot's claim on `upstream`, by slot id."""
        with self._lock, self._db.read():
            rows = self._db.execute(READ_SQL, [upstream]).fetchall()
        return {row[0]: SlotClaim(row[0], row[1], row[2], bytes(row[3]), row[4]) for row in rows}

    aread = off_loop(read)

    def disown(self, upstream: str, slot_ids: Sequence[int], now: float) -> None:
        """The slots hold nobody's text from now on (before another tenant's is sent there)."""
        rows = [[upstream, slot_id, None, 0, b"", self.holder, now] for slot_id in slot_ids]
        with self._lock, self._synced(True), self._db.write():
            self._db.executemany(DISOWN_SQL, rows)

    adisown = off_loop(disown)

    def claim(
        self, upstream: str, claims: Sequence[SlotClaim], now: float, synced: bool = True
    ) -> bool:
        """Record `claims` on `upstream`; False when, in a cluster, this writer does not hold its
        lease (nothing is written then). `synced=False`: the commit need not wait for the disk
        (SQLite), for claims whose loss with the machine's power is harmless: each leaves its
        row saying what it said before, the same tenant or nobody."""
        if not claims:
            return True
        with self._lock, self._synced(synced):
            if not self.leased and len(claims) == 1 and not self._db.is_postgresql:
                # the claim written behind a request: one statement, its own transaction
                self._db.execute(CLAIM_SQL, self._row(upstream, claims[0], now))
                return True
            with self._db.write():
                return self._claim_all(upstream, claims, now)

    aclaim = off_loop(claim)

    def _claim_all(self, upstream: str, claims: Sequence[SlotClaim], now: float) -> bool:
        if not self.leased:
            self._db.executemany(CLAIM_SQL, [self._row(upstream, claim, now) for claim in claims])
            return True
        written = 0
        for claim in claims:
            params = [*self._row(upstream, claim, now), upstream, self.holder, now]
            written += self._db.execute(LEASED_CLAIM_SQL, params).rowcount
        return written > 0

    @contextmanager
    def _synced(self, synced: bool) -> Iterator[None]:
        """With `synced`, SQLite's commits within on the disk before they return (and all
        before them); else durable when the process dies, not always when the machine does:
        an fsync fewer, most of a small write's cost. PostgreSQL's are always synced."""
        if not synced or self._db.is_postgresql:
            yield
            return
        self._db.execute("PRAGMA synchronous = FULL")
        try:
            yield
        finally:
            self._db.execute("PRAGMA synchronous = NORMAL")

    def _row(self, upstream: str, claim: SlotClaim, now: float) -> list[object]:
        return [
            upstream,
            claim.slot_id,
            claim.tenant,
            claim.hint_tokens,
            claim.hint,
            self.holder,
            now,
        ]
