"""The registry is re-read off the loop once for all the requests that find it stale."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cacheproxy.cluster.slot_claims import SlotClaim, SlotClaimStore
from cacheproxy.db.connection import DatabaseTarget
from cacheproxy.tenancy.registry import TenantRegistry
from tests.support import databases


class CountingRegistry(TenantRegistry):
    def __init__(self, path: Path) -> None:
        super().__init__(path, refresh_on_read=False)
        self.reads = 0
        self.threads: set[int] = set()

    def refresh(self) -> None:
        self.reads += 1
        self.threads.add(threading.get_ident())
        time.sleep(0.05)  # a read that takes a while: other requests arrive meanwhile
        super().refresh()


async def test_requests_that_find_the_snapshot_stale_together_share_one_read(
    tmp_path: Path,
) -> None:
    with CountingRegistry(tmp_path / "tenants.db") as registry:
        await asyncio.gather(*(registry.arefresh() for _ in range(8)))
        assert registry.reads == 1
        await registry.arefresh()  # the next one reads again
        assert registry.reads == 2


async def test_a_request_that_leaves_does_not_cut_the_read_others_wait_for(
    tmp_path: Path,
) -> None:
    with CountingRegistry(tmp_path / "tenants.db") as registry:
        leaving = asyncio.ensure_future(registry.arefresh())
        staying = asyncio.ensure_future(registry.arefresh())
        await asyncio.sleep(0.01)
        leaving.cancel()
        await staying
        assert registry.reads == 1 and not registry.snapshot_is_stale()


@pytest.fixture
def where(database_url: str | None, tmp_path: Path) -> DatabaseTarget:
    """The registry's database: the test's PostgreSQL database, or the SQLite file."""
    return databases.target(database_url, tmp_path / "cacheproxy.db")


class ReadCountingRegistry(TenantRegistry):
    """Counts the snapshot's re-reads (its own changes' aside: those always re-read)."""

    def __init__(self, where: DatabaseTarget) -> None:
        self.reads = 0
        super().__init__(where, refresh_interval_s=0)

    def _read_snapshot(self) -> Any:
        self.reads += 1
        return super()._read_snapshot()


def test_slot_claims_in_the_registry_database_do_not_make_it_read_again(
    where: DatabaseTarget,
) -> None:
    """The slot claims are written to the registry's database with every request: the registry
    re-reads its tenants only when they changed."""
    with ReadCountingRegistry(where) as registry:
        claims = SlotClaimStore(where, holder="proxy-1", leased=False)
        try:
            reads = registry.reads
            for now in range(5):
                claims.claim("http://127.0.0.1:8080", [SlotClaim(0, "acme", 3, b"h")], now)
                claims.disown("http://127.0.0.1:8080", [0], now + 0.5)
                registry.refresh()
            assert registry.reads == reads
        finally:
            claims.close()
        with TenantRegistry(where) as cli:
            tenant, key = cli.create("acme")
        registry.refresh()
        assert registry.reads == reads + 1
        assert registry.authenticate(key) == tenant


def test_a_change_that_bypasses_the_registry_is_still_seen(tmp_path: Path) -> None:
    """An operator's own sqlite3 session, writing the registry's tables directly."""
    path = tmp_path / "cacheproxy.db"
    with ReadCountingRegistry(path) as registry:
        tenant, _ = registry.create("acme")
        assert not registry.get(tenant.id).disabled
        with contextlib.closing(sqlite3.connect(path)) as operator, operator:
            operator.execute("UPDATE tenants SET disabled = 1 WHERE id = ?", [tenant.id])
        registry.refresh()
        assert registry.get(tenant.id).disabled
