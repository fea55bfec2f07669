"""The shared limits' tables: each tenant's pools and what each proxy holds of them.

They live in the database the proxies of a cluster share (the registry's: a SQLite file in WAL
mode on one machine, or PostgreSQL), beside the lease tables. One exchange of a proxy (every
pool it settles with and draws from, the expiry of what it holds renewed) is one write
transaction: two proxies never both take what is left of a pool. The SQL is portable (upserts,
timestamps in Unix seconds given by the caller), and a round reads and writes all its pools
with a few statements whatever their number.

- `shared_limit_pools`: per tenant and limit (pool_policy.py says what the level means).
- `shared_limit_holdings`: per tenant, limit and proxy, what the proxy holds (of a pool, or of
  the tenant's `max_concurrent`: its requests in progress), with an expiry it renews every
  round; a proxy that stops renewing (killed, cut off) holds nothing once it has passed.

The store owns its thread hop: the proxy calls the `a`-prefixed twins, each on a worker thread,
one at a time; the blocking methods stay callable where no event loop runs (tests).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from cacheproxy.db.connection import Database, DatabaseTarget
from cacheproxy.db.migrations import Migrations, connect_migrated
from cacheproxy.db.off_loop import off_loop
from cacheproxy.tenancy.pool_policy import Exchanged, Pool, PoolExchange, exchange

BUSY_TIMEOUT_S = 5.0
CONCURRENCY = "max_concurrent"  # the holdings' name for requests in progress
FORGET_AFTER_S = 86400.0  # holdings expired this long ago are deleted
IN_CHUNK = 400  # tenants per `IN (...)` list (SQLite allows 999 parameters)

MIGRATIONS = Migrations("cacheproxy.shared_limits")
MIGRATIONS.add(
    "m001_shared_limit_pools_and_holdings",
    """
    CREATE TABLE IF NOT EXISTS shared_limit_pools (
        tenant_id TEXT NOT NULL,
        name TEXT NOT NULL,
        capacity {float} NOT NULL,
        level {float} NOT NULL,
        stamp {float} NOT NULL,
        PRIMARY KEY (tenant_id, name)
    ) {strict};
    CREATE TABLE IF NOT EXISTS shared_limit_holdings (
        tenant_id TEXT NOT NULL,
        name TEXT NOT NULL,
        proxy_id TEXT NOT NULL,
        held {float} NOT NULL,
        expires_at {float} NOT NULL,
        PRIMARY KEY (tenant_id, name, proxy_id)
    ) {strict};
    CREATE INDEX IF NOT EXISTS shared_limit_holdings_by_proxy
        ON shared_limit_holdings (proxy_id);
    """,
)

UPSERT_POOL = (
    "INSERT INTO shared_limit_pools (tenant_id, name, capacity, level, stamp)"
    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, name) DO UPDATE SET"
    " capacity = excluded.capacity, level = excluded.level, stamp = excluded.stamp"
)
DELETE_POOL = "DELETE FROM shared_limit_pools WHERE tenant_id = ? AND name = ?"
UPSERT_HOLDING = (
    "INSERT INTO shared_limit_holdings (tenant_id, name, proxy_id, held, expires_at)"
    " VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant_id, name, proxy_id) DO UPDATE SET"
    " held = excluded.held, expires_at = excluded.expires_at"
)
DELETE_HOLDING = (
    "DELETE FROM shared_limit_holdings WHERE tenant_id = ? AND name = ? AND proxy_id = ?"
)
RENEW_HOLDINGS = "UPDATE shared_limit_holdings SET expires_at = ? WHERE proxy_id = ?"
FORGET_HOLDINGS = "DELETE FROM shared_limit_holdings WHERE expires_at < ?"
LEAVE = "DELETE FROM shared_limit_holdings WHERE proxy_id = ?"


class SharedLimitsUnavailable(Exception):
    """The shared database did not answer an exchange: the request waiting for it is answered
    503, and nothing was settled or granted."""


@dataclass(frozen=True)
class ConcurrencyAsk:
    """A proxy's wish for a tenant's requests in progress: `target` (those running here and
    those waiting for one), never fewer than `running`, within `cap` across the proxies."""

    tenant: str
    target: int
    running: int
    cap: int


@dataclass(frozen=True)
class ConcurrencyGranted:
    held: int  # what this proxy holds now
    others: int  # what the other live proxies hold


class PoolStore:
    """The shared limits' tables in `target` (a SQLite file or a `postgresql://` URL; migrated
    on open)."""

    def __init__(self, target: DatabaseTarget) -> None:
        self._db = connect_migrated(
            target, MIGRATIONS, busy_timeout_s=BUSY_TIMEOUT_S, lock_name="shared_limits"
        )
        self._lock = threading.Lock()

    @classmethod
    async def aopen(cls, target: DatabaseTarget) -> PoolStore:
        """The store, opened (and migrated) on a worker thread."""
        return await asyncio.to_thread(cls, target)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    aclose = off_loop(close)

    def __enter__(self) -> PoolStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- exchanges ---------------------------------------------------------------------------

    def exchange(
        self, proxy_id: str, items: Sequence[PoolExchange], now: float, expires_at: float
    ) -> list[Exchanged]:
        """Settle and grant every item in one transaction (pool_policy.exchange), record what
        this proxy holds of each, and renew the expiry of everything it holds."""
        with self._lock, self._db.write():
            db = self._db
            tenants = sorted({item.tenant for item in items})
            pools = _pools(db, tenants)
            held = _live_holdings(db, tenants, now)
            results, upserts, deletes, holdings, released = [], [], [], [], []
            for item in items:
                key = (item.tenant, item.name)
                others = sum(
                    amount for proxy, amount in held.get(key, {}).items() if proxy != proxy_id
                )
                pool, granted = exchange(pools.get(key), item, now, others)
                mine = item.keep + granted
                if pool is None:
                    deletes.append(key)
                    pools.pop(key, None)
                    results.append(Exchanged(0.0, 0.0, now, 0.0, others))
                else:
                    pools[key] = pool
                    upserts.append((*key, pool.capacity, pool.level, pool.stamp))
                    results.append(
                        Exchanged(granted, pool.level, pool.stamp, pool.capacity, others)
                    )
                if mine > 0 and pool is not None:
                    holdings.append((*key, proxy_id, mine, expires_at))
                else:
                    released.append((*key, proxy_id))
            db.executemany(UPSERT_POOL, upserts)
            db.executemany(DELETE_POOL, deletes)
            db.executemany(UPSERT_HOLDING, holdings)
            db.executemany(DELETE_HOLDING, released)
            db.execute(RENEW_HOLDINGS, [expires_at, proxy_id])
            db.execute(FORGET_HOLDINGS, [now - FORGET_AFTER_S])
        return results

    aexchange = off_loop(exchange)

    def set_concurrency(
        self, proxy_id: str, asks: Sequence[ConcurrencyAsk], now: float, expires_at: float
    ) -> list[ConcurrencyGranted]:
        """Hold, for each tenant, as many of its requests in progress as asked and its cap
        leaves beside what the other live proxies hold (never fewer than run here), in one
        transaction."""
        with self._lock, self._db.write():
            db = self._db
            held = _live_holdings(db, sorted({ask.tenant for ask in asks}), now, CONCURRENCY)
            results, holdings, released = [], [], []
            for ask in asks:
                key = (ask.tenant, CONCURRENCY)
                others = round(
                    sum(n for proxy, n in held.get(key, {}).items() if proxy != proxy_id)
                )
                mine = max(ask.running, min(ask.target, ask.cap - others))
                if mine > 0:
                    holdings.append((*key, proxy_id, float(mine), expires_at))
                else:
                    released.append((*key, proxy_id))
                results.append(ConcurrencyGranted(mine, others))
            db.executemany(UPSERT_HOLDING, holdings)
            db.executemany(DELETE_HOLDING, released)
        return results

    aset_concurrency = off_loop(set_concurrency)

    def leave(self, proxy_id: str) -> None:
        """Stopping: hold nothing any more (what was settled before stays settled)."""
        with self._lock, self._db.write():
            self._db.execute(LEAVE, [proxy_id])

    aleave = off_loop(leave)

    # -- reads (tests, observers) ------------------------------------------------------------

    def pool(self, tenant: str, name: str) -> Pool | None:
        with self._lock:
            return _pools(self._db, [tenant]).get((tenant, name))

    def holdings(self, tenant: str, name: str, now: float) -> dict[str, float]:
        """proxy id -> what it holds of the tenant's `name`, live at `now`."""
        with self._lock:
            return _live_holdings(self._db, [tenant], now, name).get((tenant, name), {})


