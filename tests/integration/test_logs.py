"""What `cacheproxy serve` writes to its log (stderr): no secret, and one line per client error.

The proxy runs as its own process, so the log is exactly what an operator (or journald) gets,
formatter and filters included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.serve_process import ServeProcess, start_serve
from tests.support.servers import LlamaServer

ADMIN_KEY = "admin-key-Zq8rWm3vXk-0123456789"
WRONG_KEY = "not-the-admin-key-Pt4nQy7bLc"


@pytest.fixture
async def proxy(llama_server: LlamaServer, tmp_path: Path) -> AsyncIterator[ServeProcess]:
    served = await start_serve(
        tmp_path,
        "--upstream",
        llama_server.url,
        env={"CACHEPROXY_TENANTS__ADMIN_API_KEY": ADMIN_KEY},
    )
    try:
        yield served
    finally:
        await served.stop()


async def settle(proxy: ServeProcess) -> str:
    """The log once the proxy has written what the last request made it write."""
    await asyncio.sleep(0.3)
    return proxy.log()


def lines_with(log: str, *words: str) -> list[str]:
    return [line for line in log.splitlines() if all(word in line for word in words)]


async def test_malformed_json_is_one_line_without_traceback(
    proxy: ServeProcess, client: aiohttp.ClientSession
) -> None:
    body = b'{"prompt": "hello", "n_predict": '
    headers = {"Content-Type": "application/json"}
    async with client.post(proxy.url + "/completion", data=body, headers=headers) as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "invalid_request_error"
    log = await settle(proxy)
    [line] = lines_with(log, "/completion", "400")
    assert "not valid JSON" in line
    assert "Traceback" not in log


async def test_malformed_http_is_one_line_without_traceback(proxy: ServeProcess) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    # a header line without a colon: aiohttp answers 400 before any handler runs
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nthis is no header\r\n\r\n")
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer
    log = await settle(proxy)
    assert len(lines_with(log, "Error handling request", "400 Invalid header")) == 1, log
    assert "Traceback" not in log
    assert all(line.startswith("20") for line in log.splitlines()), log  # no continuation lines


async def test_keys_never_reach_the_log(proxy: ServeProcess, client: aiohttp.ClientSession) -> None:
    # the dashboard takes its key in the URL; wrong and right, neither may be logged
    for key, status in ((WRONG_KEY, 401), (ADMIN_KEY, 200)):
        async with client.get(f"{proxy.url}/admin/dashboard?key={key}") as response:
            assert response.status == status
    # a wrong admin key in a header, on a route that then refuses it
    async with client.get(
        proxy.url + "/admin/tenants", headers={"Authorization": f"Bearer {WRONG_KEY}"}
    ) as response:
        assert response.status == 401
    async with client.get(
        proxy.url + "/admin/tenants", headers={"X-Api-Key": WRONG_KEY}
    ) as response:
        assert response.status == 401
    log = await settle(proxy)
    assert lines_with(log, "401", "/admin/dashboard"), log  # the refusal is logged...
    assert ADMIN_KEY not in log and WRONG_KEY not in log, log  # ...without the key
