"""SIGTERM stops `cacheproxy serve` within `shutdown_timeout_s`, whatever is stuck.

The proxy runs as its own process in front of a real llama-server; a request is stuck by
stopping that server (SIGSTOP: it keeps its sockets, so the proxy's connection is accepted and
never answered, as with a hung upstream). The normal case, idle slots archived on SIGTERM, is
`test_sigterm_archives_the_live_slots` in test_disk_tier.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.serve_process import ServeProcess, start_serve
from tests.support.servers import LlamaServer, StartServer

SHUTDOWN_TIMEOUT_S = 6.0
# what may follow the deadline here: closing the session and the databases (no managed server)
CLOSING_S = 4.0
PROMPT_TOKENS = 600


def conversation(seed: int, length: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 20000) for _ in range(length)]


async def start_proxy(
    server: LlamaServer, tmp_path: Path, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S
) -> ServeProcess:
    """The proxy with its disk tier archiving into the server's slot save path."""
    return await start_serve(
        tmp_path,
        "--upstream",
        server.url,
        env={
            "CACHEPROXY_SHUTDOWN_TIMEOUT_S": str(shutdown_timeout_s),
            "CACHEPROXY_DISK__DIRECTORY": str(server.slot_save_path),
            "CACHEPROXY_DISK__DATABASE": str(tmp_path / "archive.db"),
            "CACHEPROXY_DISK__MIN_TOKENS": "128",
        },
    )


@contextlib.asynccontextmanager
async def stopped(server: LlamaServer) -> AsyncIterator[None]:
    """The server frozen (SIGSTOP) for the block, and running again after it."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


async def complete(
    client: aiohttp.ClientSession, url: str, prompt: list[int], n_predict: int = 4
) -> aiohttp.ClientResponse:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0}
    async with client.post(url + "/completion", json=body) as response:
        await response.read()
        return response


async def started_request(client: aiohttp.ClientSession, url: str, seed: int) -> asyncio.Task:
    """A completion under way: sent, and given a moment to reach the upstream."""
    request = asyncio.create_task(complete(client, url, conversation(seed)), name="stuck")
    await asyncio.sleep(0.5)
    assert not request.done()
    return request


async def wait_exit(proxy: ServeProcess, timeout_s: float) -> tuple[int, float]:
    started = time.monotonic()
    try:
        code = await asyncio.wait_for(proxy.process.wait(), timeout_s)
    except TimeoutError:
        await proxy.stop()
        pytest.fail(f"still running {timeout_s} s after SIGTERM:\n{proxy.log()[-3000:]}")
    return code, time.monotonic() - started


async def test_sigterm_with_a_stuck_upstream_stops_in_time_and_names_what_it_left(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    proxy = await start_proxy(server, tmp_path)
    try:
        async with aiohttp.ClientSession() as client:
            # an idle slot worth archiving at shutdown
            assert (await complete(client, proxy.url, conversation(1))).status == 200
            async with stopped(server):
                stuck = await started_request(client, proxy.url, 2)
                proxy.process.send_signal(signal.SIGTERM)
                code, took = await wait_exit(proxy, SHUTDOWN_TIMEOUT_S + CLOSING_S)
                with contextlib.suppress(aiohttp.ClientError):
                    await stuck  # the proxy closed it: no answer, or a broken one
    finally:
        await proxy.stop()
    log = proxy.log()
    assert code == 0, log
    # the request got its half, then the drain waited for the frozen server until the deadline
    assert took >= SHUTDOWN_TIMEOUT_S - 0.5
    assert f"1 request(s) cut after the {SHUTDOWN_TIMEOUT_S / 2} s grace: POST /completion" in log
    # the idle slot could not be saved by a frozen server: said, by slot and size
    assert "drain: 1 slot(s) worth keeping not archived: slot " in log, log
    assert f"tenant default, {PROMPT_TOKENS + 3} tokens (save under way when" in log, log
    assert "Traceback" not in log, log


async def test_a_request_that_finishes_within_the_grace_is_answered(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    # a grace of 15 s: ample for a prefill of 600 tokens on a busy machine
    proxy = await start_proxy(server, tmp_path, shutdown_timeout_s=30.0)
    try:
        async with aiohttp.ClientSession() as client:
            async with stopped(server):
                request = await started_request(client, proxy.url, 3)
                proxy.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)  # the server comes back well within the grace
            response = await request
            code, _ = await wait_exit(proxy, 30.0 + CLOSING_S)
    finally:
        await proxy.stop()
    assert response.status == 200
    assert code == 0, proxy.log()
    assert "request(s) cut" not in proxy.log()
    assert "drain: 1 slots archived" in proxy.log()  # the slot it ran on, archived after


async def test_a_second_sigterm_exits_at_once(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(parallel=2, ctx_size=8192)
    proxy = await start_proxy(server, tmp_path)
    try:
        async with aiohttp.ClientSession() as client, stopped(server):
            stuck = await started_request(client, proxy.url, 4)
            proxy.process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            proxy.process.send_signal(signal.SIGTERM)
            # the first one's grace would run to SHUTDOWN_TIMEOUT_S: the upstream is stopped
            code, took = await wait_exit(proxy, SHUTDOWN_TIMEOUT_S)
            with contextlib.suppress(aiohttp.ClientError):
                await stuck
    finally:
        await proxy.stop()
    assert code == 128 + signal.SIGTERM, proxy.log()
    assert took < SHUTDOWN_TIMEOUT_S - 0.5  # before the grace ran out (counted from the first)
    assert "second SIGTERM: exiting at once" in proxy.log()
