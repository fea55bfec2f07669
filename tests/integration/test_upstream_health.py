"""Health checks with a short timeout of their own: a frozen (SIGSTOP) llama-server accepts
connections and answers nothing, and must still be found down, routed around, and taken back
after SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from cacheproxy.http.app_keys import CACHE
from cacheproxy.settings import load_settings
from cacheproxy.upstreams.managed import free_port
from tests.support.servers import LlamaServer, StartServer, serving
from tests.support.waiting import wait_for

# the default health timeout (5 s) plus a few health intervals, and slack for a loaded machine
FOUND_DOWN_WITHIN_S = 15.0


@contextlib.contextmanager
def frozen(server: LlamaServer) -> Iterator[None]:
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[int, dict]:
    body = {"prompt": prompt, "n_predict": 2}
    timeout = aiohttp.ClientTimeout(total=30)
    async with http.post(url + "/completion", json=body, timeout=timeout) as response:
        return response.status, await response.json(content_type=None)


async def test_a_frozen_upstream_is_found_down_routed_around_and_taken_back(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    first, second = start_server(parallel=2, ctx_size=4096), start_server(parallel=2, ctx_size=4096)
    settings = load_settings(
        upstreams=[first.url, second.url],
        state_dir=tmp_path / "state",
        routing={"health_interval_s": 0.5},
    )
    async with serving(settings) as (url, app):
        tables = app[CACHE].tables
        assert all(table.healthy for table in tables)
        with frozen(first):
            await wait_for(
                lambda: not tables[0].healthy, "the frozen one down", FOUND_DOWN_WITHIN_S
            )
            assert tables[1].healthy
            for index in range(6):  # every request goes to the one that answers
                status, answer = await complete(client, url, [100 + index, 7, 8, 9])
                assert status == 200, answer
        await wait_for(lambda: tables[0].healthy, "the thawed one back", FOUND_DOWN_WITHIN_S)


async def test_with_its_only_upstream_frozen_the_proxy_answers_502_at_once(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=4096)
    settings = load_settings(
        upstreams=[server.url], state_dir=tmp_path / "state", routing={"health_interval_s": 0.5}
    )
    async with serving(settings) as (url, app):
        table = app[CACHE].tables[0]
        with frozen(server):
            await wait_for(lambda: not table.healthy, "the frozen one down", FOUND_DOWN_WITHIN_S)
            started = time.monotonic()
            status, answer = await complete(client, url, [5, 6, 7])
            # one more bounded look (the health timeout), then a clear answer
            assert time.monotonic() - started < settings.routing.health_timeout_s + 3
            assert status == 502
            assert "no upstream is reachable" in answer["error"]["message"]
        await wait_for(lambda: table.healthy, "the thawed one back", FOUND_DOWN_WITHIN_S)
        status, answer = await complete(client, url, [5, 6, 7])
        assert status == 200, answer


def watchdog_pings(receiver: socket.socket, duration_s: float) -> int:
    """WATCHDOG=1 datagrams received over `duration_s`, after dropping what was queued before
    (others are ignored)."""
    receiver.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            receiver.recv(4096)
    pings = 0
    deadline = time.monotonic() + duration_s
    while (left := deadline - time.monotonic()) > 0:
        receiver.settimeout(left)
        try:
            pings += receiver.recv(4096) == b"WATCHDOG=1"
        except TimeoutError:
            break
    return pings


async def test_the_watchdog_stops_while_the_only_upstream_is_frozen(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in systemd: a real datagram socket as $NOTIFY_SOCKET, pings every 0.2 s."""
    server = start_server(parallel=2, ctx_size=4096)
    notify_path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(notify_path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    settings = load_settings(
        upstreams=[server.url],
        state_dir=tmp_path / "state",
        port=0,
        routing={"health_interval_s": 0.5},
    )
    try:
        async with serving(settings) as (_, app):
            table = app[CACHE].tables[0]
            assert await asyncio.to_thread(watchdog_pings, receiver, 1.0) >= 2
            with frozen(server):
                await wait_for(
                    lambda: not table.healthy, "the frozen one down", FOUND_DOWN_WITHIN_S
                )
                assert await asyncio.to_thread(watchdog_pings, receiver, 1.0) == 0
            await wait_for(lambda: table.healthy, "the thawed one back", FOUND_DOWN_WITHIN_S)
            assert await asyncio.to_thread(watchdog_pings, receiver, 1.0) >= 2
    finally:
        receiver.close()


async def status_of(http: aiohttp.ClientSession, url: str, path: str) -> tuple[int, dict]:
    async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=10)) as response:
        return response.status, await response.json(content_type=None)


async def test_health_is_503_while_no_upstream_can_serve_and_200_once_one_can(
    client: aiohttp.ClientSession, start_server: StartServer, tmp_path: Path
) -> None:
    """`/health` tells a load balancer the truth: 503 in llama-server's envelope while the only
    upstream is down (and while it loads its model), 200 once it serves; `/livez` is 200
    throughout: the proxy's process answers."""
    fifo = tmp_path / "model.gguf"  # a model path that is a FIFO keeps llama-server loading
    os.mkfifo(fifo)
    port = free_port()
    settings = load_settings(
        upstreams=[f"http://127.0.0.1:{port}"],
        state_dir=tmp_path / "state",
        routing={"health_interval_s": 0.2},
    )
    async with serving(settings) as (url, app):
        status, answer = await status_of(client, url, "/health")
        assert status == 503
        assert answer["error"]["type"] == "unavailable_error"
        assert answer["error"]["code"] == 503
        assert f"127.0.0.1:{port}" in answer["error"]["message"]
        assert await status_of(client, url, "/livez") == (200, {"status": "ok"})

        loading = start_server(model=fifo, port=port, wait=False)
        try:
            await wait_for(lambda: app[CACHE].tables[0].loading, "the upstream to be loading")
            status, answer = await status_of(client, url, "/v1/health")
            assert (status, answer["error"]["message"]) == (503, "Loading model")
            assert await status_of(client, url, "/livez") == (200, {"status": "ok"})
        finally:
            threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()
            loading.kill()

        start_server(port=port, parallel=2, ctx_size=4096)
        await wait_for(lambda: app[CACHE].tables[0].healthy, "the upstream to serve")
        assert await status_of(client, url, "/health") == (200, {"status": "ok"})
        assert await status_of(client, url, "/livez") == (200, {"status": "ok"})
