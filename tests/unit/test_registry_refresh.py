"""The registry is re-read off the loop once for all the requests that find it stale."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from cacheproxy.tenancy.registry import TenantRegistry


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
