"""Slow and idle clients are cut on real sockets, while a normal request is served meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from cacheproxy.settings import load_settings
from tests.support.raw_http import open_connection, raw_request, read_response, request_bytes
from tests.support.servers import LlamaServer, running_proxy

TIMEOUT_S = 1.5
# how long past its timeout a connection may live: the checks run every half second
SLACK_S = 3.0


@pytest.fixture
async def proxy(llama_server: LlamaServer, tmp_path: Path) -> AsyncIterator[str]:
    settings = load_settings(
        upstreams=[llama_server.url],
        state_dir=tmp_path / "state",
        clients={
            "keepalive_timeout_s": TIMEOUT_S,
            "body_timeout_s": TIMEOUT_S,
            "body_min_bytes_per_s": 100,
        },
    )
    async with running_proxy(settings) as url:
        yield url


async def closed_after(reader: asyncio.StreamReader) -> tuple[float, bytes]:
    """Seconds until the proxy closes the connection, and what it sent before."""
    started = time.monotonic()
    received = await asyncio.wait_for(reader.read(), TIMEOUT_S + SLACK_S)
    return time.monotonic() - started, received


async def test_half_a_request_line_is_cut(proxy: str) -> None:
    reader, writer = await open_connection(proxy)
    writer.write(b"POST /compl")
    elapsed, received = await closed_after(reader)
    assert received == b"" and elapsed >= TIMEOUT_S - 0.1
    writer.close()


async def test_headers_sent_a_line_at_a_time_are_cut(proxy: str) -> None:
    reader, writer = await open_connection(proxy)

    async def trickle() -> None:
        writer.write(b"GET /health HTTP/1.1\r\n")
        for number in range(100):
            await asyncio.sleep(0.2)
            writer.write(f"X-Slow-{number}: x\r\n".encode())

    feeding = asyncio.create_task(trickle())
    try:
        elapsed, received = await closed_after(reader)
    finally:
        feeding.cancel()
        writer.close()
    assert received == b"" and elapsed >= TIMEOUT_S - 0.1


async def test_a_slow_body_gets_408_and_the_connection_closes(proxy: str) -> None:
    body = orjson.dumps({"prompt": "hello " * 100, "n_predict": 1})
    head = request_bytes("POST", "/completion", body=body)[: -len(body)]
    reader, writer = await open_connection(proxy)
    writer.write(head)

    async def trickle() -> None:
        for offset in range(0, len(body), 3):  # 3 bytes a second
            writer.write(body[offset : offset + 3])
            await asyncio.sleep(1.0)

    feeding = asyncio.create_task(trickle())
    try:
        started = time.monotonic()
        answer = await asyncio.wait_for(read_response(reader), TIMEOUT_S + SLACK_S)
        assert answer.status == 408
        assert orjson.loads(answer.body)["error"]["code"] == 408
        assert answer.headers.get("connection") == "close"
        assert await asyncio.wait_for(reader.read(), SLACK_S) == b""
        assert time.monotonic() - started >= TIMEOUT_S - 0.1
    finally:
        feeding.cancel()
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed(proxy: str) -> None:
    reader, writer = await open_connection(proxy)
    writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = await asyncio.wait_for(read_response(reader), SLACK_S)
    assert answer.status == 200 and answer.headers.get("connection") != "close"
    elapsed, received = await closed_after(reader)
    assert received == b"" and elapsed >= TIMEOUT_S - 0.1
    writer.close()


async def test_normal_requests_are_served_while_slow_clients_wait(proxy: str) -> None:
    """Slow clients hold their connections; others are served at once, including a body that
    pauses shorter than the timeout and keeps above the minimum rate."""
    stalled = [await open_connection(proxy) for _ in range(5)]
    for _, writer in stalled:
        writer.write(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    body = orjson.dumps({"prompt": "hello there", "n_predict": 2})
    reader, writer = await open_connection(proxy)
    head = request_bytes("POST", "/completion", body=body)[: -len(body)]
    writer.write(head + body[:10])
    await asyncio.sleep(TIMEOUT_S / 2)
    writer.write(body[10:])
    answer = await asyncio.wait_for(read_response(reader), 30)
    assert answer.status == 200 and "content" in answer.json()
    writer.close()
    health = await raw_request(proxy, "GET", "/health", timeout_s=5)
    assert health.status == 200
    for stalled_reader, stalled_writer in stalled:  # and the stalled ones were cut meanwhile
        answer = await asyncio.wait_for(read_response(stalled_reader), TIMEOUT_S + SLACK_S)
        assert answer.status == 408
        stalled_writer.close()


@pytest.mark.parametrize(
    "document",
    [
        {"prompt": [1000, 2345, 4567], "n_predict": 3, "temperature": 0},
        {"prompt": [10**9], "n_predict": 1},  # refused: no such token id
        {"prompt": "hello", "n_predict": "x"},  # refused by llama-server
    ],
)
async def test_a_body_arriving_in_pieces_reads_as_the_same_body_sent_whole(
    proxy: str, document: dict
) -> None:
    """A small body all there with the request head is taken at once, one still arriving is
    read chunk by chunk (http/body_parse.py): both read the same document, and answer alike."""
    body = orjson.dumps(document)
    whole = await raw_request(proxy, "POST", "/completion", body=body)
    reader, writer = await open_connection(proxy)
    try:
        writer.write(request_bytes("POST", "/completion", body=body)[: -len(body) + 5])
        await asyncio.sleep(0.3)  # the handler starts reading before the rest is there
        writer.write(body[5:])
        pieces = await asyncio.wait_for(read_response(reader), 30)
    finally:
        writer.close()
    assert pieces.status == whole.status
    if whole.status == 200:
        assert pieces.json()["tokens"] == whole.json()["tokens"]
        assert pieces.json()["content"] == whole.json()["content"]
    else:
        assert pieces.json()["error"] == whole.json()["error"]