def _chunks(tenants: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(tenants), IN_CHUNK):
        yield tenants[start : start + IN_CHUNK]


def _marks(values: Iterable[object]) -> str:
    return ", ".join("?" for _ in values)


def _pools(db: Database, tenants: Sequence[str]) -> dict[tuple[str, str], Pool]:
    pools: dict[tuple[str, str], Pool] = {}
    for chunk in _chunks(tenants):
        rows = db.execute(
            "SELECT tenant_id, name, capacity, level, stamp FROM shared_limit_pools"
            f" WHERE tenant_id IN ({_marks(chunk)})",
            list(chunk),
        ).fetchall()
        for tenant, name, capacity, level, stamp in rows:
            pools[(tenant, name)] = Pool(capacity, level, stamp)
    return pools


def _live_holdings(
    db: Database, tenants: Sequence[str], now: float, name: str | None = None
) -> dict[tuple[str, str], dict[str, float]]:
    """(tenant, name) -> proxy -> what it holds, of holdings not expired at `now`."""
    held: dict[tuple[str, str], dict[str, float]] = {}
    for chunk in _chunks(tenants):
        sql = (
            "SELECT tenant_id, name, proxy_id, held FROM shared_limit_holdings"
            f" WHERE expires_at >= ? AND tenant_id IN ({_marks(chunk)})"
        )
        params: list[object] = [now, *chunk]
        if name is not None:
            sql += " AND name = ?"
            params.append(name)
        for tenant, limit, proxy, amount in db.execute(sql, params).fetchall():
            held.setdefault((tenant, limit), {})[proxy] = amount
    return held
