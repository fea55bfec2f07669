"""A request the server fails ends a cache-benchmark arm with the benchmark's own error, not an
exception group: the run then prints the last lines of its processes' logs (the proxy's
traceback of a 500) before their folder is removed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from cacheproxy.bench.cache_bench import run_conversations, run_requests
from cacheproxy.bench.cache_client import CompletionClient, byte_token_ids
from cacheproxy.bench.harness import BenchmarkError
from cacheproxy.bench.workloads import MultiTurnSpec, Request, multi_turn_workload
from tests.support.local_app import served


@pytest.fixture
async def failing_server() -> AsyncIterator[str]:
    """Answers every completion as aiohttp answers a handler's unhandled exception."""

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=500, text="500 Internal Server Error")

    app = web.Application()
    app.router.add_post("/completion", handler)
    async with served(app) as url:
        yield url


async def test_a_failed_shared_prefix_request_is_raised_as_itself(failing_server: str) -> None:
    requests = [Request((1, 2, 3), 2, "tenant-0", f"c{index}") for index in range(4)]
    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, "proxy", failing_server, byte_token_ids())
        with pytest.raises(BenchmarkError, match="answered 500"):
            await run_requests(client, requests, in_flight=2)


async def test_a_failed_turn_is_raised_as_itself(failing_server: str) -> None:
    spec = MultiTurnSpec(
        tenants=1, users_per_tenant=2, turns=2, tenant_prefix_tokens=8, history_tokens=8
    )
    workload = multi_turn_workload(spec, seed=1)

    async def no_restart() -> None:
        raise AssertionError("W2 has no restart")

    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, "proxy", failing_server, byte_token_ids())
        with pytest.raises(BenchmarkError, match="answered 500"):
            await run_conversations(client, workload, 2, no_restart)
