"""The overhead benchmark's bare pass-through against a real llama-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.bench.passthrough import create_app
from tests.support.servers import LlamaServer

PROMPT = [1000, 2345, 4567, 7890]


@pytest.fixture
async def bare(llama_server: LlamaServer) -> AsyncIterator[str]:
    runner = web.AppRunner(create_app(llama_server.url))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_requests_after_streams_are_not_failed_by_the_connection_the_server_closed(
    bare: str, client: aiohttp.ClientSession
) -> None:
    # llama-server closes the connection after every stream although it announces keep-alive;
    # a request sent on that pooled connection must go out again on a new one, not fail
    async def stream_then_complete() -> list[int]:
        statuses = []
        for _ in range(6):
            stream = {"prompt": PROMPT, "n_predict": 4, "stream": True}
            async with client.post(bare + "/completion", json=stream) as response:
                await response.read()
                statuses.append(response.status)
            single = {"prompt": PROMPT, "n_predict": 1}
            async with client.post(bare + "/completion", json=single) as response:
                await response.read()
                statuses.append(response.status)
        return statuses

    results = await asyncio.gather(*(stream_then_complete() for _ in range(16)))
    assert [status for statuses in results for status in statuses] == [200] * 16 * 12


async def test_the_calibration_arm_spends_its_cpu_on_every_request(
    llama_server: LlamaServer, client: aiohttp.ClientSession
) -> None:
    """`--burn-us`: each request costs the pass-through's thread that much CPU more (its own
    CPU clock, read in this process, where the app runs), and is relayed as without it."""
    runner = web.AppRunner(create_app(llama_server.url, burn_us=20_000))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        before = time.thread_time()
        for _ in range(5):
            async with client.post(
                f"http://{host}:{port}/completion", json={"prompt": PROMPT, "n_predict": 1}
            ) as response:
                assert response.status == 200
                assert (await response.json())["tokens_evaluated"] == len(PROMPT)
        assert time.thread_time() - before >= 5 * 0.020
    finally:
        await runner.cleanup()
