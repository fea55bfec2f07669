"""SQLite never runs on the event loop: a handler waiting on a locked database (another process
writing it, for up to the busy timeout) leaves every other request answering.

Each test holds a real write lock on one of the proxy's SQLite files from another connection,
sends the call that has to wait for it, and meanwhile times `/health` from another thread (the
proxy runs on this test's loop: a stalled loop would stall the test's own clock too).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from tests.support.servers import LlamaServer, serving_tenants

ADMIN_KEY = "admin-key-for-event-loop-tests-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
HOLD_S = 2.5  # how long the other connection keeps the write lock
HEALTHY_S = 1.0  # /health while the lock is held: far below HOLD_S, far above a normal answer


@contextlib.contextmanager
def write_locked(database: Path, hold_s: float) -> Iterator[None]:
    """Another connection takes the write lock now and gives it up after `hold_s` seconds
    (from a timer thread: the loop may be the thing that is stuck)."""
    other = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(hold_s, other.execute, ["ROLLBACK"])
    timer.start()
    try:
        yield
    finally:
        timer.join()
        other.close()


def health_latency(url: str, after_s: float) -> float:
    time.sleep(after_s)
    start = time.monotonic()
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        assert response.status == 200
    return time.monotonic() - start


async def test_an_admin_write_waiting_for_the_registry_stalls_no_request(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    async with (
        serving_tenants(llama_server.url, tmp_path, ADMIN_KEY) as (url, registry),
        aiohttp.ClientSession() as http,
    ):
        with write_locked(registry.path, HOLD_S):
            create = asyncio.ensure_future(
                http.post(url + "/admin/tenants", json={"name": "waits"}, headers=AUTH)
            )
            latency = await asyncio.to_thread(health_latency, url, 0.3)
            async with await create as created:
                assert created.status == 201, await created.text()
        assert latency < HEALTHY_S


async def test_the_dashboard_waiting_behind_an_archive_write_stalls_no_request(
    llama_server: LlamaServer, tmp_path: Path
) -> None:
    async with (
        serving_tenants(llama_server.url, tmp_path, ADMIN_KEY) as (url, _),
        aiohttp.ClientSession() as http,
    ):
        with write_locked(tmp_path / "state" / "archive.db", HOLD_S):
            # the store's delete waits for the lock in a worker thread, holding the store
            delete = asyncio.ensure_future(
                http.delete(url + "/admin/archives/ar_0000000000000000", headers=AUTH)
            )
            await asyncio.sleep(0.3)
            state = asyncio.ensure_future(http.get(url + "/admin/state", headers=AUTH))
            latency = await asyncio.to_thread(health_latency, url, 0.3)
            async with await delete as deleted, await state as answered:
                assert deleted.status == 404
                assert answered.status == 200
                assert (await answered.json())["archive_available"] is True
        assert latency < HEALTHY_S
